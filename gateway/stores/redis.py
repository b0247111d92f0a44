"""The session store on Redis or Valkey, shared by gateway workers and replicas.

Keys, all under ``{prefix}:`` so that several deployments can share one server (session ids arrive already
namespaced by tenant, and are opaque here):

- ``{prefix}:s:{session}``: a hash, ``rec`` = the session record (codec.py), ``pk`` = its prefix key;
  expires natively at the session's ``expires_at``.
- ``{prefix}:h:{session}``: the handle record; expires natively when the handle does (``handle_at +
  handle_ttl_s``, the gateway's ``session_ttl_s``, itself below the engine's TTL), so a stale handle is never
  returned. Taken with GETDEL: one atomic server-side operation, so of two replicas racing for one handle
  exactly one gets it.
- ``{prefix}:p:{prefix key}``: the session id a message-chain hash belongs to (anonymous clients).
- ``{prefix}:sessions``: a sorted set of session ids by expiry, so that count, list, scan and sweep never scan
  keys.

Errors propagate: :class:`~kvtether.gateway.stores.failsafe.FailSafeStore` bounds and absorbs them. Needs one
primary (Redis ≥ 6.2 or Valkey, optionally behind Sentinel): the put and delete scripts touch the prefix key
they read from the session's hash, which Redis Cluster does not allow.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

import orjson
import redis.asyncio as aioredis
from kvtether.gateway.clock import DEFAULT_CLOCK, Clock
from kvtether.gateway.stores import codec
from kvtether.gateway.stores.sessions import SCAN_PAGE_SIZE, SessionState, TakenHandle
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

log = logging.getLogger(__name__)

_COUNT_FRESH_S = 1.0  # a count read within this long is reported again without asking the server

# KEYS: session hash, handle key, index. ARGV: record, session ms, prefix key ('' = none), handle record
# ('' = none), handle ms, session id, prefix-key namespace, expiry (wall ms, the index score).
# One script, so that a session's record, handle, prefix key and index entry change together, and the old
# prefix key is dropped only while it still names this session.
_PUT = """
local old = redis.call('HGET', KEYS[1], 'pk')
if old and old ~= ARGV[3] and redis.call('GET', ARGV[7] .. old) == ARGV[6] then
  redis.call('DEL', ARGV[7] .. old)
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'rec', ARGV[1])
if ARGV[3] ~= '' then
  redis.call('HSET', KEYS[1], 'pk', ARGV[3])
  redis.call('SET', ARGV[7] .. ARGV[3], ARGV[6], 'PX', ARGV[2])
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
if ARGV[4] ~= '' then
  redis.call('SET', KEYS[2], ARGV[4], 'PX', ARGV[5])
else
  redis.call('DEL', KEYS[2])
end
redis.call('ZADD', KEYS[3], ARGV[8], ARGV[6])
return redis.call('ZCARD', KEYS[3])
"""

# KEYS: session hash, handle key, index. ARGV: session id, prefix-key namespace.
# KEYS: handle key. ARGV: the handle's request id as its record spells it ('"remote_request_id":"…"').
# A conditional GETDEL: the release of a handle decided on an earlier read takes it only while it is still that
# handle (the record is orjson's compact JSON, so the field appears exactly so).
_TAKE_IF = """
local v = redis.call('GET', KEYS[1])
if v and string.find(v, ARGV[1], 1, true) then
  redis.call('DEL', KEYS[1])
  return v
end
return false
"""

_DELETE = """
local old = redis.call('HGET', KEYS[1], 'pk')
if old and redis.call('GET', ARGV[2] .. old) == ARGV[1] then
  redis.call('DEL', ARGV[2] .. old)
end
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('ZREM', KEYS[3], ARGV[1])
return 1
"""


def connect(url: str, *, timeout_s: float, max_connections: int = 256) -> aioredis.Redis:
    """A client for the store. Never retries: a command whose reply was lost may have run, and running a put
    twice could put back a handle another replica has taken since (a handle used twice). Socket timeouts
    match the store's bound, so a dead connection is dropped from the pool rather than waited on."""
    return aioredis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                   retry=Retry(NoBackoff(), 0), max_connections=max_connections)


class RedisSessionStore:
    """The shared store (module docstring). Calls raise on any fault; wrap it in FailSafeStore."""

    available = True  # a call that got no answer raised instead

    def __init__(self, client: aioredis.Redis, *, key_prefix: str, handle_ttl_s: float,
                 clock: Clock = DEFAULT_CLOCK, wall: Callable[[], float] = time.time,
                 list_limit: int = 1000) -> None:
        self.client = client
        self.prefix = key_prefix
        self.handle_ttl_s = handle_ttl_s
        self.clock = clock
        self.wall = wall
        self.list_limit = list_limit
        self._put = client.register_script(_PUT)
        self._delete = client.register_script(_DELETE)
        self._take_if = client.register_script(_TAKE_IF)
        self._index = f"{key_prefix}:sessions"
        self._prefixes = f"{key_prefix}:p:"
        # The index size the last put saw, and when: the gateway reads the count after every put (its pinned
        # sessions gauge), which then costs no round trip of its own.
        self._count: tuple[int, float] | None = None

    def _session_key(self, session_id: str) -> str:
        return f"{self.prefix}:s:{session_id}"

    def _handle_key(self, session_id: str) -> str:
        return f"{self.prefix}:h:{session_id}"

    def _offset(self) -> float:
        return self.wall() - self.clock()

    async def get(self, session_id: str) -> SessionState | None:
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.hmget(self._session_key(session_id), "rec", "pk")
            pipe.get(self._handle_key(session_id))
            (rec, pk), handle = await pipe.execute()
        return self._decode(session_id, rec, pk, handle)

    def _decode(self, session_id: str, rec: bytes | None, pk: bytes | None,
                handle: bytes | None) -> SessionState | None:
        if rec is None:
            return None
        try:
            return codec.decode_session(session_id, rec, pk.decode() if pk is not None else None, handle,
                                        self._offset())
        except (ValueError, KeyError, TypeError):
            # Written by an incompatible version: the session starts over (cold, never wrong).
            log.warning("session store: an unreadable session record was treated as absent")
            return None

    async def put(self, state: SessionState) -> None:
        now = self.clock()
        offset = self._offset()
        session_ms = max(1, math.ceil((state.expires_at - now) * 1000))
        handle = codec.encode_handle(state, offset, now)
        handle_ms = 0
        if handle is not None:
            at = state.handle_at if state.handle_at is not None else now
            handle_ms = min(session_ms, math.floor((at + self.handle_ttl_s - now) * 1000))
            if handle_ms < 1:
                handle = None  # already past its TTL: never stored, so never returned
        sid = state.session_id
        count = await self._put(keys=[self._session_key(sid), self._handle_key(sid), self._index],
                                args=[codec.encode_session(state, offset), session_ms, state.prefix_key or "",
                                      handle or "", max(1, handle_ms), sid, self._prefixes,
                                      math.ceil((state.expires_at + offset) * 1000)])
        self._count = (int(count), now)

    async def take_handle(self, session_id: str, request_id: str | None = None) -> TakenHandle | None:
        data: bytes | None
        if request_id is None:
            data = await self.client.getdel(self._handle_key(session_id))  # type: ignore[assignment]
        else:
            field = orjson.dumps({"remote_request_id": request_id})[1:-1]
            data = await self._take_if(keys=[self._handle_key(session_id)], args=[field]) or None
        if data is None:
            return None
        try:
            return codec.decode_handle(data, self._offset())
        except (ValueError, KeyError, TypeError):
            log.warning("session store: an unreadable handle record was dropped")
            return None

    async def find_by_prefix(self, prefix_key: str) -> str | None:
        sid: bytes | None = await self.client.get(self._prefixes + prefix_key)  # type: ignore[assignment]
        return sid.decode() if sid is not None else None

    async def delete(self, session_id: str) -> None:
        self._count = None
        await self._delete(keys=[self._session_key(session_id), self._handle_key(session_id), self._index],
                           args=[session_id, self._prefixes])

    async def sweep(self) -> int:
        """Sessions expire by themselves (native TTLs); this only trims the index of their ids."""
        self._count = None
        removed: int = await self.client.zremrangebyscore(self._index, "-inf", math.floor(self.wall() * 1000))
        return removed

    async def count(self) -> int:
        """Sessions in the index (expired ones until the next sweep, as the memory store counts them)."""
        if self._count is not None and self.clock() - self._count[1] < _COUNT_FRESH_S:
            return self._count[0]
        n: int = await self.client.zcard(self._index)
        self._count = (n, self.clock())
        return n

    async def scan(self, page_size: int = SCAN_PAGE_SIZE) -> AsyncGenerator[list[SessionState], None]:
        """Every live session, by ZSCAN of the index, read ``page_size`` at a time.

        Why ZSCAN: every put moves its session later in the index (a new expiry), and sweeps and deletes drop
        entries, so paging by rank (ZRANGE … LIMIT offset) skips a session each time one ranked before the
        page's offset leaves that stretch; paging by score would hold, but needs a (score, id) cursor for the
        many sessions that share a millisecond, which no single command takes. ZSCAN walks the hash table
        behind the set, and Redis guarantees that a full walk returns every element present from its start to
        its end whatever is written meanwhile; it may return one twice (dropped here by id). Its COUNT is a
        hint: a small set (kept as a listpack) comes whole in one reply, whose records are still read a page
        at a time."""
        if page_size < 1:
            raise ValueError("page_size must be >= 1")
        seen: set[str] = set()
        cursor = 0
        while True:
            reply: tuple[int, list[tuple[bytes, float]]] = await self.client.zscan(  # type: ignore[assignment]
                self._index, cursor, count=page_size)
            cursor, entries = reply
            live_from = self._live_from()
            ids: list[str] = []
            for member, score in entries:
                sid = member.decode()
                if score >= live_from and sid not in seen:
                    seen.add(sid)
                    ids.append(sid)
            for start in range(0, len(ids), page_size):
                page = await self._read(ids[start:start + page_size])
                if page:
                    yield page
            if cursor == 0:
                return

    def _live_from(self) -> int:
        """The lowest index score (wall-clock expiry, ms) of a live session."""
        return math.floor(self.wall() * 1000)

    async def _read(self, ids: list[str]) -> list[SessionState]:
        """The sessions of ``ids`` that still exist, in one round trip."""
        if not ids:
            return []
        async with self.client.pipeline(transaction=False) as pipe:
            for sid in ids:
                pipe.hmget(self._session_key(sid), "rec", "pk")
                pipe.get(self._handle_key(sid))
            replies: list[Any] = await pipe.execute()
        out: list[SessionState] = []
        for i, sid in enumerate(ids):
            (rec, pk), handle = replies[2 * i], replies[2 * i + 1]
            state = self._decode(sid, rec, pk, handle)
            if state is not None:
                out.append(state)
        return out

    async def list(self) -> list[SessionState]:
        """Live sessions, soonest to expire first, at most ``list_limit`` of them (an admin view; :meth:`scan`
        reads them all)."""
        raw: list[bytes] = await self.client.zrangebyscore(  # type: ignore[assignment]
            self._index, self._live_from(), "+inf", start=0, num=self.list_limit)
        return await self._read([r.decode() for r in raw])

    def _record_key(self, key: str) -> str:
        return f"{self.prefix}:r:{key}"

    async def put_record(self, key: str, data: bytes, ttl_s: float) -> None:
        await self.client.set(self._record_key(key), data, px=max(1, math.ceil(ttl_s * 1000)))

    async def get_record(self, key: str) -> bytes | None:
        data: bytes | None = await self.client.get(self._record_key(key))  # type: ignore[assignment]
        return data

    async def delete_record(self, key: str) -> bool:
        removed: int = await self.client.delete(self._record_key(key))
        return removed > 0

    async def aclose(self) -> None:
        await self.client.aclose()
