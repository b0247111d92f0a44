"""One simulated vLLM node: engine + HTTP server (uvicorn) on its own port, plus fault injection."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import time
from collections.abc import Generator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import uvicorn
from kvtether.sim.api import build_app
from kvtether.sim.clock import SimClock, Source
from kvtether.sim.config import NodeConfig
from kvtether.sim.engine import Engine, ErrorEvent, State, kv_blocks
from kvtether.sim.metrics import NodeMetrics
from kvtether.sim.nixl import SERVER_KEEPALIVE_S, HttpKVTransport, KVTransport
from kvtether.sim.presets import get_preset
from kvtether.sim.tokenizer import Tokenizer, default_tokenizer

log = logging.getLogger("kvtether.sim.node")


@dataclass(slots=True)
class Faults:
    """Injected by ``POST /admin/fault``; counters are consumed request by request."""

    fail_next: int = 0  # next N completion requests answer HTTP 500
    hang_next: int = 0  # next N completion requests never answer (until the client gives up)

    def take_fail(self) -> bool:
        if self.fail_next > 0:
            self.fail_next -= 1
            return True
        return False

    def take_hang(self) -> bool:
        if self.hang_next > 0:
            self.hang_next -= 1
            return True
        return False

    def apply(self, body: Mapping[str, Any], node: SimNode) -> dict[str, Any]:
        dropped = 0
        if "fail_next" in body:
            self.fail_next = int(body["fail_next"])
        if "hang_next" in body:
            self.hang_next = int(body["hang_next"])
        if "slow_factor" in body:
            node.engine.slow_factor = max(0.0, float(body["slow_factor"]))
        if body.get("drop_retained"):
            dropped += node.engine.drop_holds("retained")
        if body.get("drop_leases"):
            dropped += node.engine.drop_holds("lease")
        return {**asdict(self), "slow_factor": node.engine.slow_factor, "dropped": dropped}


def listening_port(server: uvicorn.Server) -> int:
    """The port a started uvicorn server listens on (the one it was given, or the one it got for port 0)."""
    return int(server.servers[0].sockets[0].getsockname()[1])


class _EmbeddedServer(uvicorn.Server):
    """uvicorn for one of several nodes in a process: signals are the embedding program's, and a stop is awaited
    rather than polled. uvicorn looks at `should_exit` every 0.1 s, which on a virtual loop is a wake-up of the
    whole run per node ten times a simulated second: an hour-long replay on eight nodes spent more loop turns on
    it than on the streams. Here the loop ticks once a second (the Date header) or when told to stop."""

    def __init__(self, config: uvicorn.Config) -> None:
        self._stop = asyncio.Event()
        super().__init__(config)

    @property
    def should_exit(self) -> bool:
        return self._stop.is_set()

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        if value:
            self._stop.set()
        else:
            self._stop.clear()

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield

    async def main_loop(self) -> None:
        ticks = 0
        while not await self.on_tick(ticks):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), 1.0)
            ticks += 10  # tenths of a second, as uvicorn counts them: each tick refreshes the Date header


class SimNode:
    def __init__(self, cfg: NodeConfig, *, transport: KVTransport | None = None,
                 clock: Source | None = None) -> None:
        """`clock`: the time source of the node's simulated clock (sim/clock.py); None: the OS's."""
        cfg.validate()
        self.cfg = cfg
        self.preset = get_preset(cfg.preset)
        blocks = kv_blocks(cfg, self.preset)
        # Like vLLM at start-up: a context longer than the whole KV cache could never be scheduled.
        cfg.max_model_len = min(cfg.max_model_len, blocks * self.preset.block_size)
        self.tokenizer: Tokenizer = default_tokenizer()
        self.tool_format: str = cfg.tool_call_parser or self.preset.tool_call_parser
        self.clock = SimClock(cfg.speed, clock)
        self.metrics = NodeMetrics(
            cfg.model_name,
            block_size=self.preset.block_size,
            num_blocks=blocks,
            engine_id=cfg.engine_id,
            enable_prefix_caching=cfg.enable_prefix_caching,
        )
        self.transport: KVTransport = transport or HttpKVTransport(vllm_version=cfg.version)
        self.engine = Engine(cfg, self.preset, self.tokenizer, self.transport, self.metrics, self.clock)
        self.faults = Faults()
        self.app = build_app(self)
        self.started_at = time.time()
        self.host = "127.0.0.1"
        self.port = 0
        self._server: _EmbeddedServer | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stopped = False
        self._ids = itertools.count()

    def next_id(self, hex_digits: int) -> str:
        """A new id of `hex_digits` hex digits for a response or an engine request (vLLM's are random): drawn from
        the engine id and a counter, so a run that serves the same requests in the same order gives the same ids."""
        seed = f"{self.cfg.engine_id}/{next(self._ids)}".encode()
        return hashlib.blake2b(seed, digest_size=(hex_digits + 1) // 2).hexdigest()[:hex_digits]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> None:
        """Listen on `host`:`port` (0: a free port, read back once uvicorn listens). uvicorn opens the listener
        itself on the running loop, so the same code serves on a real socket or on a virtual loop's in-memory
        network (sim/virtual.py)."""
        config = uvicorn.Config(
            self.app,
            host=host,
            port=port,
            log_level="warning",
            lifespan="off",
            access_log=False,
            timeout_graceful_shutdown=2,
            # Longer than any client's pool expiry (httpx: 5 s, the nodes' own transport: 2 s), so a client
            # never reuses a connection the server is closing (see nixl.CLIENT_KEEPALIVE_EXPIRY_S).
            timeout_keep_alive=SERVER_KEEPALIVE_S,
        )
        self._server = server = _EmbeddedServer(config)
        self._tasks.append(asyncio.ensure_future(self.engine.run()))
        self._tasks.append(asyncio.ensure_future(server.serve()))
        while not server.started:
            if self._tasks[-1].done():
                try:
                    self._tasks[-1].result()  # surfaces the start-up error
                except SystemExit:  # uvicorn's answer to a listen that failed (it logged why)
                    raise OSError(f"the simulated node cannot listen on {host}:{port}") from None
                raise RuntimeError(f"the simulated node stopped before it listened on {host}:{port}")
            await asyncio.sleep(0.005)
        self.host, self.port = host, listening_port(server)
        self.engine.port = self.port

    async def stop(self) -> None:
        """Stop serving (idempotent: tests may kill a node before the cluster shuts down)."""
        if self._stopped:
            return
        self._stopped = True
        self._fail_outstanding()
        if self._server is not None:
            self._server.should_exit = True
        for t in reversed(self._tasks):
            if t is self._tasks[0]:
                t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks.clear()
        await self.engine.aclose()
        await self.transport.aclose()

    def _fail_outstanding(self) -> None:
        e = self.engine
        for r in [*e.arriving, *e.waiting, *e.running, *e.loading]:
            if r.state is not State.FINISHED:
                e.abort(r)
                r.events.put_nowait(ErrorEvent(503, "the node is shutting down"))

    def state(self) -> dict[str, Any]:
        """White-box view for tests and the CLI (also served at GET /admin/state)."""
        e = self.engine
        return {
            "role": self.cfg.role,
            "engine_id": self.cfg.engine_id,
            "url": self.url,
            "running": len(e.running),
            "waiting": len(e.waiting),
            "loading": len(e.loading),
            "blocks_total": e.pool.num_blocks,
            "blocks_used": e.pool.num_used,
            "blocks_cached": e.pool.cached_blocks(),
            "held": [
                {
                    "request_id": h.request_id,
                    "kind": h.kind,
                    "num_tokens": h.num_tokens,
                    "num_blocks": len(h.blocks),
                    "expires_at": h.expires_at,
                    # False: vLLM's worker does not know this hold; it never expires and no read frees it.
                    "tracked": h.tracked,
                }
                for h in e.holds.all()
            ],
            "steps": e.steps,
            "now": self.clock.now(),
            # Shared by every node of the process (default_tokenizer): hits show resent history reused.
            "tokenizer_cache": self.tokenizer.cache_info(),
        }
