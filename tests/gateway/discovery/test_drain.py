"""A decode node added, drained and removed under traffic, end to end on the simulator, with DNS discovery (a
scripted resolver: the test says what each headless Service answers).

The decode node a session runs on leaves DNS while a turn of that session runs on it: that turn finishes and is
answered correctly; another session's next turn, placed while the node drains, moves to the remaining decode node;
the node leaves the gateway's view once its turn is done, and the first session's next turn moves too. Every
answer equals the oracle's (a node that answers the same messages directly), no turn fails, and once the sessions
end nothing is held on the remaining nodes."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import anyio
import httpx
import pytest
from kvtether.gateway.config import load_config
from kvtether.gateway.nodes.cluster import sample_sum
from kvtether.gateway.nodes.discovery.dns import DnsDiscovery
from kvtether.gateway.shell.app import create_app
from kvtether.gateway.shell.server import serve_gateway
from kvtether.sim.cluster import ClusterSpec, SimCluster
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.gateway.discovery.scripted_dns import ScriptedResolver
from tests.gateway.discovery.waiting import eventually, until
from tests.support.gateway_agent import chat, comparable, first_messages, next_messages, request_body
from tests.support.sim_rig import LIMITS, SPEED

pytestmark = pytest.mark.anyio

PREFILL, DECODE = "_http._tcp.prefill.kv.svc", "_http._tcp.decode.kv.svc"


def _srv(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    return parts.hostname, parts.port


class Agent:
    """One session's turns, each checked against the oracle."""

    def __init__(self, client: httpx.AsyncClient, gateway: str, oracle: str, session: int) -> None:
        self.client, self.gateway, self.oracle, self.session = client, gateway, oracle, session
        self.messages = first_messages(session)
        self.turn = 0

    async def next(self) -> None:
        body = request_body(self.messages, stream=self.turn % 2 == 1)
        got = await chat(self.client, self.gateway, body, {"x-session-id": f"drain-{self.session}"})
        want = await chat(self.client, self.oracle, {**body, "stream": False}, clean=False)
        assert comparable(got) == comparable(want), f"session {self.session} turn {self.turn} differs"
        self.messages = next_messages(self.messages, got, self.session, self.turn)
        self.turn += 1


async def test_a_decode_node_joins_drains_and_leaves_without_a_failed_turn() -> None:
    spec = ClusterSpec(prefill=1, decode=2, speed=SPEED, kv_recompute_threshold=4, kv_lease_duration=3600.0,
                       decoder_kv_blocks_ttl=1e9)
    resolver = ScriptedResolver()
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    async with SimCluster(spec) as cluster, \
            SimCluster(ClusterSpec(prefill=0, decode=0, aggregated=1, speed=SPEED)) as oracle_cluster:
        p0, (d0, d1) = cluster.prefill_urls[0], cluster.decode_urls
        resolver.srv_records = {PREFILL: [_srv(p0)], DECODE: [_srv(d0)]}
        cfg = load_config(None, policy="pull", metrics_poll_interval_s=0.2, retention_interval_s=0.05,
                          discovery={"source": "dns", "dns_prefill": [PREFILL], "dns_decode": [DECODE],
                                     "dns_interval_s": 0.05})
        app = create_app(cfg, tracer_provider=provider, discovery=DnsDiscovery(cfg.discovery, resolver))
        gw: Any = app.state.gateway
        async with serve_gateway(cfg, app=app) as url, httpx.AsyncClient(timeout=60, limits=LIMITS) as client:

            async def metric(name: str, **labels: str) -> float:
                return sample_sum((await client.get(f"{url}/metrics")).text, name, **labels)

            async def pins() -> dict[str, str]:
                sessions = (await client.get(f"{url}/admin/sessions")).json()
                return {s["session_id"]: s["decode"] for s in sessions}

            async def ready() -> bool:
                return (await client.get(f"{url}/ready")).status_code == 200

            # Found by DNS, polled, ready: the gateway serves with the one decode node DNS names.
            await eventually(ready)
            oracle = oracle_cluster.aggregated_urls[0]
            one, two = Agent(client, url, oracle, 1), Agent(client, url, oracle, 2)
            for agent in (one, two):
                await agent.next()
                await agent.next()
            assert await pins() == {"drain-1": d0, "drain-2": d0}

            # A second decode node appears in DNS: it joins (polled) and is ready for new sessions.
            resolver.srv_records[DECODE] = [_srv(d0), _srv(d1)]
            await until(lambda: gw.cluster.nodes.get(d1) is not None and gw.cluster.nodes[d1].state == "ready")
            assert await metric("kvtether_nodes", role="decode", state="ready") == 2
            # Its series are there from its join, at zero, as a configured node's are from the start.
            series = f'kvtether_decode_stall_seconds_total{{node="{d1}"}} 0.0'
            assert series in (await client.get(f"{url}/metrics")).text

            # A turn of the first session runs on d0, slowly; while it runs, d0 leaves DNS and drains.
            await client.post(f"{d0}/admin/fault", json={"slow_factor": 2000})
            async with anyio.create_task_group() as tg:
                tg.start_soon(one.next)
                await until(lambda: gw.cluster.nodes[d0].inflight >= 1)
                resolver.srv_records[DECODE] = [_srv(d1)]
                await until(lambda: gw.cluster.nodes[d0].state == "draining")
                assert await metric("kvtether_nodes", role="decode", state="draining") == 1
                # Not ready-for-new-turns, but still in the view: its turn is running.
                assert gw.cluster.nodes[d0].inflight >= 1
                # The second session's next turn, placed while d0 drains, moves to d1; a new session starts on d1.
                await two.next()
                three = Agent(client, url, oracle, 3)
                await three.next()
                assert (await pins())["drain-2"] == d1 and (await pins())["drain-3"] == d1
                assert await metric("kvtether_session_moves_total", reason="draining") == 1
                await client.post(f"{d0}/admin/fault", json={"slow_factor": 1})
            # The first session's turn on d0 finished (and matched the oracle); d0 then left the view.
            await until(lambda: d0 not in gw.cluster.nodes)
            assert await metric("kvtether_nodes", role="decode", state="draining") == 0
            assert (await pins())["drain-1"] == d0  # its last turn ran there; the next one moves
            await one.next()
            assert (await pins())["drain-1"] == d1
            assert await metric("kvtether_session_moves_total", reason="gone") == 1
            assert await metric("kvtether_handle_releases_total", reason="unused") == 2  # the movers' d0 handles
            for agent in (one, two, three):
                await agent.next()

            # No turn failed; the move left nothing held on the remaining nodes once the sessions end.
            assert await metric("kvtether_requests_total", status="5xx") == 0
            assert await metric("kvtether_requests_total", status="4xx") == 0
            for session in ("drain-1", "drain-2", "drain-3"):
                assert (await client.delete(f"{url}/v1/sessions/{session}")).status_code == 204

            async def holds(node: str) -> list[dict[str, Any]]:
                state = (await client.get(f"{node}/admin/state")).json()
                return [h for h in state["held"] if h["kind"] == "retained"]

            async def none_held() -> bool:
                # d1's handles released as the sessions end; d0's as its sessions moved off it (it still answered)
                return await holds(d1) == [] and await holds(d0) == []

            await eventually(none_held)

    changes = [(s.attributes or {}) for s in exporter.get_finished_spans() if s.name == "kvtether.node.change"]
    seen = [(c["kvtether.node.url"], c["kvtether.node.state_before"], c["kvtether.node.state_after"])
            for c in changes]
    assert (d0, "ready", "draining") in seen and (d0, "draining", "removed") in seen
    assert (d1, "none", "joining") in seen and (d1, "joining", "ready") in seen
