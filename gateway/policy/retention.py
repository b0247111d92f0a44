"""Retention (pure): which handles the decode nodes should stop holding, and why.

Every handle pins blocks on its decode node until a prefill pulls it, the gateway releases it, or the engine's
``decoder_kv_blocks_ttl`` runs out (480 s by default, never renewed). Held blocks count as used KV, the
prefix-cache LRU cannot evict them and vLLM's scheduler preempts running requests rather than touch them
(docs/operations.md, "Decode memory"), so a handle the gateway will not pull is memory D lacks for nothing.

The shell (``gateway/nodes/retention.py``) lists the handles the session store holds, asks :func:`review` which to
release, and carries the releases out off the request path. Releases decided on the request path (a handle
superseded, refused by the guard, left unused, or the session's last) need no review: the shell sends them at
once with their reason. Here: no I/O, no clock read; times are the gateway clock's seconds.

Held KV is counted by block, each block once. D's prefix cache keys a full block by a hash of every token up to
its end (and the request's ``cache_salt`` and LoRA adapter): two handles on one D whose sequences begin with the
same tokens hold the same physical blocks for that prefix (the later request found them cached and took a
reference), so a system prompt shared by many sessions is held once. The last, partial block is each request's
own. A handle's held sequence (``guard/verify.py``: the block-hash chain of D's token ids and the partial tail)
says which blocks it shares; a handle without one is counted whole.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
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
    # The hashes of its held sequence's full blocks, in order, where D's prefix cache shares blocks (prefix
    # caching on, the hashes made for D's block size); None: counted whole, sharing nothing.
    blocks: Sequence[bytes] | None = None
    # What else keys D's block hashes (:func:`block_scope`): handles of different scopes share no block.
    scope: str = ""


@dataclass(frozen=True, slots=True)
class Release:
    session_id: str
    node: str
    tokens: int
    request_id: str | None
    reason: ReleaseReason


def held_blocks_tokens(tokens: int, block_size: int) -> int:
    """What a hold of ``tokens`` occupies on D on its own: whole blocks."""
    return math.ceil(tokens / block_size) * block_size if block_size > 0 else tokens


def block_scope(model: str, cache_salt: str | None) -> str:
    """Names what besides the tokens keys a request's blocks on vLLM: its ``cache_salt`` (mixed into the first
    block's hash, so every hash of the chain) and its model name (a LoRA adapter's blocks are its own)."""
    key = f"{model}\0{cache_salt or ''}".encode()
    return hashlib.blake2b(key, digest_size=8).hexdigest()


@dataclass(frozen=True, slots=True)
class Footprint:
    """The blocks a handle holds on its D: those it may share with other handles (scope, hash) and how many are
    its own whatever else D holds (its partial last block; all of them when it shares none)."""

    scope: str
    shared: tuple[bytes, ...]
    own: int


def footprint(h: HeldHandle, block_size: int) -> Footprint:
    """``h``'s blocks (a block size below 1 counts tokens, and shares nothing). Only the hashes of blocks the
    handle covers count as shared: a held sequence longer than the handle's tokens lends it no more."""
    if block_size < 1:
        return Footprint(h.scope, (), h.tokens)
    whole = -(-h.tokens // block_size)
    full = tuple(dict.fromkeys(h.blocks[: h.tokens // block_size])) if h.blocks is not None else ()
    return Footprint(h.scope, full, whole - len(full))


class NodeBlocks:
    """The blocks a set of handles holds on one D, each counted once: a reference count per shared block (as
    D's block pool keeps one), plus the blocks that are each handle's own."""

    def __init__(self, block_size: int) -> None:
        self.unit = max(block_size, 1)  # tokens per counted block
        self._refs: dict[str, Counter[bytes]] = {}
        self._distinct = 0
        self._own = 0

    @property
    def blocks(self) -> int:
        return self._distinct + self._own

    @property
    def tokens(self) -> int:
        return self.blocks * self.unit

    def add(self, fp: Footprint) -> None:
        refs = self._refs.setdefault(fp.scope, Counter())
        for b in fp.shared:
            refs[b] += 1
            if refs[b] == 1:
                self._distinct += 1
        self._own += fp.own

    def freed_by(self, fp: Footprint) -> int:
        """Blocks that would go free without ``fp``'s handle: its own, and the shared ones no other holds."""
        refs = self._refs.get(fp.scope)
        return fp.own + (sum(1 for b in fp.shared if refs[b] == 1) if refs is not None else 0)

    def remove(self, fp: Footprint) -> None:
        refs = self._refs[fp.scope]
        for b in fp.shared:
            refs[b] -= 1
            if refs[b] == 0:
                del refs[b]
                self._distinct -= 1
        self._own -= fp.own


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


def _by_node(handles: Iterable[HeldHandle]) -> dict[str, list[HeldHandle]]:
    out: dict[str, list[HeldHandle]] = {}
    for h in handles:
        out.setdefault(h.node, []).append(h)
    return out


def held_by_node(handles: Iterable[HeldHandle], block_size: Mapping[str, int] | None = None) -> dict[str, int]:
    """Tokens held per decode node, in whole blocks where the node's block size is known, each block once: the
    full blocks the handles share (same scope and hash) once, each handle's partial last block on its own, a
    handle without block hashes whole. Never more than the handles' whole sizes added up."""
    out: dict[str, int] = {}
    for node, hs in _by_node(handles).items():
        bs = (block_size or {}).get(node, 0)
        held = NodeBlocks(bs)
        for h in hs:
            held.add(footprint(h, bs))
        out[node] = held.tokens
    return out


def review(handles: Sequence[HeldHandle], capacity: Mapping[str, int | None], now: float, knobs: RetentionKnobs,
           block_size: Mapping[str, int] | None = None) -> list[Release]:
    """The handles to release now: every idle session's, then, per decode node still above its budget
    (``budget_share`` of ``capacity``, its KV in tokens; unknown capacity: no budget; held KV counted as
    :func:`held_by_node` does), the least likely to be pulled among those whose release frees blocks, until the
    node is back under it."""
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
    for node, hs in sorted(_by_node(kept).items()):
        cap = capacity.get(node)
        if cap:
            out.extend(over_budget(hs, knobs.budget_share * cap, sizes.get(node, 0), now, knobs))
    return out


def over_budget(handles: Sequence[HeldHandle], budget: float, block_size: int, now: float,
                knobs: RetentionKnobs) -> list[Release]:
    """The handles of one decode node to release to bring what they hold to ``budget`` tokens or below.

    A release frees only the blocks no kept handle shares, so the next to go is the least likely to be pulled
    among those whose release frees something (a handle whose blocks all other handles hold would cost its
    session its reuse for no memory). When none frees anything alone (every block held twice), the least
    likely goes anyway: that makes its partners' blocks theirs alone. The handles are few per node and nearly
    every one frees its own partial block, so the scan from the front rarely looks past the first."""
    fps = [footprint(h, block_size) for h in handles]
    held = NodeBlocks(block_size)
    for fp in fps:
        held.add(fp)
    out: list[Release] = []
    queue = sorted(range(len(handles)), key=lambda i: pull_unlikeliness(handles[i], now, knobs))
    while held.tokens > budget and queue:
        at = next((at for at, i in enumerate(queue) if held.freed_by(fps[i]) > 0), 0)
        i = queue.pop(at)
        held.remove(fps[i])
        out.append(_release(handles[i], ReleaseReason.BUDGET))
    return out


def _release(h: HeldHandle, reason: ReleaseReason) -> Release:
    return Release(h.session_id, h.node, h.tokens, h.request_id, reason)
