"""The simulator's cost model and presets: behaviour and the config formulas, never wall-clock speed."""

from __future__ import annotations

import dataclasses
import math
import types

import pytest
from kvtether.sim.cost import CostModel, Hardware, ModelShape, wall_seconds
from kvtether.sim.presets import (
    DSA_INDEXER_BYTES,
    FP8_DS_MLA_BYTES,
    PRESETS,
    Preset,
    UnknownPreset,
    get_preset,
)

from tests.support import benchmark_scripts

GPU_PRESETS = ["llama-3.1-8b-h100", "qwen3-32b-h200-tp8", "glm-5-fp8-h200-tp8"]
ALL = sorted(PRESETS)


def cost(name: str) -> CostModel:
    return get_preset(name).cost


# --- presets ---------------------------------------------------------------------------------------------


def test_required_presets_exist() -> None:
    assert {"toy", *GPU_PRESETS} <= set(PRESETS)
    for name, preset in PRESETS.items():
        assert preset.name == name


def test_unknown_preset_raises_and_lists_known_ones() -> None:
    with pytest.raises(UnknownPreset) as err:
        get_preset("no-such-preset")
    assert isinstance(err.value, KeyError)  # callers that catch KeyError keep working
    message = str(err.value)
    assert "no-such-preset" in message
    for name in PRESETS:
        assert name in message


@pytest.mark.parametrize("name", ALL)
def test_every_parameter_is_positive_and_documented(name: str) -> None:
    preset = get_preset(name)
    assert preset.description
    assert preset.sources, "a preset names where its numbers come from"
    for obj in (preset.cost.model, preset.cost.hardware):
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if f.name in {
                "attention_window",
                "indexer_dim",
                "indexer_bytes_per_token",
                "n_experts",
                "experts_per_token",
                "expert_weight_bytes",
                "hbm_capacity",
                "request_overhead",
            }:
                assert value is None or value >= 0, f.name  # optional features: absent or non-negative
            elif not isinstance(value, str):
                assert value > 0, f"{name}: {f.name} = {value}"
    assert 0 < preset.cost.hardware.efficiency <= 1
    assert preset.kv_capacity_tokens > 0
    assert preset.max_num_batched_tokens > 0 and preset.max_num_seqs > 0 and preset.block_size > 0
    # The engine's blocks and the cost model's transfer descriptors use the same block size.
    assert preset.cost.block_size == preset.block_size


def test_kv_bytes_per_token_follow_the_model_configs() -> None:
    # GQA: 2 (K and V) * layers * KV heads * head_dim * 2 bytes (BF16); TP up to the KV-head count splits.
    assert cost("llama-3.1-8b-h100").model.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # 128 KiB
    assert cost("qwen3-32b-h200-tp8").model.kv_bytes_per_token == 2 * 64 * 8 * 128 * 2  # 256 KiB
    # MLA + DSA, FP8 cache: (656 + 132) B per layer, 78 layers, a full copy on each of the 8 TP ranks.
    assert FP8_DS_MLA_BYTES == 512 + 4 * 4 + 64 * 2
    assert DSA_INDEXER_BYTES == 128 + 4
    glm = cost("glm-5-fp8-h200-tp8").model
    assert glm.kv_bytes_per_token == 78 * (656 + 132) * 8
    assert glm.indexer_bytes_per_token == 78 * 132 * 8
    assert cost("toy").model.kv_bytes_per_token == 2 * 2 * 2 * 32 * 2


def test_parameter_counts_match_the_published_sizes() -> None:
    # Weight bytes / bytes-per-parameter against the model cards: 8.03B, 32.8B, 744B (40B active).
    assert cost("llama-3.1-8b-h100").model.weight_bytes / 2 == pytest.approx(8.03e9, rel=0.01)
    assert cost("qwen3-32b-h200-tp8").model.weight_bytes / 2 == pytest.approx(32.8e9, rel=0.01)
    glm = cost("glm-5-fp8-h200-tp8").model
    assert glm.weight_bytes == pytest.approx(744e9, rel=0.01)
    assert glm.active_params == pytest.approx(40e9, rel=0.05)


def test_weights_and_kv_fit_the_node() -> None:
    for name in GPU_PRESETS:
        preset = get_preset(name)
        hw = preset.cost.hardware
        used = preset.cost.model.weight_bytes + preset.kv_capacity_tokens * preset.cost.model.kv_bytes_per_token
        assert used <= hw.hbm_capacity * hw.n_gpus * 0.9
        # ... and can hold at least a few of the sweep's longest conversations.
        assert preset.kv_capacity_tokens > 4 * 24_576


# --- prefill -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_prefill_grows_with_tokens_and_context(name: str) -> None:
    c = cost(name)
    assert c.prefill_seconds([(0, 0)]) == 0
    assert c.prefill_seconds([(1000, 0)]) < c.prefill_seconds([(2000, 0)]) < c.prefill_seconds([(4000, 0)])
    assert c.prefill_seconds([(512, 0)]) < c.prefill_seconds([(512, 4096)]) < c.prefill_seconds([(512, 16384)])


@pytest.mark.parametrize("name", ["toy", "llama-3.1-8b-h100", "qwen3-32b-h200-tp8"])
def test_dense_attention_makes_prefill_super_linear(name: str) -> None:
    c = cost(name)
    # Doubling the prompt more than doubles the time, and the excess is the attention's quadratic term.
    for n in (2048, 8192, 16384):
        assert c.prefill_seconds([(2 * n, 0)]) > 2 * c.prefill_seconds([(n, 0)])
    m = c.model
    assert m.attention_flops(4096, 0) == pytest.approx(4 * m.attention_flops(2048, 0), rel=0.01)


def test_sparse_attention_caps_the_main_attention_but_not_the_indexer() -> None:
    m = cost("glm-5-fp8-h200-tp8").model
    window = m.attention_window
    assert window == 2048
    # Past the window, each query scores exactly `window` keys.
    assert ModelShape.causal_pairs(10, 100_000, window) == 10 * window
    assert ModelShape.causal_pairs(10, 0, window) == ModelShape.causal_pairs(10, 0)  # inside: dense
    # Straddling the window: exact sum of min(position, window).
    exact = sum(min(p, window) for p in range(2001, 2101))
    assert ModelShape.causal_pairs(100, 2000, window) == exact
    # The indexer is dense: the attention cost of one query still grows with the context beyond the window.
    assert m.attention_flops(1, 100_000) > m.attention_flops(1, 10_000) > m.attention_flops(1, 2_000)
    # Prefill is still super-linear (quadratic indexer), but only mildly at these lengths.
    c = cost("glm-5-fp8-h200-tp8")
    assert c.prefill_seconds([(32768, 0)]) > 2 * c.prefill_seconds([(16384, 0)])


def test_causal_pairs_matches_a_brute_force_count() -> None:
    for new, ctx, window in [(1, 0, None), (7, 3, None), (50, 10, 32), (5, 40, 32), (40, 0, 32)]:
        expected = sum(ctx + q if window is None else min(ctx + q, window) for q in range(1, new + 1))
        assert ModelShape.causal_pairs(new, ctx, window) == expected


@pytest.mark.parametrize("name", ALL)
def test_lone_prefill_is_chunked_and_no_cheaper_than_one_big_step(name: str) -> None:
    preset = get_preset(name)
    c = preset.cost
    budget = preset.max_num_batched_tokens
    n = 3 * budget + 5
    chunked = c.lone_prefill_seconds(n, 0, budget)
    # Four steps: four per-step overheads; attention over the earlier chunks is counted in each.
    assert chunked >= c.prefill_seconds([(n, 0)]) + 4 * c.hardware.step_overhead - 1e-12
    assert c.lone_prefill_seconds(0, 100, budget) == 0
    assert c.lone_prefill_seconds(100, 0, budget) == c.step_seconds([(100, 0)], [])


# --- decode --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_decode_is_memory_bound_at_small_batch(name: str) -> None:
    c = cost(name)
    m, hw = c.model, c.hardware
    compute = (m.dense_flops(1) + m.attention_flops(1, 1024)) / hw.flops
    memory = (m.weight_bytes_read(1) + m.kv_bytes_read(1024)) / hw.bandwidth
    assert memory > compute
    assert c.decode_seconds([1024]) == pytest.approx(memory)
    assert c.decode_seconds([]) == 0


@pytest.mark.parametrize("name", ALL)
def test_decode_step_grows_with_batch_and_context(name: str) -> None:
    c = cost(name)
    assert c.decode_seconds([4096] * 8) > c.decode_seconds([4096])
    assert c.decode_seconds([32768] * 8) > c.decode_seconds([4096] * 8)
    # Batching amortizes the weights: 8 requests in one step cost less than 8 steps.
    assert c.decode_seconds([4096] * 8) < 8 * c.decode_seconds([4096])


def test_moe_decode_reads_only_the_touched_experts() -> None:
    m = cost("glm-5-fp8-h200-tp8").model
    one = m.weight_bytes_read(1)
    shared = m.weight_bytes - m.expert_weight_bytes
    assert one == pytest.approx(shared + m.expert_weight_bytes * 8 / 256)
    assert m.weight_bytes_read(1) < m.weight_bytes_read(16) < m.weight_bytes_read(256) < m.weight_bytes
    assert m.weight_bytes_read(8192) == pytest.approx(m.weight_bytes, rel=1e-6)
    # Dense models read everything whatever the batch.
    dense = cost("qwen3-32b-h200-tp8").model
    assert dense.weight_bytes_read(1) == dense.weight_bytes_read(64) == dense.weight_bytes


@pytest.mark.parametrize("name", ALL)
def test_step_is_overhead_plus_roofline(name: str) -> None:
    c = cost(name)
    assert c.step_seconds([], []) == 0
    mixed = c.step_seconds([(256, 1024)], [2048, 4096])
    assert mixed > c.hardware.step_overhead
    assert mixed >= c.step_seconds([(256, 1024)], [])
    assert mixed >= c.step_seconds([], [2048, 4096])


# --- transfer ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_transfer_is_latency_plus_the_slower_of_bytes_and_descriptors(name: str) -> None:
    c = cost(name)
    hw, m = c.hardware, c.model
    assert c.transfer_seconds(0) == 0 and c.transfer_descriptors(0) == 0
    for n in (1, 16, 4096, 24_576):
        blocks = math.ceil(n / c.block_size)
        assert c.transfer_descriptors(n) == m.kv_regions * blocks  # one per (region, block) on each GPU
        wire = n * m.kv_bytes_per_token / (hw.link_bandwidth * hw.efficiency)
        messages = m.kv_regions * blocks * hw.n_gpus / hw.link_message_rate
        assert c.transfer_seconds(n) == pytest.approx(hw.link_latency + max(wire, messages))


def test_descriptors_follow_vllms_nixl_layout() -> None:
    # FlashAttention keeps K and V of each layer in separate tensors: 2 regions per layer.
    assert cost("qwen3-32b-h200-tp8").model.kv_regions == 2 * 64
    assert cost("llama-3.1-8b-h100").model.kv_regions == 2 * 32
    # MLA: one latent cache per layer, plus DSA's indexer cache per layer; 64-token blocks.
    glm = cost("glm-5-fp8-h200-tp8")
    assert glm.model.kv_regions == 2 * 78 and glm.block_size == 64
    # 24k tokens of Qwen3-32B: 1536 blocks x 128 regions = 196,608 reads of 4 KiB on every GPU.
    qwen = cost("qwen3-32b-h200-tp8")
    assert qwen.transfer_descriptors(24_576) == 1536 * 128
    per_descriptor = qwen.model.kv_bytes_per_token / qwen.hardware.n_gpus * qwen.block_size / qwen.model.kv_regions
    assert per_descriptor == 16 * 128 * 2  # one KV head per rank, 16 tokens, 128 dims, BF16


def test_small_descriptors_are_message_rate_bound_large_ones_bandwidth_bound() -> None:
    qwen = cost("qwen3-32b-h200-tp8")
    hw, m = qwen.hardware, qwen.model
    n = 24_576
    wire = hw.link_latency + n * m.kv_bytes_per_token / hw.link
    # 4 KiB descriptors: the descriptor count, not the bytes, sets the time (an order of magnitude above).
    assert qwen.transfer_seconds(n) > 5 * wire
    assert qwen.transfer_seconds(n) == pytest.approx(hw.link_latency + 1536 * 128 * hw.n_gpus / hw.link_message_rate)
    # The same bytes in 256-token blocks (64 KiB descriptors): bandwidth bound, bytes / link exactly.
    big = dataclasses.replace(qwen, block_size=256)
    assert big.transfer_seconds(n) == pytest.approx(wire)
    # GLM-5's MLA cache alone (64 tokens x 656 B = 41 KiB per descriptor) is bandwidth bound too.
    glm = cost("glm-5-fp8-h200-tp8")
    mla_only = dataclasses.replace(glm, model=dataclasses.replace(glm.model, kv_regions=78))
    n = 20_480
    assert mla_only.transfer_seconds(n) == pytest.approx(
        glm.hardware.link_latency + n * glm.model.kv_bytes_per_token / glm.hardware.link
    )
    # Without a message-rate limit the transfer is the old latency + bytes / bandwidth.
    unlimited = dataclasses.replace(qwen, hardware=dataclasses.replace(hw, link_message_rate=math.inf))
    assert unlimited.transfer_seconds(n) == pytest.approx(hw.link_latency + n * m.kv_bytes_per_token / hw.link)


def test_glm_pull_is_tens_of_milliseconds_qwen_pull_hundreds() -> None:
    # The blog reports the D -> P transfer itself at about 30-130 ms. GLM-5's 20k pull is of that order. Qwen3's
    # 24k pull, message-rate bound at the measured ~2.4 us per descriptor, takes ~0.5 s: more than the blog's
    # figure if that figure covers Qwen3 at 24k (the README states this tension).
    assert 0.03 < cost("glm-5-fp8-h200-tp8").transfer_seconds(20_480) < 0.2
    assert 0.3 < cost("qwen3-32b-h200-tp8").transfer_seconds(24_576) < 0.7


# --- one efficiency factor, clock speed ----------------------------------------------------------------


def _with_efficiency(c: CostModel, efficiency: float) -> CostModel:
    return dataclasses.replace(c, hardware=dataclasses.replace(c.hardware, efficiency=efficiency))


@pytest.mark.parametrize("name", GPU_PRESETS)
def test_efficiency_scales_work_uniformly(name: str) -> None:
    c = cost(name)
    half = _with_efficiency(c, c.hardware.efficiency / 2)
    # Every work term doubles when the one factor halves: compute, HBM and network alike.
    assert half.prefill_seconds([(4096, 1024)]) == pytest.approx(2 * c.prefill_seconds([(4096, 1024)]))
    assert half.decode_seconds([4096] * 4) == pytest.approx(2 * c.decode_seconds([4096] * 4))
    # The network's bytes scale with it too; the descriptor rate is a measured achieved figure and does not.
    no_limit = dataclasses.replace(c.hardware, link_message_rate=math.inf)
    bw = dataclasses.replace(c, hardware=no_limit)
    bw_half = _with_efficiency(bw, c.hardware.efficiency / 2)
    latency = c.hardware.link_latency
    assert bw_half.transfer_seconds(8192) - latency == pytest.approx(2 * (bw.transfer_seconds(8192) - latency))
    messages = c.transfer_descriptors(8192) * c.hardware.n_gpus / c.hardware.link_message_rate
    assert half.transfer_seconds(8192) - latency == pytest.approx(
        max(2 * (bw.transfer_seconds(8192) - latency), messages)
    )
    # Nor does the per-request overhead (host-side).
    assert half.hardware.request_overhead == c.hardware.request_overhead


def test_speed_factor_leaves_ratios_unchanged() -> None:
    c = cost("qwen3-32b-h200-tp8")
    overhead = 2 * c.hardware.request_overhead
    off = overhead + c.lone_prefill_seconds(24_576, 0, 8192)
    on = overhead + c.transfer_seconds(24_435) + c.lone_prefill_seconds(141, 24_435, 8192)
    for speed in (1.0, 7.0, 1000.0):
        assert wall_seconds(off, speed) / wall_seconds(on, speed) == pytest.approx(off / on)
        assert wall_seconds(off, speed) == pytest.approx(off / speed)
    with pytest.raises(ValueError):
        wall_seconds(1.0, 0.0)


def test_kv_capacity_needs_hbm_capacity() -> None:
    toy = cost("toy")
    assert toy.hardware.hbm_capacity == 0
    with pytest.raises(ValueError):
        toy.kv_capacity_tokens()
    hw = Hardware("x", 1, 1e12, 1e12, 0.5, 1e9, 1e-3, 1e-3, hbm_capacity=10e9)
    model = dataclasses.replace(toy.model, weight_bytes=1e9, kv_bytes_per_token=1e5)
    capacity = CostModel(model=model, hardware=hw).kv_capacity_tokens(gpu_memory_utilization=0.9, reserve_fraction=0)
    assert capacity == math.floor((10e9 * 0.9 - 1e9) / 1e5)


def test_preset_is_frozen() -> None:
    preset: Preset = get_preset("toy")
    with pytest.raises(dataclasses.FrozenInstanceError):
        preset.name = "other"


# --- the sweep benchmark's analytic turn (benchmarks/sim_pull_sweep.py) -----------------------------------


def _sweep_module() -> types.ModuleType:
    return benchmark_scripts.load("sim_pull_sweep")


@pytest.mark.parametrize("name", ["qwen3-32b-h200-tp8", "glm-5-fp8-h200-tp8"])
def test_analytic_turn_pulls_the_held_history_and_computes_the_suffix(name: str) -> None:
    sweep = _sweep_module()
    preset = get_preset(name)
    off = sweep.analytic_turn(preset, 16_384, pull=False)
    on = sweep.analytic_turn(preset, 16_384, pull=True)
    assert (off.pulled, off.computed, off.pull) == (0, 16_384, 0)
    assert on.pulled == 16_384 - sweep.USER_TOKENS - 1  # D's handle: previous prompt + answer - 1
    assert on.computed == sweep.USER_TOKENS + 1
    assert on.pull == preset.cost.transfer_seconds(on.pulled)
    assert on.ttft == pytest.approx(on.pull + on.prefill + on.to_decode + on.first_token + on.overhead)
    # The fixed serving overhead: once per request, two requests (P leg, D leg) per turn, in both modes
    # (0 in the shipped presets: not modelled, see sim/presets.py REQUEST_OVERHEAD_PD).
    assert on.overhead == off.overhead == 2 * preset.cost.hardware.request_overhead
    # D's side of the turn does not depend on where P got the history from.
    assert (on.to_decode, on.first_token) == (off.to_decode, off.first_token)
    # Below the recompute threshold P computes locally: the same turn as without the pull.
    assert sweep.analytic_turn(preset, 16_384, pull=True, threshold=10**6) == off


@pytest.mark.parametrize("name", ["qwen3-32b-h200-tp8", "glm-5-fp8-h200-tp8"])
def test_sweep_shape_off_grows_steeply_on_slowly(name: str) -> None:
    sweep = _sweep_module()
    preset = get_preset(name)
    lengths = sweep.DEFAULT_LENGTHS[name]
    off = [sweep.analytic_turn(preset, n, pull=False).ttft for n in lengths]
    on = [sweep.analytic_turn(preset, n, pull=True).ttft for n in lengths]
    assert off == sorted(off) and on == sorted(on)
    ratios = [a / b for a, b in zip(off, on, strict=True)]
    assert ratios == sorted(ratios)  # the pull's advantage widens with the history
    assert off[-1] - off[0] > 1.4 * (on[-1] - on[0])  # blog: x1.8 (Qwen3-32B), x5.3 (GLM-5-FP8)


def test_sweep_prints_blog_figures_only_at_published_endpoints(capsys: pytest.CaptureFixture[str]) -> None:
    sweep = _sweep_module()
    assert sweep.main(["--mode", "analytic", "--preset", "qwen3-32b-h200-tp8", "--lengths", "2048,8192,24576"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.strip().split(" ")[0].isdigit()]
    assert len(rows) == 3
    assert "158" in rows[0] and "122" in rows[0]
    assert "n/a" in rows[1]
    assert "778" in rows[2] and "460" in rows[2]
    assert "ASSUMPTION" in out
    assert "not modelled" in out  # the missing serving overhead is stated next to the figures
