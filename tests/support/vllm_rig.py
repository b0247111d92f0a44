"""The gateway, in-process, in front of the session's shared real vLLM pair: what the real-vLLM tests send their
turns through, and the metrics they read back."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from kvtether.cli.up.launcher import gateway_session_ttl
from kvtether.gateway.nodes.cluster import sample_sum

from tests.support.vllm_fixtures import DECODE_TTL_S, M_CACHED_BY_SOURCE, Backend, metric_sum


async def metric(client: httpx.AsyncClient, url: str, name: str, **labels: str) -> float:
    return sample_sum((await client.get(url + "/metrics")).text, name, **labels)


@dataclass
class Rig:
    backend: Backend
    url: str
    app: Any
    client: httpx.AsyncClient

    async def p2p(self) -> float:
        return await metric_sum(self.client, self.backend.prefill_url, M_CACHED_BY_SOURCE, source="p2p")

    async def outcome(self, name: str) -> float:
        return await metric(self.client, self.url, "kvtether_handle_outcomes_total", outcome=name)


@contextlib.asynccontextmanager
async def gateway(b: Backend, **settings: Any) -> AsyncIterator[Rig]:
    try:
        from kvtether.gateway.config import load_config
        from kvtether.gateway.shell.app import create_app
        from kvtether.gateway.shell.server import serve_gateway
    except ImportError as e:  # pragma: no cover - the gateway lands in parallel
        pytest.skip(f"gateway not importable: {e}")
    cfg_kw: dict[str, Any] = {
        "prefill": [b.prefill_url],
        "decode": [b.decode_url],
        "engine_kv_ttl_s": DECODE_TTL_S,
        "session_ttl_s": gateway_session_ttl(DECODE_TTL_S),
        "metrics_poll_interval_s": 1.0,
    }
    if settings.get("nodes"):  # a pool: its instances take both roles, none is only a prefill or a decode node
        del cfg_kw["prefill"], cfg_kw["decode"]
    cfg_kw.update(settings)
    cfg = load_config(None, **cfg_kw)
    app = create_app(cfg)
    async with serve_gateway(cfg, app=app) as url, httpx.AsyncClient(
        timeout=httpx.Timeout(180.0), trust_env=False
    ) as client:
        yield Rig(b, url, app, client)
