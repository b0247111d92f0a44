"""Whether a turn waits before it runs (pure).

`auto` forces a turn when every option is over a limit: it runs the cheapest of them anyway rather than fail
it. Most limits are about the requests running on a node right now: a TPOT quota nearly spent by a short answer
decoding there, a prefill still running beside which a new answer would decode, the KV-pressure veto. Those
clear as the requests finish, often within a few decode steps (a six-token answer is gone in ~40 ms), while
running the turn now breaks the TPOT of the request the limit protects. So such a turn waits, up to
``defer_max_s`` in all, and is placed again on a fresh view every ``defer_step_s``; whatever the view then, it
runs once the wait is spent. A turn over a fixed cap alone (``max_local_suffix_tokens``) never waits: no wait
changes it.

Whether waits clear is observed, not assumed. In a burst every instance stays over some limit for seconds, and
a wait that ends forced anyway only adds its ``defer_max_s`` to the turn's TTFT (on the bursty trace at ×2, 110
turns of 261 waited 0.2 s and then ran as they would have at once). So the gateway keeps a moving average of how
its waits ended (:class:`DeferralRecord`): while fewer than ``defer_min_clear_rate`` of them clear, a turn runs
at once, but for one in ``defer_probe_every``, which still waits, so that the average sees the limits clear again.
``defer_min_clear_rate`` 0 (the default while the rule is evaluated) waits whenever a turn could.

The TTFT it costs is bounded by ``defer_max_s``; every wait is counted (``kvtether_deferred_turns_total``) and
on the turn's plan span (``kvtether.plan.deferred_s``).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtether.gateway.policy.facts import CostDecision
from kvtether.gateway.policy.knobs import PolicyKnobs


@dataclass(frozen=True, slots=True)
class DeferralRecord:
    """How recent waits ended: a moving average of those that cleared (1) against those that ran forced anyway
    (0), and how many turns have run at once since a wait last probed."""

    clear_rate: float = 1.0
    skipped: int = 0

    def ended(self, cleared: bool, knobs: PolicyKnobs) -> DeferralRecord:
        a = knobs.defer_clear_alpha
        return DeferralRecord((1.0 - a) * self.clear_rate + a * (1.0 if cleared else 0.0), self.skipped)

    def waits(self, knobs: PolicyKnobs) -> tuple[bool, DeferralRecord]:
        """Whether a turn that could wait does (and the record after it): always while waits clear often enough;
        otherwise one turn in ``defer_probe_every``."""
        if self.clear_rate >= knobs.defer_min_clear_rate or self.skipped + 1 >= knobs.defer_probe_every:
            return True, DeferralRecord(self.clear_rate, 0)
        return False, DeferralRecord(self.clear_rate, self.skipped + 1)


def could_wait(decision: CostDecision | None, knobs: PolicyKnobs) -> bool:
    """Whether waiting might change the turn's placement: it was forced over a limit that clears."""
    if decision is None or not decision.forced or knobs.defer_max_s <= 0.0:
        return False
    return any(o.soft and not o.fixed_limit for o in decision.options)  # over fixed caps only: no wait helps


def deferral_s(decision: CostDecision | None, waited_s: float, knobs: PolicyKnobs) -> float:
    """Seconds to wait before placing the turn again, having waited `waited_s` already; 0: run it as decided."""
    if not could_wait(decision, knobs):
        return 0.0
    left = knobs.defer_max_s - max(0.0, waited_s)
    return min(knobs.defer_step_s, left) if left > 1e-9 else 0.0
