"""Session state and the store protocol.

A session is what the gateway remembers between turns: the pinned decode node, D's last handle and
the held sequence it covers, when that expires, and how many turns ran. The store is a small async
protocol with two implementations (``kvtether.gateway.stores``): in memory for one process, and Redis or
Valkey shared by gateway workers and replicas. ``take_handle`` is atomic because a handle is single-use
(the first prefill that uses it makes D free the blocks).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass, replace
from typing import Any, Protocol

from kvtether.gateway.guard.verify import HeldSequence
from kvtether.gateway.policy.copies import DecodeCopy, PrefillCopy

# Sessions per page of a scan: one round trip to a shared store reads this many (a few hundred kB of records).
SCAN_PAGE_SIZE = 500


@dataclass(frozen=True, slots=True)
class SessionState:
    session_id: str
    decode: str | None = None  # pinned decode node (aggregated mode: pinned replica)
    handle: dict[str, Any] | None = None  # D's kv_transfer_params from the last finished turn
    held: HeldSequence | None = None  # the tokens that handle covers
    handle_at: float | None = None  # clock time the handle was stored
    expires_at: float = 0.0
    turns: int = 0
    created_at: float = 0.0
    # Message-chain hash of (last prompt + its answer): how a request without a session id finds us.
    prefix_key: str | None = None
    # What the pinned D's prefix cache held after the last turn (prompt + output − 1 tokens), handle or not:
    # an unmarked decode-local turn returns no handle, but its KV stays in D's prefix cache (evictable), and the cost
    # policy weighs the next turn on it. Kept when the handle is taken.
    cached: HeldSequence | None = None
    last_tokens: int | None = None  # prompt + output of the last turn: this turn's suffix is what it adds
    last_prefill: str | None = None  # P of the last P/D turn (its prefix cache may hold the history)
    avg_output_tokens: float | None = None  # running means, for the policy's look-ahead
    avg_suffix_tokens: float | None = None
    # Decode nodes the pin left (rebalancing) and how many leading tokens of ``cached`` each still holds in
    # its prefix cache (evictable): (url, tokens), most recent last. Tokens only, no ids: each is a prefix of
    # the session's history, so its overlap with a new prompt is min(tokens, the prompt's overlap with
    # ``cached``).
    elsewhere: tuple[DecodeCopy, ...] = ()
    # Prefill nodes that prefilled a turn of the session, and how much of its history each likely still
    # holds in its prefix cache (policy/copies.py); prefixes of ``cached`` like ``elsewhere``.
    prefill_copies: tuple[PrefillCopy, ...] = ()
    # The session's rhythm, for retention (policy/retention.py): when its last turn ended, and its mean wait
    # between a turn's end and the next one's start (None until it has come back once).
    last_turn_at: float | None = None
    mean_gap_s: float | None = None
    # What besides the tokens keys the session's blocks on D (policy/retention.block_scope: model and cache
    # salt), as of its last turn: held KV is shared only between handles of one scope.
    cache_scope: str | None = None

    def with_(self, **changes: Any) -> SessionState:
        return replace(self, **changes)


@dataclass(frozen=True, slots=True)
class TakenHandle:
    handle: dict[str, Any]
    held: HeldSequence | None
    handle_at: float


class SessionStore(Protocol):
    @property
    def available(self) -> bool:
        """Whether the store answered its last call (a fail-safe store answers for it, safely, while it is
        away): tells a handle another turn took from one the store could not hand out."""
        ...

    async def get(self, session_id: str) -> SessionState | None: ...

    async def put(self, state: SessionState) -> None: ...

    async def take_handle(self, session_id: str, request_id: str | None = None) -> TakenHandle | None:
        """Remove and return the session's handle, atomically: two concurrent turns never both get it. With
        ``request_id``, only if the handle is still that one (D's ``remote_request_id``): a release decided on
        an earlier read never takes a newer handle the session stored meanwhile."""
        ...

    async def find_by_prefix(self, prefix_key: str) -> str | None: ...

    async def delete(self, session_id: str) -> None: ...

    async def sweep(self) -> int:
        """Drop expired sessions; returns how many."""
        ...

    def scan(self, page_size: int = SCAN_PAGE_SIZE) -> AsyncGenerator[list[SessionState], None]:
        """Every live session, in pages of at most ``page_size``, each at most once, in no particular order; for
        reviews of the whole fleet. Under concurrent writes: every session live from the first page to the last
        is in one of them (as it was when its page was read); one created meanwhile may be, one deleted
        meanwhile may be missing."""
        ...

    async def list(self) -> list[SessionState]:
        """Live sessions for a person to look at: a shared store shows at most its ``list_limit``."""
        ...

    async def count(self) -> int: ...

    # Records: opaque values the gateway keeps beside the sessions, each with its own lifetime (the Responses
    # API's stored responses and conversations). ``key`` is already in the caller's tenant namespace.

    async def put_record(self, key: str, data: bytes, ttl_s: float) -> None: ...

    async def get_record(self, key: str) -> bytes | None: ...

    async def delete_record(self, key: str) -> bool:
        """Whether there was a live record to delete."""
        ...

    async def aclose(self) -> None:
        """Release connections (a shared store); the gateway calls it once, at shutdown."""
        ...
