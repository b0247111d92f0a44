"""HTTP/1.1 to the vLLM nodes for a turn's completion legs (prefill, decode, aggregated replica).

Why not httpx here (it still serves ``/tokenize``, ``/metrics`` and the health probes): a streamed answer is one
HTTP chunk per token, and httpx hands each chunk up through several async layers (h11 event, httpcore stream,
httpx iterators) before the relay sees it — measured, most of the gateway's CPU per streamed token
(benchmarks/gateway_overhead.py). This client reads the socket in whatever the network delivered, de-chunks
it in one pass with httptools (llhttp, the C parser uvicorn already uses), and hands the relay one piece per
read: at low load that is one token, the moment it arrives; under load, every token that queued up meanwhile,
forwarded in one write.

It speaks what the legs need and no more: a POST (or GET) with a body, keep-alive connections per node (idle ones
expire after ``keepalive_expiry_s``, before the server's own idle timeout), a bound on open connections with a
wait for one (``pool_timeout_s``), connect / write / read timeouts, and TLS for ``https`` nodes. Failures are
raised as httpx's exception types (``ConnectError`` when nothing listens, ``ConnectTimeout``, ``ReadTimeout``,
``RemoteProtocolError``, ...), so a leg treats both clients' failures alike. A response that is not read to
its end, or a request abandoned (timeout, the client left), closes its connection: only a connection whose
answer ended cleanly goes back to the pool.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, cast

import anyio
import anyio.lowlevel
import httptools
import httpx
import orjson
from kvtether.gateway.clock import DEFAULT_CLOCK, Clock

# A stream's body is buffered up to this much before the socket stops being read (flow control: a client that
# reads slowly holds the node's writes back instead of the gateway's memory growing).
_HIGH_WATER = 1 << 20


@dataclass(frozen=True)
class UpstreamLimits:
    connect_timeout_s: float = 5.0
    write_timeout_s: float = 30.0
    pool_timeout_s: float = 30.0
    max_connections: int = 2048  # GatewayConfig's default too
    max_keepalive_connections: int = 64  # GatewayConfig's default too
    keepalive_expiry_s: float = 2.0


@dataclass(frozen=True)
class _Origin:
    scheme: str
    host: str
    port: int
    host_header: bytes  # host[:port] as the request's Host header says it

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.scheme, self.host, self.port)


@lru_cache(maxsize=1024)
def _split(url: str) -> tuple[_Origin, bytes]:
    """A node URL's origin and request target (path and query), parsed once per URL."""
    u = httpx.URL(url)
    if u.scheme not in ("http", "https"):
        raise httpx.UnsupportedProtocol(f"unsupported scheme {u.scheme!r} in {url}")
    port = u.port or (443 if u.scheme == "https" else 80)
    host = u.host
    shown = f"[{host}]" if ":" in host else host
    host_header = shown if u.port is None else f"{shown}:{u.port}"
    return _Origin(u.scheme, host, port, host_header.encode("ascii")), u.raw_path


def _header_lines(headers: Mapping[str, str]) -> bytes:
    out = []
    for name, value in headers.items():
        if any(c in name or c in value for c in "\r\n\0"):
            raise httpx.LocalProtocolError(f"illegal character in header {name!r}")
        out.append(f"{name}: {value}\r\n")
    return "".join(out).encode("latin-1")


async def _bounded(fut: asyncio.Future[None], bound_s: float | None, error: Callable[[], Exception]) -> None:
    """Awaits `fut`, failing it with `error()` after `bound_s`. A timer on the future rather than a cancel scope:
    these waits happen once per streamed piece, and the future failing is all a timeout needs to do."""
    if bound_s is None:
        await fut
        return
    timer = asyncio.get_running_loop().call_later(bound_s, _expire, fut, error)
    try:
        await fut
    finally:
        timer.cancel()


def _expire(fut: asyncio.Future[None], error: Callable[[], Exception]) -> None:
    if not fut.done():
        fut.set_exception(error())


class _Connection(asyncio.Protocol):
    """One keep-alive connection; its current response is parsed as bytes arrive."""

    def __init__(self, origin: _Origin) -> None:
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self.used = False  # served a request before: the server may have closed it meanwhile
        self._writable = True
        self._drained: asyncio.Future[None] | None = None
        self._reset()

    def _reset(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.header_list: list[tuple[bytes, bytes]] = []
        self.headers_done = False
        self.complete = False
        self.keep_alive = False
        self.got_bytes = False
        self.body: list[bytes] = []
        self.buffered = 0
        self.error: Exception | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.reading_paused = False

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        if self.complete:  # bytes after a complete answer (or while idle): not a connection to reuse
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(httpx.RemoteProtocolError(f"malformed HTTP response: {exc}"))
            return
        if self.buffered > _HIGH_WATER and not self.reading_paused and self.transport is not None:
            self.reading_paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        return False  # close the transport: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.headers_done and not self.complete and self._until_close():
            self.complete = True  # a body delimited by the end of the connection
        elif not self.complete and self.error is None:
            why = f": {exc}" if exc else ""
            self.error = httpx.RemoteProtocolError(f"server disconnected before the answer was complete{why}") \
                if self.got_bytes else httpx.ReadError(f"server closed the connection without answering{why}")
        self._wake()
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def pause_writing(self) -> None:
        self._writable = False

    def resume_writing(self) -> None:
        self._writable = True
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.header_list.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        self.buffered += len(body)

    def on_message_complete(self) -> None:
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()

    # for the client
    def _until_close(self) -> bool:
        names = {n for n, _ in self.header_list}
        return b"content-length" not in names and b"transfer-encoding" not in names

    def _fail(self, error: Exception) -> None:
        self.error = error
        self.close()
        self._wake()

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def send(self, head: bytes, body: bytes) -> None:
        assert self.transport is not None
        self._reset()
        if self.closed or self.transport.is_closing():  # a write there would vanish, and no answer ever come
            raise httpx.WriteError("connection closed before the request was sent")
        self.transport.write(head + body if len(body) < 65536 else head)
        if len(body) >= 65536:
            self.transport.write(body)

    async def drain(self, bound_s: float) -> None:
        if self._writable or self.closed:
            return
        self._drained = asyncio.get_running_loop().create_future()
        try:
            await _bounded(self._drained, bound_s, lambda: httpx.WriteTimeout(f"request body not sent within "
                                                                             f"{bound_s:g} s"))
        finally:
            self._drained = None

    async def wait(self, bound_s: float | None) -> None:
        """Until more of the answer (or its end, or an error) is here."""
        self.waiter = asyncio.get_running_loop().create_future()
        try:
            await _bounded(self.waiter, bound_s, lambda: httpx.ReadTimeout(f"no answer within {bound_s:g} s"))
        finally:
            self.waiter = None

    def take_body(self) -> bytes:
        """What arrived of the body since the last call, in one piece."""
        body = self.body
        piece = body[0] if len(body) == 1 else b"".join(body)
        self.body = []
        self.buffered = 0
        if self.reading_paused and self.transport is not None:
            self.reading_paused = False
            self.transport.resume_reading()
        return piece


class UpstreamResponse:
    """An answer whose head has arrived; its body is read with :meth:`pieces` or :meth:`read`, and it must be
    closed (:meth:`aclose`, idempotent) to give its connection back."""

    def __init__(self, pool: Upstream, conn: _Connection, read_timeout: float | None) -> None:
        self._pool, self._conn, self._read_timeout = pool, conn, read_timeout
        self.status_code = conn.status
        self.headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in conn.header_list}
        self._closed = False
        self.content = b""

    async def pieces(self) -> AsyncIterator[bytes]:
        """The body as it arrives, one piece per network read (chunked encoding removed)."""
        conn = self._conn
        while True:
            if conn.body:
                yield conn.take_body()
                continue
            if conn.complete:
                return
            if conn.error is not None:
                raise conn.error
            await conn.wait(self._read_timeout)

    async def read(self) -> bytes:
        try:
            self.content = b"".join([piece async for piece in self.pieces()])
        finally:
            await self.aclose()
        return self.content

    def json(self) -> Any:
        return orjson.loads(self.content)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool._release(self._conn)


class Upstream:
    """Keep-alive connections to the nodes, at most ``max_connections`` open at once."""

    def __init__(self, limits: UpstreamLimits | None = None, clock: Clock = DEFAULT_CLOCK,
                 on_wait: Callable[[float], None] | None = None) -> None:
        self.limits = limits or UpstreamLimits()
        self.clock = clock  # the gateway's (clock.py): idle connections' expiry, and the waits for a slot
        # Told the seconds a request waited because every slot was taken (whether it then got one or gave up):
        # the wait happens before any node sees the request, so only the gateway can count it.
        self.on_wait = on_wait
        self._idle: dict[tuple[str, str, int], deque[_Connection]] = {}
        self._idle_count = 0
        self._free = self.limits.max_connections  # connection slots not taken
        self._queue: deque[asyncio.Future[None]] = deque()  # requests waiting for a slot
        self.busy = 0  # connections carrying a request now
        self._ssl: ssl.SSLContext | None = None

    async def send(self, method: str, url: str, body: bytes = b"", headers: Mapping[str, str] | None = None, *,
                   read_timeout: float | None = None) -> UpstreamResponse:
        """Sends a request and waits for the answer's head (status and headers). `read_timeout` bounds each wait
        for bytes from the node (None: no bound, a long prefill sends nothing until it is done)."""
        origin, target = _split(url)
        head = b"%s %s HTTP/1.1\r\nhost: %s\r\ncontent-length: %d\r\n%s\r\n" % (
            method.encode("ascii"), target, origin.host_header, len(body), _header_lines(headers or {}))
        await self._acquire()
        try:
            return await self._exchange(origin, head, body, read_timeout)
        except BaseException:
            self._give_slot()
            raise

    async def _acquire(self) -> None:
        """A slot among ``max_connections``, waiting up to ``pool_timeout_s`` for one (first come first served)."""
        if self._free > 0 and not self._queue:
            self._free -= 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append(fut)
        bound = self.limits.pool_timeout_s
        t0 = self.clock()
        try:
            await _bounded(fut, bound, lambda: httpx.PoolTimeout(f"no connection free within {bound:g} s"))
        except BaseException:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._give_slot()  # handed a slot as it gave up: pass it on
            elif fut in self._queue:
                self._queue.remove(fut)
            raise
        finally:
            if self.on_wait is not None:
                self.on_wait(self.clock() - t0)

    def _give_slot(self) -> None:
        while self._queue:
            fut = self._queue.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self._free += 1

    async def _exchange(self, origin: _Origin, head: bytes, body: bytes,
                        read_timeout: float | None) -> UpstreamResponse:
        for attempt in (0, 1):
            conn = self._take_idle(origin) or await self._connect(origin)
            self.busy += 1
            try:
                conn.send(head, body)
                await conn.drain(self.limits.write_timeout_s)
                while not conn.headers_done:
                    if conn.error is not None:
                        raise conn.error
                    await conn.wait(read_timeout)
                conn.used = True
                return UpstreamResponse(self, conn, read_timeout)
            except (httpx.ReadError, httpx.WriteError) as exc:
                self.busy -= 1
                conn.close()
                # A kept-alive connection the node closed as it was reused (its idle timer): nothing of this
                # request was read there, so it goes once more on a fresh connection.
                if attempt == 0 and conn.used and not conn.got_bytes:
                    continue
                raise exc from None
            except BaseException:
                self.busy -= 1
                conn.close()
                raise
        raise AssertionError("unreachable")

    def _take_idle(self, origin: _Origin) -> _Connection | None:
        idle = self._idle.get(origin.key)
        now = self.clock()
        while idle:
            conn = idle.pop()  # the most recently used: the least likely to have been closed by the node
            self._idle_count -= 1
            if not conn.closed and now - conn.idle_since < self.limits.keepalive_expiry_s:
                return conn
            conn.close()
        return None

    async def _connect(self, origin: _Origin) -> _Connection:
        loop = asyncio.get_running_loop()
        tls = self._tls() if origin.scheme == "https" else None
        timeout = self.limits.connect_timeout_s
        try:
            with anyio.fail_after(timeout):
                _, conn = await loop.create_connection(lambda: _Connection(origin), origin.host, origin.port,
                                                       ssl=tls, server_hostname=origin.host if tls else None)
        except TimeoutError:
            raise httpx.ConnectTimeout(f"connect to {origin.host}:{origin.port} timed out after {timeout:g} s") \
                from None
        except OSError as exc:
            raise httpx.ConnectError(f"cannot connect to {origin.host}:{origin.port}: {exc}") from None
        return conn

    def _tls(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return self._ssl

    def _release(self, conn: _Connection) -> None:
        self.busy -= 1
        self._give_slot()
        if conn.complete and conn.keep_alive and not conn.closed and not conn.body \
                and self._idle_count < self.limits.max_keepalive_connections:
            conn.idle_since = self.clock()
            self._idle.setdefault(conn.origin.key, deque()).append(conn)
            self._idle_count += 1
        else:
            conn.close()

    async def aclose(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
        self._idle_count = 0
        await anyio.lowlevel.checkpoint()  # lets the transports close
