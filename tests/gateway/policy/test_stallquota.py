"""Per-request TPOT quotas of stall (pure) and how the cost policy uses them."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from kvtether.gateway.policy import NodeLoad, PolicyKnobs, TurnFacts, choose
from kvtether.gateway.policy.rules.auto import decision_bucket
from kvtether.gateway.policy.stallquota import (
    Credit,
    Exposure,
    RunningPrefill,
    absorb,
    credit,
    objective_s,
    pending_s,
    quota_s,
)

from tests.support.policy_facts import D0, D1, MOE, P0, history_turn


def test_a_quota_is_the_share_of_the_answers_decode_time() -> None:
    # 128 tokens: 127 decode steps after the prefill's first token, at 15 ms each, 10 % of that.
    assert quota_s(0.10, 128, 0.015) == pytest.approx(0.10 * 127 * 0.015)
    assert quota_s(0.10, 0, 0.015) == pytest.approx(0.0015)  # at least one step
    assert quota_s(0.0, 128, 0.015) == 0.0
    with pytest.raises(ValueError):
        quota_s(1.5, 128, 0.015)


def test_a_quota_never_lets_the_request_break_its_tpot_objective() -> None:
    # Six tokens at 7 ms: a 15 % share is 5.25 ms of stall; the 25 ms objective alone would allow 5 × 18 ms.
    assert quota_s(0.15, 6, 0.007, 0.025) == pytest.approx(0.15 * 5 * 0.007)
    # A step near the objective: half of the decode time (50 ms) would be TPOT 30 ms; the objective caps the
    # stall at 5 × 5 ms (TPOT 20 ms + 25 ms / 5 = 25 ms).
    assert quota_s(0.5, 6, 0.020, 0.025) == pytest.approx(5 * 0.005)
    # A step already at the objective leaves no room at all.
    assert quota_s(0.5, 100, 0.030, 0.025) == 0.0


def test_the_credit_is_the_tightest_requests_headroom_with_its_quota() -> None:
    assert credit([]) == Credit(math.inf, math.inf)
    fresh, used = Exposure(0.20), Exposure(0.30, absorbed_s=0.25)
    c = credit([fresh, used])
    assert c.credit_s == pytest.approx(0.05)
    assert c.quota_s == pytest.approx(0.30)


def test_an_answer_already_past_its_tpot_objective_holds_no_turn_back() -> None:
    """An answer charged more stall than its TPOT objective allows has missed it, whatever comes next: its quota
    no longer binds, the tightest of the answers that can still meet theirs does."""
    lost = Exposure(0.04, absorbed_s=0.5, lost_after_s=0.09)
    savable = Exposure(0.20, absorbed_s=0.05, lost_after_s=0.30)
    c = credit([lost, savable])
    assert c.credit_s == pytest.approx(0.15) and c.quota_s == pytest.approx(0.20)
    assert credit([lost]) == Credit()  # nobody left to protect
    # Over its quota (a share of its decode time) but within its objective, an answer still binds.
    over_share = Exposure(0.04, absorbed_s=0.06, lost_after_s=0.09)
    assert credit([over_share, savable]).credit_s == pytest.approx(-0.02)
    # Without an objective nothing is ever lost.
    assert credit([Exposure(0.04, absorbed_s=0.5), savable]).credit_s == pytest.approx(-0.46)


def test_the_learning_gives_each_answer_its_objective_and_forgets_it_once_past_it() -> None:
    """With ``release_lost_answers``, each answer's exposure carries the stall its TPOT objective allows, and the
    node's credit forgets it once it was charged more."""
    from kvtether.gateway.policy.estimates import EstimatorSeeds, LearningParams
    from kvtether.gateway.policy.learning import Learning

    off = Learning(EstimatorSeeds(), LearningParams(), PolicyKnobs(tpot_budget_s=0.025), request_stall_share=0.2)
    off.decoding(D0, 6, 1.0, now=0.0)
    assert all(e.lost_after_s == math.inf for e in off.exposures[D0].values())  # the rule is off by default
    knobs = PolicyKnobs(tpot_budget_s=0.025, release_lost_answers=True)
    learning = Learning(EstimatorSeeds(), LearningParams(), knobs, request_stall_share=0.2)
    learning.decoding(D0, 6, 1.0, now=0.0)
    (answer,) = learning.exposures[D0].values()
    step = learning.snapshot(0.0).tpot_s(D0, 1.0)
    assert answer.lost_after_s == pytest.approx(objective_s(6, step, 0.025))  # (0.025 - step) x 5 intervals
    assert 0.0 < answer.quota_s <= answer.lost_after_s < 5 * 0.025
    assert learning.quota_credit(D0).credit_s == pytest.approx(answer.quota_s)
    learning.exposures[D0] = absorb(learning.exposures[D0], answer.lost_after_s + 0.001)
    assert learning.quota_credit(D0) == Credit()


def test_a_local_prefill_charges_every_decoding_request() -> None:
    after = absorb({1: Exposure(0.2), 2: Exposure(0.2, 0.1)}, 0.07)
    assert after[1].absorbed_s == pytest.approx(0.07)
    assert after[2].absorbed_s == pytest.approx(0.17)
    assert absorb(after, -1.0) == after  # a negative stall refunds nothing


BUSY = (NodeLoad(D0, running=2), NodeLoad(D1))
# The quota's own arithmetic: no node bucket, no interference price, the turn stays on its pinned D.
QUOTA_ONLY = PolicyKnobs(interference_weight=0.0, rebalance_decode=False)


def _local_stall(turn: TurnFacts) -> float:
    d = choose(turn, D0, (NodeLoad(P0),), BUSY, MOE, QUOTA_ONLY)
    return next(o for o in d.options if o.option == "decode_local").stall_s


def test_a_request_near_its_quota_sends_a_turn_that_would_stall_it_through_p() -> None:
    roomy = history_turn(16000, 300, expected_output_tokens=32, request_stall_credit_s=0.5, request_stall_quota_s=0.5)
    first = choose(roomy, D0, (NodeLoad(P0),), BUSY, MOE, QUOTA_ONLY)
    assert first.option == "decode_local", first.reason
    stall = _local_stall(roomy)
    assert 0.03 < stall < 0.1  # a MoE prefill step: several decode steps of a small batch
    tight = history_turn(16000, 300, expected_output_tokens=32, request_stall_credit_s=stall * 0.9,
                         request_stall_quota_s=0.5)
    spent = choose(tight, D0, (NodeLoad(P0),), BUSY, MOE, QUOTA_ONLY)
    assert spent.option == "pull", spent.reason
    assert "TPOT quota" in spent.trace_attributes()["rejected.decode_local"]
    assert "tightest TPOT quota" in spent.reason


def test_a_turn_lost_to_the_ttft_objective_within_the_limits_runs_over_a_quota_within_it() -> None:
    """A spent quota sends the turn through P, but P's queue puts the pull past the TTFT objective: the turn
    would be lost whatever happens, and its prefill would lengthen the queue for the turns behind it. With the
    objective set and the rule on (``ttft_over_quota``), it runs locally over the quota instead, forced and saying
    why; not when the pull is within the objective, not over the KV-pressure veto, and not with the rule off.
    On a pool only, where an answer's quota is its TPOT objective: not over a decode node's share."""
    stall = _local_stall(history_turn(16000, 300, expected_output_tokens=32))
    tight = history_turn(16000, 300, expected_output_tokens=32, request_stall_credit_s=stall * 0.9,
                         request_stall_quota_s=0.5)
    # Two pool instances: the session's, decoding two answers, and one with six prefills waiting.
    queued = (NodeLoad(P0, waiting=6.0, both=True),)
    busy = (NodeLoad(D0, running=2, both=True), *queued)
    through_p = choose(tight, D0, queued, busy, MOE, QUOTA_ONLY)
    local = next(o for o in through_p.options if o.option == "decode_local")
    pull_s = through_p.estimates_s["pull"]
    assert through_p.option == "pull" and not local.feasible and local.ttft_s < pull_s, through_p.reason
    objective = (local.ttft_s + pull_s) / 2
    rule = replace(QUOTA_ONLY, ttft_over_quota=True)
    kept = choose(tight, D0, queued, busy, MOE, replace(rule, ttft_objective_s=objective))
    assert kept.option == "decode_local" and kept.forced and kept.rescued, kept.reason
    assert f"over its limit to keep the TTFT objective {objective:.3f}s: pull" in kept.reason
    assert decision_bucket(kept, False, None) == "ttft_rescue"  # the metric's reason, apart from `forced`
    off = replace(QUOTA_ONLY, ttft_objective_s=objective, ttft_over_quota=False)
    assert choose(tight, D0, queued, busy, MOE, off).option == "pull"
    assert choose(tight, D0, queued, busy, MOE, replace(rule, ttft_objective_s=2 * pull_s)).option == "pull"
    pressed = (NodeLoad(D0, running=2, kv_usage=0.95, both=True), *queued)
    vetoed = choose(tight, D0, queued, pressed, MOE, replace(rule, ttft_objective_s=objective))
    assert vetoed.option == "pull" and not vetoed.forced, vetoed.reason
    # The same turn on a dedicated P and D: a decode node's quota is a share kept for smoothness, not the rule's.
    dedicated = choose(tight, D0, (NodeLoad(P0, waiting=6.0),), BUSY, MOE, replace(rule, ttft_objective_s=objective))
    assert dedicated.option == "pull" and not dedicated.forced and not dedicated.rescued, dedicated.reason


def test_on_p_d_a_turn_p_s_queue_would_lose_runs_on_a_decode_node_only_with_the_decode_rescue() -> None:
    """Dedicated P and D, P's queue past the TTFT objective. With ``decode_ttft_rescue`` a follow-up turn over its
    D's quota runs there (forced, rescued), and a session's first turn starts on the least loaded decode node,
    prefilled whole; without it both go through P, late. Within the objective through P, the rule changes
    nothing, and a decode node under the KV-pressure veto takes no rescue."""
    stall = _local_stall(history_turn(16000, 300, expected_output_tokens=32))
    tight = history_turn(16000, 300, expected_output_tokens=32, request_stall_credit_s=stall * 0.9,
                         request_stall_quota_s=0.5)
    queued = (NodeLoad(P0, waiting=60.0),)
    decodes = (NodeLoad(D0, running=2), NodeLoad(D1, running=1))
    through_p = choose(tight, D0, queued, decodes, MOE, QUOTA_ONLY)
    local = next(o for o in through_p.options if o.option == "decode_local")
    objective = (local.ttft_s + through_p.estimates_s["pull"]) / 2
    off = replace(QUOTA_ONLY, ttft_objective_s=objective)
    on = replace(off, decode_ttft_rescue=True)
    assert choose(tight, D0, queued, decodes, MOE, off).option == "pull"
    kept = choose(tight, D0, queued, decodes, MOE, on)
    assert (kept.option, kept.decode_url, kept.forced, kept.rescued) == ("decode_local", D0, True, True), kept.reason
    assert decision_bucket(kept, False, None) == "ttft_rescue"

    first = TurnFacts(1800, 1800, expected_output_tokens=100)
    cold = choose(first, None, queued, decodes, MOE, off)
    assert cold.option == "cold" and cold.estimates_s["cold"] > objective and not cold.rescued, cold.reason
    started = choose(first, None, queued, decodes, MOE, on)
    assert (started.option, started.decode_url, started.rescued) == ("decode_local", D1, True), started.reason
    assert started.estimates_s == cold.estimates_s  # the start on D was never an option within the limits
    assert "a session starts on a prefill node" in started.trace_attributes()["rejected.decode_local"]

    # P within the objective: the first turn goes to P as without the rule.
    idle = (NodeLoad(P0),)
    assert choose(first, None, idle, decodes, MOE, on).option == "cold"
    # A decode node short of memory: no rescue there.
    pressed = (NodeLoad(D0, running=2, kv_usage=0.95), NodeLoad(D1, running=1, kv_usage=0.95))
    assert choose(first, None, queued, pressed, MOE, on).option == "cold"
    assert choose(tight, D0, queued, pressed, MOE, on).option == "pull"


def test_the_decode_rescue_changes_the_first_turns_it_rescues_and_no_other() -> None:
    """A P/D session's first turn is sized only for the rescue: not rescued, it starts where an unsized one would
    (the "pull" rule's cold start), on P and the decode node that rule picks; rescued, on a decode node."""
    from kvtether.gateway.policy.placement import ClusterView, HandleAction, Turn, plan

    knobs = replace(QUOTA_ONLY, ttft_objective_s=2.0, decode_ttft_rescue=True)
    decodes = (NodeLoad(D0, running=3), NodeLoad(D1, running=1))
    unsized = Turn(policy="auto", new_session=True)
    sized = replace(unsized, prompt_tokens=1800, suffix_tokens=1800, expected_output_tokens=100)
    for prefills in ((NodeLoad(P0),), (NodeLoad(P0, waiting=3.0),)):  # idle, and queued within the objective
        view = ClusterView(prefills, decodes)
        assert plan(sized, view, MOE, knobs) == plan(unsized, view, MOE, knobs)
    lost = ClusterView((NodeLoad(P0, waiting=60.0),), decodes)
    rescued = plan(sized, lost, MOE, knobs)
    assert (rescued.action, rescued.decode, rescued.bucket) == (HandleAction.DECODE_LOCAL, D1, "ttft_rescue")
    assert plan(unsized, lost, MOE, knobs).action is HandleAction.NONE  # unsized: cold through P, however late


def test_a_draining_quota_prices_the_stall_and_a_full_one_does_not() -> None:
    def interference(credit_s: float) -> float:
        turn = history_turn(16000, 300, expected_output_tokens=32, request_stall_credit_s=credit_s,
                            request_stall_quota_s=0.4)
        d = choose(turn, D0, (NodeLoad(P0),), BUSY, MOE, QUOTA_ONLY)
        return next(o for o in d.options if o.option == "decode_local").interference_s

    stall = _local_stall(history_turn(16000, 300, expected_output_tokens=32))
    assert interference(0.4) == 0.0  # full: the weight (0 here) alone
    assert interference(0.2) == pytest.approx(1.0 * stall)  # half left: quota/credit − 1 = 1 per stall-second
    assert interference(0.1) == pytest.approx(3.0 * stall)


def test_nobody_decoding_means_no_quota_binds() -> None:
    # An idle D is stalled by nothing: even an exhausted quota figure (stale) does not stop the local turn.
    idle = (NodeLoad(D0), NodeLoad(D1))
    turn = history_turn(16000, 300, expected_output_tokens=32, request_stall_credit_s=0.0, request_stall_quota_s=0.2)
    assert choose(turn, D0, (NodeLoad(P0),), idle, MOE, QUOTA_ONLY).option == "decode_local"


def test_a_request_with_no_room_at_all_refuses_the_local_turn_without_error() -> None:
    # A request already over the TPOT ceiling has a quota of 0 (and a credit of 0, or below once a forced
    # local turn charged it anyway).
    for credit_s in (0.0, -0.05):
        turn = history_turn(16000, 300, expected_output_tokens=32, request_stall_credit_s=credit_s,
                            request_stall_quota_s=0.0)
        d = choose(turn, D0, (NodeLoad(P0),), BUSY, MOE, QUOTA_ONLY)
        assert d.option == "pull", d.reason
        assert "TPOT quota" in d.trace_attributes()["rejected.decode_local"]


@pytest.mark.parametrize("credit_s,quota", [(math.nan, 1.0), (0.1, -1.0), (0.1, math.nan)])
def test_invalid_quota_facts(credit_s: float, quota: float) -> None:
    with pytest.raises(ValueError):
        TurnFacts(100, 10, request_stall_credit_s=credit_s, request_stall_quota_s=quota)


def test_a_long_tool_result_runs_on_d_while_its_requests_have_room_and_through_p_once_they_do_not() -> None:
    """A 5000-token suffix (within the default 8192-token local limit, one chunked step) on a 20k history: on
    an idle D it runs locally (nobody to stall, no pull); on a busy D only while every decoding request can
    absorb its stall, which is several times a short suffix's."""
    long_turn = history_turn(25000, 5000)
    decodes = (NodeLoad(D0), NodeLoad(D1))
    assert choose(long_turn, D0, (NodeLoad(P0),), decodes, MOE).option == "decode_local"
    roomy = choose(replace(long_turn, request_stall_credit_s=1.0, request_stall_quota_s=1.0),
                   D0, (NodeLoad(P0),), BUSY, MOE, QUOTA_ONLY)
    assert roomy.option == "decode_local", roomy.reason
    stall = next(o for o in roomy.options if o.option == "decode_local").stall_s
    assert stall > 2 * _local_stall(history_turn(16000, 300, expected_output_tokens=32))
    tight = choose(replace(long_turn, request_stall_credit_s=stall / 2, request_stall_quota_s=1.0),
                   D0, (NodeLoad(P0),), BUSY, MOE, QUOTA_ONLY)
    assert tight.option == "pull", tight.reason



def test_a_running_prefills_stall_still_to_come_falls_as_it_runs() -> None:
    run = RunningPrefill(ends_at=10.5, duration_s=0.5, stall_s=0.3)
    assert run.remaining_s(10.0) == pytest.approx(0.3)  # it has just begun
    assert run.remaining_s(10.25) == pytest.approx(0.15)
    assert run.remaining_s(11.0) == 0.0
    assert run.remaining_s(9.0) == pytest.approx(0.3)  # not begun: all of it
    other = RunningPrefill(ends_at=10.2, duration_s=0.2, stall_s=0.1)
    assert pending_s([run, other], 10.1) == pytest.approx(0.24 + 0.05)
    assert objective_s(6, 0.007, 0.025) == pytest.approx(5 * 0.018)


def test_an_answer_placed_beside_a_running_prefill_must_absorb_its_rest_within_the_objective() -> None:
    # A 2,000-token local prefill on D was admitted a moment ago: 0.3 s of its stall is still to come. A short
    # answer (6 tokens: 5 × 18 ms = 90 ms within a 25 ms objective) cannot take that; a long one can.
    knobs = PolicyKnobs(tpot_budget_s=0.025)
    running = ((D0, 0.5, 0.5, 0.3, 0),)
    short = history_turn(8000, 100, expected_output_tokens=6, running_prefills=running)
    decodes = (NodeLoad(D0, running=2.0), NodeLoad(D1))
    d = choose(short, D0, (NodeLoad(P0),), decodes, MOE, knobs)
    local = next(o for o in d.options if o.option == "decode_local")
    assert not local.feasible and "prefills running on D would stall this answer" in local.why_not
    # Through P to the other decode node, whose steps no prefill holds up; on D0 alone it is forced.
    assert d.option != "decode_local" and d.decode_url == D1 and not d.forced
    alone = choose(short, D0, (NodeLoad(P0),), decodes[:1], MOE, knobs)
    assert alone.forced
    long = replace(short, expected_output_tokens=600)
    d = choose(long, D0, (NodeLoad(P0),), (NodeLoad(D0, running=2.0),), MOE, knobs)
    assert next(o for o in d.options if o.option == "decode_local").feasible
    # Long after that prefill ends, nothing is left of it.
    late = replace(short, running_prefills=((D0, 0.0, 0.5, 0.3, 0),))
    d = choose(late, D0, (NodeLoad(P0),), (NodeLoad(D0, running=2.0),), MOE, knobs)
    assert next(o for o in d.options if o.option == "decode_local").feasible



def test_a_prefill_in_one_step_stalls_an_answer_decoding_through_any_part_of_it_whole() -> None:
    # A 5,000-token prefill leg computes in one engine step (0.2 s of stall) at the end of a 0.5 s run (its read
    # first). An answer whose first token comes 0.1 s before the leg ends decodes through that step: all of it.
    one = RunningPrefill(ends_at=10.5, duration_s=0.2, stall_s=0.2, steps=1)
    assert one.remaining_s(10.2) == pytest.approx(0.2)  # still reading: all of it to come
    assert one.remaining_s(10.4) == pytest.approx(0.2)  # in its one step: all of it, not half
    assert one.remaining_s(10.5) == 0.0
    # In four steps, halfway: the step in flight and the one after.
    four = RunningPrefill(ends_at=10.5, duration_s=0.2, stall_s=0.2, steps=4)
    assert four.remaining_s(10.4) == pytest.approx(0.1)
    assert four.remaining_s(10.39) == pytest.approx(0.15)
    # Past its estimate the same steps come over a longer run.
    assert one.as_of(10.6).steps == 1 and one.as_of(10.6).remaining_s(10.6) == pytest.approx(0.2 * 0.4 / 0.2)


def test_a_prefill_unseen_past_its_estimated_end_is_expected_to_run_as_much_again() -> None:
    run = RunningPrefill(ends_at=10.5, duration_s=0.5, stall_s=0.3)
    assert run.as_of(10.2) is run  # within its estimate: as placed
    overdue = run.as_of(10.7)  # 0.2 s overdue and not seen to end: still running, for 0.2 s more
    assert overdue.ends_at == pytest.approx(10.9) and overdue.duration_s == pytest.approx(0.9)
    assert overdue.remaining_s(10.7) == pytest.approx(0.3 * 0.2 / 0.5)  # its stall at the same rate
    assert overdue.remaining_s(10.9) == 0.0
    hung = run.as_of(12.0)  # a prefill of 0.5 s that has not ended 1.5 s after it should have
    assert hung.ends_at == pytest.approx(13.5) and hung.remaining_s(12.0) == pytest.approx(0.9)
