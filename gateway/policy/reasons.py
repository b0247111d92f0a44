"""Why a turn went where it went, in a few words (pure): the plan's reason, bucketed for a metric label.

A plan's ``reason`` is free text with node URLs and numbers (right for a span or a log line, unbounded as a
label). ``reason_bucket`` maps every reason the policies write to one of the closed set :data:`BUCKETS`
(docs/metrics.md lists which reasons fall in each):

- the fixed rules (``placement._choose_reuse``, ``pull`` and ``auto`` without a verified prompt length) by the
  words after ``cold prefill:``, or the pull they chose;
- ``no-pull`` and ``reference``: the rule itself decided (``policy_fixed``);
- ``auto`` (``costmodel.choose``): ``*_cheapest`` when the pull was possible (so the option won on cost, or
  the pull did); else what ruled the pull out, from the pull option's ``why_not``, which is the question an
  operator asks of a cold or local turn. ``forced``: nothing was within the limits.

A reason this module does not know (a policy changed its wording, a new rule) maps to ``other``: a label
value never fails a turn, and a test holds every reason the policies write to a real bucket.
"""

from __future__ import annotations

from typing import Final

from kvtether.gateway.policy.facts import CostDecision, OptionEstimate
from kvtether.gateway.policy.placement import HandleAction, Plan

FIRST_TURN: Final = "first_turn"  # a new session: nothing held yet
NO_HANDLE: Final = "no_handle"  # the session holds no usable handle: none stored, or it expired (or will first)
NODE_LOST: Final = "node_lost"  # the session's decode node is out: the turn was re-placed, its handle is gone
GUARD_REFUSED: Final = "guard_refused"  # the guard verified too little of the handle (or could not verify)
NO_BIDIRECTIONAL_PREFILL: Final = "no_bidirectional_prefill"  # no healthy prefill node may receive a handle
HANDLE_VERIFIED: Final = "handle_verified"  # the pull rule: the guard verified the handle, so it is pulled
POLICY_FIXED: Final = "policy_fixed"  # no-pull and reference: the rule decides, whatever the turn
PULL_CHEAPEST: Final = "pull_cheapest"  # auto: the pull scored lowest
LOCAL_CHEAPEST: Final = "local_cheapest"  # auto: the pull was possible, decode-local scored lower
COLD_CHEAPEST: Final = "cold_cheapest"  # auto: the pull was possible, a cold prefill scored lower
FORCED: Final = "forced"  # auto: no option within the limits; run over one rather than fail the turn
# The peer rules (policy/peers.py): what the decode node's prefix cache lacks is short (prefill there) or long
# (disaggregate); Dynamo's load rule found the prefill node busy; its decode-busy veto cancelled a local prefill.
UNCACHED_SHORT: Final = "uncached_short"
UNCACHED_LONG: Final = "uncached_long"
PREFILL_BUSY: Final = "prefill_busy"
DECODE_BUSY: Final = "decode_busy"
OTHER: Final = "other"  # a reason this version does not know

BUCKETS: Final = (FIRST_TURN, NO_HANDLE, NODE_LOST, GUARD_REFUSED, NO_BIDIRECTIONAL_PREFILL, HANDLE_VERIFIED,
                  POLICY_FIXED, PULL_CHEAPEST, LOCAL_CHEAPEST, COLD_CHEAPEST, FORCED, UNCACHED_SHORT, UNCACHED_LONG,
                  PREFILL_BUSY, DECODE_BUSY, OTHER)

# The pull rule's cold prefills (placement._choose_reuse: "...; cold prefill: WHY"), by how WHY starts.
_COLD_WHY: Final = (
    ("new session", FIRST_TURN),
    ("no handle held", NO_HANDLE),
    ("handle expired", NO_HANDLE),
    ("handle is on the lost decode node", NODE_LOST),
    ("reuse not verified", GUARD_REFUSED),
    ("verified reuse ", GUARD_REFUSED),
    ("prompt diverges from the held sequence", GUARD_REFUSED),
    ("partial reuse needs one KV-cache group", GUARD_REFUSED),
    ("no healthy bidirectional prefill node", NO_BIDIRECTIONAL_PREFILL),
)
# The pull rule's pulls: attach (the prompt extends the whole handle) and truncate (the verified part).
_PULL_WHY: Final = (": pull them from decode", ": pull the verified part")
# What rules the pull out under auto (options.pull_option's why_not), by how it starts. "no valid handle" is
# refined by the plan's handle outcome (first turn, none held, refused).
_PULL_WHY_NOT: Final = (
    ("the handle's decode node is down", NODE_LOST),
    ("verified reuse ", GUARD_REFUSED),
    ("no healthy bidirectional prefill node", NO_BIDIRECTIONAL_PREFILL),
    ("handle expires", NO_HANDLE),
)
_NO_VALID_HANDLE: Final = {None: FIRST_TURN, "missing": NO_HANDLE, "expired": NO_HANDLE,
                           "refused_by_guard": GUARD_REFUSED}
_CHEAPEST: Final = {"decode_local": LOCAL_CHEAPEST, "pull": PULL_CHEAPEST, "cold": COLD_CHEAPEST}
_NO_PIN: Final = "no pinned decode node"  # options.local_option without a live pinned decode node

# The (option, reason) series each policy can produce, created at zero at start-up so a rate() sees the first
# one. option = the plan's action.
_NONE, _ATTACH, _TRUNCATE, _LOCAL = "none", "attach", "truncate", "decode_local"
_PULL_RULE_COLD: Final = (FIRST_TURN, NO_HANDLE, NODE_LOST, GUARD_REFUSED, NO_BIDIRECTIONAL_PREFILL)
SERIES: Final[dict[str, tuple[tuple[str, str], ...]]] = {
    "pull": (*((_NONE, r) for r in _PULL_RULE_COLD), (_ATTACH, HANDLE_VERIFIED), (_TRUNCATE, HANDLE_VERIFIED)),
    "no-pull": ((_NONE, POLICY_FIXED),),
    "dynamo": ((_LOCAL, UNCACHED_SHORT), (_LOCAL, PREFILL_BUSY), (_NONE, UNCACHED_LONG), (_NONE, DECODE_BUSY)),
    "llm-d": ((_LOCAL, UNCACHED_SHORT), (_NONE, UNCACHED_LONG)),
    "reference": ((_ATTACH, POLICY_FIXED), (_NONE, POLICY_FIXED)),
    "auto": (
        (_ATTACH, PULL_CHEAPEST), (_TRUNCATE, PULL_CHEAPEST), (_NONE, COLD_CHEAPEST), (_LOCAL, LOCAL_CHEAPEST),
        *((_NONE, r) for r in _PULL_RULE_COLD),
        *((_LOCAL, r) for r in (NO_HANDLE, GUARD_REFUSED, NO_BIDIRECTIONAL_PREFILL, FORCED)),
    ),
}


def reason_bucket(plan: Plan) -> str:
    """The bucket of ``plan.reason`` (one of :data:`BUCKETS`)."""
    if plan.decision is not None:
        return _cost_bucket(plan, plan.decision)
    return _rule_bucket(plan)


def _rule_bucket(plan: Plan) -> str:
    reason = plan.reason
    if reason.startswith("reference policy:") or "; policy no-pull: " in reason:
        return POLICY_FIXED
    if plan.re_placed:
        # The pull rule re-places a session whose decode node is lost; whatever else it says, that is why.
        return NODE_LOST
    peer = _peer_bucket(reason)
    if peer is not None:
        return peer
    _, cold, why = reason.partition("; cold prefill: ")
    if cold:
        return next((bucket for start, bucket in _COLD_WHY if why.startswith(start)), OTHER)
    if plan.action in (HandleAction.ATTACH, HandleAction.TRUNCATE) and reason.endswith(_PULL_WHY):
        return HANDLE_VERIFIED
    return OTHER


# The peer rules' reasons ("...; dynamo isl_bounding: WHY" / "...; llm-d: WHY"), by what WHY says.
_PEER_WHY: Final = (
    ("decode busy", DECODE_BUSY),
    ("the prefill node is busy", PREFILL_BUSY),
    ("prefill not busy: disaggregate", UNCACHED_LONG),
    ("> nonCachedTokens", UNCACHED_LONG),
    ("<= nonCachedTokens", UNCACHED_SHORT),
    ("of the prompt: prefill on decode", UNCACHED_SHORT),
)


def _peer_bucket(reason: str) -> str | None:
    _, dynamo, why = reason.partition("; dynamo ")
    if not dynamo:
        _, llm_d, why = reason.partition("; llm-d: ")
        if not llm_d:
            return None
    return next((bucket for part, bucket in _PEER_WHY if part in why), OTHER)


def _cost_bucket(plan: Plan, decision: CostDecision) -> str:
    if decision.forced:
        return FORCED
    pull, local = _option(decision, "pull"), _option(decision, "decode_local")
    if decision.option == "pull" or (pull is not None and pull.feasible):
        return _CHEAPEST.get(decision.option, OTHER)
    if plan.re_placed and local is not None and local.why_not == _NO_PIN:
        return NODE_LOST  # the pin was lost (a pin moved by rebalancing keeps its local estimate)
    why = pull.why_not if pull is not None else ""
    if why == "no valid handle":
        return _NO_VALID_HANDLE.get(plan.handle_outcome, OTHER)
    return next((bucket for start, bucket in _PULL_WHY_NOT if why.startswith(start)), OTHER)


def _option(decision: CostDecision, name: str) -> OptionEstimate | None:
    return next((o for o in decision.options if o.option == name), None)
