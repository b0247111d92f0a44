"""The gateway under faults and hostile clients, against the simulator: bad requests never take a node out,
nodes come back on their own, stuck or unreachable nodes are routed around, a 5xx storm opens the breaker
with clean 503s, a full upstream pool is the gateway's own 503 (counted, never a node's failure), clients that
leave leak nothing, and tenants never share a session."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

import anyio
import httpx
import pytest
from kvtether.gateway.transport.upstream import Upstream

from tests.support.gateway_agent import MODEL, chat, comparable, first_messages, next_messages, request_body
from tests.support.sim_rig import metric, outcome, rig
from tests.support.upstream_hooks import break_streams, on_send

pytestmark = pytest.mark.anyio



def _nested(levels: int) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        out = {"type": "object", "properties": {"x": out}}
    return out


BAD_BODIES: list[Any] = [
    b"[" * 5000 + b"]" * 5000,  # deeper than the JSON parser's recursion (a RecursionError once)
    {"model": MODEL, "messages": [{"content": "no role"}]},
    {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
    {"model": MODEL, "messages": [{"role": "user", "content": 5}]},
    {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
    {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": -5},
    {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": True},
    {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
    {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_p": 7},
    {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": "x"},
    {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [{"function": {}}]},
    {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 3},  # P/D: one sequence
    {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tool_choice": 3},
    {"model": MODEL, "messages": [{"role": "user", "content": "x"}],  # a tool schema 40 levels deep
     "tools": [{"type": "function", "function": {"name": "f", "parameters": _nested(40)}}]},
    {"model": MODEL, "messages": [{"role": "user", "content": "x"}] * 10_001},  # hashing them would stall
    {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * 1025}]},
    {"model": MODEL, "prompt": ["a", "b"]},  # a batch: one prompt per request in P/D
    {"model": MODEL, "prompt": [[1, 2], "x"]},
]


async def _post(client: httpx.AsyncClient, url: str, body: Any, path: str = "/v1/chat/completions",
                headers: dict[str, str] | None = None) -> httpx.Response:
    if isinstance(body, bytes):
        return await client.post(f"{url}{path}", content=body, headers=headers)
    if isinstance(body, dict) and "prompt" in body:
        path = "/v1/completions"
    return await client.post(f"{url}{path}", json=body, headers=headers)


async def test_hostile_requests_get_a_4xx_and_never_take_a_node_out() -> None:
    async with rig(prefill=1, decode=1) as r:
        statuses = [(await _post(r.client, r.url, body)).status_code for body in BAD_BODIES]
        assert all(s == 400 for s in statuses), list(zip(statuses, range(len(BAD_BODIES)), strict=True))
        for name, value in (("x-session-id", "a b"), ("x-session-id", "x" * 300), ("x-kvtether-turn", "-1"),
                            ("x-kvtether-prefix", "not-hex")):
            resp = await _post(r.client, r.url, request_body(first_messages(1), stream=False), headers={name: value})
            assert resp.status_code == 400 and resp.json()["error"]["param"] == name, resp.text
        # A prompt far beyond the served model's context is refused without being tokenized anywhere.
        huge = {"model": MODEL, "messages": [{"role": "user", "content": "word " * 2_500_000}]}
        tokenizer = r.cluster.nodes[0].tokenizer  # every simulated node's (and the only one in this process)
        encodings = sum(tokenizer.cache_info()[k] for k in ("hits", "misses"))
        resp = await _post(r.client, r.url, huge)
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "context_length_exceeded", resp.text
        assert sum(tokenizer.cache_info()[k] for k in ("hits", "misses")) == encodings, "the prompt was tokenized"
        nodes = r.gw.cluster.nodes.values()
        assert all(n.healthy and n.consecutive_errors == 0 for n in nodes)
        assert await metric(r.client, r.url, "kvtether_upstream_errors_total") == 0
        assert (await r.client.get(f"{r.url}/admin/sessions")).json() == []  # nothing rejected touched a session
        got = await chat(r.client, r.url, request_body(first_messages(2), stream=True), {"x-session-id": "ok"})
        want = await chat(r.client, r.oracle, request_body(first_messages(2), stream=False), clean=False)
        assert comparable(got) == comparable(want)


@pytest.mark.wall_clock  # times the breaker on the OS clock
async def test_a_5xx_storm_opens_the_breaker_with_retry_after_and_the_node_comes_back_by_itself() -> None:
    """The only decode node fails every request: after a few, the gateway stops sending it work and answers
    503 with Retry-After at once; when the storm is over its /health probe (polls are minutes apart here)
    puts it back within the bounded backoff, and turns succeed again."""
    async with rig(prefill=1, decode=1, metrics_poll_interval_s=600.0, health_backoff_s=0.1,
                   health_backoff_max_s=0.5) as r:
        d = r.cluster.decode_urls[0]
        await r.client.post(f"{d}/admin/fault", json={"fail_next": 10_000})
        body = request_body(first_messages(3), stream=False)
        seen: list[int] = []
        for _ in range(8):
            resp = await r.client.post(f"{r.url}/v1/chat/completions", json=body)
            seen.append(resp.status_code)
            assert "error" in resp.json()
            if resp.status_code == 503:
                assert resp.json()["error"]["code"] == "no_capacity"
                assert 1 <= int(resp.headers["retry-after"]) <= 5
        assert set(seen) <= {502, 503} and 503 in seen, seen
        assert not r.gw.cluster.nodes[d].healthy
        await r.client.post(f"{d}/admin/fault", json={"fail_next": 0})
        node = r.gw.cluster.nodes[d]
        # However long it has failed, its next /health probe is due within the backoff's bound (the gateway's
        # schedule, not a measured time: a busy machine only makes the probe late, not the schedule).
        assert node.backoff_s <= 0.5 and node.out_until - time.monotonic() <= 0.5, (node.backoff_s, node.out_until)
        with anyio.fail_after(30):
            while not node.healthy:  # noqa: ASYNC110 - the gateway's own state, no event
                await anyio.sleep(0.05)
        got = await chat(r.client, r.url, body)
        want = await chat(r.client, r.oracle, body, clean=False)
        assert comparable(got) == comparable(want)
        assert (await r.client.get(f"{r.url}/ready")).json()["ready"] is True


@pytest.mark.wall_clock  # times the retry on the OS clock
async def test_a_prefill_that_accepts_and_never_answers_is_retried_on_another_within_the_bound() -> None:
    async with rig(prefill=2, decode=1, prefill_timeout_s=1.0) as r:
        first = r.cluster.prefill_urls[0]  # a new session's cold prefill: least loaded, first configured
        await r.client.post(f"{first}/admin/fault", json={"hang_next": 1})
        body = request_body(first_messages(4), stream=True)
        started = time.perf_counter()
        # The hung prefill never answers and no read timeout is set: only prefill_timeout_s ends it (never
        # before it has passed), so any bound far below the test's own timeout tells the two apart, however
        # busy the machine.
        with anyio.fail_after(120):
            got = await chat(r.client, r.url, body, {"x-session-id": "stuck-p"})
        took = time.perf_counter() - started
        want = await chat(r.client, r.oracle, {**body, "stream": False}, clean=False)
        assert comparable(got) == comparable(want)
        assert took >= 1.0, took
        assert await metric(r.client, r.url, "kvtether_upstream_errors_total", phase="prefill") == 1


class _ConnectTimeoutTo:
    """Every completion request to `node` times out connecting, as a dead host behind a firewall would."""

    def __init__(self, upstream: Upstream, node: str, times: int = 1_000_000) -> None:
        self.node, self.refused, self.times = node, 0, times
        on_send(upstream, self.send)

    def send(self, method: str, url: str, headers: Mapping[str, str]) -> None:
        if url.startswith(f"{self.node}/v1/") and self.refused < self.times:
            self.refused += 1
            raise httpx.ConnectTimeout("connect timed out")


async def test_a_decode_connect_timeout_is_retried_on_another_decode_node() -> None:
    async with rig(prefill=1, decode=2) as r:
        h = {"x-session-id": "ct"}
        msgs = first_messages(5)
        for turn in range(4):
            if turn == 2:
                pinned = (await r.client.get(f"{r.url}/admin/sessions")).json()[0]["decode"]
                faulty = _ConnectTimeoutTo(r.gw.upstream, pinned)
            body = request_body(msgs, stream=turn % 2 == 0)
            got = await chat(r.client, r.url, body, h)  # asserts 200 on every turn: none failed
            want = await chat(r.client, r.oracle, {**body, "stream": False}, clean=False)
            assert comparable(got) == comparable(want)
            msgs = next_messages(msgs, got, 5, turn)
        assert faulty.refused >= 1
        assert (await r.client.get(f"{r.url}/admin/sessions")).json()[0]["decode"] != pinned


async def test_a_connect_timeout_on_the_only_decode_node_is_retried_there() -> None:
    """A connect timeout is no proof a node is down (a busy node's accept queue): with no other decode node the
    turn is tried once more on the same one, and the node stays in service."""
    async with rig(prefill=1, decode=1) as r:
        d = r.cluster.decode_urls[0]
        faulty = _ConnectTimeoutTo(r.gw.upstream, d, times=1)
        body = request_body(first_messages(9), stream=True)
        got = await chat(r.client, r.url, body, {"x-session-id": "once"})
        want = await chat(r.client, r.oracle, {**body, "stream": False}, clean=False)
        assert comparable(got) == comparable(want) and faulty.refused == 1
        assert r.gw.cluster.nodes[d].healthy


async def test_a_client_that_leaves_mid_stream_leaks_no_quota_pin_or_connection() -> None:
    async with rig(policy="auto", prefill=1, decode=1, min_reuse_tokens=4, request_stall_share=0.5) as r:
        h = {"x-session-id": "leaver"}
        msgs = first_messages(6)
        got = await chat(r.client, r.url, request_body(msgs, stream=False), h)
        msgs = next_messages(msgs, got, 6, 0)
        body = {**request_body(msgs, stream=True), "max_tokens": 3000, "min_tokens": 3000, "ignore_eos": True}
        async with r.client.stream("POST", f"{r.url}/v1/chat/completions", json=body, headers=h) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data:") and '"content"' in line:
                    break  # the answer is decoding: the client walks away
        learning = r.gw.orchestrator.learning
        d = r.gw.cluster.nodes[r.cluster.decode_urls[0]]
        with anyio.fail_after(10):
            while d.inflight or learning.exposures:  # noqa: ASYNC110 - the gateway's own state
                await anyio.sleep(0.02)
        assert d.holding_back == 0 and d.arriving == 0
        sessions = (await r.client.get(f"{r.url}/admin/sessions")).json()
        assert [s["session_id"] for s in sessions] == ["leaver"]  # the pin stays for the next turn
        with anyio.fail_after(10):
            while r.gw.upstream.busy:  # noqa: ASYNC110 - the pool's own state
                await anyio.sleep(0.02)
        got = await chat(r.client, r.url, request_body(msgs, stream=False), h)  # the session goes on
        want = await chat(r.client, r.oracle, request_body(msgs, stream=False), clean=False)
        assert comparable(got) == comparable(want)


async def test_streams_are_counted_by_how_they_ended_whole_left_or_broken() -> None:
    """A stream's request is counted 2xx when it starts; kvtether_streams_total says how it ended: whole, the
    client gone before [DONE], or the node's stream broken (the client gets an error event, the span an error)."""
    async with rig(prefill=1, decode=1) as r:
        async def streams(end: str) -> float:
            return await metric(r.client, r.url, "kvtether_streams_total", route="chat", end=end)

        msgs = first_messages(3)
        got = await chat(r.client, r.url, request_body(msgs, stream=True), {"x-session-id": "whole"})
        assert got["content"]
        await chat(r.client, r.url, request_body(msgs, stream=False), {"x-session-id": "unstreamed"})
        assert [await streams(e) for e in ("complete", "client_left", "broken")] == [1, 0, 0]

        body = {**request_body(msgs, stream=True), "max_tokens": 3000, "min_tokens": 3000, "ignore_eos": True}
        async with r.client.stream("POST", f"{r.url}/v1/chat/completions", json=body,
                                   headers={"x-session-id": "leaver"}) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data:") and '"content"' in line:
                    break  # the answer is decoding: the client walks away
        with anyio.fail_after(10):
            while await streams("client_left") < 1:  # noqa: ASYNC110 - the gateway's own metric
                await anyio.sleep(0.02)

        cut = break_streams(r.gw.upstream, r.cluster.decode_urls[0], after=3)
        async with r.client.stream("POST", f"{r.url}/v1/chat/completions", json=body,
                                   headers={"x-session-id": "broken"}) as resp:
            assert resp.status_code == 200
            text = (await resp.aread()).decode()
        assert cut == [1] and "upstream stream failed" in text and "[DONE]" not in text
        with anyio.fail_after(10):
            while await streams("broken") < 1:  # noqa: ASYNC110 - the gateway's own metric
                await anyio.sleep(0.02)
        assert [await streams(e) for e in ("complete", "client_left", "broken")] == [1, 1, 1]
        assert await metric(r.client, r.url, "kvtether_requests_total", route="chat", status="2xx") == 4


KEYS = {"key-tenant-a-0001": "A", "key-tenant-b-0002": "B"}


def _as(tenant: str, session: str) -> dict[str, str]:
    key = next(k for k, t in KEYS.items() if t == tenant)
    return {"authorization": f"Bearer {key}", "x-session-id": session}


@pytest.mark.parametrize("salted", [True, False])
async def test_tenants_do_not_hit_each_others_prefix_cache_unless_told_to(salted: bool) -> None:
    """A prefix-cache hit is a timing signal: with tenant salts, tenant B sending exactly what tenant A sent
    finds nothing of it cached on P, while another session of A's hits it."""
    async with rig(prefill=1, decode=1, api_keys=KEYS, tenant_cache_salt=salted) as r:
        msgs = first_messages(9)
        body = request_body(msgs, stream=False)

        async def source(tenant: str, session: str, **extra: Any) -> str:
            resp = await r.client.post(f"{r.url}/v1/chat/completions", json={**body, **extra},
                                       headers=_as(tenant, session))
            assert resp.status_code == 200, resp.text
            return str(resp.headers["x-kvtether-reuse-source"])

        assert await source("A", "first") == "none"
        assert await source("B", "other") == ("none" if salted else "prefill_cache")
        assert await source("A", "second") == "prefill_cache"
        # A client's own salt divides its tenant's cache further, and never reaches another tenant's.
        assert await source("A", "third", cache_salt="user-1") == "none"
        assert await source("A", "fourth", cache_salt="user-1") == "prefill_cache"
        assert await source("B", "fifth", cache_salt="user-1") == ("none" if salted else "prefill_cache")
        bad = await r.client.post(f"{r.url}/v1/chat/completions", json={**body, "cache_salt": ""},
                                  headers=_as("A", "x"))
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"


async def test_a_tenant_naming_another_tenants_session_is_answered_cold_never_with_its_kv() -> None:
    """Tenant B sends tenant A's session id with A's exact history (a perfect extension of what A's decode
    node holds): B's turn gets no handle, reads nothing from D, and A's next turn still pulls its own."""
    async with rig(prefill=1, decode=1, api_keys=KEYS, admin_key="admin-key-0003") as r:
        msgs = first_messages(8)
        for turn in range(2):
            got = await chat(r.client, r.url, request_body(msgs, stream=False), _as("A", "shared"))
            msgs = next_messages(msgs, got, 8, turn)
        attached = await outcome(r, "attached")
        assert attached == 1
        resp = await r.client.post(f"{r.url}/v1/chat/completions", json=request_body(msgs, stream=False),
                                   headers=_as("B", "shared"))
        assert resp.status_code == 200
        assert resp.headers["x-kvtether-reuse-source"] != "decode_pull"
        assert await outcome(r, "attached") == attached, "B's turn was sent A's handle"
        want = await chat(r.client, r.oracle, request_body(msgs, stream=False), clean=False)
        assert comparable(resp.json()["choices"][0]["message"]) == comparable(want)
        a = await r.client.post(f"{r.url}/v1/chat/completions", json=request_body(msgs, stream=False),
                                headers=_as("A", "shared"))
        assert a.status_code == 200 and a.headers["x-kvtether-reuse-source"] == "decode_pull"
        # Keys: none or a wrong one is a 401; the admin API needs the admin key, and shows both namespaces.
        for headers in ({}, {"authorization": "Bearer nope-nope-nope"}):
            resp = await r.client.post(f"{r.url}/v1/chat/completions", json=request_body(msgs, stream=False),
                                       headers=headers)
            assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
        assert (await r.client.get(f"{r.url}/admin/sessions", headers=_as("A", "x"))).status_code == 401
        admin = await r.client.get(f"{r.url}/admin/sessions", headers={"authorization": "Bearer admin-key-0003"})
        assert sorted(s["session_id"] for s in admin.json()) == ["A/shared", "B/shared"]
        assert "key-tenant" not in json.dumps(admin.json())



@pytest.mark.parametrize("max_connections", [1, None])
async def test_turns_that_wait_for_an_upstream_connection_are_counted(max_connections: int | None) -> None:
    """Three sessions' first turns at once through a gateway process with one upstream connection: the turns
    queue for it in the gateway, before any node sees them, and only the gateway can say so. With the default
    bound none waits."""
    async with rig(prefill=1, decode=2, **({"max_connections": max_connections} if max_connections else {})) as r:
        async def turn(session: int) -> None:
            await chat(r.client, r.url, request_body(first_messages(session), stream=True),
                       {"x-session-id": f"wait-{session}"})

        async with anyio.create_task_group() as tg:
            for session in (1, 2, 3):
                tg.start_soon(turn, session)
        waits = await metric(r.client, r.url, "kvtether_upstream_connection_waits_total")
        seconds = await metric(r.client, r.url, "kvtether_upstream_connection_wait_seconds_total")
        assert await metric(r.client, r.url, "kvtether_requests_total", route="chat", status="2xx") == 3
    if max_connections:
        # Each turn's two legs take the one connection in turn: at least the two turns behind the first waited.
        assert waits >= 2 and seconds > 0, (waits, seconds)
    else:
        assert waits == 0 and seconds == 0

async def test_a_full_upstream_pool_is_the_gateways_503_and_never_counts_against_a_node() -> None:
    """One upstream connection and a pool timeout shorter than an answer: of three turns at once, those that
    find the connection taken for that long get a 503 that says the gateway is busy, with Retry-After; no node
    is counted failing (it never saw them), every node stays in service, and the next turn is answered."""
    async with rig(prefill=1, decode=2, max_connections=1, pool_timeout_s=0.0001) as r:
        async def turn(session: int, out: list[httpx.Response]) -> None:
            out.append(await r.client.post(f"{r.url}/v1/chat/completions",
                                           json=request_body(first_messages(session), stream=False),
                                           headers={"x-session-id": f"full-{session}"}))

        answers: list[httpx.Response] = []
        async with anyio.create_task_group() as tg:
            for session in (1, 2, 3):
                tg.start_soon(turn, session, answers)
        refused = [a for a in answers if a.status_code != 200]
        assert refused and len(refused) < 3, [a.status_code for a in answers]
        for a in refused:
            assert a.status_code == 503 and a.json()["error"]["code"] == "gateway_busy", a.text
            assert int(a.headers["retry-after"]) == 1
        assert await metric(r.client, r.url, "kvtether_upstream_errors_total") == 0
        assert await metric(r.client, r.url, "kvtether_upstream_connection_waits_total") >= len(refused)
        assert all(n.healthy for n in r.gw.cluster.nodes.values())
        body = request_body(first_messages(4), stream=False)
        assert comparable(await chat(r.client, r.url, body)) == comparable(await chat(r.client, r.oracle, body,
                                                                                      clean=False))


async def test_a_handle_taken_for_a_turn_the_full_pool_refused_is_released_not_left_held() -> None:
    """A session's later turn takes its handle from the store, then finds the gateway's one connection held by
    another session's stream: refused 503, and the handle it can no longer use is released on D at once
    (it would hold D's blocks until the engine's TTL); the client's retry runs cold and is answered right."""
    async with rig(prefill=1, decode=1, max_connections=1, pool_timeout_s=0.0001) as r:
        a = {"x-session-id": "held-a"}
        messages = first_messages(1)
        got = await chat(r.client, r.url, request_body(messages, stream=False), a)
        messages = next_messages(messages, got, 1, 0)
        released = await metric(r.client, r.url, "kvtether_handle_releases_total", reason="unused")
        async with r.client.stream("POST", f"{r.url}/v1/chat/completions",
                                   json=request_body(first_messages(2), stream=True),
                                   headers={"x-session-id": "held-b"}) as stream:
            lines = stream.aiter_lines()
            while not (await anext(lines)).startswith("data:"):  # B's answer is streaming: its leg holds the pool
                pass
            refused = await r.client.post(f"{r.url}/v1/chat/completions",
                                          json=request_body(messages, stream=False), headers=a)
            async for _ in lines:
                pass
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "gateway_busy", refused.text
        # The release goes out off the request path: done within a second (virtual time: no wall time).
        with anyio.fail_after(1.0):
            while await metric(r.client, r.url, "kvtether_handle_releases_total", reason="unused") == released:  # noqa: ASYNC110 - a scraped counter, no event
                await anyio.sleep(0.01)
        assert await metric(r.client, r.url, "kvtether_handle_releases_total", reason="unused") == released + 1
        body = request_body(messages, stream=False)
        assert comparable(await chat(r.client, r.url, body, a)) == comparable(await chat(r.client, r.oracle, body,
                                                                                         clean=False))
