"""``dynamo`` and ``llm-d``: the placement rules those gateways ship (policy/peers.py has the rules themselves).

The turn is prefilled on its decode node, or disaggregated without a pull; neither gateway reads a history back
from a decode node, so the handle a P/D turn leaves there is released at once. Both weigh what the decode node's
prefix cache holds of the prompt.
"""

from __future__ import annotations

from typing import Final

from kvtether.gateway.policy.peers import DYNAMO, LLM_D, decide
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
from kvtether.gateway.policy.reasons import DECODE_BUSY, NODE_LOST, PREFILL_BUSY, UNCACHED_LONG, UNCACHED_SHORT
from kvtether.gateway.policy.registry import Policy

_NONE, _LOCAL = HandleAction.NONE.value, HandleAction.DECODE_LOCAL.value


def plan_peer(turn: Turn, cluster: ClusterView, inputs: PlanInputs) -> Plan:
    """Dynamo's or llm-d's rule (by the turn's policy): the turn prefilled on its decode node, or disaggregated
    without a pull."""
    decode, re_placed, d_reason = choose_decode(turn, cluster)
    p = preferred_p(cluster.prefill, turn, decode)
    d = next((n for n in cluster.decode if n.url == decode), None)
    # What the decode node's prefix cache holds of the prompt: nothing on a node the session was moved to.
    cached = turn.decode_cached_tokens if not re_placed and decode == turn.pinned_decode else 0
    verdict = decide(turn.policy, turn.prompt_tokens, cached, p, d, inputs.peers)
    # A re-placed session's turn is counted as its node lost, whatever the rule said.
    bucket = NODE_LOST if re_placed else verdict.bucket
    if verdict.local and turn.allow_local:
        return Plan(None, decode, HandleAction.DECODE_LOCAL, 0, f"{d_reason}; {verdict.reason}", None, re_placed,
                    bucket=bucket)
    if p is None:
        return local_instead(cluster, decode, f"{d_reason}; {verdict.reason}", None, re_placed, bucket)
    why = verdict.reason if not verdict.local else f"{verdict.reason}, but the decode leg just failed: disaggregate"
    return Plan(p.url, decode, HandleAction.NONE, 0, f"{d_reason}; {why}", None, re_placed, bucket=bucket)


DYNAMO_POLICY: Final = Policy(
    DYNAMO, plan_peer, reads_decode_cache=True,
    series=((_LOCAL, UNCACHED_SHORT), (_LOCAL, PREFILL_BUSY), (_NONE, UNCACHED_LONG), (_NONE, DECODE_BUSY)),
)
LLM_D_POLICY: Final = Policy(LLM_D, plan_peer, reads_decode_cache=True,
                             series=((_LOCAL, UNCACHED_SHORT), (_NONE, UNCACHED_LONG)))
