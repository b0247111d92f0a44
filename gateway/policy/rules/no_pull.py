"""``no-pull``: classic disaggregation. P recomputes what its own prefix cache lacks; no handle is ever sent, and
the one a P/D turn leaves on its decode node is released at once."""

from __future__ import annotations

from typing import Final

from kvtether.gateway.policy.placement import (
    ClusterView,
    HandleAction,
    Plan,
    PlanInputs,
    Turn,
    choose_decode,
    local_instead,
    preferred_p,
)
from kvtether.gateway.policy.reasons import POLICY_FIXED
from kvtether.gateway.policy.registry import Policy


def plan_no_pull(turn: Turn, cluster: ClusterView, _inputs: PlanInputs) -> Plan:
    """Cold prefill on the preferred P, whatever the session holds."""
    decode, re_placed, d_reason = choose_decode(turn, cluster)
    p = preferred_p(cluster.prefill, turn, decode)
    if p is None:
        return local_instead(cluster, decode, d_reason, None, re_placed)
    return Plan(p.url, decode, HandleAction.NONE, 0, f"{d_reason}; policy no-pull: cold prefill", None, re_placed,
                bucket=POLICY_FIXED)


NO_PULL: Final = Policy("no-pull", plan_no_pull, series=((HandleAction.NONE.value, POLICY_FIXED),))
