"""Placement (pure): facts about a turn, its session and the cluster in; a plan with its reason out.

No I/O and no clock here: the shell gathers the facts (session state, verified reuse length from the
guard, the load view) and executes the plan. The plan's ``reason`` is logged and put on spans, so
every choice can be explained after the fact.

Every policy is one :class:`Rule` in ``RULES``, by the name an operator configures: ``pull``, ``no-pull`` and
``reference`` are fixed rules (below), ``dynamo`` and ``llm-d`` the rules those gateways ship (``peers.py``);
``auto`` asks the cost model (``costmodel.choose``) to weigh "run the turn on the pinned decode node"
(``HandleAction.DECODE_LOCAL``) against "prefill + pull from decode" and "cold prefill", and maps its decision
onto a :class:`Plan`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Final, Protocol

from kvtether.gateway.policy.costmodel import choose
from kvtether.gateway.policy.estimates import EstimatorSnapshot
from kvtether.gateway.policy.facts import CostDecision, NodeLoad, NoFeasibleOption, TurnFacts
from kvtether.gateway.policy.knobs import PolicyKnobs
from kvtether.gateway.policy.peers import PEER_POLICIES, PeerKnobs, decide


class HandleAction(StrEnum):
    ATTACH = "attach"  # send D's handle unchanged: P pulls everything D holds
    TRUNCATE = "truncate"  # send the handle cut to the verified prefix (docs/protocol.md §3.2)
    NONE = "none"  # cold prefill (P's own prefix cache still applies)
    DECODE_LOCAL = "decode_local"  # whole request to the pinned D, no transfer (auto and the peer rules)


class HandleState(StrEnum):
    PRESENT = "present"
    MISSING = "missing"  # no handle: first turn, an older engine without stream handles, a failed turn
    EXPIRED = "expired"  # older than the gateway TTL: D may have freed it


@dataclass(frozen=True, slots=True)
class ClusterView:
    prefill: tuple[NodeLoad, ...] = ()
    decode: tuple[NodeLoad, ...] = ()


@dataclass(frozen=True, slots=True)
class Turn:
    policy: str  # effective policy: "auto" | "pull" | "no-pull" | "reference" | "dynamo" | "llm-d"
    new_session: bool
    pinned_decode: str | None = None
    handle: HandleState = HandleState.MISSING
    handle_tokens: int | None = None  # the handle's remote_num_tokens
    handle_groups: int = 1
    prompt_tokens: int | None = None
    reuse_tokens: int | None = None  # verified by the guard; None = not verified (tokenize failed / skipped)
    min_reuse_tokens: int = 64
    partial_reuse: bool = True
    round_robin: int = 0  # reference policy's counter, kept by the shell
    exclude: frozenset[str] = frozenset()  # nodes that just failed this turn
    # Facts only the cost-based "auto" policy reads (docs/placement.md).
    suffix_tokens: int = 0  # tokens the prompt adds to the session's last prompt + answer
    decode_cached_tokens: int = 0  # verified prefix of the prompt the pinned D still holds in its prefix cache
    handle_age_s: float = 0.0
    expected_output_tokens: int = 256  # the session's running mean
    next_suffix_tokens: int | None = None  # the session's running mean suffix; None = this turn's
    allow_local: bool = True  # False on a retry after a failed decode-local leg
    last_prefill: str | None = None  # P of the session's previous P/D turn: its prefix cache may hold the history
    # (decode url, tokens): verified prefix of the prompt a D the pin left still holds in its prefix cache
    decode_elsewhere: tuple[tuple[str, int], ...] = ()
    prefill_cached: tuple[tuple[str, int], ...] = ()  # (P url, tokens of the prompt its prefix cache holds)
    ttft_tail_s: float = math.inf  # where recent turns' estimated TTFT tail starts (tail.py); inf: unknown
    local_keeps_handle: bool = False  # a decode-local turn would return a handle (marked, D keeps them)
    # The pinned D's per-request TPOT quotas (stallquota.py): least headroom and that request's quota.
    request_stall_credit_s: float = math.inf
    request_stall_quota_s: float = math.inf
    stall_credits: tuple[tuple[str, float, float], ...] = ()  # the same per other pool instance (url, credit, quota)
    # Prefills running beside decodes (url, ends in s, run s, stall s): what an answer placed there still takes.
    running_prefills: tuple[tuple[str, float, float, float], ...] = ()


@dataclass(frozen=True, slots=True)
class Plan:
    prefill: str | None
    decode: str
    action: HandleAction
    reuse_tokens: int
    reason: str
    # attached | truncated | refused_by_guard | expired | missing | unused_local | unused_cold (auto)
    handle_outcome: str | None = None
    re_placed: bool = False
    decision: CostDecision | None = None  # auto: the cost model's choice, estimates and reason


class NoCapacity(Exception):
    """No healthy node for a role."""

    def __init__(self, role: str) -> None:
        super().__init__(f"no healthy {role} node")
        self.role = role


def least_loaded(nodes: Sequence[NodeLoad], *, exclude: frozenset[str] = frozenset()) -> NodeLoad | None:
    candidates = [n for n in nodes if n.healthy and n.url not in exclude]
    if not candidates:
        return None
    # Ties go to the first in the configuration's order (min keeps the first): never to an accident such as
    # which port sorts first.
    return min(candidates, key=lambda n: n.score)


def _healthy(nodes: Sequence[NodeLoad], exclude: frozenset[str]) -> list[NodeLoad]:
    return [n for n in nodes if n.healthy and n.url not in exclude]


@dataclass(frozen=True, slots=True)
class PlanInputs:
    """What a rule may read besides the turn and the cluster: the learned node speeds and cost-model parameters
    (auto), the peer gateways' parameters (dynamo, llm-d)."""

    estimates: EstimatorSnapshot = field(default_factory=EstimatorSnapshot)
    knobs: PolicyKnobs = field(default_factory=PolicyKnobs)
    peers: PeerKnobs = field(default_factory=PeerKnobs)


class Rule(Protocol):
    """A placement policy: the turn, the cluster and the inputs in, a plan with its reason out (pure)."""

    def __call__(self, turn: Turn, cluster: ClusterView, inputs: PlanInputs, /) -> Plan: ...


def plan(turn: Turn, cluster: ClusterView, estimates: EstimatorSnapshot | None = None,
         knobs: PolicyKnobs | None = None, peers: PeerKnobs | None = None) -> Plan:
    """Place a turn by its policy's rule (``RULES``); inputs left out take their defaults."""
    rule = RULES.get(turn.policy)
    if rule is None:
        raise ValueError(f"unknown placement policy {turn.policy!r}; known: {', '.join(RULES)}")
    return rule(turn, cluster, PlanInputs(estimates or EstimatorSnapshot(), knobs or PolicyKnobs(),
                                          peers or PeerKnobs()))


def _plan_pull(turn: Turn, cluster: ClusterView, _inputs: PlanInputs) -> Plan:
    """Always prefill on P, pulling the verified part of the session's handle when there is one."""
    decode, re_placed, d_reason = _choose_decode(turn, cluster)
    return _choose_reuse(turn, cluster, decode, re_placed, d_reason)


def _plan_no_pull(turn: Turn, cluster: ClusterView, _inputs: PlanInputs) -> Plan:
    """Classic disaggregation: P recomputes what its own prefix cache lacks; no handle is ever sent."""
    decode, re_placed, d_reason = _choose_decode(turn, cluster)
    p = _preferred_p(cluster.prefill, turn, decode)
    if p is None:
        return _local_instead(cluster, decode, d_reason, None, re_placed)
    return Plan(p.url, decode, HandleAction.NONE, 0, f"{d_reason}; policy no-pull: cold prefill", None, re_placed)


def _choose_decode(turn: Turn, cluster: ClusterView) -> tuple[str, bool, str]:
    pinned = turn.pinned_decode
    if pinned is not None:
        for n in cluster.decode:
            if n.url == pinned and n.healthy and n.url not in turn.exclude:
                return pinned, False, f"session pinned to decode {pinned}"
    d = least_loaded(cluster.decode, exclude=turn.exclude)
    if d is None:
        raise NoCapacity("decode")
    if pinned is None:
        return d.url, False, f"new pin: least-loaded decode {d.url}"
    return d.url, True, f"pinned decode {pinned} unhealthy: re-placed on {d.url}"


def _preferred_p(nodes: Sequence[NodeLoad], turn: Turn, decode: str) -> NodeLoad | None:
    """The least-loaded healthy P; the session's previous P when it is as lightly loaded (its prefix cache
    may still hold the history, which saves recomputing or pulling it). Never `decode` itself (a pool instance
    is both): a turn prefilled where it decodes is a decode-local turn."""
    exclude = turn.exclude | {decode}
    best = least_loaded(nodes, exclude=exclude)
    if best is None or turn.last_prefill is None:
        return best
    last = next((n for n in nodes if n.url == turn.last_prefill and n.healthy and n.url not in exclude), None)
    return last if last is not None and last.score <= best.score else best


def _local_instead(cluster: ClusterView, decode: str, d_reason: str, outcome: str | None, re_placed: bool) -> Plan:
    """No prefill node but the decode node itself: a pool instance runs the turn itself; a decode node cannot."""
    if not any(n.url == decode and n.both for n in cluster.decode):
        raise NoCapacity("prefill")
    return Plan(None, decode, HandleAction.DECODE_LOCAL, 0,
                f"{d_reason}; no other instance to prefill on: the pool instance runs it itself", outcome, re_placed)


def _choose_reuse(turn: Turn, cluster: ClusterView, decode: str, re_placed: bool, d_reason: str) -> Plan:
    any_p = _preferred_p(cluster.prefill, turn, decode)
    if any_p is None:
        outcome = None if turn.new_session else (
            "unused_local" if turn.handle is HandleState.PRESENT else turn.handle.value)
        return _local_instead(cluster, decode, d_reason, outcome, re_placed)

    def cold(why: str, outcome: str | None) -> Plan:
        return Plan(any_p.url, decode, HandleAction.NONE, 0, f"{d_reason}; cold prefill: {why}", outcome, re_placed)

    if turn.new_session:
        return cold("new session", None)
    if turn.handle is HandleState.MISSING:
        return cold("no handle held", "missing")
    if turn.handle is HandleState.EXPIRED:
        return cold("handle expired", "expired")
    if re_placed:
        # The handle points at the dead node: a pull would only fail.
        return cold("handle is on the lost decode node", "missing")
    if turn.reuse_tokens is None or turn.handle_tokens is None or turn.prompt_tokens is None:
        return cold("reuse not verified (no prompt tokens)", "refused_by_guard")
    bidi_p = _preferred_p([n for n in cluster.prefill if n.bidirectional], turn, decode)
    if bidi_p is None:
        return cold("no healthy bidirectional prefill node", "refused_by_guard")
    # P must compute at least the prompt's last token itself.
    reuse = min(turn.reuse_tokens, turn.prompt_tokens - 1)
    exact = reuse == turn.handle_tokens == turn.reuse_tokens
    if reuse < turn.min_reuse_tokens:
        return cold(f"verified reuse {reuse} < threshold {turn.min_reuse_tokens}", "refused_by_guard")
    if exact:
        return Plan(bidi_p.url, decode, HandleAction.ATTACH, reuse,
                    f"{d_reason}; prompt extends the held {reuse} tokens: pull them from decode", "attached")
    if not turn.partial_reuse:
        return cold(f"prompt diverges from the held sequence after {reuse} of {turn.handle_tokens} tokens",
                    "refused_by_guard")
    if turn.handle_groups != 1:
        return cold(f"partial reuse needs one KV-cache group, handle has {turn.handle_groups}", "refused_by_guard")
    why = f"prompt diverges after {reuse} of {turn.handle_tokens} held tokens: pull the verified part"
    return Plan(bidi_p.url, decode, HandleAction.TRUNCATE, reuse, f"{d_reason}; {why}", "truncated")


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


def _plan_auto(turn: Turn, cluster: ClusterView, inputs: PlanInputs) -> Plan:
    """The cost-based choice (costmodel.choose) as a Plan.

    Without a verified prompt length the cost model has nothing to weigh: the turn goes the "pull" rule's
    way (cold unless a handle is verified, which needs the prompt's tokens anyway).
    """
    if turn.prompt_tokens is None or turn.prompt_tokens < 1:
        return _plan_pull(turn, cluster, inputs)
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
    # Off the pinned D: it is lost, or (rebalancing) a P/D turn decodes on a lighter D and the pin moves.
    re_placed = pinned is not None and d.decode_url != pinned
    if re_placed and not pinned_alive and refused is None and turn.handle is HandleState.PRESENT:
        refused = "missing"  # the handle is on the lost decode node, as the pull rule reports it
    # A verified handle the choice leaves unused still gets an outcome, so every turn with a handle counts once.
    unused = refused is None and turn.handle is HandleState.PRESENT and reuse > 0
    if d.option == "decode_local":
        # D computes the suffix after its own prefix-cache hit; the handle stays for a later pull.
        outcome = "unused_local" if unused else refused
        return Plan(None, d.decode_url, HandleAction.DECODE_LOCAL, 0, d.reason, outcome, re_placed, d)
    assert d.prefill_url is not None
    if d.option == "pull":
        exact = d.reuse_tokens == turn.handle_tokens == turn.reuse_tokens
        action, outcome = (HandleAction.ATTACH, "attached") if exact else (HandleAction.TRUNCATE, "truncated")
        return Plan(d.prefill_url, d.decode_url, action, d.reuse_tokens, d.reason, outcome, re_placed, d)
    # A verified handle that cold leaves unused (pull was dearer): the orchestrator drops it (the P/D turn leaves
    # a fresh one behind).
    outcome = "unused_cold" if unused else refused
    return Plan(d.prefill_url, d.decode_url, HandleAction.NONE, 0, d.reason, outcome, re_placed, d)


def _plan_peer(turn: Turn, cluster: ClusterView, inputs: PlanInputs) -> Plan:
    """Dynamo's or llm-d's rule: the turn prefilled on its decode node, or disaggregated without a pull."""
    decode, re_placed, d_reason = _choose_decode(turn, cluster)
    p = _preferred_p(cluster.prefill, turn, decode)
    d = next((n for n in cluster.decode if n.url == decode), None)
    # What the decode node's prefix cache holds of the prompt: nothing on a node the session was moved to.
    cached = turn.decode_cached_tokens if not re_placed and decode == turn.pinned_decode else 0
    verdict = decide(turn.policy, turn.prompt_tokens, cached, p, d, inputs.peers)
    if verdict.local and turn.allow_local:
        return Plan(None, decode, HandleAction.DECODE_LOCAL, 0, f"{d_reason}; {verdict.reason}", None, re_placed)
    if p is None:
        return _local_instead(cluster, decode, f"{d_reason}; {verdict.reason}", None, re_placed)
    why = verdict.reason if not verdict.local else f"{verdict.reason}, but the decode leg just failed: disaggregate"
    return Plan(p.url, decode, HandleAction.NONE, 0, f"{d_reason}; {why}", None, re_placed)


def _plan_reference(turn: Turn, cluster: ClusterView, _inputs: PlanInputs) -> Plan:
    """vLLM's reference multi-turn proxy: round-robin P and D, the conversation's handle sent blindly."""
    ds = _healthy(cluster.decode, turn.exclude)
    if not ds:
        raise NoCapacity("decode")
    d = ds[turn.round_robin % len(ds)]
    ps = [n for n in _healthy(cluster.prefill, turn.exclude) if n.url != d.url]  # a pool instance: not for itself
    if not ps:
        return _local_instead(cluster, d.url, "reference policy: round-robin", None, False)
    p = ps[turn.round_robin % len(ps)]
    if turn.handle is HandleState.PRESENT and p.bidirectional:
        return Plan(p.url, d.url, HandleAction.ATTACH, turn.handle_tokens or 0,
                    "reference policy: round-robin, conversation handle attached unchecked", "attached")
    outcome = None if turn.new_session else turn.handle.value
    return Plan(p.url, d.url, HandleAction.NONE, 0, "reference policy: round-robin, no handle", outcome)


RULES: Final[Mapping[str, Rule]] = {
    "auto": _plan_auto,
    "pull": _plan_pull,
    "no-pull": _plan_no_pull,
    "reference": _plan_reference,
    **{name: _plan_peer for name in PEER_POLICIES},
}


def plan_aggregated(pinned: str | None, replicas: Sequence[NodeLoad], exclude: frozenset[str] = frozenset()) -> Plan:
    """Aggregated mode: stay on the pinned replica so its prefix cache serves the history."""
    if pinned is not None:
        for n in replicas:
            if n.url == pinned and n.healthy and n.url not in exclude:
                return Plan(None, pinned, HandleAction.NONE, 0, f"session pinned to replica {pinned}")
    r = least_loaded(replicas, exclude=exclude)
    if r is None:
        raise NoCapacity("aggregated")
    if pinned is None:
        return Plan(None, r.url, HandleAction.NONE, 0, f"new pin: least-loaded replica {r.url}")
    return Plan(None, r.url, HandleAction.NONE, 0, f"pinned replica {pinned} unhealthy: re-placed on {r.url}",
                re_placed=True)
