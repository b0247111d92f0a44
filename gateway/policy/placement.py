"""Placement (pure): facts about a turn, its session and the cluster in; a plan with its reason out.

No I/O and no clock here: the shell gathers the facts (session state, verified reuse length from the
guard, the load view) and executes the plan. The plan's ``reason`` is logged and put on spans, so
every choice can be explained after the fact; its ``bucket`` (policy/reasons.py), named by the rule that wrote the
reason, is the reason's metric label.

Every policy is one :class:`~kvtether.gateway.policy.registry.Policy`, by the name an operator configures, one a
file in ``rules/``: ``pull``, ``no-pull`` and ``reference`` are fixed rules, ``dynamo`` and ``llm-d`` the rules
those gateways ship (``rules/peers.py``); ``auto`` asks the cost model (``costmodel.choose``) to weigh "run the
turn on the pinned decode node" (``HandleAction.DECODE_LOCAL``) against "prefill + pull from decode" and "cold
prefill". This module holds what they share: the turn, the plan, and the choices of nodes every rule makes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from kvtether.gateway.policy.estimates import EstimatorSnapshot
from kvtether.gateway.policy.facts import CostDecision, NodeLoad
from kvtether.gateway.policy.knobs import PolicyKnobs
from kvtether.gateway.policy.peers import PeerKnobs
from kvtether.gateway.policy.reasons import NODE_LOST, OTHER
from kvtether.gateway.policy.registry import policy_named


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
    policy: str  # the configured policy's name (registry.py)
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
    # Prefills running beside decodes (url, ends in s, stall window s, stall s, steps): what an answer placed there
    # still takes.
    running_prefills: tuple[tuple[str, float, float, float, int], ...] = ()


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
    # The reason's metric label (policy/reasons.py), named where the reason is written: never parsed from it.
    bucket: str = OTHER


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


def healthy(nodes: Sequence[NodeLoad], exclude: frozenset[str]) -> list[NodeLoad]:
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
    """Place a turn by its policy's rule (registry.py); inputs left out take their defaults."""
    rule = policy_named(turn.policy).plan
    return rule(turn, cluster, PlanInputs(estimates or EstimatorSnapshot(), knobs or PolicyKnobs(),
                                          peers or PeerKnobs()))


def choose_decode(turn: Turn, cluster: ClusterView) -> tuple[str, bool, str]:
    """The session's decode node while it is healthy, else the least-loaded one: (url, re-placed, why)."""
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


def preferred_p(nodes: Sequence[NodeLoad], turn: Turn, decode: str) -> NodeLoad | None:
    """The least-loaded healthy P; the session's previous P when it is as lightly loaded (its prefix cache
    may still hold the history, which saves recomputing or pulling it). Never `decode` itself (a pool instance
    is both): a turn prefilled where it decodes is a decode-local turn."""
    exclude = turn.exclude | {decode}
    best = least_loaded(nodes, exclude=exclude)
    if best is None or turn.last_prefill is None:
        return best
    last = next((n for n in nodes if n.url == turn.last_prefill and n.healthy and n.url not in exclude), None)
    return last if last is not None and last.score <= best.score else best


def local_instead(cluster: ClusterView, decode: str, d_reason: str, outcome: str | None, re_placed: bool,
                  bucket: str = OTHER) -> Plan:
    """No prefill node but the decode node itself: a pool instance runs the turn itself; a decode node cannot.
    `bucket`: the calling rule's label for it; a re-placed session's turn is counted as its node lost."""
    if not any(n.url == decode and n.both for n in cluster.decode):
        raise NoCapacity("prefill")
    return Plan(None, decode, HandleAction.DECODE_LOCAL, 0,
                f"{d_reason}; no other instance to prefill on: the pool instance runs it itself", outcome, re_placed,
                bucket=NODE_LOST if re_placed else bucket)


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
