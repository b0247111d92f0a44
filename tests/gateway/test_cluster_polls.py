"""The gateway's node polls on the lean client (gateway/nodes/cluster.py with transport/upstream.py): the polls of
a node keep one connection alive, what they read lands on the node, and a failed answer fails the poll as the
httpx path's does."""

from __future__ import annotations

from typing import Any

import anyio
import httpx
import pytest
from kvtether.gateway.config import GatewayConfig
from kvtether.gateway.nodes.cluster import Cluster
from kvtether.gateway.transport.upstream import Upstream

from tests.gateway.discovery.fake_apiserver import serving

METRICS = b"vllm:num_requests_running 3\nvllm:num_requests_waiting 2\nvllm:kv_cache_usage_perc 0.25\n"


@pytest.mark.anyio
async def test_polls_keep_one_connection_and_a_500_is_a_failed_poll() -> None:
    status = {"metrics": 200}

    async def node_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        code = status["metrics"] if scope["path"] == "/metrics" else 200
        body = METRICS if scope["path"] == "/metrics" and code == 200 else b"{}"
        await send({"type": "http.response.start", "status": code,
                    "headers": [(b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    failed: list[str] = []
    async with serving(node_app) as url, httpx.AsyncClient() as client:
        poller = Upstream()
        connects = 0
        connect = poller._connect

        async def counted(origin: Any) -> Any:
            nonlocal connects
            connects += 1
            return await connect(origin)

        poller._connect = counted  # type: ignore[method-assign]
        cluster = Cluster(GatewayConfig(prefill=[url], decode=["http://d:1"]), client,
                          on_poll_failure=failed.append, poller=poller)
        node = cluster.nodes[url]
        for _ in range(3):
            await cluster.refresh(node)
            await anyio.sleep(1.0)  # the gateway's polls are seconds apart: the connection outlives the gap
        assert (node.polls, node.running, node.waiting, node.kv_usage) == (3, 3.0, 2.0, 0.25)
        assert connects == 1 and not failed

        status["metrics"] = 500
        await cluster.refresh(node)
        assert failed == [url] and node.polls == 3 and "HTTPStatusError" in (node.last_error or "")
        assert node.healthy  # /health still answers: a failing /metrics alone proves nothing
        await poller.aclose()


def test_the_app_polls_on_a_lean_client_of_its_own_that_outlives_the_poll_interval() -> None:
    from kvtether.gateway.shell.app import create_app

    config = GatewayConfig(prefill=["http://p:1"], decode=["http://d:1"])
    gw = create_app(config).state.gateway
    assert gw.cluster.poller is gw.poller and gw.poller is not gw.upstream  # polls never wait behind turns
    assert gw.poller.limits.keepalive_expiry_s > config.metrics_poll_interval_s
