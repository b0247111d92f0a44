"""Retention (pure): which handles the decode nodes should stop holding, and why.

Every handle pins blocks on its decode node until a prefill pulls it, the gateway releases it, or the engine's
``decoder_kv_blocks_ttl`` runs out (480 s by default, never renewed). Held blocks count as used KV, the
prefix-cache LRU cannot evict them and vLLM's scheduler preempts running requests rather than touch them
(docs/operations.md, "Decode memory"), so a handle the gateway will not pull is memory D lacks for nothing.

The shell (``gateway/nodes/retention.py``) lists the handles the session store holds, asks :func:`review` which to
release, and carries the releases out off the request path. Releases decided on the request path (a handle
superseded, refused by the guard, left unused, or the session's last) need no review: the shell sends them at
once with their reason. Here: no I/O, no clock read; times are the gateway clock's seconds.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum


class ReleaseReason(StrEnum):
    SUPERSEDED = "superseded"  # a newer handle of the same session replaced it
    REFUSED = "refused"  # the guard found the new prompt does not extend it (enough)
    UNUSED = "unused"  # the plan went cold without it (auto's choice, or a policy that never pulls)
    FINAL = "final"  # the session ended (its last turn, or an explicit end)
    IDLE = "idle"  # the session did not come back within what its own gaps predict
    BUDGET = "budget"  # its decode node held more than its budget
    SHUTDOWN = "shutdown"  # the gateway stopped, and nothing else will use it


RELEASE_REASONS: tuple[str, ...] = tuple(r.value for r in ReleaseReason)


IDLE_MIN_S = 10.0


@dataclass(frozen=True, slots=True)
class RetentionKnobs:
    # A session is idle once it has been away this many times its mean inter-turn gap: agent loops come back
    # after a tool call or a user's reply, and their gaps vary by a few times around their mean.
    idle_gap_factor: float = 4.0
    # Never idle sooner than this (a burst of fast turns gives a tiny mean gap; a tool call may still run).
    idle_min_s: float = IDLE_MIN_S
    # Idle at the latest after this long, and this long for a session with no gap yet (one turn so far).
    idle_max_s: float = 180.0
    # Held KV each decode node may carry, as a share of its KV capacity; above it the least likely to be
    # pulled go first. None: no budget.
    budget_share: float | None = 0.5

    def __post_init__(self) -> None:
        if self.idle_gap_factor <= 0 or self.idle_min_s < 0 or self.idle_max_s < self.idle_min_s:
            raise ValueError("retention: idle_gap_factor must be > 0 and 0 <= idle_min_s <= idle_max_s")
        if self.budget_share is not None and not 0.0 < self.budget_share <= 1.0:
            raise ValueError("retention: budget_share must be in (0, 1]")


@dataclass(frozen=True, slots=True)
class HeldHandle:
    """A handle the session store holds: whose, on which decode node, how much, and the session's rhythm."""

    session_id: str
    node: str
    tokens: int  # the handle's remote_num_tokens
    request_id: str | None  # D's remote_request_id: names the hold (a newer handle of the session has another)
    stored_at: float  # when D returned it
    expires_at: float  # when the gateway stops sending it (handle_at + session TTL, below D's own TTL)
    last_turn_at: float  # when the session's last turn ended
    mean_gap_s: float | None  # the session's mean wait between a turn's end and the next one's start


@dataclass(frozen=True, slots=True)
class Release:
    session_id: str
    node: str
    tokens: int
    request_id: str | None
    reason: ReleaseReason


def held_blocks_tokens(tokens: int, block_size: int) -> int:
    """What a hold of ``tokens`` occupies on D: whole blocks."""
    return math.ceil(tokens / block_size) * block_size if block_size > 0 else tokens


def expected_gap_s(h: HeldHandle, knobs: RetentionKnobs) -> float:
    """How long the session is expected to stay away: idle_max_s until it has shown a gap."""
    return h.mean_gap_s if h.mean_gap_s is not None else knobs.idle_max_s


def idle_at(h: HeldHandle, knobs: RetentionKnobs) -> float:
    """When the session counts as gone: ``idle_gap_factor`` times its mean gap after its last turn, bounded."""
    if h.mean_gap_s is None:
        wait = knobs.idle_max_s
    else:
        wait = min(knobs.idle_max_s, max(knobs.idle_min_s, knobs.idle_gap_factor * h.mean_gap_s))
    return h.last_turn_at + wait


def pull_unlikeliness(h: HeldHandle, now: float, knobs: RetentionKnobs) -> tuple[int, float, int]:
    """Sort key, least likely to be pulled first: a handle that expires before the session's expected return
    first, then by how overdue the session is (away time over its expected gap), then the bigger hold
    (it frees more memory for the same expected loss)."""
    gap = max(expected_gap_s(h, knobs), 1e-3)
    returns_too_late = h.last_turn_at + gap > h.expires_at
    return (0 if returns_too_late else 1, -(now - h.last_turn_at) / gap, -h.tokens)


def held_by_node(handles: Iterable[HeldHandle], block_size: Mapping[str, int] | None = None) -> dict[str, int]:
    """Tokens held per decode node (in whole blocks where the node's block size is known)."""
    out: dict[str, int] = {}
    for h in handles:
        bs = (block_size or {}).get(h.node, 0)
        out[h.node] = out.get(h.node, 0) + held_blocks_tokens(h.tokens, bs)
    return out


def review(handles: Sequence[HeldHandle], capacity: Mapping[str, int | None], now: float, knobs: RetentionKnobs,
           block_size: Mapping[str, int] | None = None) -> list[Release]:
    """The handles to release now: every idle session's, then, per decode node still above its budget
    (``budget_share`` of ``capacity``, its KV in tokens; unknown capacity: no budget), the least likely to be
    pulled until the node is back under it."""
    out: list[Release] = []
    kept: list[HeldHandle] = []
    for h in handles:
        if now >= idle_at(h, knobs):
            out.append(_release(h, ReleaseReason.IDLE))
        else:
            kept.append(h)
    if knobs.budget_share is None:
        return out
    sizes = block_size or {}
    held = held_by_node(kept, sizes)
    for node, total in sorted(held.items()):
        cap = capacity.get(node)
        if not cap:
            continue
        budget = knobs.budget_share * cap
        if total <= budget:
            continue
        for h in sorted((h for h in kept if h.node == node), key=lambda h: pull_unlikeliness(h, now, knobs)):
            if total <= budget:
                break
            out.append(_release(h, ReleaseReason.BUDGET))
            total -= held_blocks_tokens(h.tokens, sizes.get(node, 0))
    return out


def _release(h: HeldHandle, reason: ReleaseReason) -> Release:
    return Release(h.session_id, h.node, h.tokens, h.request_id, reason)
