"""Two simulated nodes driven exactly as vLLM's reference proxy drives vLLM (docs/protocol.md).

The corruption test here must fail if the simulator checked token identity: it mirrors vLLM, whose
decode → prefill pull is positional and unchecked.
"""

from __future__ import annotations

import asyncio
import math
import re
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from kvtether.sim.cluster import SimCluster
from kvtether.sim.engine import EngineEvent

from tests.support.sim_pd import P_PARAMS, chat, p2p_tokens, pd_turn, reply

SPEED = 50.0
LONG = (
    "You are reviewing a build log. The gateway restarted twice during the night, the cache was cold in the "
    "morning and every request paid the full prefill cost again. " * 6
)


async def two_turns(
    cluster: SimCluster, h: httpx.AsyncClient, *, first: str = LONG, gen: int = 80, **kw: Any
) -> tuple[list[dict[str, Any]], dict[str, Any], httpx.Response]:
    p, d = cluster.prefill_urls[0], cluster.decode_urls[0]
    msgs = [{"role": "user", "content": first}]
    _, d1 = await pd_turn(h, p, d, chat(msgs, min_tokens=gen, max_tokens=gen + 40, return_token_ids=True), **kw)
    assert d1 is not None and d1.status_code == 200, d1.text if d1 else None
    return msgs, d1.json()["kv_transfer_params"], d1


@pytest.fixture
async def client():  # type: ignore[no-untyped-def]
    async with httpx.AsyncClient(timeout=20) as h:
        yield h


@pytest.mark.anyio
async def test_handle_fields_and_normal_flow(client: httpx.AsyncClient) -> None:
    async with SimCluster(speed=SPEED) as c:
        p_url, d_url = c.prefill_urls[0], c.decode_urls[0]
        p, d = await pd_turn(client, p_url, d_url, chat([{"role": "user", "content": LONG}], return_token_ids=True))
        pj = p.json()
        pp = pj["kv_transfer_params"]
        assert pp["do_remote_prefill"] is True and pp["do_remote_decode"] is False
        assert pp["remote_num_tokens"] == pj["usage"]["prompt_tokens"]
        assert pp["remote_port"] == urlsplit(p_url).port and pp["remote_host"] == "localhost"
        assert pp["transfer_mode"] == "pull" and (pp["tp_size"], pp["dcp_size"], pp["pp_size"]) == (1, 1, 1)
        assert len(pp["remote_block_ids"]) == 1 and len(pp["remote_block_ids"][0]) == math.ceil(
            pp["remote_num_tokens"] / 16
        )
        assert "remote_prefill_cached_tokens" in pp
        assert "remote_blocks_expiry_time" in pp and pp["remote_blocks_expiry_time"] is None  # as vLLM 0.32
        assert min(pp["remote_block_ids"][0]) >= 1  # block 0 is vLLM's null block
        # vLLM's internal id: chat `chatcmpl-<16 hex>-<8 hex>` (completions: `cmpl-<16>-0-<8>`).
        assert re.fullmatch(r"chatcmpl-[0-9a-f]{16}-[0-9a-f]{8}", pp["remote_request_id"]), pp["remote_request_id"]
        assert pj["id"] == pp["remote_request_id"].rsplit("-", 1)[0]
        assert d is not None and d.status_code == 200
        dj = d.json()
        handle = dj["kv_transfer_params"]
        n_prompt, n_gen = dj["usage"]["prompt_tokens"], dj["usage"]["completion_tokens"]
        assert handle["do_remote_prefill"] is False and handle["do_remote_decode"] is True
        assert handle["remote_num_tokens"] == n_prompt + n_gen - 1
        assert len(handle["remote_block_ids"][0]) == math.ceil(handle["remote_num_tokens"] / 16)
        assert handle["remote_engine_id"] == c.node(d_url).cfg.engine_id
        assert handle["remote_port"] == urlsplit(d_url).port
        for key in ("remote_request_id", "remote_blocks_expiry_time", "remote_registration_generation"):
            assert key in handle
        assert handle["transfer_mode"] == "pull"
        # P's one token is D's first token; D read the prompt from P and P's lease is gone.
        assert (
            pj["choices"][0]["message"]["content"]
            == dj["choices"][0]["message"]["content"][: len(pj["choices"][0]["message"]["content"])]
        )
        # vLLM reports the KV read from P as not cached on D's leg; the read shows in D's p2p counter.
        assert dj["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert await p2p_tokens(client, d_url) == n_prompt - 1
        assert len(c.node(p_url).engine.holds) == 0
        assert len(c.node(d_url).engine.holds) == 1


@pytest.mark.anyio
async def test_pull_reuses_held_kv_and_matches_a_cold_answer(client: httpx.AsyncClient) -> None:
    async with SimCluster(speed=SPEED, aggregated=1, kv_recompute_threshold=16) as c:
        p_url, d_url, ref_url = c.prefill_urls[0], c.decode_urls[0], c.aggregated_urls[0]
        msgs, handle, d1 = await two_turns(c, client)
        assert handle["remote_num_tokens"] % 16 != 0 or True  # partial last block is the common case
        turn2 = chat([*msgs, reply(d1), {"role": "user", "content": "Summarise that in one line."}])
        p2, d2 = await pd_turn(client, p_url, d_url, turn2, handle)
        assert p2.status_code == 200 and d2 is not None and d2.status_code == 200
        cached = p2.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == handle["remote_num_tokens"]  # all held tokens, local prefix + pulled suffix
        ref = await client.post(ref_url + "/v1/chat/completions", json=turn2)
        assert d2.json()["choices"][0]["message"]["content"] == ref.json()["choices"][0]["message"]["content"]
        assert len(c.node(d_url).engine.holds) == 1  # handle consumed; only turn 2's new handle is held
        metrics = (await client.get(p_url + "/metrics")).text
        assert 'vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="kvtether-sim",source="p2p"}' in metrics
        p2p = [
            ln
            for ln in metrics.splitlines()
            if ln.startswith("vllm:prompt_tokens_cached_by_source_total") and "p2p" in ln
        ]
        assert float(p2p[0].split()[-1]) > 0
        count = [ln for ln in metrics.splitlines() if ln.startswith("vllm:nixl_xfer_time_seconds_count")]
        assert float(count[0].split()[-1]) >= 1


@pytest.mark.anyio
async def test_partial_last_block(client: httpx.AsyncClient) -> None:
    async with SimCluster(speed=SPEED, aggregated=1, kv_recompute_threshold=1) as c:
        for gen in (33, 40):
            msgs, handle, d1 = await two_turns(c, client, first=LONG + f" run {gen}", gen=gen)
            n = handle["remote_num_tokens"]
            if n % 16 == 0:
                continue
            assert len(handle["remote_block_ids"][0]) == n // 16 + 1
            turn2 = chat([*msgs, reply(d1), {"role": "user", "content": "And then?"}])
            _, d2 = await pd_turn(client, c.prefill_urls[0], c.decode_urls[0], turn2, handle)
            ref = await client.post(c.aggregated_urls[0] + "/v1/chat/completions", json=turn2)
            assert d2 is not None
            assert d2.json()["choices"][0]["message"]["content"] == ref.json()["choices"][0]["message"]["content"]
            return
        pytest.fail("no partial last block produced")


@pytest.mark.anyio
async def test_corrupted_history_gives_a_different_answer(client: httpx.AsyncClient) -> None:
    """vLLM does not check token identity: a handle for an edited history silently changes the answer."""
    async with SimCluster(speed=SPEED, aggregated=1, kv_recompute_threshold=16) as c:
        p_url, d_url, ref_url = c.prefill_urls[0], c.decode_urls[0], c.aggregated_urls[0]
        _, handle, d1 = await two_turns(c, client)
        edited = [{"role": "user", "content": LONG.replace("twice", "three times", 1)}]
        turn2 = chat([*edited, reply(d1), {"role": "user", "content": "Summarise that in one line."}])
        p2, d2 = await pd_turn(client, p_url, d_url, turn2, handle)
        assert p2.status_code == 200 and d2 is not None and d2.status_code == 200
        assert p2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16  # the pull happened
        ref = await client.post(ref_url + "/v1/chat/completions", json=turn2)
        assert ref.status_code == 200
        wrong = d2.json()["choices"][0]["message"]["content"]
        assert wrong != ref.json()["choices"][0]["message"]["content"]
        # The pulled KV now pollutes P's prefix cache under the edited prompt's block hashes.
        assert any(b.polluted for b in c.node(p_url).engine.pool.blocks)


@pytest.mark.anyio
async def test_single_use_second_read_fails(client: httpx.AsyncClient) -> None:
    async with SimCluster(speed=SPEED, prefill=2, kv_recompute_threshold=16) as c:
        msgs, handle, d1 = await two_turns(c, client)
        turn2 = chat([*msgs, reply(d1), {"role": "user", "content": "More."}])
        p2, _ = await pd_turn(client, c.prefill_urls[0], c.decode_urls[0], turn2, handle)
        assert p2.status_code == 200
        p3, _ = await pd_turn(client, c.prefill_urls[1], c.decode_urls[0], turn2, handle)
        assert p3.status_code == 500 and "KV load failure" in p3.json()["error"]["message"]
        # The gateway's recovery: retry the prefill without the handle.
        p4, d4 = await pd_turn(client, c.prefill_urls[1], c.decode_urls[0], turn2)
        assert p4.status_code == 200 and d4 is not None and d4.status_code == 200


@pytest.mark.anyio
@pytest.mark.parametrize("policy", ["fail", "recompute"])
async def test_expired_handle(client: httpx.AsyncClient, policy: str) -> None:
    async with SimCluster(
        speed=SPEED, aggregated=1, decoder_kv_blocks_ttl=20.0, kv_recompute_threshold=16, kv_load_failure_policy=policy
    ) as c:
        msgs, handle, d1 = await two_turns(c, client)
        await asyncio.sleep(16.0 / SPEED)  # past TTL − 5 s: declined, as in vLLM
        turn2 = chat([*msgs, reply(d1), {"role": "user", "content": "More."}])
        p2, d2 = await pd_turn(client, c.prefill_urls[0], c.decode_urls[0], turn2, handle)
        if policy == "fail":
            assert p2.status_code == 500
            assert p2.json()["error"]["code"] == 500
        else:
            assert p2.status_code == 200 and d2 is not None
            ref = await client.post(c.aggregated_urls[0] + "/v1/chat/completions", json=turn2)
            assert d2.json()["choices"][0]["message"]["content"] == ref.json()["choices"][0]["message"]["content"]
            # vLLM counts a read when it schedules it: recomputed after the failure, it still reports as read, in
            # usage (P's own hit and the read together) and in P's p2p counter; only the failed-transfer counter
            # tells (docs/metrics.md, "How a pull is confirmed").
            assert p2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == handle["remote_num_tokens"]
            assert await p2p_tokens(client, c.prefill_urls[0]) > 0
            failed = (await client.get(c.prefill_urls[0] + "/metrics")).text
            assert any(ln.startswith("vllm:nixl_num_failed_transfers") and float(ln.split()[-1]) >= 1
                       for ln in failed.splitlines()), "the failed read is not counted"
        await asyncio.sleep(6.0 / SPEED)
        assert c.node(c.decode_urls[0]).engine.holds.get(handle["remote_request_id"]) is None


@pytest.mark.anyio
async def test_below_threshold_computes_locally_and_frees_decode(client: httpx.AsyncClient) -> None:
    async with SimCluster(speed=SPEED) as c:  # threshold 64
        msgs, handle, d1 = await two_turns(c, client, gen=10)
        d_node = c.node(c.decode_urls[0])
        assert d_node.engine.holds.get(handle["remote_request_id"]) is not None
        turn2 = chat([*msgs, reply(d1), {"role": "user", "content": "More."}])
        p2, d2 = await pd_turn(client, c.prefill_urls[0], c.decode_urls[0], turn2, handle)
        assert p2.status_code == 200 and d2 is not None and d2.status_code == 200
        metrics = (await client.get(c.prefill_urls[0] + "/metrics")).text
        assert 'source="p2p"} 0.0' in metrics
        for _ in range(50):
            if d_node.engine.holds.get(handle["remote_request_id"]) is None:
                break
            await asyncio.sleep(0.01)
        assert d_node.engine.holds.get(handle["remote_request_id"]) is None  # the notify freed it


async def stream_handle(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> tuple[list[dict], Any]:
    import json

    chunks: list[dict] = []
    async with client.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    finish = [ch for ch in chunks if ch["choices"] and ch["choices"][0]["finish_reason"]]
    return chunks, finish[0].get("kv_transfer_params")


@pytest.mark.anyio
@pytest.mark.parametrize("emulate", ["0.33", "0.32"])
async def test_streamed_handle_depends_on_version(client: httpx.AsyncClient, emulate: str) -> None:
    async with SimCluster(speed=SPEED, emulate=emulate) as c:
        p_url, d_url = c.prefill_urls[0], c.decode_urls[0]
        body = chat([{"role": "user", "content": LONG}], stream_options={"include_usage": True})
        p = await client.post(
            p_url + "/v1/chat/completions",
            json={**chat([{"role": "user", "content": LONG}]), "max_tokens": 1, "kv_transfer_params": P_PARAMS},
        )
        chunks, handle = await stream_handle(
            client, d_url, {**body, "kv_transfer_params": p.json()["kv_transfer_params"]}
        )
        assert chunks[-1]["usage"]["completion_tokens"] > 0
        if emulate == "0.33":
            assert handle["do_remote_decode"] is True
            assert handle["remote_num_tokens"] == chunks[-1]["usage"]["total_tokens"] - 1
        else:
            assert handle is None
        assert (await client.get(d_url + "/version")).json()["version"] == emulate + ".0"


@pytest.mark.anyio
async def test_decode_without_params_hits_cache_but_returns_no_handle(client: httpx.AsyncClient) -> None:
    async with SimCluster(speed=SPEED) as c:
        msgs, handle, d1 = await two_turns(c, client, gen=20)
        turn2 = chat([*msgs, reply(d1), {"role": "user", "content": "More."}])
        d2 = await client.post(c.decode_urls[0] + "/v1/chat/completions", json=turn2)
        dj = d2.json()
        assert dj["usage"]["prompt_tokens_details"]["cached_tokens"] >= handle["remote_num_tokens"] // 16 * 16
        assert dj["kv_transfer_params"] is None


@pytest.mark.anyio
async def test_side_channel_host_must_be_rewritten(client: httpx.AsyncClient) -> None:
    async with SimCluster(
        speed=SPEED, side_channel_host="kvtether-unresolvable.invalid", kv_recompute_threshold=16
    ) as c:
        p_url, d_url = c.prefill_urls[0], c.decode_urls[0]
        body = chat([{"role": "user", "content": LONG}])
        _, d = await pd_turn(client, p_url, d_url, body)
        assert d is not None and d.status_code == 500  # D cannot reach P's advertised side channel
        msgs, handle, d1 = await two_turns(c, client, rewrite_hosts=True)
        assert handle["remote_host"] == "kvtether-unresolvable.invalid"
        turn2 = chat([*msgs, reply(d1), {"role": "user", "content": "More."}])
        p2, d2 = await pd_turn(client, p_url, d_url, turn2, handle, rewrite_hosts=True)
        assert p2.status_code == 200 and d2 is not None and d2.status_code == 200


@pytest.mark.anyio
async def test_handle_to_prefill_without_bidirectional_hangs(client: httpx.AsyncClient) -> None:
    async with (
        SimCluster(speed=SPEED, kv_recompute_threshold=16) as good,
        SimCluster(speed=SPEED, bidirectional=False) as old,
    ):
        msgs, handle, d1 = await two_turns(good, client)
        turn2 = chat([*msgs, reply(d1), {"role": "user", "content": "More."}])
        with pytest.raises(httpx.ReadTimeout):
            await client.post(
                old.prefill_urls[0] + "/v1/chat/completions",
                json={**turn2, "max_tokens": 1, "kv_transfer_params": handle},
                timeout=0.5,
            )
        p_node = old.node(old.prefill_urls[0])
        for _ in range(100):
            if not p_node.engine.loading:
                break
            await asyncio.sleep(0.01)
        assert not p_node.engine.loading  # the abandoned request was aborted, nothing leaks


@pytest.mark.anyio
async def test_dropped_reasoning_breaks_the_prefix_and_the_answer(client: httpx.AsyncClient) -> None:
    """Qwen3's template drops reasoning before the last user turn: the held tokens are no longer a prefix."""
    async with SimCluster(speed=SPEED, aggregated=1, kv_recompute_threshold=16) as c:
        thinking = {"chat_template_kwargs": {"enable_thinking": True}}
        msgs = [{"role": "user", "content": LONG}]
        _, d1 = await pd_turn(
            client, c.prefill_urls[0], c.decode_urls[0], chat(msgs, min_tokens=60, max_tokens=200, **thinking)
        )
        assert d1 is not None
        m = d1.json()["choices"][0]["message"]
        assert m["reasoning_content"]
        back = {"role": "assistant", "content": m["content"], "reasoning_content": m["reasoning_content"]}
        turn2 = chat([*msgs, back, {"role": "user", "content": "Shorter."}], **thinking)
        _, d2 = await pd_turn(client, c.prefill_urls[0], c.decode_urls[0], turn2, d1.json()["kv_transfer_params"])
        ref = await client.post(c.aggregated_urls[0] + "/v1/chat/completions", json=turn2)
        assert d2 is not None and d2.status_code == 200
        assert d2.json()["choices"][0]["message"]["content"] != ref.json()["choices"][0]["message"]["content"]


@pytest.mark.anyio
async def test_concurrent_sessions_keep_kv_accounting_exact(client: httpx.AsyncClient) -> None:
    async with SimCluster(speed=SPEED, prefill=2, decode=2, kv_recompute_threshold=16) as c:

        async def session(i: int) -> None:
            msgs: list[dict[str, Any]] = [{"role": "user", "content": f"session {i}: {LONG}"}]
            handle = None
            for turn in range(3):
                p, d = c.prefill_urls[(i + turn) % 2], c.decode_urls[i % 2]
                pr, dr = await pd_turn(client, p, d, chat(msgs, max_tokens=10 + 7 * i), handle)
                assert pr.status_code == 200 and dr is not None and dr.status_code == 200
                handle = dr.json()["kv_transfer_params"]
                msgs = [*msgs, reply(dr), {"role": "user", "content": f"turn {turn}: go on"}]

        await asyncio.gather(*(session(i) for i in range(4)))
        for n in c.nodes:
            e = n.engine
            held = {b.block_id for h in e.holds.all() for b in h.blocks}
            assert e.pool.num_used == len(held)  # nothing leaked: only handles pin blocks
            assert sum(b.ref_cnt for b in e.pool.blocks) == sum(len(h.blocks) for h in e.holds.all())
            assert not (e.running or e.waiting or e.loading)
        assert sum(len(c.node(u).engine.holds) for u in c.decode_urls) == 4  # one live handle per session


async def _p_then_d_after(client: httpx.AsyncClient, c: SimCluster, wait_real_s: float) -> httpx.Response:
    p_url, d_url = c.prefill_urls[0], c.decode_urls[0]
    body = chat([{"role": "user", "content": LONG}], max_tokens=4)
    p = await client.post(
        p_url + "/v1/chat/completions", json={**body, "max_tokens": 1, "kv_transfer_params": P_PARAMS}
    )
    assert p.status_code == 200
    await asyncio.sleep(wait_real_s)  # a CPU stall of the proxy (or of this process) between P and D
    handle = p.json()["kv_transfer_params"]
    return await client.post(d_url + "/v1/chat/completions", json={**body, "kv_transfer_params": handle})


@pytest.mark.anyio
async def test_lease_survives_a_real_time_stall_at_high_speed(client: httpx.AsyncClient) -> None:
    # 1 s of wall time is 50 simulated seconds: past the 30 s lease, within its real-time floor.
    async with SimCluster(speed=SPEED) as c:
        d = await _p_then_d_after(client, c, 1.0)
        assert d.status_code == 200, d.text
        assert await p2p_tokens(client, c.decode_urls[0]) > 0  # read from P, not recomputed
        engine = c.node(c.decode_urls[0]).engine
        # D's heartbeats go out three times per lease, the span counted in real seconds too.
        assert engine.clock.real(engine._lease_span() / 3) >= 10.0


@pytest.mark.anyio
async def test_lease_without_the_floor_expires_in_simulated_time(client: httpx.AsyncClient) -> None:
    async with SimCluster(speed=SPEED, kv_lease_real_floor_s=0.0) as c:
        d = await _p_then_d_after(client, c, 1.0)
        assert d.status_code == 500 and "KV load failure" in d.text


@pytest.mark.anyio
async def test_engine_events_trace_a_pd_turn(client: httpx.AsyncClient) -> None:
    """`Engine.on_event` (what `placement_policies.py --engine-trace` records): on P the request arrives and
    its prompt is computed; on D it arrives, reads what it lacks from P, and its prompt is done right after."""
    async with SimCluster(speed=SPEED) as c:
        p_url, d_url = c.prefill_urls[0], c.decode_urls[0]
        seen: dict[str, list[EngineEvent]] = {p_url: [], d_url: []}
        for url, out in seen.items():
            c.node(url).engine.on_event = out.append
        _, d = await pd_turn(client, p_url, d_url, chat([{"role": "user", "content": LONG}], max_tokens=8))
        assert d is not None and d.status_code == 200
        n_prompt = d.json()["usage"]["prompt_tokens"]
        p_ev, d_ev = seen[p_url], seen[d_url]
        assert [e.kind for e in p_ev] == ["submit", "prompt_done"]
        assert [e.kind for e in d_ev] == ["submit", "kv_read", "prompt_done"]  # decode steps add nothing
        assert {e.prompt_tokens for e in (*p_ev, *d_ev)} == {n_prompt}
        p_sub, p_done = p_ev
        assert p_done.at > p_sub.at and p_done.step_prefills == 1
        d_sub, read, d_done = d_ev
        assert read.tokens == n_prompt - 1 and read.seconds > 0  # D computes the last prompt token itself
        assert d_sub.at <= read.at and read.at + read.seconds <= d_done.at
        assert d_done.step_prefills == 1 and d_done.step_decodes == 0
        assert p_sub.at < p_done.at <= d_sub.at
