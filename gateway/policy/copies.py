"""What other nodes' prefix caches still hold of a session (pure): the shell's estimate for the cost policy.

Two kinds of copy, one rule: each is a prefix of the session's history, so its overlap with a new prompt is
min(its tokens, the prompt's verified overlap with the history) (:func:`cut`).

- :class:`DecodeCopy`: a decode node the session's pin left (rebalancing) still caches the history it
  decoded; moving the pin back there ships only the rest.
- :class:`PrefillCopy`: a prefill node that prefilled a turn of the session (below).

A P with prefix caching on keeps the blocks of every prompt it prefilled — the ones it computed and the ones
it read from D in a pull — after the request ends, until newer blocks evict them (vLLM frees a request's
blocks into an LRU queue, tail blocks first, and only reallocates a cached block when no uncached one is
left). The next pull on that P then reads only what its cache lacks (vLLM: ``count = min(remote_num_tokens,
prompt) − locally cached``), and a cold prefill there computes only the rest. Sending a session's P/D turns
back to the P that holds its history is the whole point; this module tells the policy how much each P
likely still holds.

Per session, one :class:`PrefillCopy` per P: how many leading tokens of the session's history it cached
and the P's write counter at that moment. Each copy is a prefix of the history as of its turn; cutting it
to every later prompt's verified overlap with the history keeps it a prefix of the current one. Tokens
only, no ids, no hashes: a wrong estimate costs a worse choice, never a wrong answer (vLLM's prefix cache
matches by content hash).

Eviction: a P's cache holds ``capacity`` tokens; the gateway counts the tokens of new KV each P took in
since (computed plus read, i.e. prompt − its own cache hit: :func:`new_kv_tokens`). Blocks written after
this session's are newer, so they are evicted after it; the session's blocks go once the writes since
exceed the room the rest of the cache had, tail first (vLLM frees a request's blocks tail first, so a prefix
outlives its end). The estimate ignores other traffic on the P the gateway does not see, and blocks
touched by hits since (which only make others newer): it leans towards "still cached" when P is shared.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple, TypeVar

MAX_COPIES = 8  # prefill nodes a session remembers (more hold too little of it to matter by then)
MAX_DECODE_COPIES = 8  # decode nodes a session remembers having left (a cluster rarely has more worth going back to)


class DecodeCopy(NamedTuple):
    url: str
    tokens: int  # leading tokens of the session's history in this D's prefix cache (evictable)


class PrefillCopy(NamedTuple):
    url: str
    tokens: int  # leading tokens of the session's history in this P's prefix cache (block-aligned)
    written_at: int  # the P's count of new KV tokens once these were in its cache


AnyCopy = TypeVar("AnyCopy", DecodeCopy, PrefillCopy)


def cached_tokens(prompt_tokens: int, block_size: int) -> int:
    """What a P caches of a prompt it prefilled: its full blocks (a partial last block is not hashed)."""
    return (max(0, prompt_tokens) // max(1, block_size)) * max(1, block_size)


def new_kv_tokens(prompt_tokens: int, local_hit_tokens: int) -> int:
    """The blocks a prefill takes in on P (what may evict older ones): everything but its own cache hit."""
    return max(0, prompt_tokens - max(0, local_hit_tokens))


def surviving(copy: PrefillCopy, written_now: int, capacity_tokens: int | None, kv_usage: float = 0.0) -> int:
    """How many of `copy`'s tokens are likely still in its P's cache.

    `capacity_tokens` None (unknown): all of them. `kv_usage` is P's share of blocks held by requests in
    flight, which are not evictable, so the room older blocks had is what the rest leaves.
    """
    if copy.tokens <= 0:
        return 0
    if capacity_tokens is None or capacity_tokens <= 0:
        return copy.tokens
    usage = min(1.0, max(0.0, kv_usage)) if math.isfinite(kv_usage) else 1.0
    room = int(capacity_tokens * (1.0 - usage)) - max(0, written_now - copy.written_at)
    return max(0, min(copy.tokens, room))


def cut(copies: Iterable[AnyCopy], overlap: int, *, drop: str | None = None) -> tuple[AnyCopy, ...]:
    """The copies as prefixes of a prompt that shares `overlap` leading tokens with the session's history;
    `drop`: the node this turn runs on (its copy is replaced by the turn's own)."""
    return tuple(c._replace(tokens=min(c.tokens, overlap))
                 for c in copies if c.url != drop and min(c.tokens, overlap) > 0)


def after_prefill(copies: Iterable[PrefillCopy], overlap: int, url: str, prompt_tokens: int, block_size: int,
                  written_now: int) -> tuple[PrefillCopy, ...]:
    """The session's copies once P `url` prefilled this turn's prompt (`overlap`: the prompt's verified
    overlap with the previous history): the others cut to it, `url`'s the prompt's full blocks."""
    kept = cut(copies, overlap, drop=url)
    mine = PrefillCopy(url, cached_tokens(prompt_tokens, block_size), written_now)
    return (*kept, mine)[-MAX_COPIES:] if mine.tokens > 0 else kept[-MAX_COPIES:]
