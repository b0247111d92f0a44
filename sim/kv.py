"""Block-based KV cache: block pool, prefix cache with LRU eviction, and holds (leases / retention).

A block records the token ids whose KV it holds (``content``) and the digest of the context it was
computed after (``parent``); the model reads both. The prefix cache is keyed by the *request's* block
hash, which equals the content digest only when the KV really belongs to those tokens: a block filled
from another node's positional read is registered under the request's hash anyway, which is how a
real engine's cache gets polluted by a mismatched pull.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvtether.sim.model import ROOT_DIGEST, chain

GARBAGE_TOKEN = -1  # what a positional read finds past the end of a remote block's content
NULL_BLOCK_ID = 0  # vLLM's null block: never allocated, so real block ids start at 1


@dataclass(eq=False, slots=True)
class Block:
    block_id: int
    content: list[int] = field(default_factory=list)
    parent: bytes = ROOT_DIGEST
    hash: bytes | None = None  # prefix-cache key while registered
    ref_cnt: int = 0
    _digest: bytes | None = None

    def digest(self) -> bytes:
        """Content digest; cached once the block is full (full blocks never change)."""
        if self._digest is not None:
            return self._digest
        return chain(self.parent, self.content)

    @property
    def sealed_digest(self) -> bytes | None:
        """The content digest once sealed (a full block), else None."""
        return self._digest

    def seal(self, digest: bytes | None = None) -> None:
        """Caches the content digest; `digest` when the caller knows it (the block holds exactly the tokens, after
        exactly the parent, its block hash was chained from: then the two are the same digest)."""
        self._digest = digest if digest is not None else chain(self.parent, self.content)

    def reset(self) -> None:
        self.content = []
        self.parent = ROOT_DIGEST
        self.hash = None
        self._digest = None

    @property
    def polluted(self) -> bool:
        """White-box: registered under a hash its content does not match (tests only; meaningless for the
        blocks of a request with a ``cache_salt``, whose hashes are salted on purpose)."""
        return self.hash is not None and self.hash != self.digest()


def salted_root(cache_salt: str | None) -> bytes:
    """The parent of a request's first block hash: vLLM mixes ``cache_salt`` into the first block's hash,
    so salted requests share prefix-cache blocks only with requests of the same salt. Only the hash is
    salted, never the KV content digest (the model's answer does not depend on the salt)."""
    if not cache_salt:
        return ROOT_DIGEST
    return hashlib.blake2b(b"cache_salt\0" + cache_salt.encode(), digest_size=len(ROOT_DIGEST)).digest()


def block_hashes(
    tokens: Sequence[int], block_size: int, start: Sequence[bytes] = (), root: bytes = ROOT_DIGEST
) -> list[bytes]:
    """Chained hashes of the full blocks of `tokens`, continuing `start` (already computed ones)."""
    return extend_block_hashes(list(start), tokens, block_size, root)


def extend_block_hashes(hashes: list[bytes], tokens: Sequence[int], block_size: int,
                        root: bytes = ROOT_DIGEST) -> list[bytes]:
    """`block_hashes(tokens, block_size, hashes, root)`, appended to `hashes` itself (returned)."""
    parent = hashes[-1] if hashes else root
    for i in range(len(hashes), len(tokens) // block_size):
        parent = chain(parent, tokens[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes


class BlockPool:
    """Fixed number of blocks; free list, prefix cache, and LRU order of unreferenced cached blocks.

    Block ids start at 1: vLLM reserves block 0 as its null block (a placeholder never handed to a request),
    so the `remote_block_ids` a gateway sees never contain 0. The null block is kept outside `num_blocks`
    here, so a preset's KV capacity stays the number of usable blocks."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Block objects are created on first use: a big preset has hundreds of thousands of blocks and
        # a node must start in milliseconds.
        self.blocks: list[Block] = []
        self._free: deque[Block] = deque()
        self._cached: dict[bytes, Block] = {}
        self._evictable: OrderedDict[int, Block] = OrderedDict()  # oldest first

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable) + self.num_blocks - len(self.blocks)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def usage(self) -> float:
        return self.num_used / self.num_blocks if self.num_blocks else 0.0

    def allocate(self, n: int) -> list[Block] | None:
        """`n` fresh referenced blocks, evicting least recently used cached ones; None if impossible."""
        if n > self.num_free:
            return None
        out: list[Block] = []
        for _ in range(n):
            if self._free:
                blk = self._free.popleft()
            elif len(self.blocks) < self.num_blocks:
                blk = Block(len(self.blocks) + NULL_BLOCK_ID + 1)
                self.blocks.append(blk)
            else:
                _, blk = self._evictable.popitem(last=False)
                if blk.hash is not None and self._cached.get(blk.hash) is blk:
                    del self._cached[blk.hash]
            blk.reset()
            blk.ref_cnt = 1
            out.append(blk)
        return out

    def lookup(self, hashes: Sequence[bytes]) -> list[Block]:
        """Longest run of cached blocks for these chained hashes (not referenced yet)."""
        hits: list[Block] = []
        for h in hashes:
            blk = self._cached.get(h)
            if blk is None:
                break
            hits.append(blk)
        return hits

    def get(self, block_id: int) -> Block:
        if block_id <= NULL_BLOCK_ID:
            raise IndexError(f"block id {block_id} is not a usable block (ids start at {NULL_BLOCK_ID + 1})")
        return self.blocks[block_id - NULL_BLOCK_ID - 1]

    def touch(self, blocks: Iterable[Block]) -> None:
        for blk in blocks:
            if blk.ref_cnt == 0:
                self._evictable.pop(blk.block_id, None)
            blk.ref_cnt += 1

    def release(self, blocks: Iterable[Block]) -> None:
        # Release in reverse so a request's tail blocks are evicted before its head (as vLLM does).
        for blk in reversed(list(blocks)):
            blk.ref_cnt -= 1
            if blk.ref_cnt > 0:
                continue
            if blk.hash is not None and self._cached.get(blk.hash) is blk:
                self._evictable[blk.block_id] = blk
            else:
                blk.reset()
                self._free.append(blk)

    def register(self, blk: Block, h: bytes, digest: bytes | None = None) -> None:
        """Put a full block in the prefix cache under the request's hash (first writer wins); `digest`: its
        content digest when the caller knows it (:meth:`Block.seal`)."""
        blk.seal(digest)
        if blk.hash is None and h not in self._cached:
            blk.hash = h
            self._cached[h] = blk

    def cached_blocks(self) -> int:
        return len(self._cached)


@dataclass(eq=False, slots=True)
class Hold:
    """Blocks pinned for another node: a prefill lease (for D's read) or a decode retention (handle).

    ``tracked``: whether vLLM's NIXL worker knows the hold. It registers a request only when its
    kv_transfer_params set ``do_remote_decode``, or ``do_remote_prefill`` with bidirectional transfer on
    (``update_state_after_alloc`` → ``_reqs_in_batch``). A decode-local request with non-empty params that
    set neither flag still keeps its blocks and returns a handle, but its deadline is dropped and a
    reader's consume notification is ignored: an untracked hold never expires and is never consumed; only
    a restart of the node frees it. ``expires_at`` is then only the deadline the handle advertises, which a
    prefill still checks before reading."""

    request_id: str
    kind: str  # "lease" | "retained"
    blocks: list[Block]
    num_tokens: int
    expires_at: float  # simulated seconds on the holding node's clock
    tracked: bool = True


class HoldTable:
    """A node's holds by request id. The earliest deadline of the tracked ones is kept, so that the check every
    engine step makes (anything expired?) costs nothing until one is due: a node of a long replay holds thousands
    of handles, and a scan of them all each step was a few percent of the run."""

    def __init__(self) -> None:
        self._holds: dict[str, Hold] = {}
        # At most the earliest deadline of a tracked hold (None: no tracked hold); exact when `_exact`.
        self._earliest: float | None = None
        self._exact = True

    def __len__(self) -> int:
        return len(self._holds)

    def put(self, hold: Hold) -> None:
        old = self._holds.get(hold.request_id)
        self._holds[hold.request_id] = hold
        if old is not None and old.tracked:
            self._exact = False
        if hold.tracked and (self._earliest is None or hold.expires_at < self._earliest):
            self._earliest = hold.expires_at

    def renew(self, hold: Hold, expires_at: float) -> None:
        """Move a hold's deadline later (a heartbeat)."""
        if expires_at > hold.expires_at:
            if hold.tracked and hold.expires_at == self._earliest:
                self._exact = False
            hold.expires_at = expires_at

    def get(self, request_id: str) -> Hold | None:
        return self._holds.get(request_id)

    def take(self, request_id: str) -> Hold | None:
        hold = self._holds.pop(request_id, None)
        if hold is not None and hold.tracked and hold.expires_at == self._earliest:
            self._exact = False
        return hold

    def expired(self, now: float) -> list[Hold]:
        """Take the tracked holds past their deadline (an untracked one has no deadline the worker knows)."""
        if self._earliest is None or now < self._earliest:
            return []
        gone = [h for h in self._holds.values() if h.tracked and h.expires_at <= now]
        for h in gone:
            del self._holds[h.request_id]
        self._rescan()
        return gone

    def next_expiry(self) -> float | None:
        if not self._exact:
            self._rescan()
        return self._earliest

    def _rescan(self) -> None:
        self._earliest = min((h.expires_at for h in self._holds.values() if h.tracked), default=None)
        self._exact = True

    def all(self, kind: str | None = None) -> list[Hold]:
        return [h for h in self._holds.values() if kind is None or h.kind == kind]

    def held_tokens(self, kind: str) -> int:
        return sum(h.num_tokens for h in self._holds.values() if h.kind == kind)
