"""Placement over a pool of instances that take both roles (pure): no turn is prefilled where it decodes, a
prefill leg on an instance is charged to that instance's own decodes, sessions keep their instance until it is
overloaded against the pool, and the fixed rules fall back to the instance itself when it is alone."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import httpx
import pytest
from kvtether.gateway.config import load_config
from kvtether.gateway.nodes.cluster import Cluster
from kvtether.gateway.policy import NodeLoad, PolicyKnobs, TurnFacts, choose
from kvtether.gateway.policy.estimates import EstimatorSeeds, EstimatorSnapshot, LearningParams
from kvtether.gateway.policy.learning import Learning
from kvtether.gateway.policy.options import Nodes, decode_choices, p_queue_s, pool_overloaded, pull_option
from kvtether.gateway.policy.placement import ClusterView, HandleAction, HandleState, Turn, plan

from tests.support.policy_facts import MOE, history_turn

A, B, C = "http://a", "http://b", "http://c"
SNAP = EstimatorSnapshot(EstimatorSeeds())


def inst(url: str, **kw: Any) -> NodeLoad:
    return NodeLoad(url, both=True, **kw)


def pool(*nodes: NodeLoad) -> tuple[tuple[NodeLoad, ...], tuple[NodeLoad, ...]]:
    """A pool's view: every instance is a prefill and a decode candidate."""
    return nodes, nodes


def long_turn() -> TurnFacts:
    # Over the local limit below: the turn must be disaggregated.
    return history_turn(12000, 6000)


KNOBS = PolicyKnobs(max_local_suffix_tokens=2048, pool_max_local_suffix_tokens=2048)


def test_a_pool_turn_is_never_prefilled_where_it_decodes() -> None:
    ps, ds = pool(inst(A), inst(B), inst(C))
    d = choose(long_turn(), A, ps, ds, SNAP, KNOBS)
    assert d.option == "pull"
    assert d.decode_url == A and d.prefill_url in (B, C)
    for o in d.options:
        if o.prefill_url is not None:
            assert o.prefill_url != o.decode_url


def test_a_pool_of_one_runs_every_turn_on_its_instance() -> None:
    ps, ds = pool(inst(A))
    d = choose(long_turn(), A, ps, ds, SNAP, KNOBS)
    # Over the local limit, but nothing else can run it: forced, not failed.
    assert d.option == "decode_local" and d.forced
    why = {o.option: o.why_not for o in d.options if not o.feasible}
    assert "but the decode node itself" in why["pull"] and "but the decode node itself" in why["cold"]


def test_a_new_session_may_start_on_the_least_busy_instance_itself() -> None:
    ps, ds = pool(inst(A, running=6.0), inst(B, running=1.0))
    d = choose(TurnFacts(600, 600), None, ps, ds, SNAP, KNOBS)
    local = next(o for o in d.options if o.option == "decode_local")
    assert local.feasible and local.decode_url == B and local.computed_tokens == 600
    # On dedicated decode nodes a new session still needs a prefill node.
    d2 = choose(TurnFacts(600, 600), None, (NodeLoad("http://p"),), (NodeLoad(A), NodeLoad(B)), SNAP, KNOBS)
    assert d2.option == "cold"
    assert not next(o for o in d2.options if o.option == "decode_local").feasible


def test_a_prefill_leg_goes_to_the_instance_whose_decodes_lose_least() -> None:
    # B and C are alike but for B's eight decoding requests, which a prefill leg there would stall.
    ps, ds = pool(inst(A), inst(B, running=8.0), inst(C))
    d = choose(long_turn(), A, ps, ds, MOE, KNOBS)
    assert d.option == "pull" and d.prefill_url == C
    # The estimate on B carries the stall and its price; C's none.
    c = Nodes(ps, ds, MOE, KNOBS)
    on_b = pull_option(long_turn(), A, replace(c, prefills=(inst(B, running=8.0),)))
    on_c = pull_option(long_turn(), A, replace(c, prefills=(inst(C),)))
    assert on_b.stall_s > 0 and on_b.interference_s > 0
    assert on_c.stall_s == 0 and on_c.interference_s == 0


def test_a_prefill_leg_must_fit_the_instances_tpot_quotas() -> None:
    ps, ds = pool(inst(A), inst(B, running=8.0))
    tight = replace(long_turn(), stall_credits=((B, 0.001, 0.05),))
    c = Nodes(ps, ds, MOE, KNOBS)
    o = pull_option(tight, A, c)
    assert not o.feasible and o.soft and "TPOT quota" in o.why_not and B in o.why_not
    roomy = replace(long_turn(), stall_credits=((B, 10.0, 10.0),))
    assert pull_option(roomy, A, c).feasible


def test_a_prefill_leg_is_vetoed_on_an_instance_short_of_kv() -> None:
    c = Nodes(*pool(inst(A), inst(B, running=2.0, kv_usage=0.95)), MOE, KNOBS)
    o = pull_option(long_turn(), A, c)
    assert not o.feasible and "KV usage" in o.why_not


def test_an_instance_queues_a_prefill_behind_its_prefill_legs_not_its_decodes() -> None:
    c = Nodes((), (), SNAP, KNOBS)
    decoding = inst(B, running=10.0)
    prefilling = inst(B, running=10.0, prefilling=10.0)
    turn = long_turn()
    assert p_queue_s(c, decoding, turn) == pytest.approx(SNAP.queue_s(B, 0.0))
    assert p_queue_s(c, prefilling, turn) > p_queue_s(c, decoding, turn)
    assert prefilling.decoding == 0.0 and decoding.decoding == 10.0
    # A dedicated P's running requests are all prefills.
    assert p_queue_s(c, NodeLoad(B, running=10.0), turn) == p_queue_s(c, prefilling, turn)


def test_a_pool_instance_queues_a_prefill_behind_what_is_left_of_the_prefills_running_there() -> None:
    """With ``pool_queue_observed``, a prefill on a pool instance waits for the remaining compute of every prefill
    running there, a local turn of that instance's own session as much as another session's leg, and for one
    past its estimated end until it is seen to end; the count of legs alone saw none of the local ones."""
    observed = replace(KNOBS, pool_queue_observed=True)
    # B runs a local turn's 1.2 s prefill (0.4 s into its compute: 0.8 s left, ends in 0.8 s) and a leg still
    # reading its history (ends in 1.5 s, 0.5 s of compute): the gateway counts no leg of its own there.
    b = inst(B, running=2.0, prefilling=0.0)
    busy = replace(long_turn(), running_prefills=((B, 0.8, 1.2, 0.05, 1), (B, 1.5, 0.5, 0.02, 1),
                                                  (C, 3.0, 3.0, 0.1, 1)))
    by_count = Nodes((b,), (b,), SNAP, replace(KNOBS, pool_queue_observed=False))
    by_running = Nodes((b,), (b,), SNAP, observed)
    assert p_queue_s(by_count, b, busy) == 0.0
    assert p_queue_s(by_running, b, busy) == pytest.approx(0.8 + 0.5)
    # One past its estimated end is still running: what the shell passes for it (stallquota.RunningPrefill.as_of)
    # is the time it has been overdue, as much again.
    overdue = replace(long_turn(), running_prefills=((B, 0.3, 1.9, 0.05, 1),))
    assert p_queue_s(by_running, b, overdue) == pytest.approx(0.3)
    # A dedicated prefill node's queue is its running requests already.
    p = NodeLoad(B, running=2.0)
    assert p_queue_s(by_running, p, busy) == p_queue_s(by_count, p, busy)
    # The pool chooses by it: B busy prefilling, C idle, A the session's instance over the local limit.
    ps, ds = pool(inst(A), b, inst(C))
    queued = replace(busy, running_prefills=busy.running_prefills[:2])
    assert choose(queued, A, ps, ds, SNAP, observed).prefill_url == C
    pulled = pull_option(queued, A, Nodes((b,), ds, SNAP, observed))
    alone = pull_option(queued, A, Nodes((inst(C),), ds, SNAP, observed))
    assert pulled.ttft_s == pytest.approx(alone.ttft_s + 1.3)


def test_a_local_turns_first_token_waits_for_the_prefills_running_on_its_instance_not_its_answers_stall() -> None:
    """A local turn on a pool instance computes after the prefills running there (``pool_queue_observed``), so its
    TTFT counts their rest; whether its answer can take their stall is still judged from the soonest it could
    start decoding, when vLLM's chunked prefill gives it a step's leftover budget."""
    observed = replace(KNOBS, pool_queue_observed=True, pool_max_local_suffix_tokens=None, tpot_budget_s=0.025)
    a = inst(A, running=1.0)
    turn = replace(history_turn(12000, 1000), running_prefills=((A, 0.9, 0.9, 0.0, 1),))
    by_count = replace(observed, pool_queue_observed=False)
    plain = next(o for o in choose(turn, A, (a,), (a,), SNAP, by_count).options
                 if o.option == "decode_local")
    queued = next(o for o in choose(turn, A, (a,), (a,), SNAP, observed).options if o.option == "decode_local")
    assert queued.ttft_s >= 0.9 + (plain.ttft_s - SNAP.queue_s(A, 0.0)) - 1e-9 > plain.ttft_s
    # A running prefill whose stall this answer cannot take keeps the turn off the instance, though by the time
    # the turn's own prefill is estimated done that prefill would be over.
    stalled = replace(turn, running_prefills=((A, 0.9, 0.9, 5.0, 1),))
    o = next(o for o in choose(stalled, A, (a,), (a,), SNAP, observed).options if o.option == "decode_local")
    assert not o.feasible and "would stall this answer" in o.why_not


@pytest.mark.parametrize(("home", "lightest", "moves"), [
    (6.0, 1.0, True),  # 5 more than the lightest and 6x: overloaded
    (5.0, 1.0, False),  # 4 more: within the absolute threshold
    (14.0, 9.5, False),  # 4.5 more, but only 1.47x: within the relative one
    (15.0, 9.5, True),
])
def test_a_session_keeps_its_instance_until_it_is_overloaded_against_the_pool(
        home: float, lightest: float, moves: bool) -> None:
    a, b = inst(A, running=home), inst(B, running=lightest)
    c = Nodes(*pool(a, b), SNAP, PolicyKnobs())
    assert pool_overloaded(a, c) is moves
    assert (len(decode_choices(a, c)) > 1) is moves


def test_an_overloaded_instance_sheds_its_session_with_the_history_pulled() -> None:
    ps, ds = pool(inst(A, running=12.0), inst(B), inst(C, running=12.0))
    d = choose(long_turn(), A, ps, ds, MOE, KNOBS)
    assert d.option == "pull" and d.decode_url == B and d.prefill_url == C
    assert "moves the pin" in d.reason


def test_a_session_leaves_an_instance_short_of_memory_with_its_history_pulled_when_that_is_cheaper() -> None:
    # A's load is no heavier than the others' (no rebalancing by load), but its KV is at the pressure mark: a
    # local prefill there is vetoed, and an answer decoding there may be preempted and its prompt recomputed.
    turn = long_turn()
    ps, ds = pool(inst(A, running=2.0, kv_usage=0.95), inst(B, running=2.0), inst(C, running=2.0))
    c = Nodes(ps, ds, MOE, KNOBS)
    assert not pool_overloaded(ds[0], c) and len(decode_choices(ds[0], c)) == 3
    d = choose(turn, A, ps, ds, MOE, KNOBS)
    assert d.option == "pull" and d.decode_url != A and d.prefill_url not in (A, d.decode_url), d.reason
    assert "moves the pin" in d.reason and f"pull on {A} preemption risk" not in d.reason
    stay = min((o for o in d.options if o.decode_url == A and o.feasible), key=lambda o: o.score_s, default=None)
    assert stay is None or stay.pressure_s > 0.0
    # With the preemption risk off, the move's transfer is not worth it: the session stays on A (through a
    # prefill leg elsewhere, the local prefill being vetoed).
    unaware = choose(turn, A, ps, ds, MOE, replace(KNOBS, preemption_weight=0.0))
    assert unaware.decode_url == A, unaware.reason
    # Below the knee (0.8) nothing is at risk: the session keeps its instance.
    roomy = (inst(A, running=2.0, kv_usage=0.5), *ds[1:])
    assert choose(turn, A, roomy, roomy, MOE, KNOBS).decode_url == A


@pytest.mark.parametrize("policy", ["pull", "no-pull", "reference", "dynamo", "llm-d"])
def test_the_fixed_rules_never_prefill_on_the_decode_instance(policy: str) -> None:
    turn = Turn(policy, new_session=False, pinned_decode=A, handle=HandleState.PRESENT, handle_tokens=6000,
                prompt_tokens=12000, reuse_tokens=6000, suffix_tokens=6000)
    two = ClusterView(*pool(inst(A), inst(B)))
    for rr in range(4):
        p = plan(replace(turn, round_robin=rr), two)
        assert p.prefill != p.decode
    alone = ClusterView(*pool(inst(A)))
    p = plan(turn, alone)
    assert p.action is HandleAction.DECODE_LOCAL and p.prefill is None and p.decode == A
    assert "no other instance" in p.reason or policy in ("dynamo", "llm-d")


def test_a_prefill_legs_stall_is_charged_to_the_instance_that_runs_it() -> None:
    learning = Learning(EstimatorSeeds(), LearningParams(), KNOBS, request_stall_share=0.15)
    key = learning.decoding(B, 512, 4.0, now=0.0)
    assert key is not None
    before = learning.quota_credit(B).credit_s
    ps, ds = pool(inst(A), inst(B, running=4.0))
    turn = Turn("auto", new_session=False, pinned_decode=A, handle=HandleState.PRESENT, handle_tokens=6000,
                prompt_tokens=12000, reuse_tokens=6000, suffix_tokens=6000,
                stall_credits=((B, before, learning.quota_credit(B).quota_s),))
    p = plan(turn, ClusterView(ps, ds), MOE, KNOBS)
    assert p.prefill == B and p.decode == A
    stall = learning.planned(p)
    assert stall > 0
    assert learning.quota_credit(B).credit_s == pytest.approx(before - stall)
    assert math.isinf(learning.quota_credit(A).credit_s)


def test_a_pool_instances_quota_is_bounded_by_the_objective_not_by_the_decode_nodes_share() -> None:
    knobs = PolicyKnobs(tpot_budget_s=0.025)
    learning = Learning(EstimatorSeeds(tpot_base_s=0.007, tpot_s_per_seq=1e-9), LearningParams(), knobs,
                        request_stall_share=0.15)
    # A dedicated decode node: 15 % of a 301-token answer's 300 steps of 7 ms.
    learning.decoding(A, 301, 1.0, now=0.0)
    assert learning.quota_credit(A).quota_s == pytest.approx(0.15 * 300 * 0.007)
    # A pool instance at share 1: its whole decode time, within the 25 ms objective (18 ms a step to spare).
    learning.decoding(B, 301, 1.0, now=0.0, share=1.0)
    assert learning.quota_credit(B).quota_s == pytest.approx(300 * 0.007)
    learning.decoding(C, 301, 1.0, now=0.0, share=1.0)
    tight = Learning(EstimatorSeeds(tpot_base_s=0.020, tpot_s_per_seq=1e-9), LearningParams(), knobs)
    tight.decoding(C, 301, 1.0, now=0.0, share=1.0)
    assert tight.quota_credit(C).quota_s == pytest.approx(300 * 0.005)  # the objective binds: 25 − 20 ms a step
    # Without a share of its own and at request_stall_share 1, no quota is kept at all.
    assert tight.decoding(A, 301, 1.0, now=0.0) is None


def test_a_pool_instance_is_held_to_the_objective_per_request_not_to_the_decode_nodes_hiccup_window() -> None:
    # A 1,500-token suffix on an instance with 8 decoding: its stall over a 16-token window breaks a 25 ms budget,
    # yet every request there can absorb it within its quota (the objective).
    turn = replace(history_turn(12000, 1500), request_stall_credit_s=5.0, request_stall_quota_s=5.0)
    knobs = PolicyKnobs(tpot_budget_s=0.025)
    on_pool = Nodes(*pool(inst(A, running=8.0)), MOE, knobs)
    local = next(o for o in choose(turn, A, on_pool.prefills, on_pool.decodes, MOE, knobs).options
                 if o.option == "decode_local")
    assert local.feasible and local.stall_s > 0
    decode = NodeLoad(A, running=8.0)
    local_d = next(o for o in choose(turn, A, (NodeLoad("http://p"),), (decode,), MOE, knobs).options
                   if o.option == "decode_local")
    assert not local_d.feasible and "TPOT of D's" in local_d.why_not
    # Without quotas to go by (nothing of this gateway's decoding there), the window rule still holds on a pool.
    blind = replace(turn, request_stall_credit_s=math.inf, request_stall_quota_s=math.inf)
    local_b = next(o for o in choose(blind, A, on_pool.prefills, on_pool.decodes, MOE, knobs).options
                   if o.option == "decode_local")
    assert not local_b.feasible


def test_a_prefill_placed_is_remembered_while_it_runs_and_charged_to_answers_placed_beside_it() -> None:
    learning = Learning(EstimatorSeeds(), LearningParams(), KNOBS, request_stall_share=0.15)
    learning.decoding(B, 512, 4.0, now=0.0)
    ps, ds = pool(inst(A), inst(B, running=4.0))
    turn = Turn("auto", new_session=False, pinned_decode=A, handle=HandleState.PRESENT, handle_tokens=6000,
                prompt_tokens=12000, reuse_tokens=6000, suffix_tokens=6000,
                stall_credits=((B, learning.quota_credit(B).credit_s, learning.quota_credit(B).quota_s),))
    p = plan(turn, ClusterView(ps, ds), MOE, KNOBS)
    assert p.prefill == B
    stall, running = learning.admitted(p, now=100.0)
    (url, ends_in, window, charged, steps), = learning.prefills_running(100.0)
    # Its stall comes with its compute, the last `window` of its run (after the history is read in), in engine
    # steps of KNOBS.chunk_tokens: 6,000 new tokens in 3.
    assert url == B and charged == pytest.approx(stall) and 0 < window < ends_in and steps == 3
    # An answer placed on B while the leg still reads its history starts with all of that stall against its
    # quota; one placed halfway through its compute, with the step then in flight and the last: two thirds.
    reading = learning.decoding(B, 512, 4.0, now=100.0 + (ends_in - window) / 2, share=1.0)
    computing = learning.decoding(B, 512, 4.0, now=100.0 + ends_in - window / 2, share=1.0)
    assert reading is not None and computing is not None
    assert learning.exposures[B][reading].absorbed_s == pytest.approx(stall)
    assert learning.exposures[B][computing].absorbed_s == pytest.approx(stall * 2 / 3)
    # Past its estimated end, not seen to end, it still runs: expected to end as much later as it overran.
    (url, ends_in_late, _, _, _), = learning.prefills_running(100.0 + ends_in + 0.25)
    assert url == B and ends_in_late == pytest.approx(0.25)
    # Once seen to end it is forgotten.
    learning.prefill_seen(running)
    assert learning.prefills_running(100.0 + ends_in + 0.25) == ()
    learning.prefill_seen(running)  # seen again (the turn's end): harmless


def test_a_prefill_on_an_idle_instance_is_remembered_for_the_answers_placed_beside_it() -> None:
    # B decodes nothing when a prefill leg is placed there, so the leg stalls nobody yet; an answer placed on B
    # while the leg runs would decode beside its chunks, and must be weighed against them.
    learning = Learning(EstimatorSeeds(), LearningParams(), KNOBS, request_stall_share=0.15)
    ps, ds = pool(inst(A), inst(B), inst(C, running=8.0))
    turn = Turn("auto", new_session=False, pinned_decode=A, handle=HandleState.PRESENT, handle_tokens=6000,
                prompt_tokens=12000, reuse_tokens=6000, suffix_tokens=6000)
    p = plan(turn, ClusterView(ps, ds), MOE, KNOBS)
    assert p.prefill == B and p.decode == A
    assert learning.planned(p, now=100.0) == 0.0  # nobody decoding on B to charge
    (url, ends_in, window, beside, steps), = learning.prefills_running(100.0)
    assert url == B and beside > 0 and window == pytest.approx(beside) and ends_in > window and steps == 3
    # A short answer of another session pinned to B, placed now: its local turn would decode beside the leg.
    short = history_turn(8000, 100, expected_output_tokens=6, running_prefills=learning.prefills_running(100.0))
    knobs = replace(KNOBS, tpot_budget_s=0.025)
    local = next(o for o in choose(short, B, ps, ds, MOE, knobs).options if o.option == "decode_local")
    assert not local.feasible and f"prefills running on {B} would stall this answer" in local.why_not
    # Placed anyway (forced), its quota starts with the leg's stall still to come when its first token is due:
    # all of it while the leg reads its history; in its last step, that whole step.
    early = learning.decoding(B, 6, 1.0, now=100.0, share=1.0, starts_in_s=(ends_in - window) / 2)
    late = learning.decoding(B, 6, 1.0, now=100.0, share=1.0, starts_in_s=ends_in - window / 6)
    assert early is not None and late is not None
    assert learning.exposures[B][early].absorbed_s == pytest.approx(beside)
    assert learning.exposures[B][late].absorbed_s == pytest.approx(beside / 3)


def test_a_local_turns_own_prefill_is_not_charged_to_its_answer() -> None:
    # A local turn on an idle instance: its prefill is remembered (for answers placed beside it), yet its own
    # answer starts when that prefill ends, so none of it counts against its own quota.
    learning = Learning(EstimatorSeeds(), LearningParams(), KNOBS, request_stall_share=0.15)
    ps, ds = pool(inst(A), inst(B))
    turn = Turn("auto", new_session=False, pinned_decode=A, handle=HandleState.PRESENT, handle_tokens=6000,
                prompt_tokens=7000, reuse_tokens=6000, suffix_tokens=1000)
    p = plan(turn, ClusterView(ps, ds), MOE, KNOBS)
    assert p.action is HandleAction.DECODE_LOCAL and p.decode == A
    learning.planned(p, now=100.0)
    (url, ends_in, _run, beside, _), = learning.prefills_running(100.0)
    assert url == A and beside > 0
    own = learning.decoding(A, 300, 1.0, now=100.0, share=1.0, starts_in_s=ends_in)
    assert own is not None and learning.exposures[A][own].absorbed_s == 0.0
    # Counted from now instead, it would have been charged the whole of it.
    early = learning.decoding(A, 300, 1.0, now=100.0, share=1.0)
    assert early is not None and learning.exposures[A][early].absorbed_s == pytest.approx(beside)


def test_a_pool_instance_prefills_a_long_suffix_itself_unless_an_operator_caps_it() -> None:
    # 6,000 new tokens on an idle instance: a dedicated decode node is capped by max_local_suffix_tokens
    # (2,048 here); a pool instance by nothing but its quotas, unless pool_max_local_suffix_tokens is set.
    turn = long_turn()
    knobs = PolicyKnobs(max_local_suffix_tokens=2048)
    ps, ds = pool(inst(A), inst(B))
    d = choose(turn, A, ps, ds, SNAP, knobs)
    assert d.option == "decode_local" and not d.forced
    capped = choose(turn, A, ps, ds, SNAP, replace(knobs, pool_max_local_suffix_tokens=2048))
    local = next(o for o in capped.options if o.option == "decode_local")
    assert capped.option == "pull" and "pool_max_local_suffix_tokens 2048" in local.why_not
    on_d = choose(turn, A, (NodeLoad("http://p"),), (NodeLoad(A),), SNAP, knobs)
    local = next(o for o in on_d.options if o.option == "decode_local")
    assert on_d.option == "pull" and "max_local_suffix_tokens 2048" in local.why_not


def test_new_sessions_planned_together_start_on_different_instances() -> None:
    # A's first turn is on its way (a prefill leg elsewhere, counted in A's `arriving`): with nothing running
    # anywhere yet, the next new session starts on another instance instead of following it to A.
    first = TurnFacts(9000, 9000)
    ps, ds = pool(inst(A, arriving=1.0), inst(B, running=1.0, prefilling=1.0), inst(C))
    d = choose(first, None, ps, ds, SNAP, KNOBS)
    assert d.decode_url == C
    # The same on dedicated decode nodes.
    d = choose(first, None, (NodeLoad("http://p"),), (NodeLoad(A, arriving=1.0), NodeLoad(B)), SNAP, KNOBS)
    assert d.option == "cold" and d.decode_url == B


def test_a_move_off_an_instance_short_of_memory_is_counted_as_such() -> None:
    cfg = load_config(None, nodes=[A, B], decode_pressure_usage=0.9)
    cluster = Cluster(cfg, httpx.AsyncClient())
    node = cluster.nodes[A]
    node.kv_usage = 0.5
    assert cluster.move_reason(A) == "rebalance"
    node.kv_usage = 0.95
    assert cluster.move_reason(A) == "kv_pressure"
    assert cluster.move_reason("http://elsewhere") == "gone"


def test_a_local_turn_the_gateway_placed_is_the_queue_a_later_leg_on_that_instance_waits_behind() -> None:
    """The gateway remembers the local turn it placed on B while its prefill runs; another session's prefill leg
    planned meanwhile sees B's queue in it and goes to idle C. Counting only legs, B looked as idle as C and, first
    in the configuration, took the leg behind that prefill."""
    observed = replace(KNOBS, pool_queue_observed=True)
    learning = Learning(EstimatorSeeds(), LearningParams(), observed, request_stall_share=1.0)
    ps, ds = pool(inst(A), inst(B), inst(C))
    on_b = Turn("auto", new_session=False, pinned_decode=B, handle=HandleState.PRESENT, handle_tokens=6000,
                prompt_tokens=8000, reuse_tokens=6000, suffix_tokens=2000)
    local = plan(on_b, ClusterView(ps, ds), MOE, observed)
    assert local.action is HandleAction.DECODE_LOCAL and local.decode == B
    learning.planned(local, now=100.0)
    running = learning.prefills_running(100.1)
    assert [url for url, *_ in running] == [B]
    on_a = Turn("auto", new_session=False, pinned_decode=A, handle=HandleState.PRESENT, handle_tokens=6000,
                prompt_tokens=12000, reuse_tokens=6000, suffix_tokens=6000, running_prefills=running)
    assert plan(on_a, ClusterView(ps, ds), MOE, observed).prefill == C
    assert plan(on_a, ClusterView(ps, ds), MOE, replace(observed, pool_queue_observed=False)).prefill == B
