"""The completion legs' HTTP/1.1 client (gateway/transport/upstream.py) against raw servers that misbehave on
purpose."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import anyio
import httpx
import pytest
from kvtether.gateway.transport.upstream import _HIGH_WATER, Upstream, UpstreamLimits

pytestmark = pytest.mark.anyio

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


@dataclass
class Server:
    url: str
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)


async def read_request(reader: asyncio.StreamReader, server: Server) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    body = await reader.readexactly(length) if length else b""
    server.requests.append(head + body)
    return body


@contextlib.asynccontextmanager
async def serve(handler: Handler) -> AsyncIterator[Server]:
    server = Server("")

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        server.connections += 1
        try:
            await handler(reader, writer, server.connections)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    srv = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    server.url = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
    async with srv:
        yield server


def answer(body: bytes, *extra: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n%s\r\n%s" % (len(body), b"".join(extra), body)


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def keep_answering(server_ref: list[Server]) -> Handler:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        while True:
            body = await read_request(reader, server_ref[0])
            writer.write(answer(b"echo:" + body[:20] + b":%d" % len(body)))
            await writer.drain()

    return handler


@contextlib.asynccontextmanager
async def echo_server() -> AsyncIterator[Server]:
    ref: list[Server] = []
    async with serve(keep_answering(ref)) as s:
        ref.append(s)
        yield s


async def test_keep_alive_connections_are_reused_and_bodies_of_any_size_arrive_whole() -> None:
    up = Upstream()
    async with echo_server() as s:
        for body in (b"hello", b"x" * 3_000_000, b""):
            resp = await up.send("POST", f"{s.url}/v1/chat/completions?a=1", body, {"content-type": "application/json"})
            assert resp.status_code == 200
            assert await resp.read() == b"echo:" + body[:20] + b":%d" % len(body)
        assert s.connections == 1 and up.busy == 0
        head = s.requests[0].split(b"\r\n\r\n")[0].split(b"\r\n")
        assert head[0] == b"POST /v1/chat/completions?a=1 HTTP/1.1"
        assert b"host: " + s.url.removeprefix("http://").encode() in head and b"content-type: application/json" in head
    await up.aclose()


async def test_a_stream_is_handed_over_as_it_arrives_and_what_queued_up_comes_in_one_piece() -> None:
    go = anyio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader, s)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-type: text/event-stream\r\n\r\n")
        writer.write(chunk(b"data: first\n\n"))
        await writer.drain()
        await go.wait()
        # 200 events in one write: the client sees them in (far) fewer pieces, de-chunked.
        writer.write(b"".join(chunk(b"data: %d\n\n" % i) for i in range(200)) + b"0\r\n\r\n")
        await writer.drain()
        await read_request(reader, s)

    async with serve(handler) as s:
        up = Upstream()
        resp = await up.send("POST", f"{s.url}/v1/completions", b"{}")
        assert resp.headers["content-type"] == "text/event-stream"
        pieces = resp.pieces()
        with anyio.fail_after(5):
            assert await pieces.__anext__() == b"data: first\n\n"  # before the rest was even sent
        go.set()
        rest = [p async for p in pieces]
        assert b"".join(rest) == b"".join(b"data: %d\n\n" % i for i in range(200))
        assert len(rest) < 20, len(rest)
        await resp.aclose()
        assert up.busy == 0


@pytest.mark.wall_clock  # a real listen backlog
async def test_refused_is_a_connect_error_and_a_full_accept_queue_a_connect_timeout() -> None:
    up = Upstream(UpstreamLimits(connect_timeout_s=0.3))
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    with pytest.raises(httpx.ConnectError):
        await up.send("POST", f"http://127.0.0.1:{port}/v1/completions", b"{}")
    # A listener that never accepts, its queue full: the next SYN is dropped and the connect hangs.
    with socket.socket() as deaf:
        deaf.bind(("127.0.0.1", 0))
        deaf.listen(0)
        fillers = []
        for _ in range(4):
            f = socket.socket()
            f.setblocking(False)
            f.connect_ex(deaf.getsockname())
            fillers.append(f)
        try:
            with anyio.fail_after(5), pytest.raises(httpx.ConnectTimeout):
                await up.send("POST", f"http://127.0.0.1:{deaf.getsockname()[1]}/v1/completions", b"{}")
        finally:
            for f in fillers:
                f.close()
    assert up.busy == 0


async def test_a_node_that_never_answers_is_a_read_timeout_and_its_connection_is_dropped() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader, s)
        await asyncio.sleep(30)

    async with serve(handler) as s:
        up = Upstream()
        with anyio.fail_after(5), pytest.raises(httpx.ReadTimeout):
            await up.send("POST", f"{s.url}/v1/completions", b"{}", read_timeout=0.2)
        assert up.busy == 0 and not up._idle.get(("http", "127.0.0.1", int(s.url.rsplit(":", 1)[1])))


async def test_a_connection_the_node_closed_while_idle_or_as_it_was_reused_is_replaced() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader, s)
        writer.write(answer(b"ok"))
        await writer.drain()
        if n == 1:
            return  # closes while the client holds it idle
        await read_request(reader, s)  # the next request on this connection: closed unanswered
        writer.transport.abort()

    async with serve(handler) as s:
        up = Upstream()
        assert await (await up.send("POST", s.url + "/a", b"1")).read() == b"ok"
        await anyio.sleep(0.1)  # the close reached the client
        assert await (await up.send("POST", s.url + "/a", b"2")).read() == b"ok"  # idle one seen closed: fresh
        assert s.connections == 2
        # Connection 2 is reused and closed unanswered: sent once more on a fresh one (3), which answers.
        assert await (await up.send("POST", s.url + "/a", b"3")).read() == b"ok"
        assert s.connections == 3 and len(s.requests) == 4


async def test_a_fresh_connection_closed_unanswered_is_an_error_not_a_retry() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader, s)
        writer.transport.abort()

    async with serve(handler) as s:
        up = Upstream()
        with pytest.raises(httpx.ReadError):
            await up.send("POST", s.url + "/a", b"1")
        assert s.connections == 1 and up.busy == 0


async def test_an_answer_cut_short_is_a_protocol_error() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader, s)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + chunk(b"data: 1\n\n"))
        await writer.drain()
        writer.transport.abort()

    async with serve(handler) as s:
        up = Upstream()
        resp = await up.send("POST", s.url + "/a", b"1")
        got = []
        with pytest.raises(httpx.RemoteProtocolError):
            async for piece in resp.pieces():
                got.append(piece)
        assert got == [b"data: 1\n\n"]
        await resp.aclose()
        assert up.busy == 0


async def test_a_malformed_answer_is_a_protocol_error() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader, s)
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(5)

    async with serve(handler) as s:
        up = Upstream()
        with anyio.fail_after(5), pytest.raises(httpx.RemoteProtocolError):
            await up.send("POST", s.url + "/a", b"1")
        assert up.busy == 0


async def test_an_answer_left_unread_or_abandoned_closes_its_connection() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        while True:
            await read_request(reader, s)
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + chunk(b"data: 1\n\n"))
            await writer.drain()
            await asyncio.sleep(0.3)
            writer.write(chunk(b"data: 2\n\n") + b"0\r\n\r\n")
            await writer.drain()

    async with serve(handler) as s:
        up = Upstream()
        resp = await up.send("POST", s.url + "/a", b"1")
        await resp.aclose()  # unread: this connection cannot carry another request
        resp = await up.send("POST", s.url + "/a", b"2")
        with anyio.move_on_after(0.1):  # the client left mid-stream
            async for _ in resp.pieces():
                pass
        await resp.aclose()
        assert up.busy == 0
        resp = await up.send("POST", s.url + "/a", b"3")
        assert await resp.read() == b"data: 1\n\ndata: 2\n\n"
        resp = await up.send("POST", s.url + "/a", b"4")  # read to its end: this one is reused
        assert await resp.read() == b"data: 1\n\ndata: 2\n\n"
        assert s.connections == 3


async def test_connections_are_bounded_and_a_request_waits_for_one_up_to_the_pool_timeout() -> None:
    ref: list[Server] = []
    async with serve(keep_answering(ref)) as s:
        ref.append(s)
        up = Upstream(UpstreamLimits(max_connections=1, pool_timeout_s=0.2))
        held = await up.send("POST", s.url + "/a", b"1")
        with pytest.raises(httpx.PoolTimeout):
            await up.send("POST", s.url + "/a", b"2")
        async with anyio.create_task_group() as tg:
            got: list[bytes] = []

            async def second() -> None:
                up.limits = UpstreamLimits(max_connections=1, pool_timeout_s=5)
                got.append(await (await up.send("POST", s.url + "/a", b"3")).read())

            tg.start_soon(second)
            await anyio.sleep(0.1)
            assert not got
            await held.read()
        assert got == [b"echo:3:1"] and s.connections == 1


async def test_a_request_that_waits_for_a_connection_says_how_long_whether_it_gets_one_or_not() -> None:
    waits: list[float] = []
    async with echo_server() as s:
        loop = asyncio.get_running_loop()  # virtual time: the waits are exact
        up = Upstream(UpstreamLimits(max_connections=1, pool_timeout_s=0.2), clock=loop.time, on_wait=waits.append)
        held = await up.send("POST", s.url + "/a", b"1")
        assert waits == []  # a free slot: no wait
        with pytest.raises(httpx.PoolTimeout):
            await up.send("POST", s.url + "/a", b"2")
        assert waits == [pytest.approx(0.2, abs=1e-9)]  # gave up at the pool timeout: counted too
        async with anyio.create_task_group() as tg:
            got: list[bytes] = []

            async def second() -> None:
                got.append(await (await up.send("POST", s.url + "/a", b"3")).read())

            tg.start_soon(second)
            await anyio.sleep(0.15)
            await held.read()  # frees the slot 0.15 s into the second request's wait
        assert got == [b"echo:3:1"]
        assert waits[1] == pytest.approx(0.15, abs=1e-3)


async def test_a_header_that_could_split_the_request_is_refused_before_anything_is_sent() -> None:
    async with echo_server() as s:
        up = Upstream()
        with pytest.raises(httpx.LocalProtocolError):
            await up.send("POST", s.url + "/a", b"1", {"x-a": "b\r\nx-injected: 1"})
        assert s.requests == [] and up.busy == 0
        assert await (await up.send("POST", s.url + "/a", b"1")).read() == b"echo:1:1"


@pytest.mark.wall_clock  # a real socket's buffers
async def test_a_slow_reader_stops_the_socket_being_read_instead_of_buffering_it_all() -> None:
    big = b"x" * (8 * _HIGH_WATER)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader, s)
        writer.write(answer(big))
        await writer.drain()

    async with serve(handler) as s:
        up = Upstream()
        resp = await up.send("POST", s.url + "/a", b"1")
        await anyio.sleep(0.5)  # the node wrote it all; the client has not read
        assert resp._conn.buffered <= _HIGH_WATER + (1 << 18)
        assert len(await resp.read()) == len(big)


async def test_a_body_delimited_by_the_end_of_the_connection() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader, s)
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of it")
        await writer.drain()

    async with serve(handler) as s:
        up = Upstream()
        assert await (await up.send("POST", s.url + "/a", b"1")).read() == b"all of it"
        assert await (await up.send("POST", s.url + "/a", b"1")).read() == b"all of it"
        assert s.connections == 2


@pytest.mark.wall_clock  # a real server closing an idle socket
async def test_an_idle_connection_past_its_keep_alive_expiry_is_not_reused() -> None:
    async with echo_server() as s:
        up = Upstream(UpstreamLimits(keepalive_expiry_s=0.2))
        await (await up.send("POST", s.url + "/a", b"1")).read()
        await (await up.send("POST", s.url + "/a", b"2")).read()
        assert s.connections == 1
        await anyio.sleep(0.3)
        await (await up.send("POST", s.url + "/a", b"3")).read()
        assert s.connections == 2
