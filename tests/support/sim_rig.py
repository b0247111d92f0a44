"""The simulator rig of the gateway's tests: a simulated P/D cluster, an aggregated oracle node answering the same
messages directly, and the gateway in front of the cluster; with the metrics and the session driver the tests
read it through."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
from kvtether.gateway.config import load_config
from kvtether.gateway.nodes.cluster import sample_sum
from kvtether.gateway.shell.app import create_app
from kvtether.gateway.shell.server import serve_gateway
from kvtether.sim.cluster import ClusterSpec, SimCluster

from tests.support.gateway_agent import chat, comparable, first_messages, next_messages, request_body

SPEED = 50.0
# Drop idle connections before the servers' 5 s keep-alive does (else a reused one may be reset).
LIMITS = httpx.Limits(keepalive_expiry=2.0)


@dataclass
class Rig:
    cluster: SimCluster
    oracle: str
    url: str
    app: Any
    client: httpx.AsyncClient

    @property
    def gw(self) -> Any:
        return self.app.state.gateway


@contextlib.asynccontextmanager
async def rig(*, prefill: int = 1, decode: int = 1, aggregated: int = 0, sim: dict[str, Any] | None = None,
              store: Any = None, **gw: Any) -> AsyncIterator[Rig]:
    # These tests pin down the pull mechanics: policy "pull" unless a test asks otherwise ("auto" may run a
    # turn on D instead; tests/gateway/test_auto.py covers it).
    gw.setdefault("policy", "pull")
    gw.setdefault("metrics_poll_interval_s", 0.5)
    spec = ClusterSpec(prefill=prefill, decode=decode, aggregated=aggregated, speed=SPEED,
                       **{"kv_recompute_threshold": 4, "kv_lease_duration": 3600.0, **(sim or {})})
    async with SimCluster(spec) as cluster, SimCluster(ClusterSpec(prefill=0, decode=0, aggregated=1,
                                                                    speed=SPEED)) as oracle:
        if aggregated:
            cfg = load_config(None, aggregated=cluster.aggregated_urls, **gw)
        else:
            cfg = load_config(None, prefill=cluster.prefill_urls, decode=cluster.decode_urls, **gw)
        app = create_app(cfg, store=store)
        async with serve_gateway(cfg, app=app) as url, httpx.AsyncClient(timeout=60, limits=LIMITS) as client:
            yield Rig(cluster, oracle.aggregated_urls[0], url, app, client)


async def metric(client: httpx.AsyncClient, url: str, name: str, **labels: str) -> float:
    return sample_sum((await client.get(f"{url}/metrics")).text, name, **labels)


async def p2p_tokens(r: Rig) -> float:
    return sum([await metric(r.client, u, "vllm:prompt_tokens_cached_by_source_total", source="p2p")
                for u in r.cluster.prefill_urls])


async def outcome(r: Rig, name: str) -> float:
    return await metric(r.client, r.url, "kvtether_handle_outcomes_total", outcome=name)


async def run_session(r: Rig, session: int, turns: int, *, header: bool = True, stream_every: int = 2,
                      thinking: bool = False, check_pull: bool = False) -> list[dict[str, Any]]:
    """Run one agent session through the gateway and against the oracle, turn by turn; assert equality."""
    messages = first_messages(session)
    headers = {"x-session-id": f"sess-{session}"} if header else {}
    answers = []
    for turn in range(turns):
        stream = stream_every > 0 and turn % stream_every == stream_every - 1
        before = await p2p_tokens(r) if check_pull else 0.0
        attached_before = await outcome(r, "attached") if check_pull else 0.0
        seen: dict[str, str] = {}
        got = await chat(r.client, r.url, request_body(messages, stream=stream, thinking=thinking), headers,
                         response_headers=seen)
        want = await chat(r.client, r.oracle, request_body(messages, stream=False, thinking=thinking), clean=False)
        assert comparable(got) == comparable(want), f"session {session} turn {turn} differs from the oracle"
        if check_pull and turn > 0:
            # Every turn after the first extends the history exactly: the handle is attached and P pulls, and
            # the answer says so because P's cached count says so.
            assert await outcome(r, "attached") == attached_before + 1, f"turn {turn} not attached"
            assert await p2p_tokens(r) > before, f"turn {turn}: no reverse pull"
            assert seen["x-kvtether-reuse-source"] == "decode_pull", (turn, seen)
        answers.append(got)
        messages = next_messages(messages, got, session, turn)
    return answers
