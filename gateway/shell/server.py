"""Run the gateway under uvicorn: in-process for tests, the demo and replay, or as `kvtether serve` (one
process, or several workers sharing a session store)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import secrets
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import uvicorn
from kvtether.gateway.config import GatewayConfig, load_config
from kvtether.gateway.shell.app import create_app
from kvtether.gateway.shell.limits import raise_open_files_limit
from kvtether.gateway.shell.workers import MULTIPROC_ENV, metrics_directory, sigint_to_supervisor_only
from kvtether.gateway.stores.sessions import SessionStore
from starlette.applications import Starlette
from starlette.types import ASGIApp


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


# uvicorn's fast event loop and HTTP parser (declared dependencies: every relayed chunk is a write through
# both), with the pure-Python ones where they are missing (uvloop has no Windows build).
LOOP = "uvloop" if _installed("uvloop") else "asyncio"
HTTP = "httptools" if _installed("httptools") else "h11"
# The gateway serves no WebSocket: an upgrade request (Codex's Responses transport) is answered as plain HTTP,
# where GET /v1/responses says 426 and the client falls back to HTTP at once.
WS = "none"


class _EmbeddedServer(uvicorn.Server):
    """uvicorn in someone else's process (tests, the demo, replay): Ctrl-C and SIGTERM are the embedding
    program's to handle, not this one server's (uvicorn would otherwise take them over, stop only itself, and
    leave the program carrying on against a stopped gateway)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@contextlib.asynccontextmanager
async def serve_gateway(config: GatewayConfig, *, store: SessionStore | None = None, app: ASGIApp | None = None,
                        log_level: str = "warning") -> AsyncIterator[str]:
    """``async with serve_gateway(cfg) as url:`` — a running gateway on a free port (``config.port`` ignored).

    Pass ``app=create_app(cfg)`` to keep a handle on it (``app.state.gateway``: store, cluster, metrics).
    """
    app = app or create_app(config, store=store)
    # uvicorn opens the listener itself on the running loop (port 0: a free one, read back once it listens), so
    # the same code serves on a real socket or on a virtual loop's in-memory network (the simulated stack's
    # virtual time). The caller's event loop runs it (so no `loop`); the HTTP parser is uvicorn's own choice.
    server = _EmbeddedServer(uvicorn.Config(app, host=config.host, port=0, log_level=log_level, lifespan="on",
                                            access_log=False, http=HTTP, ws=WS, timeout_graceful_shutdown=2,
                                            timeout_keep_alive=int(config.client_keepalive_s)))
    async with anyio.create_task_group() as tg:
        tg.start_soon(_serve, server)
        while not server.started:
            if server.should_exit:
                raise RuntimeError("gateway failed to start")
            await anyio.sleep(0.01)
        port = int(server.servers[0].sockets[0].getsockname()[1])
        try:
            yield f"http://{config.host}:{port}"
        finally:
            server.should_exit = True


async def _serve(server: uvicorn.Server) -> None:
    """uvicorn's serve, its failure to listen (it exits, having logged why) turned into a start-up error."""
    try:
        await server.serve()
    except SystemExit:
        server.should_exit = True
        raise RuntimeError("gateway failed to start: it cannot listen") from None


# How `run_gateway` hands the configuration to its worker processes (each builds its own app from it).
SETTINGS_ENV = "KVTETHER_GATEWAY_SETTINGS"
LOG_LEVEL_ENV = "KVTETHER_GATEWAY_LOG_LEVEL"


def run_gateway(config: GatewayConfig, log_level: str = "info", *, workers: int = 1) -> None:
    """Blocking: serve on ``config.host:config.port`` until interrupted.

    ``workers > 1``: that many processes accept on the one port (uvicorn's supervisor), each with its own app,
    cluster view and upstream connections; they share sessions only through a shared store, so the caller
    refuses the memory store with several workers. Their metrics go to a directory of this run's, so that
    every scrape answers the sum over the workers; they ignore Ctrl-C, and stop when the supervisor tells them
    (shell/workers.py).
    """
    common: dict[str, Any] = {"host": config.host, "port": config.port, "log_level": log_level, "access_log": False,
                              "timeout_keep_alive": int(config.client_keepalive_s), "loop": LOOP, "http": HTTP,
                              "ws": WS}
    quiet_upstream_client(log_level)
    # Before uvicorn starts: its worker processes inherit the limit (shell/limits.py).
    raise_open_files_limit(config.max_connections)
    if workers <= 1:
        uvicorn.run(create_app(config), **common)
        return
    if config.reasoning_key is None:
        # One key for every worker: a client's reasoning sealed by one is read back by another.
        config = dataclasses.replace(config, reasoning_key=secrets.token_hex(32))
    os.environ[SETTINGS_ENV] = json.dumps(dataclasses.asdict(config))
    os.environ[LOG_LEVEL_ENV] = log_level
    with metrics_directory(), sigint_to_supervisor_only():
        uvicorn.run(f"{__name__}:app_from_env", factory=True, workers=workers, **common)


def app_from_env() -> Starlette:
    """A worker's app (uvicorn factory): the configuration `run_gateway` left in the environment."""
    level = os.environ.get(LOG_LEVEL_ENV)
    if level:
        logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        quiet_upstream_client(level)
    return create_app(load_config(None, **json.loads(os.environ[SETTINGS_ENV])),
                      worker_metrics=os.environ.get(MULTIPROC_ENV))


def quiet_upstream_client(log_level: str) -> None:
    """httpx logs every request at info: the gateway's node polls (/metrics, /health every few seconds per
    node) would drown its own lines. Kept at debug."""
    if log_level.lower() != "debug":
        for name in ("httpx", "httpcore"):
            logging.getLogger(name).setLevel(logging.WARNING)
