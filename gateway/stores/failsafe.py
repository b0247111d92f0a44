"""A shared store that can fail without failing a turn.

Every call is bounded by ``timeout_s``; an error or a timeout is counted and answered with the safe value:
no handle (the turn goes cold: a handle whose take may not have happened, or happened unseen, is never used,
so none is used twice), no session found by prefix, a dropped put. A stored record (the Responses API's
state) has no safe stand-in: reading one raises :class:`StoreUnavailable`, which its caller answers with a
503; nor has a scan of every session (the retention review's), which raises it too, and the review skips a
round. ``get`` answers a session *pinned by hash*: its decode node chosen by rendezvous hashing of the session
id over the nodes that take sessions (in service and neither joining nor draining, discovered ones included), so
every replica that sees the same nodes sends the session's turns to the same node while the store is away, and
that node's prefix cache keeps serving its history; a node leaving moves only its own sessions. Nothing else
raises into the request path.

After a failure the store is not asked again for a short, growing pause (``cooldown_s`` doubling up to
``max_cooldown_s``): a store that hangs costs one timeout per pause, not one per call. The first call after the
pause probes it; the client reconnects by itself when the server is back.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, NoReturn, TypeVar

import anyio
from kvtether.gateway.clock import DEFAULT_CLOCK, Clock
from kvtether.gateway.stores.sessions import SCAN_PAGE_SIZE, SessionState, SessionStore, TakenHandle

if TYPE_CHECKING:
    from kvtether.gateway.telemetry import Metrics

log = logging.getLogger(__name__)

R = TypeVar("R")


def _none() -> None:
    return None


class StoreUnavailable(Exception):
    """A call whose answer has no safe stand-in (a stored record, a scan's page) found the store away."""


def _unavailable() -> NoReturn:
    raise StoreUnavailable("the session store does not answer")


def pin_by_hash(session_id: str, nodes: Sequence[str]) -> str | None:
    """The node rendezvous hashing gives the session: the same on every replica, and a lost node moves only
    its own sessions."""
    if not nodes:
        return None
    return max(nodes, key=lambda n: hashlib.blake2b(f"{n}\0{session_id}".encode(), digest_size=8).digest())


class FailSafeStore:
    """Wraps a shared store: every call bounded, counted, and answered safely when the store fails."""

    def __init__(self, inner: SessionStore, *, timeout_s: float, metrics: Metrics | None = None,
                 pins: Sequence[str] | Callable[[], Sequence[str]] = (), clock: Clock = DEFAULT_CLOCK,
                 cooldown_s: float = 0.1, max_cooldown_s: float = 2.0) -> None:
        self.inner = inner
        self.timeout_s = timeout_s
        self.metrics = metrics
        # The nodes a session is pinned among by hash while the store is down: a fixed list, or (the gateway's)
        # the nodes that take sessions now, so that discovered nodes count and drained or failed ones do not.
        self.pins: Callable[[], Sequence[str]]
        if callable(pins):
            self.pins = pins
        else:
            fixed = tuple(pins)
            self.pins = lambda: fixed
        self.clock = clock
        self.cooldown_s = cooldown_s
        self.max_cooldown_s = max_cooldown_s
        self.failures = 0  # consecutive failed calls (0: the store answers)
        self._missed = 0  # calls answered with the fallback since the store last answered
        self._paused_until = 0.0
        self._last_count = 0

    @property
    def available(self) -> bool:
        return self.failures == 0

    async def _call(self, operation: str, call: Callable[[], Awaitable[R]], fallback: Callable[[], R]) -> R:
        if self.failures and self.clock() < self._paused_until:
            self._count_failure(operation, "skipped")
            return fallback()
        t0 = self.clock()
        try:
            with anyio.fail_after(self.timeout_s):
                result = await call()
        except TimeoutError:
            self._failed(operation, "timeout", f"no answer within {self.timeout_s} s")
            return fallback()
        except Exception as exc:  # any store fault: connection, protocol, server error
            self._failed(operation, "error", f"{type(exc).__name__}: {exc}")
            return fallback()
        if self.metrics is not None:
            self.metrics.store_seconds.labels(operation).observe(self.clock() - t0)
        if self.failures:
            log.warning("session store answers again (%d calls ran without it)", self._missed)
            self.failures = self._missed = 0
        return result

    def _failed(self, operation: str, reason: str, why: str) -> None:
        self.failures += 1
        pause = min(self.max_cooldown_s, self.cooldown_s * 2 ** min(self.failures - 1, 16))
        self._paused_until = self.clock() + pause
        self._count_failure(operation, reason)
        if self.failures == 1:
            log.warning("session store %s failed (%s): turns run cold until it answers", operation, why)

    def _count_failure(self, operation: str, reason: str) -> None:
        self._missed += 1
        if self.metrics is not None:
            self.metrics.store_failures.labels(operation, reason).inc()

    def _pinned(self, session_id: str) -> SessionState:
        now = self.clock()
        return SessionState(session_id, decode=pin_by_hash(session_id, self.pins()), expires_at=now, created_at=now)

    async def get(self, session_id: str) -> SessionState | None:
        return await self._call("get", lambda: self.inner.get(session_id), lambda: self._pinned(session_id))

    async def put(self, state: SessionState) -> None:
        await self._call("put", lambda: self.inner.put(state), _none)

    async def take_handle(self, session_id: str, request_id: str | None = None) -> TakenHandle | None:
        return await self._call("take_handle", lambda: self.inner.take_handle(session_id, request_id), _none)

    async def find_by_prefix(self, prefix_key: str) -> str | None:
        return await self._call("find_by_prefix", lambda: self.inner.find_by_prefix(prefix_key), _none)

    async def delete(self, session_id: str) -> None:
        await self._call("delete", lambda: self.inner.delete(session_id), _none)

    async def sweep(self) -> int:
        return await self._call("sweep", self.inner.sweep, lambda: 0)

    async def scan(self, page_size: int = SCAN_PAGE_SIZE) -> AsyncGenerator[list[SessionState], None]:
        """The inner store's pages, each read bounded like any call. A page the store does not answer raises
        :class:`StoreUnavailable`: part of the fleet has no safe stand-in (a review of it would count too
        little held KV)."""
        pages = self.inner.scan(page_size)
        try:
            while True:
                page = await self._call("scan", lambda: anext(pages, None), _unavailable)
                if page is None:
                    return
                yield page
        finally:
            await pages.aclose()

    async def list(self) -> list[SessionState]:
        return await self._call("list", self.inner.list, lambda: [])

    async def count(self) -> int:
        # On a failure the last count stands (the pinned-sessions gauge should not drop to 0 in an outage).
        self._last_count = await self._call("count", self.inner.count, lambda: self._last_count)
        return self._last_count

    async def put_record(self, key: str, data: bytes, ttl_s: float) -> None:
        await self._call("put_record", lambda: self.inner.put_record(key, data, ttl_s), _none)

    async def get_record(self, key: str) -> bytes | None:
        # No safe value stands in for a stored record: the caller answers 503, not "not found".
        return await self._call("get_record", lambda: self.inner.get_record(key), _unavailable)

    async def delete_record(self, key: str) -> bool:
        return await self._call("delete_record", lambda: self.inner.delete_record(key), _unavailable)

    async def aclose(self) -> None:
        try:
            with anyio.fail_after(max(1.0, self.timeout_s)):
                await self.inner.aclose()
        except Exception as exc:
            log.debug("closing the session store: %s", exc)
