"""The cost-based placement policy (pure) and its online estimates, over tables of situations."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvtether.gateway.policy import (
    CostDecision,
    NodeLoad,
    NoFeasibleOption,
    PolicyKnobs,
    TurnFacts,
    choose,
)
from kvtether.gateway.policy.estimates import (
    SNAPSHOT_REUSE_S,
    Estimator,
    EstimatorSeeds,
    EstimatorSnapshot,
    LearningParams,
    link_key,
)

from tests.support.policy_facts import D0, D1, MOE, P0, P1, history_turn

SEEDS = EstimatorSeeds()
SNAP = EstimatorSnapshot(SEEDS)
# Most situations here exercise the P/D options with a long suffix, several on an idle D where the default local
# limit (8192, the TPOT quotas deciding whether a long suffix may run on a busy D) would run it locally: they set
# a 2048-token limit. The local limit and the quotas have cases of their own.
def knobs(**kw: Any) -> PolicyKnobs:
    return PolicyKnobs(**{"max_local_suffix_tokens": 2048, **kw})


def p(url: str = P0, **kw: Any) -> NodeLoad:
    return NodeLoad(url, **kw)


def d(url: str = D0, **kw: Any) -> NodeLoad:
    return NodeLoad(url, **kw)


@dataclass(frozen=True)
class Case:
    turn: TurnFacts
    option: str
    words: tuple[str, ...] = ()  # must all appear in the reason
    prefills: tuple[NodeLoad, ...] = (p(P0), p(P1))
    decodes: tuple[NodeLoad, ...] = (d(D0), d(D1))
    knobs: PolicyKnobs = field(default_factory=knobs)
    pinned: str | None = D0
    decode_url: str = D0
    reuse: int | None = None  # expected reuse_tokens of the decision, when it matters
    forced: bool = False
    est: EstimatorSnapshot = SNAP


# The cases about a turn on its pinned D (local or not) keep the other D out of it; rebalancing has its own.
STAY = knobs(rebalance_decode=False)

CASES = {
    "idle-decode-short-suffix": Case(history_turn(8000, 200), "decode_local", ("suffix 200 tok", "pull", "cold")),
    "idle-decode-long-suffix-valid-handle": Case(
        history_turn(12000, 6000), "pull", ("max_local_suffix_tokens",), reuse=6000),
    "busy-decode-medium-suffix": Case(
        history_turn(12000, 1000), "pull", ("interference", "D 32 running"), decodes=(d(D0, running=32), d(D1)),
        knobs=STAY),
    "busy-decode-tight-tpot-budget": Case(
        history_turn(12000, 600), "pull", ("TPOT",), decodes=(d(D0, running=48), d(D1)),
        knobs=knobs(tpot_budget_s=0.022, interference_weight=0.0, rebalance_decode=False)),
    "first-turn-no-handle-no-cache": Case(
        TurnFacts(3000, 3000), "cold", ("no valid handle", "no pinned decode node"), pinned=None, decode_url=D0),
    "no-handle-short-cached-suffix": Case(
        TurnFacts(8000, 200, decode_cached_tokens=7800), "decode_local", ("pull n/a: no valid handle",)),
    "no-handle-long-suffix": Case(TurnFacts(9000, 3000, decode_cached_tokens=6000), "cold", ("no valid handle",)),
    "expired-handle-by-age": Case(
        history_turn(12000, 4000, handle_age_s=447.0), "cold", ("handle expires",)),
    "expired-handle-dropped-short-suffix": Case(
        history_turn(8000, 300, handle_valid=False, reuse_tokens=0), "decode_local", ("no valid handle",)),
    "truncated-handle-partial-reuse": Case(
        history_turn(12000, 500, reuse_tokens=5000, decode_cached_tokens=5000), "pull",
        ("reuse 5000 tok", "max_local_suffix_tokens"), reuse=5000),
    "truncated-handle-below-threshold": Case(
        history_turn(12000, 500, reuse_tokens=40, decode_cached_tokens=40), "cold", ("threshold 64",)),
    "dead-pinned-decode": Case(
        history_turn(8000, 200), "cold", ("pinned decode http://d0 is down", "down"),
        decodes=(d(D0, healthy=False), d(D1)), decode_url=D1),
    "dead-pinned-decode-picks-least-loaded": Case(
        history_turn(8000, 200), "cold", (), decodes=(d(D0, healthy=False), d(D1, waiting=5), d("http://d2")),
        decode_url="http://d2"),
    "prefill-saturated-short-suffix-busyish-decode": Case(
        history_turn(8000, 300), "decode_local", ("P 4 running/20 waiting",),
        prefills=(p(P0, running=4, waiting=20), p(P1, running=4, waiting=25)), decodes=(d(D0, running=8), d(D1))),
    "busy-decode-short-suffix-idle-prefill": Case(
        history_turn(12000, 1200), "pull", ("interference",), decodes=(d(D0, running=16), d(D1)), knobs=STAY),
    "least-loaded-prefill-for-pull": Case(
        history_turn(12000, 6000), "pull", ("P 0 running/1 waiting",),
        prefills=(p(P0, running=2, waiting=6), p(P1, waiting=1))),
    "no-bidirectional-prefill": Case(
        history_turn(12000, 6000), "cold", ("no healthy bidirectional prefill node",),
        prefills=(p(P0, bidirectional=False),)),
    "every-prefill-dead-forces-local": Case(
        history_turn(12000, 6000), "decode_local", ("forced", "no healthy prefill node"),
        prefills=(p(P0, healthy=False),), forced=True),
    # MoE decode: a short local suffix costs the running batch ~7 decode steps. Idle D: free, run it there.
    # One running request: at the default weight the TTFT a pull loses (~0.1 s) still outweighs the stall;
    # an operator who weighs TPOT higher (interference_weight 2) sends it through P.
    "moe-idle-decode-short-suffix": Case(
        history_turn(16000, 300, expected_output_tokens=32), "decode_local", ("D 0 running",), est=MOE),
    "moe-one-running-short-suffix": Case(
        history_turn(16000, 300, expected_output_tokens=32), "decode_local", ("decode_local interference",),
        decodes=(d(D0, running=1), d(D1)), est=MOE),
    "moe-one-running-short-suffix-tpot-weighted": Case(
        history_turn(16000, 300, expected_output_tokens=32), "pull", ("decode_local interference", "D 1 running"),
        decodes=(d(D0, running=1), d(D1)), est=MOE, reuse=15700,
        knobs=knobs(interference_weight=2.0, rebalance_decode=False)),
    # Rebalancing (auto): a P/D turn decodes on a lighter D when the balance pays for moving the whole
    # prompt's KV there; the pull still reads the history from the pinned D.
    "rebalance-pull-onto-the-idle-decode": Case(
        history_turn(12000, 1000), "pull", ("moves the pin from http://d0 (32 running", "balance"),
        decodes=(d(D0, running=32), d(D1)), decode_url=D1, reuse=11000),
    "rebalance-not-worth-moving-a-long-history-for-a-short-answer": Case(
        history_turn(30000, 3000, expected_output_tokens=16), "pull", (), est=MOE,
        decodes=(d(D0, running=3), d(D1, running=2)), reuse=27000),
    "rebalance-worth-it-for-a-long-answer": Case(
        history_turn(30000, 3000, expected_output_tokens=512), "pull", ("moves the pin",), est=MOE,
        decodes=(d(D0, running=3), d(D1, running=2)), decode_url=D1, reuse=27000),
    # A D the pin left still holds the history in its prefix cache: moving back ships only the rest.
    "rebalance-back-to-the-decode-that-kept-the-history": Case(
        history_turn(30000, 3000, expected_output_tokens=16, decode_elsewhere=((D1, 27000),)), "pull",
        ("moves the pin", "D still holds 26992 tok of the history"), est=MOE,
        decodes=(d(D0, running=3), d(D1, running=2)), decode_url=D1, reuse=27000),
    "rebalance-kept-history-is-likely-evicted-on-a-full-decode": Case(
        history_turn(30000, 3000, expected_output_tokens=16, decode_elsewhere=((D1, 27000),)), "pull", (),
        est=MOE, decodes=(d(D0, running=3), d(D1, running=2, kv_usage=0.99)), reuse=27000),
    "rebalance-counts-turns-already-headed-to-the-lighter-decode": Case(
        history_turn(12000, 3000, expected_output_tokens=256), "pull", (), prefills=(p(P0),), est=MOE,
        decodes=(d(D0, running=4), d(D1, running=1, arriving=4)), reuse=9000),
    "rebalance-onto-a-decode-few-are-headed-to": Case(
        history_turn(12000, 3000, expected_output_tokens=256), "pull", ("moves the pin", "1 arriving"),
        prefills=(p(P0),), est=MOE, decodes=(d(D0, running=4), d(D1, running=1, arriving=1)), decode_url=D1,
        reuse=9000),
    "rebalance-off-stays-pinned": Case(
        history_turn(30000, 3000, expected_output_tokens=512), "pull", (), est=MOE,
        decodes=(d(D0, running=3), d(D1, running=2)), reuse=27000, knobs=STAY),
    "rebalance-cold-onto-the-idle-decode": Case(
        TurnFacts(9000, 3000, decode_cached_tokens=6000), "cold", ("moves the pin",),
        decodes=(d(D0, running=8, waiting=2), d(D1)), decode_url=D1),
}


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_choose_situations(case: Case) -> None:
    dec = choose(case.turn, case.pinned, case.prefills, case.decodes, case.est, case.knobs)
    assert dec.option == case.option, dec.reason
    assert dec.decode_url == case.decode_url, dec.reason
    assert dec.forced is case.forced
    for w in case.words:
        assert w in dec.reason, (w, dec.reason)
    assert dec.reason.split(": ", 1)[0].endswith(dec.option) or "(forced)" in dec.reason
    if case.reuse is not None:
        assert dec.reuse_tokens == case.reuse
    if dec.option == "decode_local":
        assert dec.prefill_url is None and dec.reuse_tokens == 0
    else:
        assert dec.prefill_url is not None
    if dec.option != "pull":
        assert dec.reuse_tokens == 0
    # Every feasible estimate is a positive, finite number and appears in the reason.
    assert dec.option in dec.estimates_s or dec.forced
    for name, secs in dec.estimates_s.items():
        assert 0 < secs < math.inf
        assert name in dec.reason


def test_horizon_changes_a_borderline_decision() -> None:
    # This turn's suffix is small enough to run locally, but the session's turns typically add 3000 tokens
    # (tool results, over max_local_suffix_tokens) and the handle is about to expire: a local turn leaves
    # no fresh handle, the old one is dead by the next turn, so that turn would recompute the whole history
    # cold. Looking one turn ahead pulls now, which leaves a fresh handle.
    turn = history_turn(20000, 700, next_suffix_tokens=3000, handle_age_s=444.0)
    decodes = (d(D0), d(D1))
    greedy = choose(turn, D0, (p(P0),), decodes, SNAP, knobs(horizon_turns=0))
    ahead = choose(turn, D0, (p(P0),), decodes, SNAP, knobs(horizon_turns=1))
    assert greedy.option == "decode_local", greedy.reason
    assert ahead.option == "pull", ahead.reason
    assert ahead.greedy_option == "decode_local"
    assert "horizon: pull over greedy decode_local" in ahead.reason
    assert "next turn" in ahead.reason
    # A session whose next suffix is small again does not need the handle: local stays.
    calm = choose(replace(turn, next_suffix_tokens=200), D0, (p(P0),), decodes, SNAP, knobs())
    assert calm.option == "decode_local", calm.reason


def test_a_ttft_objective_stops_the_look_ahead_from_pushing_a_turn_past_it() -> None:
    # The borderline turn above: the look-ahead pulls now for the next turn's sake, at a higher TTFT than the
    # local turn's. With a TTFT objective between the two, the pull would miss it: the local turn runs.
    turn = history_turn(20000, 700, next_suffix_tokens=3000, handle_age_s=444.0)
    decodes = (d(D0), d(D1))
    ahead = choose(turn, D0, (p(P0),), decodes, SNAP, knobs(horizon_turns=1))
    local_s, pull_s = ahead.estimates_s["decode_local"], ahead.estimates_s["pull"]
    assert ahead.option == "pull" and local_s < pull_s
    objective = (local_s + pull_s) / 2
    held = choose(turn, D0, (p(P0),), decodes, SNAP, knobs(horizon_turns=1, ttft_objective_s=objective))
    assert held.option == "decode_local", held.reason
    assert f"held to the TTFT objective {objective:.3f}s: pull, cold over it" in held.reason
    # Within reach of both, or of neither, the objective changes nothing.
    for loose in (2 * pull_s, local_s / 2):
        same = choose(turn, D0, (p(P0),), decodes, SNAP, knobs(horizon_turns=1, ttft_objective_s=loose))
        assert same.option == "pull", same.reason


def test_tail_weight_keeps_a_tail_turn_off_a_slower_move() -> None:
    """A long tool result whose TTFT is already in the tail: moving it to a lighter D (which lacks the
    history) saves decode time but adds TTFT. Without the tail term the balance wins; with it, every second
    above the threshold costs tail_weight more, and the turn stays pinned. Below the threshold nothing
    changes."""
    turn = history_turn(30000, 3000, expected_output_tokens=128)
    decodes = (d(D0, running=3), d(D1, running=2))
    moved = choose(turn, D0, (p(P0),), decodes, MOE, knobs(tail_weight=4.0))
    assert moved.decode_url == D1, moved.reason  # no threshold known yet: the plain score
    stay_ttft = choose(turn, D0, (p(P0),), decodes, MOE, STAY).estimates_s["pull"]
    assert moved.estimates_s["pull"] > stay_ttft  # the move is slower to its first token
    tail = replace(turn, ttft_tail_s=stay_ttft - 0.05)
    kept = choose(tail, D0, (p(P0),), decodes, MOE, knobs(tail_weight=4.0))
    assert kept.option == "pull" and kept.decode_url == D0, kept.reason
    assert "tail" in kept.reason and "moves the pin" not in kept.reason
    off = choose(tail, D0, (p(P0),), decodes, MOE, knobs(tail_weight=0.0))
    assert off.decode_url == D1, off.reason
    below = choose(replace(turn, ttft_tail_s=10.0), D0, (p(P0),), decodes, MOE, knobs(tail_weight=4.0))
    assert below.decode_url == D1 and below.scores_s == moved.scores_s


def test_look_ahead_remembers_the_decode_a_move_leaves() -> None:
    """After a move the next turn is pinned on the new D, and the D it left holds this turn's history."""
    from kvtether.gateway.policy import lookahead, options

    turn = history_turn(12000, 1000, decode_elsewhere=((D1, 4000),))
    c = options.Nodes((p(P0),), (d(D0), d(D1)), MOE, knobs())
    moved = options.OptionEstimate("pull", True, "", False, 0.3, 0.0, 0.0, P0, D1, 11000, 1000, 1000)
    [(prob, nxt, pin)] = lookahead.after(turn, moved, D0, c)
    assert prob == 1.0 and pin == D1 and nxt.decode_elsewhere == ((D0, 10992),)  # whole blocks
    stayed = replace(moved, decode_url=D0)
    [(_, nxt, pin)] = lookahead.after(turn, stayed, D0, c)
    assert pin == D0 and nxt.decode_elsewhere == ((D1, 4000),)


def test_local_turn_keeps_the_unused_handle_for_the_next_turn() -> None:
    # vLLM returns no handle for a decode-local turn, but the gateway puts back the one the turn did not
    # use: its blocks still cover the history up to the last P/D turn, so the next turn may pull that
    # prefix (P computes this turn's suffix and answer too). With a young handle, a large next suffix is
    # no reason to avoid running this turn locally; without any handle it is (the next turn goes cold).
    turn = history_turn(20000, 700, next_suffix_tokens=3000)
    with_handle = choose(turn, D0, (p(P0),), (d(D0), d(D1)), SNAP, knobs())
    assert with_handle.option == "decode_local", with_handle.reason
    local = next(o for o in with_handle.options if o.option == "decode_local")
    pull = next(o for o in with_handle.options if o.option == "pull")
    # The next turn pulls (a bit more to compute on P than after a pull, far from a cold recompute).
    assert pull.horizon_s < local.horizon_s < 1.5 * pull.horizon_s, with_handle.reason
    no_handle = choose(replace(turn, handle_valid=False, reuse_tokens=0), D0, (p(P0),), (d(D0), d(D1)), SNAP, knobs())
    stuck = next(o for o in no_handle.options if o.option == "decode_local")
    assert stuck.horizon_s > 3 * local.horizon_s, no_handle.reason


def test_a_local_turn_that_keeps_a_handle_leaves_the_next_turn_a_whole_history_pull() -> None:
    """Marked for retention, a decode-local turn comes back with a handle of its whole sequence: the next turn
    then pulls everything, as after a P/D turn. The borderline turn that the look-ahead sent to P (its local
    run would leave only a dying handle, so the next, long turn would recompute the history cold) stays on D,
    and the eviction risk of a full D no longer weighs on it (the handle's blocks are pinned)."""
    turn = history_turn(20000, 700, next_suffix_tokens=3000, handle_age_s=444.0)
    decodes = (d(D0), d(D1))
    unmarked = choose(turn, D0, (p(P0),), decodes, SNAP, knobs())
    assert unmarked.option == "pull", unmarked.reason
    marked = choose(replace(turn, local_keeps_handle=True), D0, (p(P0),), decodes, SNAP, knobs())
    assert marked.option == "decode_local", marked.reason
    local = next(o for o in marked.options if o.option == "decode_local")
    pull = next(o for o in marked.options if o.option == "pull")
    # The same next turn either way (a fresh whole-history handle), so the same look-ahead cost.
    assert local.horizon_s == pytest.approx(pull.horizon_s), marked.reason
    short = history_turn(20000, 400, local_keeps_handle=True)
    empty = choose(short, D0, (p(P0),), (d(D0, kv_usage=0.2),), SNAP, knobs())
    # The KV-pressure veto and the preemption risk off: the look-ahead's eviction term alone.
    full = choose(short, D0, (p(P0),), (d(D0, kv_usage=0.99),), SNAP, knobs(local_kv_veto=1.0, preemption_weight=0.0))
    assert next(o for o in full.options if o.option == "decode_local").horizon_s == pytest.approx(
        next(o for o in empty.options if o.option == "decode_local").horizon_s)


def test_horizon_accounts_for_eviction_risk_on_full_decode() -> None:
    # Same short turn; on a D whose KV is nearly full, the history a local turn leaves in the prefix cache
    # is likely gone by the next turn, so the look-ahead costs a local turn more than on an empty D.
    turn = history_turn(20000, 400)
    empty = choose(turn, D0, (p(P0),), (d(D0, kv_usage=0.2),), SNAP, knobs())
    full = choose(turn, D0, (p(P0),), (d(D0, kv_usage=0.99),), SNAP,
                  knobs(local_kv_veto=1.0, preemption_weight=0.0))  # the veto and the preemption risk off
    assert full.scores_s["decode_local"] > empty.scores_s["decode_local"]
    assert full.scores_s["pull"] == pytest.approx(empty.scores_s["pull"])


def test_a_decode_node_near_full_kv_vetoes_a_local_prefill() -> None:
    """At D's pressure mark a local suffix's blocks would come chunk by chunk beside the running requests' and
    preempt one of them: the turn goes to P however cheap it would be on D; below the mark it stays local."""
    turn = history_turn(20000, 400)
    below = choose(turn, D0, (p(P0),), (d(D0, kv_usage=0.85),), SNAP, knobs(local_kv_veto=0.9))
    assert below.option == "decode_local", below.reason
    at = choose(turn, D0, (p(P0),), (d(D0, kv_usage=0.9),), SNAP, knobs(local_kv_veto=0.9))
    assert at.option == "pull", at.reason
    assert "KV usage 0.90 >= 0.9" in at.reason


def test_deeper_horizon_is_bounded_and_consistent() -> None:
    turn = history_turn(20000, 700, next_suffix_tokens=3000)
    for h in range(4):
        dec = choose(turn, D0, (p(P0),), (d(D0, running=4),), SNAP, knobs(horizon_turns=h))
        assert dec.option in ("decode_local", "pull")
        assert all(math.isfinite(v) for v in dec.scores_s.values())
    with pytest.raises(ValueError):
        knobs(horizon_turns=4)


def test_no_healthy_decode_raises() -> None:
    with pytest.raises(NoFeasibleOption):
        choose(history_turn(8000, 200), D0, (p(P0),), (d(D0, healthy=False),), SNAP, knobs())


def test_no_prefill_and_dead_pinned_decode_raises() -> None:
    with pytest.raises(NoFeasibleOption):
        choose(history_turn(8000, 200), D0, (p(P0, healthy=False),), (d(D0, healthy=False), d(D1)), SNAP, knobs())


def test_exclude_treats_a_failed_node_as_dead() -> None:
    dec = choose(history_turn(8000, 200), D0, (p(P0), p(P1)), (d(D0), d(D1)), SNAP, knobs(), exclude=frozenset({D0}))
    assert dec.option == "cold" and dec.decode_url == D1
    dec = choose(history_turn(12000, 6000), D0, (p(P0), p(P1)), (d(D0),), SNAP, knobs(), exclude=frozenset({P0}))
    assert dec.prefill_url == P1


def test_trace_attributes_are_flat_primitives() -> None:
    dec = choose(history_turn(12000, 6000), D0, (p(P0),), (d(D0),), SNAP, knobs())
    attrs = dec.trace_attributes()
    assert attrs["option"] == "pull"
    assert "ttft_est_s.pull" in attrs and "rejected.decode_local" in attrs
    assert all(isinstance(v, str | int | float | bool) for v in attrs.values())


def test_decision_is_deterministic_and_pure() -> None:
    args = (history_turn(9000, 900), D0, (p(P0), p(P1)), (d(D0, running=6), d(D1)), SNAP, knobs())
    first: CostDecision = choose(*args)
    assert all(choose(*args) == first for _ in range(3))


@pytest.mark.parametrize(
    "kw",
    [{"prompt_tokens": 0, "suffix_tokens": 0}, {"prompt_tokens": 10, "suffix_tokens": -1},
     {"prompt_tokens": 10, "suffix_tokens": 1, "reuse_tokens": -5}],
    ids=["empty-prompt", "negative-suffix", "negative-reuse"],
)
def test_turn_facts_validation(kw: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        TurnFacts(**kw)


def test_learned_slow_decode_prefill_moves_short_suffix_to_pull() -> None:
    # D turns out 8× slower at prefill than the seed says (e.g. a smaller GPU): its local turns got costly.
    est = Estimator()
    for i in range(30):
        tokens, ctx = 200 + 37 * i, 8000
        secs = (SEEDS.prefill_overhead_s + SEEDS.prefill_s_per_token * tokens
                + SEEDS.prefill_s_per_pair * tokens * (ctx + tokens / 2))
        est.observe_prefill(D0, tokens, ctx, 8 * secs, now=float(i))
        est.observe_prefill(P0, tokens, ctx, secs, now=float(i))  # P is as fast as the seed says
    turn, ps, ds = history_turn(8000, 600), (p(P0),), (d(D0),)
    assert choose(turn, D0, ps, ds, SNAP, knobs()).option == "decode_local"
    assert choose(turn, D0, ps, ds, est.snapshot(30.0), knobs()).option == "pull"


# ---------------------------------------------------------------------------------------------------------
# Estimates.


def _true_prefill(tokens: int, ctx: int, a: float, b: float, c: float) -> float:
    return a + b * tokens + c * tokens * (ctx + tokens / 2)


def test_prefill_estimate_converges_to_a_different_shape() -> None:
    a, b, c = 0.02, 2.5e-4, 0.6e-9  # slower dense part, faster attention, more overhead than the seed
    est = Estimator()
    # Suffixes from 50 to 6000 tokens (log-spread), contexts up to 30k: what an agent's turns look like.
    sizes = [(int(50 * math.exp((i * 0.618) % 1 * math.log(120))), (i * 3571) % 30000) for i in range(200)]
    for i, (n, ctx) in enumerate(sizes):
        est.observe_prefill(P0, n, ctx, _true_prefill(n, ctx, a, b, c), now=float(i))
    snap = est.snapshot(200.0)
    for n, ctx in [(50, 0), (200, 0), (2000, 5000), (6000, 25000), (500, 20000)]:
        assert snap.prefill_s(P0, n, ctx) == pytest.approx(_true_prefill(n, ctx, a, b, c), rel=0.1)


def test_scale_converges_quickly_for_a_uniformly_slower_node() -> None:
    est = Estimator()
    for i in range(30):
        est.observe_transfer(D0, P0, 4000, 3 * (SEEDS.transfer_latency_s + 4000 * SEEDS.transfer_s_per_token),
                             now=float(i))
    snap = est.snapshot(30.0)
    seed = EstimatorSnapshot(SEEDS).transfer_s(D0, P0, 4000)
    assert snap.transfer_s(D0, P0, 4000) == pytest.approx(3 * seed, rel=0.05)
    # Links are symmetric: the same path either way.
    assert snap.transfer_s(P0, D0, 4000) == snap.transfer_s(D0, P0, 4000)
    assert link_key(D0, P0) == link_key(P0, D0)


def test_outlier_is_clamped() -> None:
    est = Estimator()
    for i in range(30):
        est.observe_tpot(D0, 16, SEEDS.tpot_base_s + 16 * SEEDS.tpot_s_per_seq, now=float(i))
    before = est.snapshot(30.0).tpot_s(D0, 16)
    est.observe_tpot(D0, 16, 100.0, now=30.0)  # a preemption or a GC pause: 100 s for one step
    after = est.snapshot(30.0).tpot_s(D0, 16)
    assert before == pytest.approx(SEEDS.tpot_base_s + 16 * SEEDS.tpot_s_per_seq, rel=0.01)
    assert after < 1.5 * before


def test_coefficients_stay_within_bounds() -> None:
    params = LearningParams()
    est = Estimator(params=params)
    for i in range(200):
        est.observe_queue(P0, 4, 4 * SEEDS.queue_s_per_request * 1e4, now=float(i))
    snap = est.snapshot(200.0)
    assert snap.queue_s(P0, 1) == pytest.approx(SEEDS.queue_s_per_request * params.theta_max)


def test_one_sample_moves_an_estimate_only_a_little() -> None:
    params = LearningParams()
    est = Estimator(params=params)
    seed = EstimatorSnapshot(SEEDS).prefill_s(P0, 1000, 0)
    est.observe_prefill(P0, 1000, 0, 45 * seed, now=0.0)  # clamped to outlier_factor, then trusted 1/min_weight
    got = est.snapshot(0.0).prefill_s(P0, 1000, 0)
    # Trusted 1/min_weight at two levels (the node's fit over the cluster-wide fit, over the seed).
    share = 1 - (1 - 1 / params.min_weight) ** 2
    assert seed < got <= seed * (1 + (params.outlier_factor - 1) * share) * 1.001


def test_stale_estimates_decay_toward_the_seed() -> None:
    params = LearningParams(half_life_s=100.0)
    est = Estimator(params=params)
    seed = EstimatorSnapshot(SEEDS).prefill_s(P0, 1000, 1000)
    for i in range(40):
        est.observe_prefill(P0, 1000, 1000, 3 * seed, now=float(i))
    fresh = est.snapshot(40.0).prefill_s(P0, 1000, 1000)
    later = est.snapshot(40.0 + 3 * 100.0).prefill_s(P0, 1000, 1000)
    stale = est.snapshot(40.0 + 20 * 100.0).prefill_s(P0, 1000, 1000)
    assert fresh == pytest.approx(3 * seed, rel=0.05)
    assert 1.5 * seed < later < 2.5 * seed  # three half-lives: weight ≈ 2.1 of min_weight 5, about half-way back
    assert stale == pytest.approx(seed, rel=1e-3)  # long idle: back to the seed


def test_unknown_node_uses_the_cluster_wide_fit() -> None:
    est = Estimator()
    seed = EstimatorSnapshot(SEEDS).prefill_s(P0, 2000, 0)
    for i in range(30):
        est.observe_prefill(f"http://p{i % 3}", 2000, 0, 2 * seed, now=float(i))
    snap = est.snapshot(30.0)
    assert snap.prefill_s("http://p-new", 2000, 0) == pytest.approx(2 * seed, rel=0.1)


def test_memory_is_bounded() -> None:
    params = LearningParams(max_keys=16)
    est = Estimator(params=params)
    for i in range(1000):
        for k in range(4):  # enough samples for each node's own fit to be used
            est.observe_prefill(f"http://p{i}", 500, 0, 0.1, now=float(i) + k / 10)
            est.observe_transfer(f"http://p{i}", D0, 500, 0.01, now=float(i) + k / 10)
    assert len(est) <= 4 * (params.max_keys + 1)
    snap = est.snapshot(1000.0)
    assert "*" in snap.coefficients["prefill"]
    assert "http://p999" in snap.coefficients["prefill"] and "http://p0" not in snap.coefficients["prefill"]


@pytest.mark.parametrize("secs", [math.nan, math.inf, -1.0, 0.0], ids=["nan", "inf", "negative", "zero"])
def test_invalid_samples_are_ignored(secs: float) -> None:
    est = Estimator()
    for i in range(10):
        est.observe_prefill(P0, 1000, 0, secs, now=float(i))
    assert est.snapshot(10.0).prefill_s(P0, 1000, 0) == EstimatorSnapshot(SEEDS).prefill_s(P0, 1000, 0)


def test_prefill_leg_attributes_one_unknown_at_a_time() -> None:
    est = Estimator()
    seed = EstimatorSnapshot(SEEDS)
    compute = seed.prefill_s(P0, 1000, 0)
    for i in range(20):  # queued legs: the residual over the compute estimate is queue delay
        est.observe_prefill_leg(P0, 1000, 0, compute + 5 * 0.3, ahead=5, now=float(i))
    snap = est.snapshot(20.0)
    assert snap.queue_s(P0, 5) == pytest.approx(1.5, rel=0.05)
    assert snap.prefill_s(P0, 1000, 0) == seed.prefill_s(P0, 1000, 0)
    read = seed.transfer_s(D0, P0, 8000)
    for i in range(20):  # pulled legs with nobody ahead: the residual is the transfer
        est.observe_prefill_leg(P0, 200, 8000, seed.prefill_s(P0, 200, 8000) + 2 * read,
                                pulled_tokens=8000, pulled_from=D0, now=20.0 + i)
    assert est.snapshot(40.0).transfer_s(D0, P0, 8000) == pytest.approx(2 * read, rel=0.05)


def test_snapshot_is_immutable_and_detached() -> None:
    est = Estimator()
    for i in range(10):
        est.observe_tpot(D0, 8, 0.05, now=float(i))
    snap = est.snapshot(10.0)
    value = snap.tpot_s(D0, 8)
    for i in range(10):
        est.observe_tpot(D0, 8, 0.2, now=10.0 + i)
    assert snap.tpot_s(D0, 8) == value
    with pytest.raises(TypeError):
        tpot_fits: Any = snap.coefficients["tpot"]
        tpot_fits[D0] = (1.0, 1.0)


@pytest.mark.parametrize(
    "kw", [{"alpha": 0.0}, {"outlier_factor": 1.0}, {"theta_min": 2.0}, {"max_keys": 0}],
    ids=["alpha", "outlier", "theta", "keys"],
)
def test_learning_params_validation(kw: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        LearningParams(**kw)


def test_seed_validation() -> None:
    with pytest.raises(ValueError):
        EstimatorSeeds(prefill_s_per_token=0.0)


def _on(decision: CostDecision, option: str) -> Any:
    return next(o for o in decision.options if o.option == option)


def test_a_pull_goes_to_the_prefill_node_that_holds_the_history_and_reads_only_the_rest() -> None:
    """P1 prefilled the session's last P/D turn and (prefix caching on) still holds 24k of the 27k-token
    history: a pull there reads only the last 3k from D (vLLM: remote tokens − local hit), so it beats the
    same pull on the equally idle P0, which would read all 27k, by about that transfer."""
    turn = history_turn(30000, 3000)  # over max_local_suffix_tokens: a P/D turn
    plain = choose(turn, D0, (p(P0), p(P1)), (d(D0),), MOE, STAY)
    assert plain.option == "pull" and plain.prefill_url == P0, plain.reason  # tie: the first configured
    held = choose(replace(turn, prefill_cached=((P1, 24000),)), D0, (p(P0), p(P1)), (d(D0),), MOE, STAY)
    assert held.option == "pull" and held.prefill_url == P1, held.reason
    assert held.reuse_tokens == 27000  # the whole verified handle is still sent; P reads what it lacks
    assert "its cache holds 24000 tok" in held.reason
    saved = plain.estimates_s["pull"] - held.estimates_s["pull"]
    assert saved == pytest.approx(24000 * 6e-6, rel=0.05)
    assert _on(held, "pull").moved_tokens == 3000 + 3008  # 3k read from D, the suffix (whole blocks) back
    # A busy P that holds the history still loses to an idle one once its queue costs more than the read.
    busy = choose(replace(turn, prefill_cached=((P1, 24000),)), D0, (p(P0), p(P1, waiting=3)), (d(D0),), MOE,
                  STAY)
    assert busy.prefill_url == P0, busy.reason


def test_a_read_below_the_recompute_threshold_is_computed_on_the_prefill_node() -> None:
    # P1 holds all but 40 tokens of the handle: vLLM computes them rather than read (kv_recompute_threshold
    # 64), so nothing crosses from D to P.
    turn = history_turn(30000, 3000, prefill_cached=((P1, 26960),))
    dec = choose(turn, D0, (p(P1),), (d(D0),), MOE, STAY)
    pull = _on(dec, "pull")
    assert dec.option == "pull" and pull.moved_tokens == 3008 and pull.computed_tokens == 30000 - 26960


def test_a_cold_prefill_goes_where_the_history_is_cached() -> None:
    """No handle (expired), but P1's prefix cache still holds the history: cold there computes the suffix
    only, so auto does not pay a cold prefill of the whole prompt, and P1 is where it runs."""
    turn = TurnFacts(30000, 3000, decode_cached_tokens=27000, prefill_cached=((P1, 26000),))
    dec = choose(turn, D0, (p(P0), p(P1)), (d(D0),), MOE, STAY)
    cold = _on(dec, "cold")
    assert dec.option == "cold" and dec.prefill_url == P1 and cold.computed_tokens == 4000, dec.reason
    nothing = choose(replace(turn, prefill_cached=()), D0, (p(P0), p(P1)), (d(D0),), MOE, STAY)
    assert nothing.estimates_s["cold"] > dec.estimates_s["cold"] + 0.2  # 22k more tokens computed


def test_look_ahead_counts_the_prefill_copy_a_pd_turn_leaves() -> None:
    from kvtether.gateway.policy import lookahead, options

    turn = history_turn(12000, 1000, prefill_cached=((P0, 8000),))
    c = options.Nodes((p(P0, prefix_caching=True), p(P1, prefix_caching=True)), (d(D0),), MOE, knobs())
    on_p1 = options.OptionEstimate("pull", True, "", False, 0.3, 0.0, 0.0, P1, D0, 11000, 1000, 1000)
    [(_, nxt, _)] = lookahead.after(turn, on_p1, D0, c)
    assert nxt.prefill_cached == ((P0, 8000), (P1, 12000))
    local = options.OptionEstimate("decode_local", True, "", False, 0.1, 0.0, 0.0, None, D0, 0, 1000, 0)
    for _, nxt, _ in lookahead.after(turn, local, D0, c):
        assert nxt.prefill_cached == ((P0, 8000),)
    # A P without prefix caching keeps nothing of the turn.
    c = options.Nodes((p(P0, prefix_caching=True), p(P1)), (d(D0),), MOE, knobs())
    [(_, nxt, _)] = lookahead.after(turn, on_p1, D0, c)
    assert nxt.prefill_cached == ((P0, 8000),)



def test_blocked_s_counts_the_instants_a_local_step_holds_up() -> None:
    from kvtether.gateway.policy import blocked_s

    # A local prefill holding D from 0.01 s to 0.09 s (from now).
    assert blocked_s((), 0.01, 0.09) == 0.0
    assert blocked_s(((0.2, 0.05),), 0.01, 0.09) == 0.0  # arrives after the step
    assert blocked_s(((0.03, 0.2),), 0.01, 0.09) == pytest.approx(0.06)  # its read starts 0.06 s late
    assert blocked_s(((-0.02, 0.05),), 0.01, 0.09) == pytest.approx(0.06)  # its first step, read done at 0.03
    assert blocked_s(((0.02, 0.03),), 0.01, 0.09) == pytest.approx(0.07 + 0.04)  # both inside
    assert blocked_s(((0.03, 0.2), (0.05, 0.2)), 0.01, 0.09) == pytest.approx(0.06 + 0.04)
    assert blocked_s(((0.03, 0.2),), 0.09, 0.09) == 0.0


def test_a_local_turn_pays_for_the_pd_turns_it_would_hold_up_on_d() -> None:
    """A P/D turn about to reach D would wait for a local prefill's engine step (its KV read, or its first
    step, cannot start inside it): with arrival_weight 1 (off by default) the local option's interference
    grows by that delay (another session's first token), and enough arrivals inside the step send the turn to
    P instead."""
    turn = history_turn(20000, 300)
    free = choose(turn, D0, (p(P0),), (d(D0, running=2),), MOE, knobs(arrival_weight=1.0))
    assert free.option == "decode_local", free.reason
    local_free = next(o for o in free.options if o.option == "decode_local")
    on = knobs(arrival_weight=1.0)
    one = choose(turn, D0, (p(P0),), (d(D0, running=2, arriving=1, arrivals=((0.02, 0.3),)),), MOE, on)
    local_one = next(o for o in one.options if o.option == "decode_local")
    assert local_one.blocks_s > 0.03, one.reason
    assert local_one.interference_s == pytest.approx(local_free.interference_s + local_one.blocks_s)
    assert "holds up arriving turns" in one.reason
    # Only this turn can hold them up: the look-ahead's next turn comes long after they are through.
    assert [o.horizon_s for o in one.options] == [o.horizon_s for o in free.options]
    busy = d(D0, running=2, arriving=4, arrivals=tuple((0.005 * i, 0.3) for i in range(4)))
    held_up = choose(turn, D0, (p(P0),), (busy,), MOE, on)
    assert held_up.option != "decode_local", held_up.reason
    ignored = choose(turn, D0, (p(P0),), (busy,), MOE)  # the default
    assert ignored.option == "decode_local", ignored.reason
    # Arrivals after the local step do not count.
    late = choose(turn, D0, (p(P0),), (d(D0, running=2, arriving=1, arrivals=((1.0, 0.1),)),), MOE, on)
    assert next(o for o in late.options if o.option == "decode_local").blocks_s == 0.0


def test_a_pd_decision_says_when_it_reaches_its_decode_node() -> None:
    turn = history_turn(20000, 3000)
    dec = choose(turn, D0, (p(P0),), (d(D0),), MOE, knobs())
    assert dec.option == "pull", dec.reason
    pick = next(o for o in dec.options if o.option == "pull")
    assert 0.0 < dec.arrive_s == pick.arrive_s < pick.ttft_s
    assert 0.0 < dec.d_read_s == pick.d_read_s < pick.ttft_s - pick.arrive_s


def test_a_stall_on_a_request_whose_client_has_seen_nothing_costs_its_ttft() -> None:
    """A running request whose first delta a tool-call parser still holds back (or that is not streamed) loses
    the local prefill's stall from its TTFT, not from its TPOT: with holdback_weight 1 (off by default) it is
    priced at 1, not at interference_weight."""
    turn = history_turn(20000, 300)
    k = knobs(holdback_weight=1.0)
    calm = choose(turn, D0, (p(P0),), (d(D0, running=3),), MOE, k)
    held = choose(turn, D0, (p(P0),), (d(D0, running=3, holding_back=2),), MOE, k)
    local_calm = next(o for o in calm.options if o.option == "decode_local")
    local_held = next(o for o in held.options if o.option == "decode_local")
    assert local_calm.stall_s > 0.03
    extra = (1.0 - k.interference_weight) * 2 * local_calm.stall_s
    assert local_held.interference_s == pytest.approx(local_calm.interference_s + extra)
    # Never more of them than are running; weight 0.2 (= interference_weight) adds nothing.
    over = choose(turn, D0, (p(P0),), (d(D0, running=3, holding_back=9),), MOE, k)
    assert next(o for o in over.options if o.option == "decode_local").interference_s == pytest.approx(
        local_calm.interference_s + (1.0 - k.interference_weight) * 3 * local_calm.stall_s)
    same = choose(turn, D0, (p(P0),), (d(D0, running=3, holding_back=2),), MOE,
                  replace(k, holdback_weight=k.interference_weight))
    assert same.scores_s == calm.scores_s


def test_a_snapshot_is_reused_briefly_and_never_past_a_new_sample() -> None:
    est = Estimator()
    for i in range(10):
        est.observe_tpot(D0, 8, 0.05, now=float(i))
    first = est.snapshot(10.0)
    assert est.snapshot(10.0 + SNAPSHOT_REUSE_S / 2) is first  # nothing new, a moment later: the same
    assert est.snapshot(10.0 + SNAPSHOT_REUSE_S * 2) is not first  # long enough for decay to count
    again = est.snapshot(20.0)
    est.observe_tpot(D0, 8, 0.2, now=20.0)
    after = est.snapshot(20.0)
    assert after is not again and after.tpot_s(D0, 8) > again.tpot_s(D0, 8)
    assert est.snapshot(19.0) is not after  # an earlier `now` is computed, not served from the cache


def test_after_a_sample_only_its_kind_is_computed_again_and_the_result_equals_a_fresh_one() -> None:
    est = Estimator()
    for i in range(10):
        est.observe_tpot(D0, 8, 0.05, now=float(i))
        est.observe_prefill(P0, 1000, 0, 0.3, now=float(i))
    before = est.snapshot(10.0)
    est.observe_tpot(D0, 8, 0.2, now=10.01)
    after = est.snapshot(10.02)
    assert after.coefficients["prefill"] is before.coefficients["prefill"]  # untouched kind: reused
    assert after.coefficients["tpot"] is not before.coefficients["tpot"]
    fresh = Estimator()
    fresh._fits = est._fits  # same data, no cache: every kind computed at 10.02
    assert fresh.snapshot(10.02).coefficients["tpot"] == after.coefficients["tpot"]
    assert fresh.snapshot(10.02).prefill_s(P0, 1000) == pytest.approx(after.prefill_s(P0, 1000), rel=1e-6)
    assert est.snapshot(10.0 + 2 * SNAPSHOT_REUSE_S).coefficients["prefill"] is not before.coefficients["prefill"]


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 3), st.lists(st.floats(-50, 50), min_size=12, max_size=12), st.floats(0.01, 40.0))
def test_the_closed_form_ridge_solve_agrees_with_elimination(dim: int, values: list[float], lam: float) -> None:
    from kvtether.gateway.policy.estimates import _eliminate, _solve

    # A ridge system as the fits build one: Σ g·gᵀ + λI, with its right-hand side.
    rows = [values[i * dim:(i + 1) * dim] for i in range(3)]
    a = [[sum(r[i] * r[j] for r in rows) + (lam if i == j else 0.0) for j in range(dim)] for i in range(dim)]
    b = values[9:9 + dim]
    got, want = _solve([row[:] for row in a], b[:]), _eliminate([row[:] for row in a], b[:])
    assert got == pytest.approx(want, rel=1e-6, abs=1e-9)
