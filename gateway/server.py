"""Run the gateway under uvicorn: in-process for tests, the demo and replay, or as `kvtether serve`."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator

import anyio
import uvicorn
from kvtether.gateway.app import create_app
from kvtether.gateway.config import GatewayConfig
from kvtether.gateway.sessions import SessionStore
from starlette.applications import Starlette


@contextlib.asynccontextmanager
async def serve_gateway(config: GatewayConfig, *, store: SessionStore | None = None, app: Starlette | None = None,
                        log_level: str = "warning") -> AsyncIterator[str]:
    """``async with serve_gateway(cfg) as url:`` — a running gateway on a free port (``config.port`` ignored).

    Pass ``app=create_app(cfg)`` to keep a handle on it (``app.state.gateway``: store, cluster, metrics).
    """
    app = app or create_app(config, store=store)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((config.host, 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="on", access_log=False,
                                           timeout_graceful_shutdown=2,
                                           timeout_keep_alive=int(config.client_keepalive_s)))
    async with anyio.create_task_group() as tg:
        tg.start_soon(server.serve, [sock])
        while not server.started:
            if server.should_exit:
                raise RuntimeError("gateway failed to start")
            await anyio.sleep(0.01)
        try:
            yield f"http://{config.host}:{port}"
        finally:
            server.should_exit = True
    sock.close()


def run_gateway(config: GatewayConfig, log_level: str = "info") -> None:
    """Blocking: serve on ``config.host:config.port`` until interrupted."""
    uvicorn.run(create_app(config), host=config.host, port=config.port, log_level=log_level, access_log=False,
                timeout_keep_alive=int(config.client_keepalive_s))
