"""Whether a turn waits before it runs (pure).

`auto` forces a turn when every option is over a limit: it runs the cheapest of them anyway rather than fail
it. Most limits are about the requests running on a node right now: a TPOT quota nearly spent by a short answer
decoding there, a prefill still running beside which a new answer would decode, the KV-pressure veto. Those
clear as the requests finish, often within a few decode steps (a six-token answer is gone in ~40 ms), while
running the turn now breaks the TPOT of the request the limit protects. So such a turn waits, up to
``defer_max_s`` in all, and is placed again on a fresh view every ``defer_step_s``; whatever the view then, it
runs once the wait is spent. A turn over a fixed cap alone (``max_local_suffix_tokens``) never waits: no wait
changes it.

The TTFT it costs is bounded by ``defer_max_s``; every wait is counted (``kvtether_deferred_turns_total``) and
on the turn's plan span (``kvtether.plan.deferred_s``).
"""

from __future__ import annotations

from kvtether.gateway.policy.facts import CostDecision
from kvtether.gateway.policy.knobs import PolicyKnobs


def deferral_s(decision: CostDecision | None, waited_s: float, knobs: PolicyKnobs) -> float:
    """Seconds to wait before placing the turn again, having waited `waited_s` already; 0: run it as decided."""
    if decision is None or not decision.forced or knobs.defer_max_s <= 0.0:
        return 0.0
    if not any(o.soft and not o.fixed_limit for o in decision.options):
        return 0.0  # over fixed caps only, or impossible: waiting would not change it
    left = knobs.defer_max_s - max(0.0, waited_s)
    return min(knobs.defer_step_s, left) if left > 1e-9 else 0.0
