"""Whether a forced turn waits (pure): only over limits that clear as running requests finish, in steps, and
never longer than defer_max_s in all."""

from __future__ import annotations

from dataclasses import replace

import pytest
from kvtether.gateway.policy import NodeLoad, PolicyKnobs, choose
from kvtether.gateway.policy.deferral import DeferralRecord, deferral_s

from tests.support.policy_facts import D0, D1, MOE, P0, history_turn

KNOBS = PolicyKnobs(tpot_budget_s=0.025, defer_max_s=0.2, defer_step_s=0.01)
# A 2,000-token prefill still running on D0 with 0.3 s of its stall to come: a six-token answer there cannot
# take it within a 25 ms objective.
SHORT = history_turn(8000, 100, expected_output_tokens=6, running_prefills=((D0, 0.5, 0.5, 0.3, 0),))


def test_a_turn_forced_over_a_limit_that_clears_waits_a_step_at_a_time_up_to_the_maximum() -> None:
    alone = choose(SHORT, D0, (NodeLoad(P0),), (NodeLoad(D0, running=2.0),), MOE, KNOBS)
    assert alone.forced
    assert deferral_s(alone, 0.0, KNOBS) == pytest.approx(0.01)
    assert deferral_s(alone, 0.195, KNOBS) == pytest.approx(0.005)  # the rest of the wait, no more
    assert deferral_s(alone, 0.2, KNOBS) == 0.0  # spent: it runs as decided
    assert deferral_s(alone, 0.0, replace(KNOBS, defer_max_s=0.0)) == 0.0  # off


def test_a_turn_within_the_limits_or_over_a_fixed_cap_alone_never_waits() -> None:
    # Another decode node, which no prefill holds up, takes it: not forced.
    free = choose(SHORT, D0, (NodeLoad(P0),), (NodeLoad(D0, running=2.0), NodeLoad(D1)), MOE, KNOBS)
    assert not free.forced and deferral_s(free, 0.0, KNOBS) == 0.0
    # No prefill node at all and a suffix over max_local_suffix_tokens: only the fixed cap stands in the way,
    # which no wait clears.
    long = history_turn(12000, 6000)
    capped = replace(KNOBS, max_local_suffix_tokens=2048)
    d = choose(long, D0, (), (NodeLoad(D0),), MOE, capped)
    local = next(o for o in d.options if o.option == "decode_local")
    assert d.forced and local.fixed_limit and "max_local_suffix_tokens" in local.why_not
    assert deferral_s(d, 0.0, capped) == 0.0
    assert deferral_s(None, 0.0, KNOBS) == 0.0  # a fixed policy's plan has no decision to wait on


def test_waits_that_seldom_clear_are_skipped_but_for_one_in_a_few_that_keeps_observing() -> None:
    """In a burst every option stays over a limit for seconds, and a wait that ends forced anyway only adds its
    time to the turn's TTFT. The record of how waits ended decides: each wait that ends forced lowers the moving
    share that clear; under `defer_min_clear_rate`, three turns in four run at once and the fourth still waits,
    and once such a wait clears again, every turn waits again."""
    knobs = replace(KNOBS, defer_min_clear_rate=0.3, defer_probe_every=4, defer_clear_alpha=0.1)
    record = DeferralRecord()
    waited = []
    for _ in range(20):
        waits, record = record.waits(knobs)
        waited.append(waits)
        if waits:
            record = record.ended(False, knobs)  # the burst holds: every wait runs out
    # 0.9^11 = 0.31 still waits; after the twelfth forced wait the share is 0.28.
    assert waited[:12] == [True] * 12
    assert waited[12:20] == [False, False, False, True] * 2
    assert record.clear_rate < 0.3
    # The burst is over: the next probe clears, which brings the share back over the mark.
    while not (step := record.waits(knobs))[0]:
        record = step[1]
    record = step[1].ended(True, knobs)
    assert record.clear_rate >= 0.3
    for _ in range(4):  # every turn waits again, none is skipped
        waits, record = record.waits(knobs)
        assert waits and record.skipped == 0
    # Waits that clear keep the share up: nothing is skipped.
    steady = DeferralRecord()
    for _ in range(50):
        waits, steady = steady.waits(knobs)
        assert waits
        steady = steady.ended(True, knobs)


def test_the_deferral_record_knobs_are_checked() -> None:
    for bad in ({"defer_min_clear_rate": 1.5}, {"defer_clear_alpha": 0.0}, {"defer_probe_every": 0}):
        with pytest.raises(ValueError, match="defer_"):
            PolicyKnobs(**bad)  # type: ignore[arg-type]
