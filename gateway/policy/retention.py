"""Retention (pure): which handles the decode nodes should stop holding, and why.

Every handle pins blocks on its decode node until a prefill pulls it, the gateway releases it, or the engine's
``decoder_kv_blocks_ttl`` runs out (480 s by default, never renewed). Held blocks count as used KV, the
prefix-cache LRU cannot evict them and vLLM's scheduler preempts running requests rather than touch them
(docs/protocol.md §5). Yet a held handle costs nothing while nobody wants D's memory, and every handle released
early is a turn that recomputes its history. So a handle is released for memory, never for the clock:

- ``budget``: D's held KV (counted as :func:`held_by_node` does) is above ``budget_share`` of its capacity, the
  high-water mark; the least likely to be pulled go until it is at ``low_water`` of that mark;
- ``pressure``: D's own gauges say its requests want its memory (:func:`memory_wanted`): preempted since the
  previous poll, or waiting while its KV usage (holds included) is at ``pressure_usage`` or above, or waiting for
  capacity with nothing running there, poll after poll; the least likely go until its usage, less what they free, is at
  ``low_water`` of that mark (of its usage when under it: each poll that still shows D short frees more);
- ``expired``: the handle is within ``expiry_lead_s`` of the gateway's handle expiry (``session_ttl_s``, below
  the engine's TTL): the gateway will never send it again, and D would hold it to its own TTL for nothing.

A session that stops without a word keeps its handle until one of these happens; one that signals its end is
released at once by the request path.

The shell (``gateway/nodes/retention.py``) lists the handles the session store holds and what each decode node's
last poll said of its memory, asks :func:`review` which to release, and carries the releases out off the
request path. Releases decided on the request path (a handle superseded, refused by the guard, left unused, or
the session's last) need no review: the shell sends them at once with their reason. Here: no I/O, no clock
read; times are the gateway clock's seconds.

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
    EXPIRED = "expired"  # it reached the gateway's handle expiry: never sent again, D held it for nothing
    BUDGET = "budget"  # its decode node held more than its budget
    PRESSURE = "pressure"  # its decode node's requests wanted the memory (waiting or preempted, KV nearly full)
    SHUTDOWN = "shutdown"  # the gateway stopped, and nothing else will use it


RELEASE_REASONS: tuple[str, ...] = tuple(r.value for r in ReleaseReason)


@dataclass(frozen=True, slots=True)
class RetentionKnobs:
    # The high-water mark of held KV on each decode node, as a share of its KV capacity: above it the least
    # likely to be pulled go. None: no budget.
    budget_share: float | None = 0.5
    # A release pass, once started by a mark, goes on to this share of that mark (hysteresis: the handles that
    # arrive meanwhile do not start a pass per review).
    low_water: float = 0.9
    # D's KV usage (holds included) at or above which requests waiting on D mean its memory is wanted. Below it
    # a waiting request may wait for something else: a sequence slot, the step's token budget, or (where the
    # engine does not tell them apart) a KV read in flight.
    pressure_usage: float = 0.9
    # A handle this close to its expiry is released: the review runs every interval, the store forgets the
    # session at its expiry, so the shell sets this above one review interval.
    expiry_lead_s: float = 2.0
    # What a session that has not come back yet is expected to stay away, for the order of releases only.
    first_gap_s: float = 180.0
    # Polls in a row that must show requests waiting for capacity with nothing running on D before that counts
    # as memory wanted at any usage: one may catch a request that arrived between two engine steps.
    blocked_polls: int = 2

    def __post_init__(self) -> None:
        if self.budget_share is not None and not 0.0 < self.budget_share <= 1.0:
            raise ValueError("retention: budget_share must be in (0, 1]")
        if not 0.0 < self.low_water <= 1.0 or not 0.0 < self.pressure_usage <= 1.0:
            raise ValueError("retention: low_water and pressure_usage must be in (0, 1]")
        if self.expiry_lead_s < 0 or self.first_gap_s <= 0 or self.blocked_polls < 1:
            raise ValueError("retention: expiry_lead_s must be >= 0, first_gap_s > 0 and blocked_polls >= 1")


@dataclass(frozen=True, slots=True)
class DecodeMemory:
    """What the gateway knows of one decode node's memory: its size, and its last poll of ``/metrics``."""

    capacity: int | None = None  # KV tokens (num_gpu_blocks × block_size); None: unknown, nothing to release for
    block_size: int = 0  # tokens per block; below 1: count tokens
    usage: float = 0.0  # vllm:kv_cache_usage_perc, holds included
    # Requests waiting on D, and preemptions (vllm:num_preemptions_total) since the poll before, and how many
    # polls in a row (this one included) showed requests waiting for scheduling capacity with none running
    # there: all from a poll no review has acted on yet (the shell passes 0 for one already seen, so that the
    # releases one poll asked for are not asked again before D shows their effect). Waiting: those waiting for
    # capacity where the engine tells them apart (vLLM's num_requests_waiting_by_reason{reason="capacity"}, not
    # its KV reads in flight, which it counts as waiting too), else all of them; blocked polls: 0 where it does
    # not tell them apart.
    waiting: float = 0.0
    preempted: float = 0.0
    blocked_polls: int = 0


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
        before = len(refs)
        refs.update(fp.shared)  # counted in C: a long history is thousands of blocks, reviewed every interval
        self._distinct += len(refs) - before
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
    """How long the session is expected to stay away: ``first_gap_s`` until it has shown a gap."""
    return h.mean_gap_s if h.mean_gap_s is not None else knobs.first_gap_s


def pull_unlikeliness(h: HeldHandle, now: float, knobs: RetentionKnobs) -> tuple[int, float, int]:
    """Sort key, least likely to be pulled first: a handle that expires before the session's expected return
    first, then by how overdue the session is (away time over its expected gap), then the bigger hold
    (it frees more memory for the same expected loss)."""
    gap = max(expected_gap_s(h, knobs), 1e-3)
    returns_too_late = h.last_turn_at + gap > h.expires_at
    return (0 if returns_too_late else 1, -(now - h.last_turn_at) / gap, -h.tokens)


def expiring(h: HeldHandle, now: float, knobs: RetentionKnobs) -> bool:
    """Whether the gateway is done with ``h`` for good: within ``expiry_lead_s`` of its expiry."""
    return now >= h.expires_at - knobs.expiry_lead_s


def memory_wanted(m: DecodeMemory, knobs: RetentionKnobs) -> bool:
    """Whether D's requests want its memory: vLLM preempted one (it does only when a running request cannot get
    a block), some wait while its KV is nearly full, or some keep waiting for capacity while nothing runs (no
    sequence slot or token budget is taken then: only memory, which holds may fill alone, keeps them out)."""
    if not m.capacity:
        return False
    return (m.preempted > 0 or (m.waiting > 0 and m.usage >= knobs.pressure_usage)
            or m.blocked_polls >= knobs.blocked_polls)


def _by_node(handles: Iterable[HeldHandle]) -> dict[str, list[HeldHandle]]:
    out: dict[str, list[HeldHandle]] = {}
    for h in handles:
        out.setdefault(h.node, []).append(h)
    return out


def held_by_node(handles: Iterable[HeldHandle], block_size: Mapping[str, int] | None = None) -> dict[str, int]:
    """Tokens held per decode node, in whole blocks where the node's block size is known, each block once: the
    full blocks the handles share (same scope and hash) once, each handle's partial last block on its own, a
    handle without block hashes whole. Never more than the handles' whole sizes added up."""
    ledger = HeldLedger()
    ledger.sync(handles, block_size or {})
    return ledger.held_by_node()


HandleKey = tuple[str, str, str | None, int, str, bool]


def handle_key(h: HeldHandle) -> HandleKey:
    """What names one hold and its footprint: a session's next turn brings another request id (another hold)."""
    return (h.session_id, h.node, h.request_id, h.tokens, h.scope, h.blocks is not None)


class HeldLedger:
    """The blocks every held handle holds, per decode node, kept from one review to the next.

    A review sees nearly the same handles as the one before (a few turns ended, a few handles went), but a
    long history is thousands of blocks: counting every handle's blocks anew each interval costs as much as
    the handles hold, every second, for as long as they are held. The ledger counts each handle once, when it
    first appears, and forgets it when it is gone (:meth:`sync`); a node whose block size changed (its first
    poll) is counted anew. No I/O, no clock: plain data the shell keeps between reviews."""

    def __init__(self) -> None:
        self._nodes: dict[str, NodeBlocks] = {}
        self._sizes: dict[str, int] = {}
        self._held: dict[str, dict[HandleKey, Footprint]] = {}

    def sync(self, handles: Iterable[HeldHandle], block_size: Mapping[str, int]) -> None:
        """Make the ledger hold exactly ``handles``, each node counted in its block size (below 1: tokens)."""
        wanted: dict[str, dict[HandleKey, HeldHandle]] = {}
        for h in handles:
            wanted.setdefault(h.node, {})[handle_key(h)] = h
        for node in list(self._nodes):
            if node not in wanted:
                del self._nodes[node], self._sizes[node], self._held[node]
        for node, hs in wanted.items():
            bs = block_size.get(node, 0)
            if self._sizes.get(node) != bs:
                self._nodes[node], self._sizes[node], self._held[node] = NodeBlocks(bs), bs, {}
            blocks, held = self._nodes[node], self._held[node]
            for key in [k for k in held if k not in hs]:
                blocks.remove(held.pop(key))
            for key, h in hs.items():
                if key not in held:
                    held[key] = fp = footprint(h, bs)
                    blocks.add(fp)

    def blocks(self, node: str) -> NodeBlocks:
        """The node's count (an empty one for a node that holds nothing)."""
        return self._nodes.get(node) or NodeBlocks(0)

    def footprint(self, h: HeldHandle) -> Footprint:
        """``h``'s footprint as counted (``h`` must be held: :meth:`sync` saw it)."""
        return self._held[h.node][handle_key(h)]

    def held_by_node(self) -> dict[str, int]:
        return {node: blocks.tokens for node, blocks in self._nodes.items()}


def review(handles: Sequence[HeldHandle], nodes: Mapping[str, DecodeMemory], now: float,
           knobs: RetentionKnobs, ledger: HeldLedger | None = None) -> list[Release]:
    """The handles to release now: those at their expiry, then per decode node whose memory is wanted (held KV
    over its budget, or its requests short of KV: :func:`make_room`) the least likely to be pulled, until it
    is not. A node ``nodes`` does not know is never short of memory.

    ``ledger``: the blocks of exactly ``handles`` (synced by the caller with the block sizes of ``nodes``), so
    that a review need not count them anew; it is left as it was found. None: counted here."""
    if ledger is None:
        ledger = HeldLedger()
        ledger.sync(handles, {node: m.block_size for node, m in nodes.items()})
    out: list[Release] = []
    kept: list[HeldHandle] = []
    expired: list[tuple[NodeBlocks, Footprint]] = []
    for h in handles:
        if expiring(h, now, knobs):
            out.append(_release(h, ReleaseReason.EXPIRED))
            expired.append((ledger.blocks(h.node), ledger.footprint(h)))
        else:
            kept.append(h)
    for blocks, fp in expired:  # the memory left: what the kept handles hold
        blocks.remove(fp)
    try:
        for node, hs in sorted(_by_node(kept).items()):
            memory = nodes.get(node, DecodeMemory())
            out.extend(make_room(hs, memory, now, knobs, ledger.blocks(node), [ledger.footprint(h) for h in hs]))
    finally:
        for blocks, fp in expired:
            blocks.add(fp)
    return out


def make_room(handles: Sequence[HeldHandle], memory: DecodeMemory, now: float, knobs: RetentionKnobs,
              held: NodeBlocks | None = None, fps: Sequence[Footprint] | None = None) -> list[Release]:
    """The handles of one decode node to release so that its memory is no longer wanted; none while it is not.

    Over its budget (held KV above ``budget_share`` of its capacity): released (``budget``) until held KV is at
    ``low_water`` of the budget. Its requests short of KV (:func:`memory_wanted`): released (``pressure``)
    until its usage less what the releases free is at ``low_water`` of ``pressure_usage``, or of its usage if
    lower (a request may need more than what is free under the mark: the next poll that shows it still short
    frees as much again). Both in one order.

    A release frees only the blocks no kept handle shares, so the next to go is the least likely to be pulled
    among those whose release frees something (a handle whose blocks all other handles hold would cost its
    session its reuse for no memory). When none frees anything alone (every block held twice), the least
    likely goes anyway: that makes its partners' blocks theirs alone. The handles are few per node and nearly
    every one frees its own partial block, so the scan from the front rarely looks past the first.

    ``held`` and ``fps``: the count of exactly ``handles`` in the node's block size and their footprints, in
    order (counted here when None); ``held`` is left as it was found."""
    capacity = memory.capacity
    if not capacity:
        return []
    if held is None or fps is None:
        fps = [footprint(h, memory.block_size) for h in handles]
        held = NodeBlocks(memory.block_size)
        for fp in fps:
            held.add(fp)
    high = knobs.budget_share * capacity if knobs.budget_share is not None else math.inf
    wanted = memory_wanted(memory, knobs)
    if held.tokens <= high and not wanted:
        return []  # the usual case: nothing to release, and no need to order the handles
    budget_target = knobs.low_water * high if held.tokens > high else math.inf
    usage_target = knobs.low_water * min(memory.usage, knobs.pressure_usage) if wanted else math.inf
    usage = memory.usage
    out: list[Release] = []
    taken: list[Footprint] = []
    queue = sorted(range(len(handles)), key=lambda i: pull_unlikeliness(handles[i], now, knobs))
    try:
        while queue:
            over_budget = held.tokens > budget_target
            if not over_budget and usage <= usage_target:
                break
            at = next((at for at, i in enumerate(queue) if held.freed_by(fps[i]) > 0), 0)
            i = queue.pop(at)
            usage -= held.freed_by(fps[i]) * held.unit / capacity
            held.remove(fps[i])
            taken.append(fps[i])
            out.append(_release(handles[i], ReleaseReason.BUDGET if over_budget else ReleaseReason.PRESSURE))
    finally:
        for fp in taken:
            held.add(fp)
    return out


def _release(h: HeldHandle, reason: ReleaseReason) -> Release:
    return Release(h.session_id, h.node, h.tokens, h.request_id, reason)
