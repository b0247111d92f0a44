"""The token guard (pure): does the new prompt really extend what the decode node holds?

vLLM's pull is positional and unchecked (protocol §3): attach a handle to a prompt whose tokens
differ and P silently computes with the wrong KV. The gateway keeps D's *held sequence* compactly
(a chain of per-block hashes plus the tokens of the last, partial block) and, before attaching a
handle, measures the verified reuse length against the new prompt's token ids.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_DIGEST = 8


def _block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    # Chained like vLLM's prefix-cache hashes: a block's hash names the whole prefix up to it, so two
    # sequences agree on block i's hash only if they agree on every token before it.
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=_DIGEST).digest()


def block_hashes(tokens: Sequence[int], block_size: int) -> list[bytes]:
    out: list[bytes] = []
    parent = b""
    for start in range(0, len(tokens) - len(tokens) % block_size, block_size):
        parent = _block_hash(parent, tokens[start : start + block_size])
        out.append(parent)
    return out


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
    def from_tokens(cls, tokens: Sequence[int], block_size: int) -> HeldSequence:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        full = len(tokens) - len(tokens) % block_size
        return cls(block_size, tuple(block_hashes(tokens[:full], block_size)), tuple(tokens[full:]))


def verified_reuse(held: HeldSequence, prompt: Sequence[int]) -> int:
    """Length of the longest prefix of ``prompt`` proven equal to the held sequence.

    Within the hashed blocks the answer is block-aligned (a mismatching block proves nothing about
    its first tokens); inside the verbatim tail it is exact. Equal to ``held.num_tokens`` exactly
    when the prompt is an extension of (or equal to) the held sequence.
    """
    bs = held.block_size
    parent = b""
    matched_blocks = 0
    for i, expected in enumerate(held.hashes):
        chunk = prompt[i * bs : (i + 1) * bs]
        if len(chunk) < bs:
            break
        parent = _block_hash(parent, chunk)
        if parent != expected:
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


def handle_groups(handle: Mapping[str, Any]) -> int:
    ids = handle.get("remote_block_ids")
    return len(ids) if isinstance(ids, list) else 0


def truncate_handle(handle: Mapping[str, Any], reuse_tokens: int, block_size: int) -> dict[str, Any]:
    """A copy of ``handle`` that offers only the first ``reuse_tokens`` tokens (protocol §3.2).

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
