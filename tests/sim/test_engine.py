"""Scheduler: chunked prefill under the token budget, batched decode, prefix cache, cold == warm."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from kvtether.sim.clock import SimClock
from kvtether.sim.config import NodeConfig
from kvtether.sim.engine import Engine, Step
from kvtether.sim.metrics import NodeMetrics
from kvtether.sim.presets import get_preset

from tests.support.sim_engine import TOK, NoTransport, make_engine, request, run


@pytest.fixture
async def engine_factory():
    tasks: list[asyncio.Task[None]] = []

    def start(**kw: int) -> Engine:
        e = make_engine(**kw)
        tasks.append(asyncio.ensure_future(e.run()))
        return e

    yield start
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


PROMPT = TOK.encode("The cache holds the prefix of every request that the node has served today. " * 12)


@pytest.mark.anyio
async def test_chunked_prefill_respects_the_budget(engine_factory) -> None:
    e = engine_factory(budget=64)
    steps: list[Step] = []
    e.on_step = steps.append
    [(ids, fin)] = await run(e, request(PROMPT, max_tokens=4))
    assert fin.reason == "length" and len(ids) == 4
    chunks = [c for s in steps for c in s.prefill_chunks]
    assert all(sum(n for n, _ in s.prefill_chunks) + len(s.decode_contexts) <= 64 for s in steps)
    assert sum(n for n, _ in chunks) == len(PROMPT)
    assert [ctx for _, ctx in chunks] == list(range(0, len(PROMPT), 64))  # context grows chunk by chunk


@pytest.mark.anyio
async def test_decode_is_batched(engine_factory) -> None:
    e = engine_factory(budget=4096)
    steps: list[Step] = []
    e.on_step = steps.append
    prompts = [TOK.encode(f"request number {i} asks about the weather") for i in range(4)]
    await run(e, *(request(p, max_tokens=6, ignore_eos=True) for p in prompts))
    assert max(len(s.decode_contexts) for s in steps) == 4


@pytest.mark.anyio
async def test_prefix_cache_hit_gives_the_cold_answer(engine_factory) -> None:
    e = engine_factory(budget=4096)
    [(cold, f1)] = await run(e, request(PROMPT, max_tokens=30))
    r2 = request(list(PROMPT), max_tokens=30)
    [(warm, _)] = await run(e, r2)
    assert warm == cold
    assert r2.cached_device == (len(PROMPT) - 1) // 16 * 16
    assert f1.kv_transfer_params is None  # a plain request never leaves a handle


@pytest.mark.anyio
async def test_preemption_under_kv_pressure_still_answers(engine_factory) -> None:
    e = engine_factory(budget=512, capacity=16 * 20)
    prompts = [TOK.encode(f"story {i} " + "about the long road home " * 10) for i in range(3)]
    out = await run(e, *(request(p, max_tokens=40, ignore_eos=True) for p in prompts))
    assert [len(ids) for ids, _ in out] == [40, 40, 40]
    alone = make_engine(budget=512)
    task = asyncio.ensure_future(alone.run())
    try:
        [(ref, _)] = await run(alone, request(prompts[2], max_tokens=40, ignore_eos=True))
    finally:
        task.cancel()
    assert out[2][0] == ref


# --- prefix-caching switch and per-request overhead ----------------------------------------------------------


def _engine_with(cfg: NodeConfig, request_overhead: float = 0.0) -> Engine:
    base = get_preset("toy")
    hw = dataclasses.replace(base.cost.hardware, request_overhead=request_overhead)
    preset = dataclasses.replace(base, cost=dataclasses.replace(base.cost, hardware=hw), kv_capacity_tokens=4096)
    metrics = NodeMetrics(
        cfg.model_name,
        block_size=16,
        num_blocks=4096 // 16,
        engine_id=cfg.engine_id,
        enable_prefix_caching=cfg.enable_prefix_caching,
    )
    return Engine(cfg, preset, TOK, NoTransport(), metrics, SimClock(cfg.speed))


@pytest.mark.anyio
async def test_prefix_caching_off_skips_the_lookup_and_says_so_in_metrics() -> None:
    e = _engine_with(NodeConfig(speed=1000.0, enable_prefix_caching=False))
    task = asyncio.ensure_future(e.run())
    try:
        [(cold, _)] = await run(e, request(PROMPT, max_tokens=10))
        r2 = request(list(PROMPT), max_tokens=10)
        [(again, _)] = await run(e, r2)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert again == cold  # same answer, computed from scratch
    assert r2.cached_device == 0
    assert 'enable_prefix_caching="False"' in e.metrics.render().decode()


def test_cluster_spec_switches_prefix_caching_off_on_prefill_nodes_only() -> None:
    from kvtether.sim.cluster import ClusterSpec

    configs = ClusterSpec(prefill=2, decode=1, aggregated=1, prefill_prefix_caching=False).node_configs()
    assert {c.role: c.enable_prefix_caching for c in configs} == {"prefill": False, "decode": True, "aggregated": True}
    assert all(c.enable_prefix_caching for c in ClusterSpec(prefill=1, decode=1).node_configs())  # default: on


def test_a_prefill_cache_can_be_made_smaller_than_the_presets() -> None:
    # vLLM --num-gpu-blocks-override on P only: the engine's pool, its max_model_len and cache_config_info.
    from kvtether.sim.cluster import ClusterSpec
    from kvtether.sim.node import SimNode

    configs = ClusterSpec(prefill=1, decode=1, prefill_num_gpu_blocks=50).node_configs()
    assert [c.num_gpu_blocks_override for c in configs] == [50, None]
    p, d = (SimNode(c) for c in configs)
    assert p.engine.pool.num_blocks == 50 and p.cfg.max_model_len == 50 * p.preset.block_size
    assert d.engine.pool.num_blocks == d.preset.kv_capacity_tokens // d.preset.block_size
    assert 'num_gpu_blocks="50"' in p.metrics.render().decode()


@pytest.mark.anyio
async def test_request_overhead_is_charged_once_per_request_even_when_preempted() -> None:
    overhead = 0.5  # simulated seconds; 0.5 ms of real time at speed 1000
    e = _engine_with(NodeConfig(speed=1000.0), request_overhead=overhead)
    e.pool = type(e.pool)(20, 16)  # 320 tokens of KV: three long requests preempt each other
    task = asyncio.ensure_future(e.run())
    steps: list[Step] = []
    e.on_step = steps.append
    prompts = [TOK.encode(f"story {i} " + "about the long road home " * 10) for i in range(3)]
    try:
        start = e.clock.now()
        out = await run(e, *(request(p, max_tokens=40, ignore_eos=True) for p in prompts))
        elapsed = e.clock.now() - start
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert [len(ids) for ids, _ in out] == [40, 40, 40]
    assert e.overhead_charged == pytest.approx(3 * overhead)  # once per request, not per (re-)admission
    assert not e.arriving
    assert elapsed >= overhead  # no request reached the scheduler before its overhead had passed
    assert get_preset("toy").cost.hardware.request_overhead == 0  # the test preset stays instant
