"""``reference``: vLLM's reference multi-turn proxy. Round-robin P and D, the conversation's handle sent blindly
(no guard), and every handle held until the engine's TTL (the proxy releases none)."""

from __future__ import annotations

from typing import Final

from kvtether.gateway.policy.placement import (
    ClusterView,
    HandleAction,
    HandleState,
    NoCapacity,
    Plan,
    PlanInputs,
    Turn,
    healthy,
    local_instead,
)
from kvtether.gateway.policy.reasons import POLICY_FIXED
from kvtether.gateway.policy.registry import Policy


def plan_reference(turn: Turn, cluster: ClusterView, _inputs: PlanInputs) -> Plan:
    """Round-robin P and D, the conversation's handle attached whenever one is held and P can read it."""
    ds = healthy(cluster.decode, turn.exclude)
    if not ds:
        raise NoCapacity("decode")
    d = ds[turn.round_robin % len(ds)]
    ps = [n for n in healthy(cluster.prefill, turn.exclude) if n.url != d.url]  # a pool instance: not for itself
    if not ps:
        return local_instead(cluster, d.url, "reference policy: round-robin", None, False, POLICY_FIXED)
    p = ps[turn.round_robin % len(ps)]
    if turn.handle is HandleState.PRESENT and p.bidirectional:
        return Plan(p.url, d.url, HandleAction.ATTACH, turn.handle_tokens or 0,
                    "reference policy: round-robin, conversation handle attached unchecked", "attached",
                    bucket=POLICY_FIXED)
    outcome = None if turn.new_session else turn.handle.value
    return Plan(p.url, d.url, HandleAction.NONE, 0, "reference policy: round-robin, no handle", outcome,
                bucket=POLICY_FIXED)


REFERENCE: Final = Policy(
    "reference", plan_reference, pulls=True, keeps_handles=True, releases_held_handles=False,
    series=((HandleAction.ATTACH.value, POLICY_FIXED), (HandleAction.NONE.value, POLICY_FIXED)),
)
