"""Virtual time: an asyncio event loop whose clock jumps to the next timer when nothing is runnable, and an
in-memory network between the servers and clients that run on it.

The whole simulated stack (the replay's clients, the gateway under uvicorn, the simulated vLLM nodes and their
NIXL transfers) runs unchanged in one process on a :class:`VirtualLoop`: every sleep, timeout and keep-alive is a
timer of the loop; every read of time goes through the clock the gateway and the simulator are handed, which is
``loop.time``; every TCP connection to a listening address of the loop's :class:`MemoryNetwork` is a pair of
in-memory transports. So a run takes the CPU its Python needs, not the simulated seconds it covers, and two runs
of the same inputs take the same steps in the same order: their figures are identical to the microsecond.

What cannot follow virtual time is refused, loudly (:class:`VirtualTimeError`), never left to run on the wall
clock: an executor or thread that would wake the loop, a real socket (a connection to an address nobody on the
network listens at is refused like a closed port), TLS, subprocesses, or a loop with nothing to run and no timer
(it waits on something outside: a deadlock in virtual time). A run that goes past ``horizon_s`` virtual seconds
stops the same way, so that a livelock cannot run the clock away forever.

The loop stands on three attributes of CPython's ``BaseEventLoop`` (``_scheduled``, ``_ready`` through the
selector's timeout, ``_ssock``), which tests/sim/test_virtual.py pins for the Python versions the project supports.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import heapq
import itertools
import selectors
import socket
import threading
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Any, TypeVar

import anyio

T = TypeVar("T")

# Where virtual time starts: far from 0, which some code takes for "never" (an idle connection's timestamp).
VIRTUAL_EPOCH = 1_000_000.0
# The names the network resolves itself (a NIXL handle advertises ``localhost``); anything else is refused.
LOOPBACK_NAMES = {"localhost": "127.0.0.1", "ip6-localhost": "::1"}
# Ports the network hands out for a listen on port 0, in order: the same run gets the same ports.
FIRST_EPHEMERAL_PORT = 20_000
# How many loop iterations with work ready may pass without polling the real selector (the loop's self-pipe, a
# signal's wake-up): every poll is a system call, and a busy run iterates millions of times. A jump in time
# always polls first, so a signal waits at most this many callbacks' worth of CPU.
REAL_POLL_EVERY = 64
# The cyclic garbage collector's young-generation threshold during a run (CPython's default is 700). A run
# allocates objects by the million (chunks, events, handles) over a heap of up to gigabytes (the sessions, the
# nodes' KV contents); at the default, collections ran thousands of times and the older ones walked the whole
# heap: 9 % of a 200-conversation Mooncake replay's CPU, and the whole trace went from 1,215-1,535 CPU-s to 955.
RUN_GC_THRESHOLD = (100_000, 50, 100)


class VirtualTimeError(RuntimeError):
    """Something would wait on the wall clock (a thread, real I/O) inside a virtual-time run, or the run is stuck."""


class _Selector(selectors.DefaultSelector):
    """The loop's selector: real readiness is only ever polled (the loop's self-pipe, woken by a signal); where
    asyncio would block for `timeout`, virtual time jumps to the next timer instead."""

    loop: VirtualLoop
    _unpolled = 0  # iterations since the real selector was last polled

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if self.loop.leaked is not None:
            leaked, self.loop.leaked = self.loop.leaked, None  # said once: the run's tasks are cancelled after it
            raise VirtualTimeError(leaked)
        if timeout == 0:
            self._unpolled += 1
            if self._unpolled < REAL_POLL_EVERY:
                return []
        self._unpolled = 0
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        self.loop._jump(timeout)
        return []


class _Timer(asyncio.TimerHandle):
    """A timer that, due at the same instant as another, runs after the ones scheduled before it. asyncio's own
    compare their times only, so a tie's order is the heap's shape, which every other timer pending (an idle
    server's tick, say) changes. Ties are common in virtual time, where no time passes while callbacks run: at
    scale an unrelated timer then moved turns between engine steps and changed a replay's figures."""

    __slots__ = ("_seq",)

    def __init__(self, when: float, callback: Callable[..., Any], args: tuple[Any, ...], loop: VirtualLoop,
                 context: Any, seq: int) -> None:
        super().__init__(when, callback, args, loop, context)
        self._seq = seq

    def __lt__(self, other: object) -> bool:
        # The heap compares timers millions of times in a long run: attributes, not when() and tuples.
        if isinstance(other, _Timer):
            a, b = self._when, other._when  # type: ignore[attr-defined]
            return bool(a < b or (a == b and self._seq < other._seq))
        return NotImplemented


class VirtualLoop(asyncio.SelectorEventLoop):
    """An event loop on virtual time (module docstring). ``network``: the in-memory network its servers and clients
    meet on (a new one by default); ``horizon_s``: virtual seconds after which the run is stopped as stuck."""

    # What a gateway or a simulated node made on this loop reads to follow its clock without being told
    # (gateway/clock.py, sim/clock.py).
    virtual_time = True

    def __init__(self, network: MemoryNetwork | None = None, *, horizon_s: float | None = None) -> None:
        selector = _Selector()
        selector.loop = self
        self._now = VIRTUAL_EPOCH
        self._horizon = None if horizon_s is None else VIRTUAL_EPOCH + horizon_s
        self.leaked: str | None = None  # what ran beside virtual time (a thread): the run stops with it
        self.network = network or MemoryNetwork()
        self.jumps = 0  # how often time moved forward: a measure of the run's event count
        self._timer_seq = itertools.count()
        super().__init__(selector)

    # -- time ----------------------------------------------------------------------------------------------
    def time(self) -> float:
        return self._now

    def virtual_seconds(self) -> float:
        """Virtual seconds since the loop was made."""
        return self._now - VIRTUAL_EPOCH

    def _jump(self, timeout: float | None) -> None:
        scheduled: list[asyncio.TimerHandle] = self._scheduled  # type: ignore[attr-defined]
        if timeout is None or not scheduled:
            raise VirtualTimeError(
                "nothing to run and no timer in virtual time: the run waits on something outside it (real I/O, a "
                "thread, a process) or on itself (a deadlock)")
        # To the first timer exactly (not now + timeout, which would round): it runs in this iteration.
        when = max(self._now, scheduled[0].when())
        if self._horizon is not None and when > self._horizon:
            raise VirtualTimeError(f"the run passed its horizon of {self._horizon - VIRTUAL_EPOCH:g} virtual seconds")
        self._now = when
        self.jumps += 1

    def call_at(self, when: float, callback: Callable[..., Any], *args: Any,  # type: ignore[override]
                context: Any = None) -> asyncio.TimerHandle:
        """asyncio's, with a timer whose ties go in the order they were scheduled (:class:`_Timer`)."""
        if when is None:
            raise TypeError("when cannot be None")
        self._check_closed()  # type: ignore[attr-defined]
        timer = _Timer(when, callback, args, self, context, next(self._timer_seq))
        heapq.heappush(self._scheduled, timer)  # type: ignore[attr-defined]
        timer._scheduled = True  # type: ignore[attr-defined]
        return timer

    # -- refused: whatever would run beside the loop on the wall clock -------------------------------------
    def call_soon_threadsafe(  # type: ignore[override]
            self, callback: Callable[..., Any], *args: Any, context: Any = None) -> asyncio.Handle:
        running_in = getattr(self, "_thread_id", None)
        if running_in is not None and threading.get_ident() != running_in:
            # A thread finished work the loop waited for: in virtual time it took no time, but the loop may
            # already have jumped past the moment it ended. The run stops rather than measure it wrong.
            self.leaked = (f"a thread woke the loop ({getattr(callback, '__qualname__', callback)!s}): work ran "
                           "beside virtual time, on the wall clock")
        return super().call_soon_threadsafe(callback, *args, context=context)

    def run_in_executor(  # type: ignore[override]
            self, executor: Any, func: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        raise VirtualTimeError(f"{getattr(func, '__qualname__', func)!s} would run in a thread, on the wall clock")

    def _add_reader(self, fd: Any, callback: Callable[..., Any], *args: Any) -> Any:
        ssock = getattr(self, "_ssock", None)
        if ssock is None or fd != ssock.fileno():
            raise VirtualTimeError("a real socket or file descriptor would be read in virtual time")
        return super()._add_reader(fd, callback, *args)  # type: ignore[misc]

    def _add_writer(self, fd: Any, callback: Callable[..., Any], *args: Any) -> Any:
        raise VirtualTimeError("a real socket or file descriptor would be written in virtual time")

    async def subprocess_exec(self, *args: Any, **kwargs: Any) -> Any:
        raise VirtualTimeError("a subprocess cannot run in virtual time")

    async def subprocess_shell(self, *args: Any, **kwargs: Any) -> Any:
        raise VirtualTimeError("a subprocess cannot run in virtual time")

    async def create_datagram_endpoint(self, *args: Any, **kwargs: Any) -> Any:
        raise VirtualTimeError("UDP is not part of the in-memory network")

    async def create_unix_connection(self, *args: Any, **kwargs: Any) -> Any:
        raise VirtualTimeError("Unix sockets are not part of the in-memory network")

    async def create_unix_server(self, *args: Any, **kwargs: Any) -> Any:
        raise VirtualTimeError("Unix sockets are not part of the in-memory network")

    # -- the in-memory network -------------------------------------------------------------------------------
    async def getaddrinfo(self, host: Any, port: Any, *, family: int = 0, type: int = 0, proto: int = 0,
                          flags: int = 0) -> list[tuple[Any, ...]]:
        address = self.network.resolve(host.decode() if isinstance(host, bytes) else str(host))
        fam = socket.AF_INET6 if ":" in address else socket.AF_INET
        sockaddr: tuple[Any, ...] = (address, int(port or 0), 0, 0) if fam == socket.AF_INET6 else (address,
                                                                                                    int(port or 0))
        return [(fam, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", sockaddr)]

    async def create_server(self, protocol_factory: Callable[[], asyncio.BaseProtocol], host: Any = None,
                            port: Any = None, *, sock: Any = None, ssl: Any = None, **kwargs: Any) -> Any:
        if sock is not None or ssl is not None:
            raise VirtualTimeError("a server on a real socket or with TLS cannot run in virtual time")
        hosts = [host] if isinstance(host, str) or host is None else list(host)
        return self.network.listen(self, protocol_factory, [self.network.resolve(h or "0.0.0.0") for h in hosts],
                                   int(port or 0))

    async def create_connection(self, protocol_factory: Callable[[], asyncio.BaseProtocol], host: Any = None,
                                port: Any = None, *, ssl: Any = None, sock: Any = None, **kwargs: Any) -> Any:
        if sock is not None or ssl:
            raise VirtualTimeError("a connection over a real socket or with TLS cannot run in virtual time")
        await asyncio.sleep(0)  # connecting yields, as a real connect does
        return self.network.connect(self, protocol_factory, self.network.resolve(str(host)), int(port))


class _Endpoint:
    """What ``get_extra_info('socket')`` answers on an in-memory transport: the addresses, and no descriptor (so
    a client that checks an idle connection's socket for readability treats it as dropped and opens another)."""

    def __init__(self, local: tuple[str, int], peer: tuple[str, int]) -> None:
        self._local, self._peer = local, peer
        self.family = socket.AF_INET6 if ":" in local[0] else socket.AF_INET
        self.type = socket.SOCK_STREAM

    def getsockname(self) -> tuple[str, int]:
        return self._local

    def getpeername(self) -> tuple[str, int]:
        return self._peer

    def fileno(self) -> int:
        return -1

    def setsockopt(self, *args: Any) -> None:
        return None

    def getsockopt(self, *args: Any) -> int:
        return 0


class MemoryTransport(asyncio.Transport):
    """One end of an in-memory TCP connection. Writes reach the peer's protocol on the loop's next turn, in
    order (what was written before the peer reads arrives as one piece, as a socket delivers it); closing sends the
    peer an end of stream after the data; reading can be paused. Writes are never refused for a full buffer."""

    def __init__(self, loop: VirtualLoop, protocol: asyncio.BaseProtocol, local: tuple[str, int],
                 peer: tuple[str, int]) -> None:
        super().__init__()
        self._loop = loop
        self._protocol = protocol
        self._endpoint = _Endpoint(local, peer)
        self._peer_end: MemoryTransport | None = None
        self._inbox: deque[bytes] = deque()
        self._eof_in = False  # the peer ended its side; told to the protocol after the data
        self._delivering = False  # a delivery is scheduled
        self._paused = False
        self._closing = False
        self._lost = False
        self._write_eof = False

    # -- writing ---------------------------------------------------------------------------------------------
    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._closing or self._write_eof:
            return  # as a socket transport: writes after close are dropped
        peer = self._peer_end
        if peer is not None and data:
            peer._receive(bytes(data))

    def writelines(self, list_of_data: Iterable[bytes | bytearray | memoryview]) -> None:
        self.write(b"".join(bytes(d) for d in list_of_data))

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        if self._write_eof or self._closing:
            return
        self._write_eof = True
        if self._peer_end is not None:
            self._peer_end._end_of_stream()

    def get_write_buffer_size(self) -> int:
        return 0

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return (0, 0)

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        return None

    # -- reading ---------------------------------------------------------------------------------------------
    def _receive(self, data: bytes) -> None:
        if self._lost:
            return
        self._inbox.append(data)
        self._schedule()

    def _end_of_stream(self) -> None:
        if not self._lost:
            self._eof_in = True
            self._schedule()

    def _schedule(self) -> None:
        if not self._delivering and not self._paused:
            self._delivering = True
            self._loop.call_soon(self._deliver)

    def _deliver(self) -> None:
        self._delivering = False
        if self._lost or self._paused:
            return
        if self._inbox:
            data = b"".join(self._inbox)
            self._inbox.clear()
            self._protocol.data_received(data)  # type: ignore[attr-defined]
            if self._inbox or self._eof_in:
                self._schedule()  # the protocol may have paused meanwhile
            return
        if self._eof_in:
            self._eof_in = False
            keep_open = self._protocol.eof_received()  # type: ignore[attr-defined]
            if not keep_open:
                self.close()

    def is_reading(self) -> bool:
        return not self._paused and not self._lost

    def pause_reading(self) -> None:
        self._paused = True

    def resume_reading(self) -> None:
        if self._paused:
            self._paused = False
            if self._inbox or self._eof_in:
                self._schedule()

    # -- closing ---------------------------------------------------------------------------------------------
    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        peer = self._peer_end
        if peer is not None and not self._write_eof:
            peer._end_of_stream()
        self._loop.call_soon(self._connection_lost)

    def abort(self) -> None:
        self.close()

    def _connection_lost(self) -> None:
        if self._lost:
            return
        self._lost = True
        self._inbox.clear()
        self._protocol.connection_lost(None)

    # -- the rest of the transport interface ---------------------------------------------------------------
    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "socket":
            return self._endpoint
        if name == "sockname":
            return self._endpoint.getsockname()
        if name == "peername":
            return self._endpoint.getpeername()
        return default

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._protocol = protocol

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._protocol


class MemoryServer(asyncio.AbstractServer):
    """A listening address on the network, as ``loop.create_server`` returns one (uvicorn reads ``sockets``)."""

    def __init__(self, network: MemoryNetwork, loop: VirtualLoop, factory: Callable[[], asyncio.BaseProtocol],
                 addresses: list[tuple[str, int]]) -> None:
        self._network, self._loop, self.factory, self.addresses = network, loop, factory, addresses
        self.sockets = [_Endpoint(a, ("", 0)) for a in addresses]
        self._serving = True
        self._closed = asyncio.Event()

    def close(self) -> None:
        if self._serving:
            self._serving = False
            for a in self.addresses:
                self._network.unlisten(a, self)
            self._closed.set()

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def is_serving(self) -> bool:
        return self._serving

    async def start_serving(self) -> None:
        return None

    async def serve_forever(self) -> None:
        await self._closed.wait()

    async def wait_closed(self) -> None:
        await self._closed.wait()


class MemoryNetwork:
    """Listening addresses and the connections between them, all in memory. A connection to an address where
    nobody listens is refused (``ConnectionRefusedError``), as a stopped node's port is."""

    def __init__(self) -> None:
        self._listening: dict[tuple[str, int], MemoryServer] = {}
        self._ports = itertools.count(FIRST_EPHEMERAL_PORT)
        self.connections = 0  # opened so far

    def resolve(self, host: str) -> str:
        host = host.strip("[]")
        if host in LOOPBACK_NAMES:
            return LOOPBACK_NAMES[host]
        try:
            socket.inet_pton(socket.AF_INET6 if ":" in host else socket.AF_INET, host)
        except OSError:
            raise socket.gaierror(socket.EAI_NONAME, f"{host} is not on the in-memory network") from None
        return host

    def _port(self, host: str) -> int:
        while True:
            port = next(self._ports)
            if (host, port) not in self._listening and ("0.0.0.0", port) not in self._listening:
                return port

    def listen(self, loop: VirtualLoop, factory: Callable[[], asyncio.BaseProtocol], hosts: list[str],
               port: int) -> MemoryServer:
        port = port or self._port(hosts[0])
        addresses = [(h, port) for h in hosts]
        for a in addresses:
            if a in self._listening:
                raise OSError(errno.EADDRINUSE, f"address already in use: {a[0]}:{a[1]}")
        server = MemoryServer(self, loop, factory, addresses)
        for a in addresses:
            self._listening[a] = server
        return server

    def unlisten(self, address: tuple[str, int], server: MemoryServer) -> None:
        if self._listening.get(address) is server:
            del self._listening[address]

    def connect(self, loop: VirtualLoop, factory: Callable[[], asyncio.BaseProtocol], host: str,
                port: int) -> tuple[MemoryTransport, asyncio.BaseProtocol]:
        server = self._listening.get((host, port)) or self._listening.get(("0.0.0.0", port))
        if server is None:
            raise ConnectionRefusedError(errno.ECONNREFUSED, f"connect to {host}:{port}: nobody listens there")
        self.connections += 1
        client_addr, server_addr = ("127.0.0.1", 1_000 + self.connections % 60_000), (host, port)
        client_protocol, server_protocol = factory(), server.factory()
        client = MemoryTransport(loop, client_protocol, client_addr, server_addr)
        served = MemoryTransport(loop, server_protocol, server_addr, client_addr)
        client._peer_end, served._peer_end = served, client
        server_protocol.connection_made(served)
        client_protocol.connection_made(client)
        return client, client_protocol


def current_virtual_loop() -> VirtualLoop | None:
    """The running loop when it is virtual, else None."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return None
    return loop if isinstance(loop, VirtualLoop) else None


def run_virtual(func: Callable[..., Awaitable[T]], *args: Any, horizon_s: float | None = None) -> T:
    """``anyio.run(func, *args)`` on a fresh :class:`VirtualLoop` and in-memory network."""
    with _batch_gc():
        return anyio.run(func, *args, backend="asyncio",
                         backend_options={"loop_factory": lambda: VirtualLoop(horizon_s=horizon_s)})


@contextlib.contextmanager
def _batch_gc() -> Iterator[None]:
    """The collector tuned for a batch run (:data:`RUN_GC_THRESHOLD`), restored after it. What exists when the
    run starts (the sessions to replay, imported modules) is frozen out of its collections: it lives as long."""
    before = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(*RUN_GC_THRESHOLD)
    try:
        yield
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()
