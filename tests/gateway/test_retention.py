"""Decode memory through the gateway on the simulator: every handle the gateway will not pull is released on
its decode node (superseded, refused, unused, final, expired, budget, pressure, shutdown), a handle it may still
pull is kept for as long as D has room for it, the held-KV gauges say what the rest hold, and answers still equal
the aggregated oracle's.

The simulator holds D's blocks as vLLM 0.32–0.34 does (tests/sim/test_retention.py): a P/D turn's hold until a
pull, a one-token release or ``decoder_kv_blocks_ttl``. Its TTL is set far out here, so that every hold that
goes away went because the gateway released it.
"""

from __future__ import annotations

import math
from typing import Any

import anyio
import httpx
import openai
import pytest
from kvtether.gateway.config import load_config
from kvtether.gateway.shell.app import create_app
from kvtether.gateway.shell.server import serve_gateway
from kvtether.protocol.contract import FINAL_HEADER
from kvtether.sdk import AgentSession
from kvtether.sim.cluster import ClusterSpec, SimCluster

from tests.support.gateway_agent import chat, comparable, first_messages, next_messages, request_body, tool_result
from tests.support.sim_rig import LIMITS, SPEED, Rig, metric, rig

pytestmark = pytest.mark.anyio

# Simulated seconds: at SPEED 50 a 480 s TTL would end in under 10 real seconds, inside a test.
_NO_TTL = {"decoder_kv_blocks_ttl": 1e9}
# The gateway's retention times as the simulator's clock sees them (the gateway's clock is real): its handle
# expiry 450 s, the engine TTL it must stay under 480 s, its review every second.
_SCALED = {"session_ttl_s": 450.0 / SPEED, "engine_kv_ttl_s": 480.0 / SPEED, "retention_interval_s": 0.05}


async def holds(r: Rig, node: str | None = None) -> list[dict[str, Any]]:
    """The decode node's retained holds (the simulator's white-box view)."""
    url = node or r.cluster.decode_urls[0]
    state = (await r.client.get(f"{url}/admin/state")).json()
    return [h for h in state["held"] if h["kind"] == "retained"]


async def released(r: Rig, reason: str) -> float:
    return await metric(r.client, r.url, "kvtether_handle_releases_total", reason=reason)


async def eventually(check: Any, within_s: float = 10.0) -> None:
    """Releases go out off the request path: wait for `check()` (async, truthy) or fail with its last value."""
    last: Any = None
    for _ in range(int(within_s / 0.05)):
        if last := await check():
            return
        await anyio.sleep(0.05)
    raise AssertionError(f"not reached in {within_s} s: {last!r}")


async def turns(r: Rig, session: int, n: int, headers: dict[str, str], *, final: bool = False,
                messages: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """`n` turns of one session, each checked against the oracle; the last one marked final when asked."""
    messages = messages or first_messages(session)
    for t in range(n):
        h = {**headers, FINAL_HEADER: "true"} if final and t == n - 1 else headers
        got = await chat(r.client, r.url, request_body(messages, stream=t % 2 == 1), h)
        want = await chat(r.client, r.oracle, request_body(messages, stream=False), clean=False)
        assert comparable(got) == comparable(want), f"session {session} turn {t} differs from the oracle"
        messages = next_messages(messages, got, session, t, result_words=40)
    return messages


async def test_a_final_turn_releases_its_handle_and_ends_the_session() -> None:
    async with rig(sim=_NO_TTL) as r:
        h = {"x-session-id": "final-1"}
        await turns(r, 1, 2, h)
        # Each P/D turn's hold: the first was pulled (freed) by the second, which left one.
        assert len(await holds(r)) == 1
        await turns(r, 2, 3, {"x-session-id": "final-2"}, final=True)
        await eventually(lambda: released(r, "final"))
        await eventually(lambda: _count(holds(r), 1))
        sessions = (await r.client.get(f"{r.url}/admin/sessions")).json()
        assert [s["session_id"] for s in sessions] == ["final-1"]
        assert await released(r, "final") == 1


async def _count(coro: Any, n: int) -> bool:
    return len(await coro) == n


async def test_delete_ends_a_session_and_releases_its_handle() -> None:
    async with rig(sim=_NO_TTL) as r:
        await turns(r, 3, 2, {"x-session-id": "del/1"})
        assert len(await holds(r)) == 1
        resp = await r.client.delete(f"{r.url}/v1/sessions/del/1")
        assert resp.status_code == 204, resp.text
        await eventually(lambda: _count(holds(r), 0))
        assert await released(r, "final") == 1
        assert (await r.client.get(f"{r.url}/admin/sessions")).json() == []
        again = await r.client.delete(f"{r.url}/v1/sessions/del/1")
        assert again.status_code == 404 and again.json()["error"]["code"] == "session_not_found"
        bad = await r.client.delete(f"{r.url}/v1/sessions/has space")
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "session_id"


async def test_a_handle_the_guard_refuses_is_released_at_once() -> None:
    async with rig(sim=_NO_TTL) as r:
        h = {"x-session-id": "edit-1"}
        messages = await turns(r, 4, 2, h)
        [before] = await holds(r)
        # An edited history (the system prompt rewritten): the guard refuses the handle, the turn goes cold.
        edited = [{**messages[0], "content": "You are someone else entirely. " * 20}, *messages[1:]]
        await turns(r, 4, 1, h, messages=edited)
        assert await metric(r.client, r.url, "kvtether_handle_outcomes_total", outcome="refused_by_guard") == 1
        await eventually(lambda: released(r, "refused"))
        await eventually(lambda: _count(holds(r), 1))
        [after] = await holds(r)
        assert after["request_id"] != before["request_id"]  # the new turn's hold is the one left


async def paced(r: Rig, session: int, gaps_s: list[float], *, final: bool, start_s: float = 0.0) -> list[str]:
    """A session of ``len(gaps_s) + 1`` turns from ``start_s``, each checked against the oracle, away ``gaps_s``
    between them (a tool call, or a person reading and typing; simulated seconds); its last turn final when
    asked. Returns each turn's reuse source."""
    await anyio.sleep(start_s / SPEED)
    headers = {"x-session-id": f"paced-{session}"}
    messages = first_messages(session)
    sources = []
    for t in range(len(gaps_s) + 1):
        last = t == len(gaps_s)
        h = {**headers, FINAL_HEADER: "true"} if final and last else headers
        seen: dict[str, str] = {}
        got = await chat(r.client, r.url, request_body(messages, stream=t % 2 == 1), h, response_headers=seen)
        want = await chat(r.client, r.oracle, request_body(messages, stream=False), clean=False)
        assert comparable(got) == comparable(want), f"session {session} turn {t} differs from the oracle"
        sources.append(seen.get("x-kvtether-reuse-source", ""))
        if not last:
            messages = next_messages(messages, got, session, t, result_words=40)
            await anyio.sleep(gaps_s[t] / SPEED)
    return sources


# Coding agents' tool calls (0–20 s, a burst of fast ones then a slow build or test run) and people's replies
# (minutes), in simulated seconds. The clock rule this gateway once had (away 4 of its mean gaps, 180 s at
# most) released every one of these sessions' handles before its next turn.
_TOOL_GAPS = [[0.2, 0.3, 0.1, 18.0, 0.5, 20.0], [2.0, 0.1, 12.0, 0.2, 19.0], [0.0, 5.0, 0.4, 16.0]]
_HUMAN_GAPS = [[150.0, 290.0], [240.0, 60.0, 270.0]]


async def test_sessions_that_stay_away_keep_their_handles_while_the_decode_node_has_room() -> None:
    """Five sessions far apart in time on a decode node far below its budget: not one handle is released before
    its session's next turn, however long the session stays away (within the handle's expiry), and every later
    turn pulls. The sessions that end say so and are released; those that just stop keep their handles (until
    their expiry: the coding sessions start late, so that every session's last turn is well within it at the
    end)."""
    async with rig(sim=_NO_TTL, **_SCALED) as r:
        plans = [(g, i % 2 == 0, 400.0 if g in _TOOL_GAPS else 0.0) for i, g in enumerate(_TOOL_GAPS + _HUMAN_GAPS)]
        got: dict[int, list[str]] = {}

        async def one(i: int, gaps: list[float], final: bool, start_s: float) -> None:
            got[i] = await paced(r, 100 + i, gaps, final=final, start_s=start_s)

        async with anyio.create_task_group() as tg:
            for i, (gaps, final, start_s) in enumerate(plans):
                tg.start_soon(one, i, gaps, final, start_s)
        later = sum(len(g) for g, _, _ in plans)
        assert all(src == "decode_pull" for i in got for src in got[i][1:]), got
        pulled = sum([await metric(r.client, r.url, "kvtether_handle_outcomes_total", outcome=o)
                      for o in ("attached", "truncated")])
        assert pulled == later
        ended = sum(final for _, final, _ in plans)
        await eventually(lambda: released(r, "final"))
        await eventually(lambda: _count(holds(r), len(plans) - ended))
        for reason in ("expired", "budget", "pressure", "unused", "superseded", "refused"):
            assert await released(r, reason) == 0, reason
        assert await released(r, "final") == ended
        # The held KV is far below the budget: that is why nothing had to go.
        d = r.cluster.decode_urls[0]
        assert 0 < await metric(r.client, r.url, "kvtether_held_kv_share", node=d) < 0.1


async def test_a_handle_is_released_at_its_expiry_not_left_to_the_engine() -> None:
    """A session that just stops keeps its handle until the gateway's handle expiry (session_ttl_s); then the
    gateway, which will never send it again, releases it, rather than leave D holding it to its own TTL (here
    never): D holds nothing afterwards."""
    async with rig(sim=_NO_TTL, session_ttl_s=1.5, engine_kv_ttl_s=2.0, retention_interval_s=0.05) as r:
        await turns(r, 5, 2, {"x-session-id": "expiring-1"})
        assert len(await holds(r)) == 1
        await anyio.sleep(0.5)
        assert len(await holds(r)) == 1 and await released(r, "expired") == 0  # not yet
        await eventually(lambda: released(r, "expired"))
        await eventually(lambda: _count(holds(r), 0))
        assert await released(r, "expired") == 1


async def test_when_holds_fill_the_decode_node_pressure_releases_them_and_every_request_is_served() -> None:
    """No budget (held_kv_budget 1), no engine TTL, and a decode node of 300 blocks that about ten sessions'
    holds fill: the next decode leg cannot get its blocks and waits, with nothing running on D. Its memory is
    wanted, so the gateway releases holds (the least likely to be pulled first) until the leg fits: every turn
    is answered as the oracle answers it, and D is left with no request waiting."""
    async with rig(sim={**_NO_TTL, "decode_num_gpu_blocks": 300}, held_kv_budget=1.0,
                   retention_interval_s=0.05) as r:
        d = r.cluster.decode_urls[0]
        await eventually(lambda: _capacity_known(r, d))
        sessions = 16
        for s in range(sessions):
            await turns(r, 200 + s, 1, {"x-session-id": f"full-{s}"})
        assert await released(r, "pressure") > 0
        assert await released(r, "budget") == 0 and await released(r, "expired") == 0
        state = (await r.client.get(f"{d}/admin/state")).json()
        assert state["waiting"] == 0 and state["running"] == 0
        left = await holds(r)
        assert 0 < len(left) < sessions
        # The newest sessions kept theirs: the oldest (longest away) went first.
        kept = {s["session_id"] for s in (await r.client.get(f"{r.url}/admin/sessions")).json() if s["has_handle"]}
        assert f"full-{sessions - 1}" in kept and "full-0" not in kept


async def test_each_decode_node_stays_under_its_budget() -> None:
    # 300 blocks of 16 tokens on D: 4,800 tokens; a budget of 30 % is 1,440 tokens, about three sessions' holds.
    async with rig(sim={**_NO_TTL, "decode_num_gpu_blocks": 300}, held_kv_budget=0.3,
                   retention_interval_s=0.1) as r:
        d = r.cluster.decode_urls[0]
        await eventually(lambda: _capacity_known(r, d))
        for s in range(6):
            await turns(r, 10 + s, 1, {"x-session-id": f"budget-{s}"})
        await eventually(lambda: released(r, "budget"))

        async def under() -> bool:
            held = sum(math.ceil(x["num_tokens"] / 16) * 16 for x in await holds(r))
            gauge = await metric(r.client, r.url, "kvtether_held_kv_tokens", node=d)
            return held <= 0.3 * 4800 and gauge == held

        await eventually(under)
        share = await metric(r.client, r.url, "kvtether_held_kv_share", node=d)
        assert 0 < share <= 0.3
        # The oldest sessions (furthest past their expected return) went first; the newest keeps its handle.
        sessions = {s["session_id"]: s for s in (await r.client.get(f"{r.url}/admin/sessions")).json()}
        assert sessions["budget-5"]["has_handle"] and not sessions["budget-0"]["has_handle"]


async def _capacity_known(r: Rig, d: str) -> bool:
    return bool(r.gw.cluster.nodes[d].kv_capacity_tokens)


async def test_no_pull_releases_every_handle_and_reference_keeps_them_all() -> None:
    for policy, left in (("no-pull", 0), ("reference", 3)):
        async with rig(sim=_NO_TTL, policy=policy) as r:
            for s in range(3):
                await turns(r, 20 + s, 1, {"x-session-id": f"{policy}-{s}"})
            if policy == "no-pull":
                await eventually(lambda r=r: released(r, "unused"))
            await eventually(lambda r=r, left=left: _count(holds(r), left))
            reasons = ("unused", "final", "expired", "budget", "pressure")
            assert sum([await released(r, reason) for reason in reasons]) == 3 - left


async def test_shutdown_releases_what_the_gateway_holds() -> None:
    spec = ClusterSpec(prefill=1, decode=1, speed=SPEED, kv_recompute_threshold=4, kv_lease_duration=3600.0,
                       **_NO_TTL)
    async with SimCluster(spec) as cluster, httpx.AsyncClient(timeout=60, limits=LIMITS) as client:
        cfg = load_config(None, prefill=cluster.prefill_urls, decode=cluster.decode_urls, policy="pull",
                          metrics_poll_interval_s=0.5)
        app = create_app(cfg)
        d = cluster.decode_urls[0]
        async with serve_gateway(cfg, app=app) as url:
            for s in range(2):
                await chat(client, url, request_body(first_messages(30 + s), stream=False), {"x-session-id": f"sd{s}"})
            assert len([h for h in (await client.get(f"{d}/admin/state")).json()["held"]
                        if h["kind"] == "retained"]) == 2
        # The lifespan's end waited for the releases.
        assert [h for h in (await client.get(f"{d}/admin/state")).json()["held"] if h["kind"] == "retained"] == []
        assert sum(s.value for m in app.state.gateway.metrics.handle_releases.collect() for s in m.samples
                   if s.name.endswith("_total") and s.labels.get("reason") == "shutdown") == 2


async def test_concurrent_turns_of_one_session_leave_one_hold() -> None:
    """Two turns of one session at once: one takes the handle, the other goes cold; each leaves a hold, and
    the turn that stores last supersedes the other's, which is released rather than left to the TTL."""
    async with rig(sim=_NO_TTL) as r:
        h = {"x-session-id": "twice"}
        messages = await turns(r, 40, 1, h)
        body = request_body(next_messages(messages, {"role": "assistant", "content": "ok"}, 40, 1), stream=False)
        async with anyio.create_task_group() as tg:
            for _ in range(2):
                tg.start_soon(chat, r.client, r.url, body, h)
        await eventually(lambda: released(r, "superseded"))
        await eventually(lambda: _count(holds(r), 1))
        [s] = (await r.client.get(f"{r.url}/admin/sessions")).json()
        [left] = await holds(r)
        assert s["has_handle"] and left["num_tokens"] == s["held_tokens"]


@pytest.mark.wall_clock  # the synchronous SDK client runs in a worker thread
async def test_the_sdk_ends_its_session_on_close() -> None:
    async with rig(sim=_NO_TTL) as r:
        base = openai.OpenAI(base_url=f"{r.url}/v1", api_key="none", max_retries=0)
        abase = openai.AsyncOpenAI(base_url=f"{r.url}/v1", api_key="none", max_retries=0)
        with AgentSession("sdk-sync") as session:
            client = session.wrap(base)
            messages = first_messages(50)
            for t in range(2):
                body = request_body(messages, stream=False)
                got = await anyio.to_thread.run_sync(lambda body=body: client.chat.completions.create(**body))
                messages = next_messages(messages, got.choices[0].message.model_dump(exclude_none=True), 50, t)
            assert len(await holds(r)) == 1
            await anyio.to_thread.run_sync(session.close)
        await eventually(lambda: _count(holds(r), 0))
        async with AgentSession("sdk-async") as asession:
            aclient = asession.wrap(abase)
            await aclient.chat.completions.create(**request_body(first_messages(51), stream=False))
            assert len(await holds(r)) == 1
        await eventually(lambda: _count(holds(r), 0))
        assert await released(r, "final") == 2
        assert (await r.client.get(f"{r.url}/admin/sessions")).json() == []
        base.close()
        await abase.close()


async def test_local_turn_handles_leak_on_the_decode_node_and_are_off_by_default() -> None:
    """A marked decode-local turn (local_turn_handles) makes an untracked hold on vLLM 0.32–0.34, which the
    simulator reproduces: once the session ends, the default leaves D holding nothing, the marked run leaves
    the local turns' blocks pinned (no pull, release or TTL frees them)."""
    settings = {"policy": "auto", "min_reuse_tokens": 4, "learn_estimates": False, "max_local_suffix_tokens": 256}
    for marked in (False, True):
        async with rig(sim={**_NO_TTL, "prefill_prefix_caching": False}, local_turn_handles=marked,
                       **settings) as r:
            await turns(r, 60, 4, {"x-session-id": f"local-{marked}"}, final=True)
            assert await metric(r.client, r.url, "kvtether_ttft_seconds_count", reuse_source="decode_local") >= 1
            await eventually(lambda r=r: released(r, "final"))
            await anyio.sleep(0.3)
            left = await holds(r)
            if marked:
                assert left and all(h.get("tracked") is False for h in left), left
            else:
                assert left == []


@pytest.mark.wall_clock  # runs `kvtether sessions` in a worker thread
async def test_held_kv_per_decode_node_in_ready_and_kvtether_sessions() -> None:
    from kvtether.cli.main import app as cli_app
    from typer.testing import CliRunner

    async with rig(sim=_NO_TTL, retention_interval_s=0.1) as r:
        d = r.cluster.decode_urls[0]
        for s in range(2):
            await turns(r, 70 + s, 1, {"x-session-id": f"view-{s}"})
        want = sum(math.ceil(h["num_tokens"] / 16) * 16 for h in await holds(r))

        async def gauge_caught_up() -> bool:
            return await metric(r.client, r.url, "kvtether_held_kv_tokens", node=d) == want

        await eventually(gauge_caught_up)
        [node] = [n for n in (await r.client.get(f"{r.url}/ready")).json()["nodes"] if n["role"] == "decode"]
        assert node["held_kv_tokens"] == want
        out = await anyio.to_thread.run_sync(
            lambda: CliRunner().invoke(cli_app, ["sessions", "--gateway", r.url], env={"COLUMNS": "200"}))
        assert out.exit_code == 0, out.output
        assert "held KV per decode node" in out.output and f"{want:,}" in out.output


async def test_a_shared_system_prompt_counts_once_as_the_decode_node_holds_it() -> None:
    """Sessions that begin with the same long system prompt hold its blocks on D once (D's prefix cache gave
    each later turn the blocks the first one computed): the gateway's held-KV figure is the simulator's own
    count of used blocks (all of them held once the turns are over), and the budget, measured on it, releases
    nothing although the handles counted whole would be far over it."""
    # 300 blocks of 16 tokens on D; a budget of 50 %: 150 blocks.
    async with rig(sim={**_NO_TTL, "decode_num_gpu_blocks": 300}, held_kv_budget=0.5,
                   retention_interval_s=0.1) as r:
        d = r.cluster.decode_urls[0]
        await eventually(lambda: _sharing_known(r, d))
        system = {"role": "system", "content": "You are a coding agent. " + tool_result("shared-system", 400)}
        sessions = 6
        for s in range(sessions):
            task = [system, {"role": "user", "content": f"Task {s}: " + tool_result(f"task{s}", 30)}]
            await turns(r, 80 + s, 2 if s < 2 else 1, {"x-session-id": f"shared-{s}"}, messages=task)
        held = await holds(r)
        assert len(held) == sessions
        state = (await r.client.get(f"{d}/admin/state")).json()
        assert state["running"] == state["waiting"] == state["loading"] == 0
        used = state["blocks_used"]  # every used block on an idle D is a held one
        usage = await metric(r.client, d, "vllm:kv_cache_usage_perc")
        assert round(usage * state["blocks_total"]) == used
        whole = sum(math.ceil(h["num_tokens"] / 16) for h in held)
        assert used < 150 < whole, (used, whole)  # under the budget only when shared blocks count once

        async def gauge() -> float:
            return await metric(r.client, r.url, "kvtether_held_kv_tokens", node=d)

        async def caught_up() -> bool:
            return abs(await gauge() / 16 - used) <= sessions

        await eventually(caught_up)
        assert await gauge() / 16 == used  # exact on the simulator: one block per session is the test's margin
        await anyio.sleep(0.5)  # several reviews
        assert await released(r, "budget") == 0
        assert len(await holds(r)) == sessions
        share = await metric(r.client, r.url, "kvtether_held_kv_share", node=d)
        assert share == used * 16 / 4800


async def _sharing_known(r: Rig, d: str) -> bool:
    node = r.gw.cluster.nodes[d]
    return bool(node.kv_capacity_tokens) and node.prefix_caching is True
