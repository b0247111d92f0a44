"""The decode-node stall budget (pure token bucket) and how the cost policy uses it."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from kvtether.gateway.costpolicy import NodeState, PolicyKnobs, choose
from kvtether.gateway.estimates import EstimatorSeeds, EstimatorSnapshot
from kvtether.gateway.stallbudget import StallBudget
from test_costpolicy import D0, D1, MOE, P0, history_turn


def test_a_full_budget_holds_the_burst_and_refills_at_the_share() -> None:
    b = StallBudget.full(0.04, 4.0, now=100.0)
    assert b.burst_s == pytest.approx(0.16)
    assert b.credit(100.0) == pytest.approx(0.16)
    spent = b.spend(0.07, now=100.0).spend(0.07, now=100.5)
    # 0.16 − 0.07 − 0.07 + 0.04 × 0.5 s of refill
    assert spent.credit(100.5) == pytest.approx(0.04)
    assert spent.credit(101.5) == pytest.approx(0.08)
    assert spent.credit(1000.0) == pytest.approx(0.16)  # capped at the burst, however long D was quiet


def test_overspending_is_carried_as_debt_and_a_clock_going_back_refills_nothing() -> None:
    b = StallBudget.full(0.05, 2.0, now=0.0).spend(0.3, now=0.0)  # e.g. a forced local turn
    assert b.credit(0.0) == pytest.approx(-0.2)
    assert b.credit(2.0) == pytest.approx(-0.1)
    assert b.credit(-5.0) == pytest.approx(-0.2)
    assert b.spend(-1.0, now=0.0).credit(0.0) == pytest.approx(-0.2)  # a negative stall is no refund


@pytest.mark.parametrize("share,window", [(-0.1, 1.0), (1.5, 1.0), (0.1, 0.0)])
def test_invalid_budget(share: float, window: float) -> None:
    with pytest.raises(ValueError):
        StallBudget.full(share, window, now=0.0)
    with pytest.raises(ValueError):
        PolicyKnobs(decode_stall_share=share, decode_stall_window_s=window)


BUSY = (NodeState(D0, running=1), NodeState(D1))
# The budget's own arithmetic (a 4 % share: 0.16 s burst), with the turn staying on its pinned D.
BUDGET_ONLY = PolicyKnobs(interference_weight=0.0, decode_stall_share=0.04, rebalance_decode=False)


def test_a_spent_budget_sends_a_turn_that_would_stall_the_batch_through_p() -> None:
    turn = history_turn(16000, 300, expected_output_tokens=32)
    full = choose(turn, D0, (NodeState(P0),), BUSY, MOE)
    assert full.option == "decode_local", full.reason
    stall = next(o for o in full.options if o.option == "decode_local").stall_s
    assert 0.03 < stall < 0.1  # a MoE prefill step: ~7 decode steps of a small batch
    spent = choose(history_turn(16000, 300, expected_output_tokens=32, decode_stall_credit_s=stall / 2),
                   D0, (NodeState(P0),), BUSY, MOE)
    assert spent.option == "pull", spent.reason
    assert "stall budget" in spent.trace_attributes()["rejected.decode_local"]
    assert "D stall budget" in spent.reason


def test_an_empty_budget_does_not_stop_a_local_turn_on_an_idle_decode() -> None:
    # Nobody decodes on D: the local prefill stalls no one, whatever the budget says.
    turn = history_turn(16000, 300, expected_output_tokens=32, decode_stall_credit_s=-0.5)
    dec = choose(turn, D0, (NodeState(P0),), (NodeState(D0), NodeState(D1)), MOE)
    assert dec.option == "decode_local", dec.reason
    assert next(o for o in dec.options if o.option == "decode_local").stall_s == 0.0


def test_a_draining_budget_keeps_the_turns_with_most_to_gain() -> None:
    # With the interference weight at 0 only the budget's shadow price weighs the stall: 0 while it is full,
    # burst/credit − 1 below. At half the burst a long history (its pull reads 16k tokens of KV) still runs
    # locally; a short one (its pull is cheap) goes through P and leaves the budget to the long ones.
    knobs = BUDGET_ONLY
    half = knobs.stall_burst_s / 2
    for prompt in (4000, 16000):
        full = choose(history_turn(prompt, 300, expected_output_tokens=32, decode_stall_credit_s=knobs.stall_burst_s),
                      D0, (NodeState(P0),), BUSY, MOE, knobs)
        assert full.option == "decode_local", full.reason
    long = choose(history_turn(16000, 300, expected_output_tokens=32, decode_stall_credit_s=half),
                  D0, (NodeState(P0),), BUSY, MOE, knobs)
    short = choose(history_turn(4000, 300, expected_output_tokens=32, decode_stall_credit_s=half),
                   D0, (NodeState(P0),), BUSY, MOE, knobs)
    assert long.option == "decode_local", long.reason
    assert short.option == "pull", short.reason
    local = next(o for o in short.options if o.option == "decode_local")
    assert local.interference_s == pytest.approx(local.stall_s)  # price 1 at half the burst


def test_a_stall_larger_than_the_burst_runs_only_from_a_full_budget() -> None:
    # A slow decode node (every local prefill stalls its batch ~1 s) with a 0.16 s burst: from a full
    # budget the turn may run (overdrawing it; the share still holds over time), from a partial one it may
    # not, and after the overdraft the budget needs (stall − 0.16) / 0.04 ≈ 25 s before the next.
    slow = EstimatorSnapshot(EstimatorSeeds(prefill_overhead_s=1.0, tpot_base_s=0.01, tpot_s_per_seq=0.001))
    knobs = BUDGET_ONLY
    turn = history_turn(16000, 300, expected_output_tokens=32)
    full = choose(replace(turn, decode_stall_credit_s=knobs.stall_burst_s), D0, (NodeState(P0),), BUSY, slow, knobs)
    assert full.option == "decode_local", full.reason
    stall = next(o for o in full.options if o.option == "decode_local").stall_s
    assert stall > knobs.stall_burst_s
    after = StallBudget.full(knobs.decode_stall_share, knobs.decode_stall_window_s, now=0.0).spend(stall, now=0.0)
    for t in (1.0, 20.0):
        credit = after.credit(t)
        dec = choose(replace(turn, decode_stall_credit_s=credit), D0, (NodeState(P0),), BUSY, slow, knobs)
        assert dec.option != "decode_local", (t, dec.reason)
    full_again = stall / knobs.decode_stall_share  # from −(stall − burst) back up to the burst
    assert after.credit(full_again - 1.0) < knobs.stall_burst_s
    assert after.credit(full_again) == pytest.approx(knobs.stall_burst_s)



def test_an_overdrawn_budget_keeps_every_score_finite() -> None:
    # Every P is down: the local turn is forced although the budget is overdrawn; its score stays a number.
    turn = history_turn(16000, 300, expected_output_tokens=32, decode_stall_credit_s=-1.0)
    dec = choose(turn, D0, (NodeState(P0, healthy=False),), BUSY, MOE)
    assert dec.option == "decode_local" and dec.forced, dec.reason
    local = next(o for o in dec.options if o.option == "decode_local")
    assert "stall budget" in local.why_not
    assert math.isfinite(local.interference_s) and local.interference_s > 0
    idle = choose(turn, D0, (NodeState(P0),), (NodeState(D0), NodeState(D1)), MOE)
    assert all(math.isfinite(s) for s in idle.scores_s.values()), idle.reason
