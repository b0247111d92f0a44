"""``auto``: the cost-based choice per turn (``costmodel.choose`` weighs decode-local, pull and cold;
docs/placement.md), as a plan.

Everything the gateway learns serves it: the guard's verified reuse, what each node's prefix cache holds, the
TPOT quotas of stall a decode-local turn or a pool prefill spends, and handles kept (decode-local turns marked for
retention too, when the engine tracks them) for a later pull.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Final

from kvtether.gateway.policy.costmodel import choose
from kvtether.gateway.policy.facts import CostDecision, NoFeasibleOption, OptionEstimate, TurnFacts
from kvtether.gateway.policy.placement import ClusterView, HandleAction, HandleState, NoCapacity, Plan, PlanInputs, Turn
from kvtether.gateway.policy.reasons import (
    COLD_CHEAPEST,
    FIRST_TURN,
    FORCED,
    GUARD_REFUSED,
    LOCAL_CHEAPEST,
    NO_BIDIRECTIONAL_PREFILL,
    NO_HANDLE,
    NODE_LOST,
    OTHER,
    PULL_CHEAPEST,
    PULL_OVER_LIMIT,
    TTFT_RESCUE,
)
from kvtether.gateway.policy.registry import Policy
from kvtether.gateway.policy.rules.pull import COLD_BUCKETS, plan_pull


def plan_auto(turn: Turn, cluster: ClusterView, inputs: PlanInputs) -> Plan:
    """The cost-based choice (costmodel.choose) as a Plan.

    Without a verified prompt length the cost model has nothing to weigh: the turn goes the "pull" rule's
    way (cold unless a handle is verified, which needs the prompt's tokens anyway).
    """
    if turn.prompt_tokens is None or turn.prompt_tokens < 1:
        return plan_pull(turn, cluster, inputs)
    reuse, refused = _usable_reuse(turn)
    pinned = turn.pinned_decode
    pinned_alive = pinned is not None and any(
        n.url == pinned and n.healthy and n.url not in turn.exclude for n in cluster.decode)
    facts = TurnFacts(
        prompt_tokens=turn.prompt_tokens,
        suffix_tokens=max(0, turn.suffix_tokens),
        reuse_tokens=reuse,
        handle_valid=reuse > 0 and pinned_alive,
        handle_age_s=max(0.0, turn.handle_age_s),
        decode_cached_tokens=max(0, turn.decode_cached_tokens) if pinned_alive else 0,
        expected_output_tokens=max(0, turn.expected_output_tokens),
        next_suffix_tokens=turn.next_suffix_tokens,
        decode_elsewhere=tuple((u, max(0, n)) for u, n in turn.decode_elsewhere if u != pinned),
        prefill_cached=tuple((u, max(0, n)) for u, n in turn.prefill_cached),
        ttft_tail_s=turn.ttft_tail_s,
        local_keeps_handle=turn.local_keeps_handle,
        request_stall_credit_s=turn.request_stall_credit_s,
        request_stall_quota_s=turn.request_stall_quota_s,
        stall_credits=turn.stall_credits,
        running_prefills=turn.running_prefills,
    )
    knobs = inputs.knobs
    if not turn.allow_local:
        # A decode-local leg just failed: an over-limit local turn stays possible only as the last resort.
        knobs = replace(knobs, max_local_suffix_tokens=0, pool_max_local_suffix_tokens=0)
    try:
        d = choose(facts, pinned if pinned_alive else None, cluster.prefill, cluster.decode, inputs.estimates, knobs,
                   exclude=turn.exclude)
    except NoFeasibleOption as exc:
        raise NoCapacity("decode" if "decode" in exc.why else "prefill") from None
    if turn.new_session and not d.rescued and not any(n.both for n in cluster.decode):
        # A P/D session's first turn is sized only for the decode-node rescue (decode_ttft_rescue); not rescued,
        # it starts as it would unsized, so the rule changes the turns it rescues and no other.
        return plan_pull(turn, cluster, inputs)
    # Off the pinned D: it is lost, or (rebalancing) a P/D turn decodes on a lighter D and the pin moves.
    re_placed = pinned is not None and d.decode_url != pinned
    if re_placed and not pinned_alive and refused is None and turn.handle is HandleState.PRESENT:
        refused = "missing"  # the handle is on the lost decode node, as the pull rule reports it
    # A verified handle the choice leaves unused still gets an outcome, so every turn with a handle counts once.
    unused = refused is None and turn.handle is HandleState.PRESENT and reuse > 0
    if d.option == "decode_local":
        # D computes the suffix after its own prefix-cache hit; the handle stays for a later pull.
        outcome = "unused_local" if unused else refused
        return Plan(None, d.decode_url, HandleAction.DECODE_LOCAL, 0, d.reason, outcome, re_placed, d,
                    decision_bucket(d, re_placed, outcome))
    assert d.prefill_url is not None
    if d.option == "pull":
        exact = d.reuse_tokens == turn.handle_tokens == turn.reuse_tokens
        action, outcome = (HandleAction.ATTACH, "attached") if exact else (HandleAction.TRUNCATE, "truncated")
        return Plan(d.prefill_url, d.decode_url, action, d.reuse_tokens, d.reason, outcome, re_placed, d,
                    decision_bucket(d, re_placed, outcome))
    # A verified handle that cold leaves unused (pull was dearer): the orchestrator drops it (the P/D turn leaves
    # a fresh one behind).
    outcome = "unused_cold" if unused else refused
    return Plan(d.prefill_url, d.decode_url, HandleAction.NONE, 0, d.reason, outcome, re_placed, d,
                decision_bucket(d, re_placed, outcome))


def _usable_reuse(turn: Turn) -> tuple[int, str | None]:
    """Verified reuse a pull may use (0 = none) and, when 0, the handle outcome that says why."""
    if turn.new_session:
        return 0, None
    if turn.handle is HandleState.MISSING:
        return 0, "missing"
    if turn.handle is HandleState.EXPIRED:
        return 0, "expired"
    if turn.reuse_tokens is None or turn.handle_tokens is None or turn.prompt_tokens is None:
        return 0, "refused_by_guard"
    reuse = min(turn.reuse_tokens, turn.prompt_tokens - 1)
    exact = reuse == turn.handle_tokens == turn.reuse_tokens
    if reuse < turn.min_reuse_tokens:
        return 0, "refused_by_guard"
    if not exact and (not turn.partial_reuse or turn.handle_groups != 1):
        return 0, "refused_by_guard"
    return reuse, None


# What rules the pull out (options.pull_option's why_not), by how it starts. "no valid handle" is refined by the
# plan's handle outcome (first turn, none held, refused).
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


def decision_bucket(decision: CostDecision, re_placed: bool, handle_outcome: str | None) -> str:
    """The cost model's decision as a metric label: ``*_cheapest`` when the pull was possible (so the option won
    on cost, or the pull did); else what ruled the pull out, the question an operator asks of a cold or local turn;
    ``forced`` when nothing was within the limits, ``ttft_rescue`` when that was to keep the TTFT objective."""
    if decision.rescued:
        return TTFT_RESCUE
    if decision.forced:
        return FORCED
    pull, local = _option(decision, "pull"), _option(decision, "decode_local")
    if decision.option == "pull" or (pull is not None and pull.feasible):
        return _CHEAPEST.get(decision.option, OTHER)
    if re_placed and local is not None and local.why_not == _NO_PIN:
        return NODE_LOST  # the pin was lost (a pin moved by rebalancing keeps its local estimate)
    if pull is not None and pull.soft:
        return PULL_OVER_LIMIT
    why = pull.why_not if pull is not None else ""
    if why == "no valid handle":
        return _NO_VALID_HANDLE.get(handle_outcome, OTHER)
    return next((bucket for start, bucket in _PULL_WHY_NOT if why.startswith(start)), OTHER)


def _option(decision: CostDecision, name: str) -> OptionEstimate | None:
    return next((o for o in decision.options if o.option == name), None)


_NONE, _ATTACH, _TRUNCATE, _LOCAL = (a.value for a in (HandleAction.NONE, HandleAction.ATTACH, HandleAction.TRUNCATE,
                                                       HandleAction.DECODE_LOCAL))
AUTO: Final = Policy(
    "auto", plan_auto, verifies_reuse=True, reads_decode_cache=True, sizes_pool_turns=True, pulls=True,
    keeps_handles=True, marks_local_turns=True, uses_stall_quotas=True, tracks_cache_copies=True,
    series=(
        (_ATTACH, PULL_CHEAPEST), (_TRUNCATE, PULL_CHEAPEST), (_NONE, COLD_CHEAPEST), (_LOCAL, LOCAL_CHEAPEST),
        *((_NONE, r) for r in COLD_BUCKETS),
        *((_LOCAL, r) for r in (NO_HANDLE, GUARD_REFUSED, NO_BIDIRECTIONAL_PREFILL, FORCED, PULL_OVER_LIMIT)),
        (_NONE, PULL_OVER_LIMIT),
        *((a, TTFT_RESCUE) for a in (_LOCAL, _ATTACH, _TRUNCATE, _NONE)),
    ),
)
