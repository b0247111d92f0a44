"""Placement (pure): facts about a turn, its session and the cluster in; a plan with its reason out.

No I/O and no clock here: the shell gathers the facts (session state, verified reuse length from the
guard, the load view) and executes the plan. The plan's ``reason`` is logged and put on spans, so
every choice can be explained after the fact.

Seam for the cost-based "auto" policy of a later issue: ``_choose_reuse`` is where a cost model will
weigh "run the suffix on the pinned decode node" (``HandleAction.DECODE_LOCAL``) against "prefill +
pull from decode" and "cold prefill"; today "auto" behaves as "pull".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum


class HandleAction(StrEnum):
    ATTACH = "attach"  # send D's handle unchanged: P pulls everything D holds
    TRUNCATE = "truncate"  # send the handle cut to the verified prefix (protocol §3.2)
    NONE = "none"  # cold prefill (P's own prefix cache still applies)
    DECODE_LOCAL = "decode_local"  # seam: run the turn on the pinned D directly (not chosen yet)


class HandleState(StrEnum):
    PRESENT = "present"
    MISSING = "missing"  # no handle: first turn, an older engine without stream handles, a failed turn
    EXPIRED = "expired"  # older than the gateway TTL: D may have freed it


@dataclass(frozen=True, slots=True)
class NodeLoad:
    url: str
    healthy: bool = True
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0  # 0..1
    bidirectional: bool = True  # prefill only: may receive a handle

    @property
    def score(self) -> tuple[float, float]:
        # Queued work first (it is what delays a new request), KV pressure breaks ties.
        return (self.running + 2.0 * self.waiting, self.kv_usage)


@dataclass(frozen=True, slots=True)
class ClusterView:
    prefill: tuple[NodeLoad, ...] = ()
    decode: tuple[NodeLoad, ...] = ()


@dataclass(frozen=True, slots=True)
class Turn:
    policy: str  # effective policy: "pull" | "no-pull" | "reference"
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


@dataclass(frozen=True, slots=True)
class Plan:
    prefill: str | None
    decode: str
    action: HandleAction
    reuse_tokens: int
    reason: str
    handle_outcome: str | None = None  # attached | truncated | refused_by_guard | expired | missing
    re_placed: bool = False


class NoCapacity(Exception):
    """No healthy node for a role."""

    def __init__(self, role: str) -> None:
        super().__init__(f"no healthy {role} node")
        self.role = role


def least_loaded(nodes: Sequence[NodeLoad], *, exclude: frozenset[str] = frozenset()) -> NodeLoad | None:
    candidates = [n for n in nodes if n.healthy and n.url not in exclude]
    if not candidates:
        return None
    return min(candidates, key=lambda n: (n.score, n.url))


def _healthy(nodes: Sequence[NodeLoad], exclude: frozenset[str]) -> list[NodeLoad]:
    return [n for n in nodes if n.healthy and n.url not in exclude]


def plan(turn: Turn, cluster: ClusterView) -> Plan:
    if turn.policy == "reference":
        return _plan_reference(turn, cluster)
    decode, re_placed, d_reason = _choose_decode(turn, cluster)
    if turn.policy == "no-pull":
        p = least_loaded(cluster.prefill, exclude=turn.exclude)
        if p is None:
            raise NoCapacity("prefill")
        return Plan(p.url, decode, HandleAction.NONE, 0, f"{d_reason}; policy no-pull: cold prefill", None, re_placed)
    return _choose_reuse(turn, cluster, decode, re_placed, d_reason)


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


def _choose_reuse(turn: Turn, cluster: ClusterView, decode: str, re_placed: bool, d_reason: str) -> Plan:
    any_p = least_loaded(cluster.prefill, exclude=turn.exclude)
    if any_p is None:
        raise NoCapacity("prefill")

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
    bidi_p = least_loaded([n for n in cluster.prefill if n.bidirectional], exclude=turn.exclude)
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


def _plan_reference(turn: Turn, cluster: ClusterView) -> Plan:
    """vLLM's reference multi-turn proxy: round-robin P and D, the conversation's handle sent blindly."""
    ps, ds = _healthy(cluster.prefill, turn.exclude), _healthy(cluster.decode, turn.exclude)
    if not ps:
        raise NoCapacity("prefill")
    if not ds:
        raise NoCapacity("decode")
    p, d = ps[turn.round_robin % len(ps)], ds[turn.round_robin % len(ds)]
    if turn.handle is HandleState.PRESENT and p.bidirectional:
        return Plan(p.url, d.url, HandleAction.ATTACH, turn.handle_tokens or 0,
                    "reference policy: round-robin, conversation handle attached unchecked", "attached")
    outcome = None if turn.new_session else turn.handle.value
    return Plan(p.url, d.url, HandleAction.NONE, 0, "reference policy: round-robin, no handle", outcome)


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
