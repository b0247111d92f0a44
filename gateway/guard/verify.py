"""The token guard (pure): does the new prompt really extend what the decode node holds?

vLLM's pull is positional and unchecked (docs/protocol.md §3): attach a handle to a prompt whose tokens
differ and P silently computes with the wrong KV. The gateway keeps D's *held sequence* compactly
(a chain of per-block hashes plus the tokens of the last, partial block) and, before attaching a
handle, measures the verified reuse length against the new prompt's token ids.
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_DIGEST = 8
# Held sequences' own tokens, kept by this process for a while (a bounded LRU, in tokens): checking a prompt
# against them is one comparison instead of a hash per block (~1000 for 16k tokens in 16-token blocks). The
# store keeps only the hashes, so another process (or an evicted entry) falls back to hashing: same answer.
_VERBATIM_TOKENS = 2_000_000
_verbatim: OrderedDict[tuple[int, bytes, tuple[int, ...]], array[int]] = OrderedDict()
_verbatim_size = 0
_verbatim_lock = threading.Lock()


def _chain(tokens: Sequence[int], block_size: int, parent: bytes = b"") -> Iterator[bytes]:
    """The chained hashes of the full blocks of `tokens` (after the block whose hash is `parent`), lazily: each
    is blake2b(previous hash + the block's tokens as int64), chained like vLLM's prefix-cache hashes, so two
    sequences agree on block i's hash only if they agree on every token before it."""
    data = as_tokens(tokens)[: len(tokens) - len(tokens) % block_size].tobytes()
    step = block_size * 8
    blake = hashlib.blake2b
    for start in range(0, len(data), step):
        parent = blake(parent + data[start : start + step], digest_size=_DIGEST).digest()
        yield parent


def block_hashes(tokens: Sequence[int], block_size: int, parent: bytes = b"") -> list[bytes]:
    return list(_chain(tokens, block_size, parent))


def _remember(held: HeldSequence, tokens: Sequence[int]) -> None:
    global _verbatim_size
    if not held.num_tokens or held.num_tokens > _VERBATIM_TOKENS:
        return
    key = held.key
    with _verbatim_lock:
        if key in _verbatim:
            _verbatim.move_to_end(key)
            return
        _verbatim[key] = array("q", tokens)
        _verbatim_size += held.num_tokens
        while _verbatim_size > _VERBATIM_TOKENS:
            _, dropped = _verbatim.popitem(last=False)
            _verbatim_size -= len(dropped)


def _tokens_of(held: HeldSequence) -> array[int] | None:
    with _verbatim_lock:
        return _verbatim.get(held.key)


def _first_difference(a: array[int], b: array[int]) -> int:
    """The first index where two token arrays differ (the shorter one's length when one is a prefix): one
    comparison when they agree, a bisection of slice comparisons when they do not."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n
    while hi - lo > 64:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return next(i for i in range(lo, hi) if a[i] != b[i])


def as_tokens(prompt: Sequence[int]) -> array[int]:
    """A prompt's ids as the int64 array the guard compares and hashes (convert once, check many times)."""
    return prompt if isinstance(prompt, array) and prompt.typecode == "q" else array("q", prompt)


def _known_prefix(prefix: HeldSequence | None, tokens: Sequence[int], block_size: int) -> tuple[bytes, ...]:
    """The hashes of `prefix`'s full blocks that `tokens` begins with, where this process knows its tokens."""
    if prefix is None or prefix.block_size != block_size or not prefix.hashes:
        return ()
    theirs = _tokens_of(prefix)
    if theirs is None:
        return ()
    n = len(prefix.hashes) * block_size
    same = _first_difference(as_tokens(tokens[:n]), theirs[:n])
    return prefix.hashes[: same // block_size]


@dataclass(frozen=True, slots=True)
class HeldSequence:
    """The tokens whose KV D holds for a handle: full blocks as hashes, the partial last block verbatim."""

    block_size: int
    hashes: tuple[bytes, ...]
    tail: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return len(self.hashes) * self.block_size + len(self.tail)

    @classmethod
    def from_tokens(cls, tokens: Sequence[int], block_size: int, prefix: HeldSequence | None = None) -> HeldSequence:
        """The held sequence of `tokens`. `prefix`: a held sequence these tokens may extend (the session's
        previous one); where this process still knows its tokens and they agree, its block hashes are reused."""
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        full = len(tokens) - len(tokens) % block_size
        known = _known_prefix(prefix, tokens, block_size)
        hashes = known + tuple(block_hashes(tokens[len(known) * block_size:full], block_size,
                                            known[-1] if known else b""))
        held = cls(block_size, hashes, tuple(tokens[full:]))
        _remember(held, tokens)
        return held

    @property
    def key(self) -> tuple[int, bytes, tuple[int, ...]]:
        """Names the whole sequence: the last block hash chains every block before it."""
        return self.block_size, self.hashes[-1] if self.hashes else b"", self.tail


def verified_reuse(held: HeldSequence, prompt: Sequence[int]) -> int:
    """Length of the longest prefix of ``prompt`` proven equal to the held sequence.

    Within the hashed blocks the answer is block-aligned (a mismatching block proves nothing about
    its first tokens); inside the verbatim tail it is exact. Equal to ``held.num_tokens`` exactly
    when the prompt is an extension of (or equal to) the held sequence.
    """
    bs = held.block_size
    theirs = _tokens_of(held)
    if theirs is not None:
        # Block-aligned within the hashed blocks, exact in the tail: what hashing would answer.
        same = _first_difference(as_tokens(prompt)[: held.num_tokens], theirs)
        hashed = len(held.hashes) * bs
        return same - same % bs if same < hashed else same
    usable = min(len(held.hashes), len(prompt) // bs)
    matched_blocks = 0
    # Lazily: hashing stops at the first block that differs.
    for ours, expected in zip(_chain(as_tokens(prompt)[: usable * bs], bs), held.hashes, strict=False):
        if ours != expected:
            break
        matched_blocks += 1
    reuse = matched_blocks * bs
    if matched_blocks < len(held.hashes):
        return reuse
    for offset, token in enumerate(held.tail):
        pos = reuse + offset
        if pos >= len(prompt) or prompt[pos] != token:
            return pos
    return held.num_tokens


def is_exact_extension(held: HeldSequence, prompt: Sequence[int]) -> bool:
    return len(prompt) >= held.num_tokens and verified_reuse(held, prompt) == held.num_tokens


def handle_num_tokens(handle: Mapping[str, Any]) -> int | None:
    value = handle.get("remote_num_tokens")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def handle_request_id(handle: Mapping[str, Any] | None) -> str | None:
    """D's ``remote_request_id``: what names the hold a handle stands for."""
    rid = handle.get("remote_request_id") if handle is not None else None
    return rid if isinstance(rid, str) and rid else None


def handle_groups(handle: Mapping[str, Any]) -> int:
    ids = handle.get("remote_block_ids")
    return len(ids) if isinstance(ids, list) else 0


def truncate_handle(handle: Mapping[str, Any], reuse_tokens: int, block_size: int) -> dict[str, Any]:
    """A copy of ``handle`` that offers only the first ``reuse_tokens`` tokens (docs/protocol.md §3.2).

    ``remote_num_tokens = L`` and each group's ``remote_block_ids`` cut to its first
    ``ceil(L / block_size)`` blocks, so P's end-trim of the block list stays aligned with the prompt.
    Only sound for a single full-attention group; the caller (placement) checks that.
    """
    if reuse_tokens < 0:
        raise ValueError("reuse_tokens must be >= 0")
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    keep = -(-reuse_tokens // block_size)
    out = dict(handle)
    out["remote_num_tokens"] = reuse_tokens
    groups = handle.get("remote_block_ids")
    if isinstance(groups, list):
        out["remote_block_ids"] = [list(g[:keep]) if isinstance(g, list) else g for g in groups]
    return out
