"""``pull``: always prefill on P, pulling the verified part of the session's handle when there is one.

The rule ``auto`` falls back to when it has no verified prompt length to weigh.
"""

from __future__ import annotations

from typing import Final

from kvtether.gateway.policy.placement import (
    ClusterView,
    HandleAction,
    HandleState,
    Plan,
    PlanInputs,
    Turn,
    choose_decode,
    local_instead,
    preferred_p,
)
from kvtether.gateway.policy.reasons import (
    FIRST_TURN,
    GUARD_REFUSED,
    HANDLE_VERIFIED,
    NO_BIDIRECTIONAL_PREFILL,
    NO_HANDLE,
    NODE_LOST,
)
from kvtether.gateway.policy.registry import Policy

# Why this rule goes cold, as counted: the series auto's fallback to it produces too.
COLD_BUCKETS: Final = (FIRST_TURN, NO_HANDLE, NODE_LOST, GUARD_REFUSED, NO_BIDIRECTIONAL_PREFILL)
_NONE, _ATTACH, _TRUNCATE = HandleAction.NONE.value, HandleAction.ATTACH.value, HandleAction.TRUNCATE.value


def plan_pull(turn: Turn, cluster: ClusterView, _inputs: PlanInputs) -> Plan:
    """Always prefill on P, pulling the verified part of the session's handle when there is one."""
    decode, re_placed, d_reason = choose_decode(turn, cluster)
    return _pull_or_cold(turn, cluster, decode, re_placed, d_reason)


def _pull_or_cold(turn: Turn, cluster: ClusterView, decode: str, re_placed: bool, d_reason: str) -> Plan:
    any_p = preferred_p(cluster.prefill, turn, decode)
    if any_p is None:
        outcome = None if turn.new_session else (
            "unused_local" if turn.handle is HandleState.PRESENT else turn.handle.value)
        return local_instead(cluster, decode, d_reason, outcome, re_placed)

    def cold(why: str, outcome: str | None, bucket: str) -> Plan:
        # A re-placed session's turn is counted as its node lost, whatever else kept it cold.
        return Plan(any_p.url, decode, HandleAction.NONE, 0, f"{d_reason}; cold prefill: {why}", outcome, re_placed,
                    bucket=NODE_LOST if re_placed else bucket)

    if turn.new_session:
        return cold("new session", None, FIRST_TURN)
    if turn.handle is HandleState.MISSING:
        return cold("no handle held", "missing", NO_HANDLE)
    if turn.handle is HandleState.EXPIRED:
        return cold("handle expired", "expired", NO_HANDLE)
    if re_placed:
        # The handle points at the dead node: a pull would only fail.
        return cold("handle is on the lost decode node", "missing", NODE_LOST)
    if turn.reuse_tokens is None or turn.handle_tokens is None or turn.prompt_tokens is None:
        return cold("reuse not verified (no prompt tokens)", "refused_by_guard", GUARD_REFUSED)
    bidi_p = preferred_p([n for n in cluster.prefill if n.bidirectional], turn, decode)
    if bidi_p is None:
        return cold("no healthy bidirectional prefill node", "refused_by_guard", NO_BIDIRECTIONAL_PREFILL)
    # P must compute at least the prompt's last token itself.
    reuse = min(turn.reuse_tokens, turn.prompt_tokens - 1)
    exact = reuse == turn.handle_tokens == turn.reuse_tokens
    if reuse < turn.min_reuse_tokens:
        return cold(f"verified reuse {reuse} < threshold {turn.min_reuse_tokens}", "refused_by_guard", GUARD_REFUSED)
    if exact:
        return Plan(bidi_p.url, decode, HandleAction.ATTACH, reuse,
                    f"{d_reason}; prompt extends the held {reuse} tokens: pull them from decode", "attached",
                    bucket=HANDLE_VERIFIED)
    if not turn.partial_reuse:
        return cold(f"prompt diverges from the held sequence after {reuse} of {turn.handle_tokens} tokens",
                    "refused_by_guard", GUARD_REFUSED)
    if turn.handle_groups != 1:
        return cold(f"partial reuse needs one KV-cache group, handle has {turn.handle_groups}", "refused_by_guard",
                    GUARD_REFUSED)
    why = f"prompt diverges after {reuse} of {turn.handle_tokens} held tokens: pull the verified part"
    return Plan(bidi_p.url, decode, HandleAction.TRUNCATE, reuse, f"{d_reason}; {why}", "truncated",
                bucket=HANDLE_VERIFIED)


PULL: Final = Policy(
    "pull", plan_pull, verifies_reuse=True, pulls=True, keeps_handles=True,
    series=(*((_NONE, r) for r in COLD_BUCKETS), (_ATTACH, HANDLE_VERIFIED), (_TRUNCATE, HANDLE_VERIFIED)),
)
