"""The simulator rig of the gateway's tests: `cli/simstack`'s stack (a simulated P/D cluster, an aggregated oracle
node answering the same messages directly, and the gateway in front of the cluster) with the gateway's own
defaults under each test's settings, a client, and the metrics and the session driver the tests read it through.

`stack_spec` spells a simulated cluster as the simulator's `ClusterSpec` does (its defaults, its field names) for
the tests that start `sim_stack` themselves."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
from kvtether.cli.simstack import COLOCATED, SimStack, StackSpec, StackTimes, sim_stack
from kvtether.gateway.nodes.cluster import sample_sum
from kvtether.gateway.stores import SessionStore
from kvtether.sim.cluster import ClusterSpec, SimCluster

from tests.support.gateway_agent import chat, comparable, first_messages, next_messages, request_body

SPEED = 50.0
# Drop idle connections before the servers' 5 s keep-alive does (else a reused one may be reset).
LIMITS = httpx.Limits(keepalive_expiry=2.0)
# The rig's nodes: a turn's KV is reused from 4 tokens on, and a lease outlasts every test.
RIG_SIM: dict[str, Any] = {"kv_recompute_threshold": 4, "kv_lease_duration": 3600.0}
_DEFAULTS = ClusterSpec()


def stack_spec(*, prefill: int = 1, decode: int = 1, aggregated: int = 0, speed: float = SPEED,
               preset: str = _DEFAULTS.preset, **cluster: Any) -> StackSpec:
    """The stack of a `ClusterSpec(prefill=…, decode=…, aggregated=…, speed=…, preset=…, **cluster)`: the
    simulator's defaults where the stack has its own (the engines' KV TTL, prefix caching on P). `aggregated`: that
    many nodes for a one-pool option (``COLOCATED``, ``HYBRID``), instead of `prefill` + `decode`."""
    if aggregated:  # a one-pool option's stack runs as many instances as the P/D shape has nodes
        prefill, decode = aggregated, 0
    ttl = cluster.pop("decoder_kv_blocks_ttl", _DEFAULTS.decoder_kv_blocks_ttl)
    caching = cluster.pop("prefill_prefix_caching", _DEFAULTS.prefill_prefix_caching)
    return StackSpec(preset=preset, prefill=prefill, decode=decode, speed=speed,
                     times=StackTimes(engine_kv_ttl_s=ttl), prefill_prefix_caching=caching, cluster=cluster)


@dataclass
class Rig:
    stack: SimStack
    client: httpx.AsyncClient

    @property
    def cluster(self) -> SimCluster:
        assert self.stack.cluster is not None
        return self.stack.cluster

    @property
    def oracle(self) -> str:
        assert self.stack.oracle is not None
        return self.stack.oracle

    @property
    def url(self) -> str:
        return self.stack.url

    @property
    def app(self) -> Any:
        return self.stack.app

    @property
    def gw(self) -> Any:
        return self.app.state.gateway


@contextlib.asynccontextmanager
async def rig(*, prefill: int = 1, decode: int = 1, aggregated: int = 0, sim: dict[str, Any] | None = None,
              store: SessionStore | None = None, tracer_provider: Any = None, **gw: Any) -> AsyncIterator[Rig]:
    """`prefill` + `decode` nodes (or `aggregated` ones) with `RIG_SIM` and `sim` over the simulator's defaults;
    the gateway's defaults with `gw` over them."""
    # These tests pin down the pull mechanics: policy "pull" unless a test asks otherwise ("auto" may run a
    # turn on D instead; tests/gateway/test_auto.py covers it).
    gw.setdefault("policy", "pull")
    gw.setdefault("metrics_poll_interval_s", 0.5)
    option = COLOCATED if aggregated else gw["policy"]
    spec = stack_spec(prefill=prefill, decode=decode, aggregated=aggregated, **{**RIG_SIM, **(sim or {})})
    async with sim_stack(spec, option, gateway=gw, calibrated=False, oracle=True, store=store,
                         tracer_provider=tracer_provider) as stack, \
            httpx.AsyncClient(timeout=60, limits=LIMITS) as client:
        yield Rig(stack, client)


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
