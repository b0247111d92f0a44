"""The virtual event loop and its in-memory network (sim/virtual.py): exact jumps, refusals, transport semantics."""

from __future__ import annotations

import asyncio
import sys
import threading

import anyio
import httpx
import pytest
import uvicorn
from kvtether.sim.virtual import VIRTUAL_EPOCH, VirtualLoop, VirtualTimeError, current_virtual_loop, run_virtual
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route


def test_the_asyncio_internals_it_stands_on_are_there() -> None:
    # The loop reads BaseEventLoop's timer heap and self-pipe: a Python that renames them must fail here first.
    loop = VirtualLoop()
    try:
        assert isinstance(loop._scheduled, list)  # type: ignore[attr-defined]
        assert loop._ssock is not None  # type: ignore[attr-defined]
        assert sys.version_info >= (3, 11)
    finally:
        loop.close()


def test_sleeps_jump_exactly_and_take_no_wall_time() -> None:
    seen: list[float] = []

    async def main() -> None:
        loop = current_virtual_loop()
        assert loop is not None
        await anyio.sleep(3600.0)
        seen.append(loop.time())
        with anyio.move_on_after(0.25):
            await anyio.sleep(10.0)
        seen.append(loop.time())
        await asyncio.gather(anyio.sleep(0.001), anyio.sleep(0.002))
        seen.append(loop.virtual_seconds())

    import time

    wall = time.perf_counter()
    run_virtual(main)
    assert time.perf_counter() - wall < 30  # an hour of virtual time; generous for a loaded machine
    assert seen[0] == VIRTUAL_EPOCH + 3600.0
    assert seen[1] == VIRTUAL_EPOCH + 3600.25
    assert seen[2] == pytest.approx(3600.252, abs=1e-9)


def test_a_wait_on_nothing_is_a_deadlock_not_a_hang() -> None:
    async def main() -> None:
        await asyncio.Event().wait()

    with pytest.raises(VirtualTimeError, match="nothing to run"):
        run_virtual(main)


def test_a_thread_or_executor_is_refused() -> None:
    async def executor() -> None:
        await asyncio.get_running_loop().run_in_executor(None, sum, [1, 2])

    with pytest.raises(VirtualTimeError, match="thread"):
        run_virtual(executor)

    async def thread() -> None:
        loop = asyncio.get_running_loop()
        done = asyncio.Event()
        threading.Thread(target=lambda: loop.call_soon_threadsafe(done.set)).start()
        await anyio.sleep(5.0)  # a timer keeps the loop going meanwhile: the wake-up still stops the run
        await done.wait()

    with pytest.raises(VirtualTimeError, match="a thread woke the loop"):
        run_virtual(thread)


def test_the_horizon_stops_a_run_that_never_ends() -> None:
    async def main() -> None:
        for _ in range(10**9):  # a livelock: always a timer, never an end
            await anyio.sleep(1.0)

    with pytest.raises(VirtualTimeError, match="horizon"):
        run_virtual(main, horizon_s=60.0)


class _Echo(asyncio.Protocol):
    def __init__(self, log: list[object]) -> None:
        self.log = log

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.log.append(data)
        self.transport.write(data.upper())  # type: ignore[attr-defined]

    def eof_received(self) -> bool:
        self.log.append("eof")
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.log.append("lost")


class _Client(asyncio.Protocol):
    def __init__(self) -> None:
        self.got: list[object] = []

    def data_received(self, data: bytes) -> None:
        self.got.append(data)

    def eof_received(self) -> bool:
        self.got.append("eof")
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.got.append("lost")


def test_transports_deliver_in_order_pause_and_close_like_tcp() -> None:
    server_log: list[object] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: _Echo(server_log), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        with pytest.raises(ConnectionRefusedError):
            await loop.create_connection(asyncio.Protocol, "127.0.0.1", port + 1)
        transport, client = await loop.create_connection(_Client, "localhost", port)
        assert isinstance(client, _Client)
        transport.write(b"a")
        transport.write(b"b")  # written before the peer reads: one piece, as a socket would deliver them
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert server_log == [b"ab"] and client.got == [b"AB"]
        transport.pause_reading()
        transport.write(b"c")
        for _ in range(3):
            await asyncio.sleep(0)
        assert client.got == [b"AB"]  # paused: held back
        transport.resume_reading()
        await asyncio.sleep(0)
        assert client.got == [b"AB", b"C"]
        transport.close()
        for _ in range(4):
            await asyncio.sleep(0)
        assert server_log == [b"ab", b"c", "eof", "lost"] and client.got[-1] == "lost"
        server.close()
        with pytest.raises(ConnectionRefusedError):  # a closed listener refuses, as a stopped node's port does
            await loop.create_connection(asyncio.Protocol, "127.0.0.1", port)

    run_virtual(main)


def test_real_network_paths_are_refused() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        with pytest.raises(VirtualTimeError):
            await loop.create_connection(asyncio.Protocol, "127.0.0.1", 1, ssl=True)
        with pytest.raises(OSError):  # a name the in-memory network does not know
            await loop.getaddrinfo("example.com", 80)
        with pytest.raises(VirtualTimeError):
            await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")

    run_virtual(main)


async def _slow_stream(request: Request) -> StreamingResponse:
    async def body() -> object:
        for i in range(3):
            await anyio.sleep(0.5)
            yield f"data: {i}\n\n".encode()

    return StreamingResponse(body(), media_type="text/event-stream")


async def _hello(request: Request) -> JSONResponse:
    return JSONResponse({"at": asyncio.get_running_loop().time()})


def test_uvicorn_and_httpx_stream_unchanged_over_it() -> None:
    app = Starlette(routes=[Route("/stream", _slow_stream), Route("/hello", _hello)])

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
        task = asyncio.ensure_future(server.serve())
        for _ in range(1000):
            if server.started:
                break
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        async with httpx.AsyncClient() as http:
            assert (await http.get(f"http://127.0.0.1:{port}/hello")).status_code == 200
            t0, arrivals = loop.time(), []
            async with http.stream("GET", f"http://localhost:{port}/stream") as resp:
                async for line in resp.aiter_lines():
                    if line:
                        arrivals.append(round(loop.time() - t0, 9))
        # Each event arrives when it was sent, not buffered to the end of the response.
        assert arrivals == [0.5, 1.0, 1.5]
        server.should_exit = True
        await task

    run_virtual(main)
