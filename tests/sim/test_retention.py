"""Decode-side holds as vLLM 0.32–0.34 keeps them (docs/protocol.md §2, §5).

- A P/D decode leg's hold is tracked: a pull, the one-token release and the TTL each free it.
- A whole request whose kv_transfer_params set neither flag gets the same handle, but vLLM's NIXL worker never
  registers it: readable, yet never freed (not at the TTL, not by a pull, not by a release) until a restart.
- Held blocks are used KV: they fill the decode node, new work waits, running work is preempted, and the
  prefix-cache LRU never takes them.
- 0.34: the handle carries remote_registration_generation; nodes of different releases cannot transfer.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest
from kvtether.sim.cluster import SimCluster
from kvtether.sim.engine import Engine, EngineRequest
from kvtether.sim.node import SimNode
from kvtether.sim.tokenizer import default_tokenizer

from tests.support.sim_engine import make_engine, request, run

SPEED = 50.0
P_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# What kvtether's gateway sends with a decode-local turn (kvtether.protocol.wire LOCAL_RETAIN_PARAMS).
LOCAL_RETAIN = {"do_remote_prefill": False, "do_remote_decode": False}
TOK = default_tokenizer()
TEXT = (
    "The night shift restarted the gateway twice, the cache was cold by morning and every request paid the "
    "full prefill again, so the on-call engineer wrote down what the decode nodes were holding. "
)
USAGE = "vllm:kv_cache_usage_perc"
NOTIFS = "vllm:nixl_num_notifications_after_expiry_total"
EXPIRED = "vllm:nixl_num_kv_expired_reqs_total"
P2P = 'vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="kvtether-sim",source="p2p"}'


def ids(text: str) -> list[int]:
    return TOK.encode(text)


async def metric(h: httpx.AsyncClient, url: str, name: str) -> float:
    """One series of a node's /metrics: `name` with its labels (`name{...}`), or an exact labelled series."""
    text = (await h.get(url + "/metrics")).text
    for ln in text.splitlines():
        if ln.startswith(name + "{") or ln.startswith(name + " "):
            return float(ln.rsplit(" ", 1)[1])
    raise KeyError(name)


async def until(check: Callable[[], Awaitable[bool]]) -> None:
    """Poll for up to 5 s: the engine reaps at its next wake-up, a notification arrives after P's answer."""
    for _ in range(500):
        if await check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached in time")


async def complete(
    h: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int, kvp: dict[str, Any] | None = None, **kw: Any
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "kvtether-sim",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **kw,
    }
    if kvp is not None:
        body["kv_transfer_params"] = kvp
    r = await h.post(url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


async def pd(
    h: httpx.AsyncClient, c: SimCluster, prompt: list[int], max_tokens: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A P/D turn as vLLM's reference proxy drives it: P computes the prompt, D reads it and decodes."""
    p = await complete(h, c.prefill_urls[0], prompt, 1, P_PARAMS)
    d = await complete(h, c.decode_urls[0], prompt, max_tokens, p["kv_transfer_params"])
    return p, d


async def release(h: httpx.AsyncClient, p_url: str, handle: dict[str, Any]) -> httpx.Response:
    """docs/protocol.md §5.3: a one-token completion on a bidirectional P carrying D's handle as returned."""
    body = {"model": "kvtether-sim", "prompt": [ids("ok")[0]], "max_tokens": 1, "stream": False,
            "kv_transfer_params": handle}
    return await h.post(p_url + "/v1/completions", json=body)


def out_ids(body: dict[str, Any]) -> list[int]:
    return list(body["choices"][0]["token_ids"])


async def held(h: httpx.AsyncClient, url: str) -> dict[str, dict[str, Any]]:
    """The node's debug listing of its holds, by request id."""
    return {x["request_id"]: x for x in (await h.get(url + "/admin/state")).json()["held"]}


def usage_of(node: SimNode, n_blocks: int) -> float:
    return n_blocks / node.engine.pool.num_blocks


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=20) as h:
        yield h


# ---- (a) a P/D decode leg's hold is tracked ------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("how", ["pull", "release", "release_fully_cached", "release_threshold_1", "ttl"])
async def test_a_decode_legs_hold_is_freed_by_a_pull_a_release_or_the_ttl(client: httpx.AsyncClient, how: str) -> None:
    # With kv_recompute_threshold 1 the one-token release is not below the threshold: P goes the read way,
    # has nothing to read before the prompt's last token (always computed locally), and notifies D.
    threshold = 1 if how == "release_threshold_1" else 16
    async with SimCluster(speed=SPEED, kv_recompute_threshold=threshold) as c:
        p_url, d_url = c.prefill_urls[0], c.decode_urls[0]
        d, p = c.node(d_url), c.node(p_url)
        baseline = await metric(client, d_url, USAGE)
        prompt = ids(TEXT * 2)
        _, d1 = await pd(client, c, prompt, 40)
        handle = d1["kv_transfer_params"]
        rid = handle["remote_request_id"]
        listing = await held(client, d_url)
        assert listing[rid]["tracked"] is True and listing[rid]["kind"] == "retained"
        # The hold is used KV (and nothing else is: D's request has finished).
        assert await metric(client, d_url, USAGE) == pytest.approx(usage_of(d, listing[rid]["num_blocks"]))
        assert await metric(client, d_url, USAGE) > baseline
        p2p_before = await metric(client, p_url, P2P)
        if how == "pull":
            p2 = await complete(client, p_url, prompt + out_ids(d1) + ids(" What next?"), 1, handle)
            assert await metric(client, p_url, P2P) > p2p_before  # P read D's blocks
            assert p2["kv_transfer_params"]["do_remote_prefill"] is True
        elif how.startswith("release"):
            kvp = handle
            if how == "release_fully_cached":
                # P's own prefix cache (its leg of turn 1) covers every token the handle would give: count <= 0,
                # so P only notifies D. Cutting remote_num_tokens is the gateway's partial reuse.
                kvp = {**handle, "remote_num_tokens": 16}
                r = await client.post(p_url + "/v1/completions", json={
                    "model": "kvtether-sim", "prompt": prompt, "max_tokens": 1, "kv_transfer_params": kvp})
            else:
                r = await release(client, p_url, kvp)
            assert r.status_code == 200, r.text
            pp = r.json()["kv_transfer_params"]
            # P computed locally (nothing read) and answers with prefill params under its own lease.
            assert await metric(client, p_url, P2P) == p2p_before
            assert pp["do_remote_prefill"] is True and pp["remote_blocks_expiry_time"] is None
            assert pp["remote_engine_id"] == p.cfg.engine_id
            lease = p.engine.holds.get(pp["remote_request_id"])
            assert lease is not None and lease.kind == "lease" and lease.tracked
            if how != "release_fully_cached":
                assert len(lease.blocks) == 1 and pp["remote_num_tokens"] == 1
        else:
            d.clock.advance(d.cfg.decoder_kv_blocks_ttl + 1)

        async def freed() -> bool:
            return d.engine.holds.get(rid) is None

        await until(freed)
        assert await metric(client, d_url, USAGE) == baseline
        assert await metric(client, d_url, EXPIRED) == (1 if how == "ttl" else 0)
        assert await metric(client, d_url, NOTIFS) == 0


# ---- (b) an untracked hold leaks -----------------------------------------------------------------------------


@pytest.mark.anyio
async def test_an_untracked_hold_is_readable_but_never_freed(client: httpx.AsyncClient) -> None:
    # P without prefix caching: every use of the handle reaches D (a read, never a cached notify-only turn).
    async with SimCluster(speed=SPEED, aggregated=1, kv_recompute_threshold=16, prefill_prefix_caching=False) as c:
        p_url, d_url, ref_url = c.prefill_urls[0], c.decode_urls[0], c.aggregated_urls[0]
        d = c.node(d_url)
        baseline = await metric(client, d_url, USAGE)
        prompt = ids(TEXT * 2)
        d1 = await complete(client, d_url, prompt, 40, LOCAL_RETAIN)
        handle = d1["kv_transfer_params"]
        rid = handle["remote_request_id"]
        # The same handle as a decode leg's, expiry included: nothing tells the gateway it is untracked.
        assert handle["do_remote_decode"] is True and handle["do_remote_prefill"] is False
        assert handle["remote_blocks_expiry_time"] is not None and "remote_registration_generation" in handle
        assert handle["remote_num_tokens"] == len(prompt) + 40 - 1
        listing = await held(client, d_url)
        assert listing[rid]["tracked"] is False
        pinned = await metric(client, d_url, USAGE)
        assert pinned == pytest.approx(usage_of(d, listing[rid]["num_blocks"])) and pinned > baseline

        # A pull reads valid blocks (the answer equals a cold one), but D ignores the consume notification.
        prompt2 = prompt + out_ids(d1) + ids(" Summarise that in one line.")
        p2 = await complete(client, p_url, prompt2, 1, handle)
        assert await metric(client, p_url, P2P) >= len(prompt)
        assert await metric(client, d_url, NOTIFS) == 1
        assert d.engine.holds.get(rid) is not None
        d2 = await complete(client, d_url, prompt2, 20, p2["kv_transfer_params"])
        ref = await complete(client, ref_url, prompt2, 20)
        assert out_ids(d2) == out_ids(ref)
        rid2 = d2["kv_transfer_params"]["remote_request_id"]
        assert (await held(client, d_url))[rid2]["tracked"] is True  # a P/D decode leg's hold is tracked

        # The one-token release: P notifies, D does not know the request.
        r = await release(client, p_url, handle)
        assert r.status_code == 200, r.text

        async def notified_twice() -> bool:
            return await metric(client, d_url, NOTIFS) == 2

        await until(notified_twice)
        assert d.engine.holds.get(rid) is not None

        # Past the TTL the reaper frees the tracked hold of turn 2 and leaves the untracked one.
        d.clock.advance(d.cfg.decoder_kv_blocks_ttl + 1)

        async def reaped() -> bool:
            return d.engine.holds.get(rid2) is None

        await until(reaped)
        assert d.engine.holds.get(rid) is not None
        assert await metric(client, d_url, EXPIRED) == 1
        assert await metric(client, d_url, USAGE) == pinned  # turn 2 shared the pinned blocks; those stay

        # P declines a read past the handle's expiry (kv_load_failure_policy "fail": an error); still pinned.
        late = await client.post(p_url + "/v1/completions", json={
            "model": "kvtether-sim", "prompt": prompt2, "max_tokens": 1, "kv_transfer_params": handle})
        assert late.status_code == 500 and "KV load failure" in late.text
        assert d.engine.holds.get(rid) is not None and await metric(client, d_url, USAGE) == pinned

        # Only a restart of D frees it (the admin drop stands for one).
        dropped = (await client.post(d_url + "/admin/fault", json={"drop_retained": True})).json()["dropped"]
        assert dropped == 1
        assert await metric(client, d_url, USAGE) == baseline


# ---- (c) holds fill the decode node --------------------------------------------------------------------------


def held_snapshot(engine: Engine) -> dict[int, tuple[list[int], bytes | None]]:
    return {b.block_id: (list(b.content), b.hash) for h in engine.holds.all() for b in h.blocks}


def assert_holds_intact(engine: Engine, before: dict[int, tuple[list[int], bytes | None]]) -> None:
    """Every held block still has its KV and its prefix-cache entry: never evicted, never reallocated."""
    assert sum(b.hash is not None for h in engine.holds.all() for b in h.blocks) > 0
    for h in engine.holds.all():
        for b in h.blocks:
            assert b.ref_cnt >= 1
            assert (list(b.content), b.hash) == before[b.block_id]
            if b.hash is not None:  # a partial last block is never in the prefix cache
                assert engine.pool.lookup([b.hash]) == [b]


@pytest.mark.anyio
async def test_holds_fill_the_decode_node_new_work_waits_until_a_release(client: httpx.AsyncClient) -> None:
    async with SimCluster(speed=SPEED, decode_num_gpu_blocks=32) as c:
        p_url, d_url = c.prefill_urls[0], c.decode_urls[0]
        d = c.node(d_url)
        handles = []
        for i in range(3):  # 96-token prompts + 31 computed output tokens: 8 blocks held each
            prompt = ids(f"Conversation {i}. " + TEXT * 3)[:96]
            _, d1 = await pd(client, c, prompt, 32)
            handles.append(d1["kv_transfer_params"])
        assert [len(h["remote_block_ids"][0]) for h in handles] == [8, 8, 8]
        assert await metric(client, d_url, USAGE) == pytest.approx(24 / 32)
        before = held_snapshot(d.engine)

        # A 160-token prompt needs 10 blocks, 8 are free: it waits (held blocks are neither evicted nor
        # preempted), and D reports it waiting, nothing running.
        waiting = asyncio.ensure_future(complete(client, d_url, ids("A new conversation. " + TEXT * 4)[:160], 8))

        async def queued() -> bool:
            return await metric(client, d_url, "vllm:num_requests_waiting") == 1

        await until(queued)
        await asyncio.sleep(0.2)
        assert not waiting.done()
        assert await metric(client, d_url, "vllm:num_requests_running") == 0
        assert_holds_intact(d.engine, before)

        # Releasing one handle frees its 8 blocks at once: the waiting request runs.
        r = await release(client, p_url, handles[0])
        assert r.status_code == 200
        done = await asyncio.wait_for(waiting, 10)
        assert len(out_ids(done)) == 8
        assert len(d.engine.holds) == 2
        assert_holds_intact(d.engine, before)

        # A 240-token prompt needs 15 blocks: the free ones plus the LRU's cached ones, never a held one.
        await complete(client, d_url, ids("Another one. " + TEXT * 5)[:240], 1)
        assert_holds_intact(d.engine, before)
        assert await metric(client, d_url, USAGE) == pytest.approx(16 / 32)


@pytest.mark.anyio
async def test_out_of_blocks_the_last_running_request_is_preempted_not_a_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    e = make_engine(budget=4096, capacity=16 * 24)
    task = asyncio.ensure_future(e.run())
    victims: list[str] = []
    real_preempt = e._preempt

    def spy(r: EngineRequest) -> None:
        victims.append(r.request_id)
        real_preempt(r)

    monkeypatch.setattr(e, "_preempt", spy)
    try:
        # Two decode-local turns kept behind handles: 5 blocks held each, 14 of 24 left.
        pinned = [request(ids(f"held {i} " + TEXT * 3)[:80], max_tokens=1) for i in range(2)]
        for r in pinned:
            r.kv_params = dict(LOCAL_RETAIN)
        await run(e, *pinned)
        assert len(e.holds) == 2 and e.pool.num_used == 10
        before = held_snapshot(e)
        # Two requests that each grow to 10 blocks: both cannot fit next to the holds.
        a = request(ids("first " + TEXT * 2)[:48], max_tokens=100, ignore_eos=True)
        b = request(ids("second " + TEXT * 2)[:48], max_tokens=100, ignore_eos=True)
        out = await run(e, a, b)
        assert [len(x) for x, _ in out] == [100, 100]
        # vLLM preempts the lowest-priority running request, the last admitted, not the one needing a block.
        assert victims and victims[0] == b.request_id and a.request_id not in victims
        labels = {"model_name": e.metrics.model, "engine": "0"}
        assert e.metrics.registry.get_sample_value("vllm:num_preemptions_total", labels) == len(victims)
        assert_holds_intact(e, before)
        assert e.pool.num_used == 10
        # Preempted and recomputed, B still gives the answer it gives alone.
        alone = make_engine(budget=4096)
        t2 = asyncio.ensure_future(alone.run())
        try:
            [(ref, _)] = await run(alone, request(list(b.prompt_ids), max_tokens=100, ignore_eos=True))
        finally:
            t2.cancel()
        assert out[1][0] == ref
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


# ---- (d) vLLM 0.34 -------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_0_34_handle_and_stream_and_no_transfer_across_versions(client: httpx.AsyncClient) -> None:
    async with (
        SimCluster(speed=SPEED, emulate="0.34", kv_recompute_threshold=16) as new,
        SimCluster(speed=SPEED, emulate="0.33", kv_recompute_threshold=16, prefill_prefix_caching=False) as old,
    ):
        assert (await client.get(new.decode_urls[0] + "/version")).json()["version"] == "0.34.0"
        prompt = ids(TEXT * 2)
        _, d1 = await pd(client, new, prompt, 20)
        handle = d1["kv_transfer_params"]
        assert handle["remote_registration_generation"] == 0 and handle["remote_blocks_expiry_time"] is not None
        assert (await held(client, new.decode_urls[0]))[handle["remote_request_id"]]["tracked"] is True

        # Streamed: the handle comes on the finish chunk, as from 0.33.
        p = await complete(client, new.prefill_urls[0], prompt, 1, P_PARAMS)
        body = {"model": "kvtether-sim", "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True,
                "kv_transfer_params": p["kv_transfer_params"]}
        chunks = []
        async with client.stream("POST", new.decode_urls[0] + "/v1/completions", json=body) as s:
            async for line in s.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
        [fin] = [ch for ch in chunks if ch["choices"] and ch["choices"][0]["finish_reason"]]
        assert fin["kv_transfer_params"]["remote_registration_generation"] == 0

        # A 0.34 P cannot use a 0.33 D's handle: the NIXL handshake fails, and D's hold is left to its TTL.
        _, od1 = await pd(client, old, prompt, 20)
        old_handle = od1["kv_transfer_params"]
        assert "remote_registration_generation" in old_handle
        prompt2 = prompt + out_ids(od1) + ids(" And then?")
        cross = await client.post(new.prefill_urls[0] + "/v1/completions", json={
            "model": "kvtether-sim", "prompt": prompt2, "max_tokens": 1, "kv_transfer_params": old_handle})
        assert cross.status_code == 500 and "KV load failure" in cross.text
        assert (await release(client, new.prefill_urls[0], old_handle)).status_code == 200
        await asyncio.sleep(0.1)
        old_d = old.node(old.decode_urls[0])
        assert old_d.engine.holds.get(old_handle["remote_request_id"]) is not None
        # The same read from a P of its own release works and frees it.
        same = await complete(client, old.prefill_urls[0], prompt2, 1, old_handle)
        assert same["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16
        assert old_d.engine.holds.get(old_handle["remote_request_id"]) is None
