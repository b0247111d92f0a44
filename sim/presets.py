"""Named simulator set-ups: a model shape on a hardware configuration plus engine limits.

Every number below is either copied from a public model config / data sheet (the source is named next to
it) or marked ASSUMPTION. Derived numbers (parameter counts, KV bytes per token) are computed from the
config values by the small functions here, so a test can hold them against the formula. Each preset has
exactly one free factor, `Hardware.efficiency`, chosen a priori (the reason is written next to it), never
fitted to a benchmark point.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvtether.sim.cost import CostModel, Hardware, ModelShape

GB = 1e9
TFLOPS = 1e12
GBIT = 1e9 / 8  # bytes/s in one Gb/s


@dataclass(frozen=True, slots=True)
class Preset:
    """`block_size` must equal `cost.block_size` (the engine's blocks and the cost model's descriptors)."""

    name: str
    description: str
    cost: CostModel
    kv_capacity_tokens: int  # KV-cache size of one node, in tokens
    max_num_batched_tokens: int  # token budget of one engine step (chunked prefill)
    max_num_seqs: int  # running requests per node
    block_size: int = 16
    sources: tuple[str, ...] = ()  # where the model and hardware numbers come from
    # How the model writes tool calls, i.e. the --tool-call-parser vLLM serves it with (sim/template.py).
    tool_call_parser: str = "hermes"


class UnknownPreset(KeyError):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name

    def __str__(self) -> str:
        return f"unknown preset {self.name!r}; known: {', '.join(sorted(PRESETS))}"


# --- formulas from config.json fields ------------------------------------------------------------------


def gqa_kv_bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, dtype_bytes: float) -> float:
    """K and V, every layer, every KV head: 2 * layers * kv_heads * head_dim * bytes.

    With tensor parallelism up to n_kv_heads ranks the heads are split, not copied, so the node total is
    the same as one GPU's would be (assumes tp <= n_kv_heads, true for the presets here).
    """
    return 2.0 * n_layers * n_kv_heads * head_dim * dtype_bytes


def gqa_kv_regions(n_layers: int) -> int:
    """NIXL regions per GPU for a FlashAttention KV cache: K and V of each layer are separate tensors.

    Source: vllm-project/vllm, vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py,
    `_get_block_descs_ids` ("the regions are organized as [K0, V0, K1, V1, ...]"; descriptor id =
    region_id * num_blocks + block_id) and the registration loop (num_regions = registered cache tensors).
    """
    return 2 * n_layers


def gqa_layer_params(hidden: int, n_heads: int, n_kv_heads: int, head_dim: int, intermediate: int) -> float:
    """Weights of one GQA + SwiGLU decoder layer (q, k, v, o projections; gate, up, down); norms ignored."""
    attention = hidden * n_heads * head_dim * 2 + hidden * n_kv_heads * head_dim * 2
    mlp = 3 * hidden * intermediate
    return float(attention + mlp)


# vLLM's FP8 MLA cache for DeepSeek sparse attention ("fp8_ds_mla"): 512 FP8 latent values, 4 FP32 scales
# (16 B) and the 64-dim RoPE key in BF16 (128 B) = 656 B per token per layer. Source: vllm-project/vllm,
# vllm/v1/attention/backends/mla/flashmla_sparse.py, FlashMLASparseBackend.get_kv_cache_shape ("custom
# storage format is 656 bytes").
FP8_DS_MLA_BYTES = 656
# DSA indexer key cache: index_head_dim FP8 values + one FP32 scale per 128 = 128 + 4 = 132 B per token per
# layer. Source: vllm-project/vllm, vllm/model_executor/models/deepseek_v2.py, Indexer:
# DeepseekV32IndexerCache(head_dim=head_dim + head_dim // quant_block_size * 4).
DSA_INDEXER_BYTES = 128 + 128 // 128 * 4


def mla_dsa_kv_regions(n_layers: int) -> int:
    """NIXL regions per GPU for MLA + DSA: one latent cache per layer (MLA keeps no separate K and V, the
    connector's "num_layers == num_regions" case) plus the indexer's key cache, which vLLM allocates as a
    KV-cache layer of its own (DeepseekV32IndexerCache) and the connector registers like any other.
    ASSUMPTION for the indexer part: that it is transferred with the MLA cache (vllm issue #55434 counts
    91k-120k descriptors per TP-rank transfer for GLM-5.3 and names MLA + DSA indexer as the amplifier)."""
    return 2 * n_layers


def mla_dsa_kv_bytes_per_token(n_layers: int, tp: int) -> float:
    """GLM-5 / DeepSeek-V3.2 with an FP8 KV cache: (656 + 132) B per layer per token on EVERY TP rank.

    MLA has one latent "KV head", which tensor parallelism cannot split: each of the `tp` ranks keeps a
    full copy, and each rank pulls its own copy in a NIXL transfer, so the node total is tp times a GPU's.
    """
    return float(n_layers * (FP8_DS_MLA_BYTES + DSA_INDEXER_BYTES) * tp)


# --- toy -----------------------------------------------------------------------------------------------

# A tiny CPU-friendly model (the shape of the 2-layer test model scripts/setup-vllm-cpu.sh builds) on one CPU
# socket. Efficiency 0.3: eager PyTorch on CPU reaches a fraction of peak.
TOY = Preset(
    name="toy",
    description="tiny 2-layer model on a CPU: fast, for tests and the laptop demo",
    cost=CostModel(
        model=ModelShape(
            name="toy-2L",
            active_params=5.0e6,
            weight_bytes=1.0e7,
            n_layers=2,
            n_heads=4,
            qk_head_dim=32,
            v_head_dim=32,
            kv_bytes_per_token=gqa_kv_bytes_per_token(n_layers=2, n_kv_heads=2, head_dim=32, dtype_bytes=2),
            kv_regions=gqa_kv_regions(n_layers=2),
        ),
        hardware=Hardware(
            name="cpu",
            n_gpus=1,
            peak_flops=2.0e11,
            hbm_bandwidth=2.0e10,
            efficiency=0.3,
            link_bandwidth=2.0e9,
            link_latency=2.0e-4,
            step_overhead=1.0e-3,
            # No per-descriptor cost and no per-request overhead: the toy is for fast tests, not for figures.
            link_message_rate=math.inf,
            request_overhead=0.0,
        ),
    ),
    kv_capacity_tokens=262_144,
    max_num_batched_tokens=8192,
    max_num_seqs=64,
    sources=("ASSUMPTION: shape of the 2-layer test model scripts/setup-vllm-cpu.sh builds; CPU figures are rough",),
)

# --- hardware ------------------------------------------------------------------------------------------

# NVIDIA H100 SXM5 / H200 SXM data sheets: dense (no 2:4 sparsity) BF16 989 TFLOPS, FP8 1979 TFLOPS per GPU
# (the data sheets print the sparse 1979 / 3958); HBM3 3.35 TB/s and 80 GB (H100), HBM3e 4.8 TB/s and 141 GB
# (H200). Dense figures as tabulated in e.g. https://itkb.uw.cz/2026/06/nvidia-h200-vs-b300-precisions-cores.html
# and https://lzwjava.github.io/nvidia-h200-gpu-specs-en (which notes the data-sheet figures include sparsity).
H100_BF16 = 989 * TFLOPS
H200_BF16 = 989 * TFLOPS
H200_FP8 = 1979 * TFLOPS
H100_HBM, H100_HBM_BYTES = 3.35e12, 80 * GB
H200_HBM, H200_HBM_BYTES = 4.8e12, 141 * GB
# The vLLM blog's nodes: 16 x 200 Gb/s EFA per 8 x H200 node = 3.2 Tb/s = 400 GB/s (docs/protocol.md §4).
EFA_16X200 = 16 * 200 * GBIT
# ASSUMPTION: one 400 Gb/s NIC for a single-H100 node (the usual 1 NIC per GPU of an HGX H100).
NIC_400G = 400 * GBIT
# NIXL posts one RDMA read per descriptor from a single loop per GPU (its LIBFABRIC backend, the one used on
# EFA). Measured: ~46 ms of posting time for 18,880 descriptors (Llama-70B, TP8, 80 layers x 2 K/V x 118
# blocks), i.e. ~2.4 us per descriptor per GPU (github.com/ai-dynamo/nixl issue #1514, "LIBFABRIC backend:
# Add thread pool support to ... postXfer", which also says these post times dominate the KV-transfer
# latency). Every GPU of a node posts its own share in parallel, so a node processes n_gpus / 2.4 us.
# ASSUMPTION: the blog's nodes post from one thread per GPU (NIXL's default; nixl PR #1581 added an optional
# thread pool for this loop), and the UCX path of the single-H100 preset posts at the same rate.
NIXL_POST_SECONDS = 46e-3 / 18_880
EFA_8GPU_MESSAGE_RATE = 8 / NIXL_POST_SECONDS  # ~3.3e6 descriptors/s per 8-GPU node
ONE_GPU_MESSAGE_RATE = 1 / NIXL_POST_SECONDS
# Per-request serving overhead on the P/D path (API server, connector hand-over, scheduler hand-offs), charged
# once per request on each node. Set to 0: no public low-load measurement exists, and the only way to get a
# value would be to read it off the blog's own 2k point, i.e. to fit the curve we are checking against (a
# 43 ms value derived that way was tried: it fixes the absolute TTFT at 2k but pushes GLM-5's 20k ratio to
# -32 %). Consequence, stated in the benchmark: absolute TTFTs at short prompts sit below the blog's by its
# fixed serving costs (~100 ms per turn); ratios at long prompts, where compute and transfer dominate, are the
# comparison that matters. The mechanism stays (Hardware.request_overhead) for users who measured their own.
# Plausibility of the order of magnitude: vllm issue #50913 / PR #51919 measured the P -> D hand-over at
# ~197 ms p50 (3P1D, under load) against ~29 ms of actual KV transfer.
REQUEST_OVERHEAD_PD = 0.0
# ASSUMPTION: 1 ms per NIXL transfer (notification and completion poll; the side-channel handshake is made
# once per peer and cached), and 2 ms of scheduler / input-prep / launch time per engine step at TP8 (1 ms at
# TP1) with CUDA graphs. Both are small beside the sweep's prefill times and are not tuned.
XFER_LATENCY = 1e-3
STEP_OVERHEAD_TP8 = 2e-3
STEP_OVERHEAD_TP1 = 1e-3
# vLLM's defaults for the OpenAI server on >= 70 GiB GPUs (vllm/engine/arg_utils.py): 8192 batched tokens per
# step, 1024 sequences; GPU memory utilization 0.9 (see CostModel.kv_capacity_tokens).
MAX_BATCHED = 8192
MAX_SEQS = 1024

# --- Llama-3.1-8B on 1 x H100 ---------------------------------------------------------------------------

# meta-llama/Llama-3.1-8B config.json: hidden 4096, 32 layers, 32 heads, 8 KV heads, head_dim 128,
# intermediate 14336, vocab 128256, untied embeddings, BF16 (e.g. huggingface.co/NbAiLab/nb-llama-3.1-8B,
# a verbatim copy of the base config).
_L8_LAYER = gqa_layer_params(hidden=4096, n_heads=32, n_kv_heads=8, head_dim=128, intermediate=14336)
_L8_VOCAB = 128256 * 4096
LLAMA_8B = ModelShape(
    name="Llama-3.1-8B",
    active_params=32 * _L8_LAYER + _L8_VOCAB,  # layers + lm_head (the embedding lookup costs no FLOPs)
    weight_bytes=2.0 * (32 * _L8_LAYER + 2 * _L8_VOCAB),  # BF16; 8.03e9 parameters
    n_layers=32,
    n_heads=32,
    qk_head_dim=128,
    v_head_dim=128,
    kv_bytes_per_token=gqa_kv_bytes_per_token(n_layers=32, n_kv_heads=8, head_dim=128, dtype_bytes=2),
    kv_regions=gqa_kv_regions(n_layers=32),
)
LLAMA_8B_H100 = Preset(
    name="llama-3.1-8b-h100",
    description="Llama-3.1-8B (BF16) on one H100 SXM, BF16 KV cache, one 400 Gb/s NIC",
    cost=CostModel(
        model=LLAMA_8B,
        hardware=Hardware(
            name="1xH100-SXM",
            n_gpus=1,
            peak_flops=H100_BF16,
            hbm_bandwidth=H100_HBM,
            # Efficiency 0.5 (a priori): an 8B model on one GPU has no TP collectives, and FlashAttention-3
            # plus cuBLAS BF16 GEMMs of this size run at roughly half of the dense peak in vLLM prefill.
            efficiency=0.5,
            link_bandwidth=NIC_400G,
            link_latency=XFER_LATENCY,
            step_overhead=STEP_OVERHEAD_TP1,
            hbm_capacity=H100_HBM_BYTES,
            link_message_rate=ONE_GPU_MESSAGE_RATE,
            request_overhead=REQUEST_OVERHEAD_PD,  # ASSUMPTION: the same serving path as the blog's nodes
        ),
    ),
    kv_capacity_tokens=0,  # filled in below from the memory budget
    max_num_batched_tokens=MAX_BATCHED,
    max_num_seqs=MAX_SEQS,
    sources=(
        "model: meta-llama/Llama-3.1-8B config.json",
        "hardware: NVIDIA H100 SXM data sheet (dense BF16 989 TFLOPS, 3.35 TB/s, 80 GB)",
        "ASSUMPTION: 1 x 400 Gb/s NIC; efficiency 0.5; NIXL posting rate and request overhead as the H200 presets",
    ),
)

# --- Qwen3-32B on 8 x H200, TP8 --------------------------------------------------------------------------

# Qwen/Qwen3-32B config.json: hidden 5120, 64 layers, 64 heads, 8 KV heads, head_dim 128, intermediate 25600,
# vocab 151936, untied embeddings, BF16 (copies: huggingface.co/ronnywebdevs1/d-m-1 config.json;
# gitcode.com/Ascend/MindSpeed-RL configs/model/qwen3_32b.yaml). 31.2e9 non-embedding parameters, 32.8e9 total.
_Q32_LAYER = gqa_layer_params(hidden=5120, n_heads=64, n_kv_heads=8, head_dim=128, intermediate=25600)
_Q32_VOCAB = 151936 * 5120
QWEN3_32B = ModelShape(
    name="Qwen3-32B",
    active_params=64 * _Q32_LAYER + _Q32_VOCAB,
    weight_bytes=2.0 * (64 * _Q32_LAYER + 2 * _Q32_VOCAB),
    n_layers=64,
    n_heads=64,
    qk_head_dim=128,
    v_head_dim=128,
    # 8 KV heads over TP8: one head per rank, split not copied: 256 KiB per token per node.
    kv_bytes_per_token=gqa_kv_bytes_per_token(n_layers=64, n_kv_heads=8, head_dim=128, dtype_bytes=2),
    # 128 regions per GPU; with one KV head per rank a (region, 16-token block) descriptor is 16 x 128 x 2 B
    # = 4 KiB, so this model's transfers are message-rate bound, not bandwidth bound.
    kv_regions=gqa_kv_regions(n_layers=64),
)
QWEN3_32B_H200_TP8 = Preset(
    name="qwen3-32b-h200-tp8",
    description="Qwen3-32B (BF16) on 8 x H200 TP8, BF16 KV cache, 16 x 200 Gb/s EFA (the vLLM blog's set-up)",
    cost=CostModel(
        model=QWEN3_32B,
        hardware=Hardware(
            name="8xH200-TP8-EFA",
            n_gpus=8,
            peak_flops=H200_BF16,
            hbm_bandwidth=H200_HBM,
            # Efficiency 0.4 (a priori): BF16 GEMMs split 8 ways (5120 x 3200 per rank for the MLP) plus two
            # NVLink all-reduces per layer keep TP8 prefill of a 32B model well under the single-GPU ~0.5.
            efficiency=0.4,
            link_bandwidth=EFA_16X200,
            link_latency=XFER_LATENCY,
            step_overhead=STEP_OVERHEAD_TP8,
            hbm_capacity=H200_HBM_BYTES,
            link_message_rate=EFA_8GPU_MESSAGE_RATE,
            request_overhead=REQUEST_OVERHEAD_PD,
        ),
    ),
    kv_capacity_tokens=0,
    max_num_batched_tokens=MAX_BATCHED,
    max_num_seqs=MAX_SEQS,
    sources=(
        "model: Qwen/Qwen3-32B config.json",
        "hardware: NVIDIA H200 SXM data sheet (dense BF16 989 TFLOPS, 4.8 TB/s, 141 GB); 16 x 200 Gb/s EFA",
        "kv transfer: vLLM NIXL connector, one descriptor per (layer, K/V, block); ~2.4 us per descriptor per GPU"
        " (ai-dynamo/nixl issue #1514)",
        "ASSUMPTION: efficiency 0.4; serving overhead not modelled (0)",
    ),
)

# --- GLM-5-FP8 on 8 x H200, TP8 --------------------------------------------------------------------------

# zai-org/GLM-5 (model_type glm_moe_dsa; transformers GlmMoeDsaConfig; NVIDIA NeMo AutoModel GlmMoeDsaConfig
# defaults, docs.nvidia.com/nemo/automodel/.../glm_moe_dsa/config): hidden 6144, 78 layers (3 dense + 75
# MoE), 64 heads, MLA with q_lora_rank 2048, kv_lora_rank 512, qk_nope_head_dim 192, qk_rope_head_dim 64,
# v_head_dim 256; dense intermediate 12288; 256 routed experts (top-8) + 1 shared, moe_intermediate 2048;
# vocab 154880; DSA indexer with index_n_heads 32, index_head_dim 128, index_topk 2048. The GLM-5 README
# (github.com/zai-org/GLM-5): 744B parameters, 40B active, DeepSeek Sparse Attention. The -FP8 checkpoint
# stores the linear layers in FP8 (1 byte per parameter).
_G5_H, _G5_HEADS = 6144, 64
_G5_ATTN = (
    _G5_H * 2048  # q_a
    + 2048 * _G5_HEADS * (192 + 64)  # q_b
    + _G5_H * (512 + 64)  # kv_a (latent + rope key)
    + 512 * _G5_HEADS * (192 + 256)  # kv_b (up-projection to per-head nope key and value)
    + _G5_HEADS * 256 * _G5_H  # o
    + 2048 * 32 * 128  # indexer q
    + _G5_H * 128  # indexer k
    + _G5_H * 32  # indexer head weights
)
_G5_EXPERT = 3 * _G5_H * 2048
_G5_ROUTED = 75 * 256 * _G5_EXPERT
_G5_VOCAB = 154880 * _G5_H
_G5_TOTAL = 78 * _G5_ATTN + 3 * 3 * _G5_H * 12288 + 75 * _G5_EXPERT + _G5_ROUTED + 2 * _G5_VOCAB  # ~744e9
GLM5_FP8 = ModelShape(
    name="GLM-5-FP8",
    active_params=float(_G5_TOTAL - _G5_ROUTED * (1 - 8 / 256) - _G5_VOCAB),  # ~41e9 (README: 40B)
    weight_bytes=float(_G5_TOTAL + 2 * _G5_VOCAB),  # FP8 linears; embedding and lm_head kept in BF16
    n_layers=78,
    n_heads=_G5_HEADS,
    # ASSUMPTION: vLLM's sparse FlashMLA runs prefill and decode in the absorbed form, so each of the 64 heads
    # scores a 576-dim latent key (512 + 64 rope) and sums a 512-dim latent value, over the top-2048 keys.
    qk_head_dim=512 + 64,
    v_head_dim=512,
    kv_bytes_per_token=mla_dsa_kv_bytes_per_token(n_layers=78, tp=8),
    attention_window=2048,
    indexer_dim=32 * 128,
    indexer_bytes_per_token=float(78 * DSA_INDEXER_BYTES * 8),
    n_experts=256,
    experts_per_token=8,
    expert_weight_bytes=float(_G5_ROUTED),
    # 156 regions per GPU; a 64-token block descriptor is 64 x 656 B = 41 KiB (MLA) or 8.3 KiB (indexer).
    kv_regions=mla_dsa_kv_regions(n_layers=78),
)
GLM5_FP8_H200_TP8 = Preset(
    name="glm-5-fp8-h200-tp8",
    description="GLM-5-FP8 (744B MoE, 40B active, MLA + DSA) on 8 x H200 TP8, FP8 KV cache, 16 x 200 Gb/s EFA",
    cost=CostModel(
        model=GLM5_FP8,
        hardware=Hardware(
            name="8xH200-TP8-EFA-fp8",
            n_gpus=8,
            peak_flops=H200_FP8,
            hbm_bandwidth=H200_HBM,
            # Efficiency 0.25 (a priori): TP8 splits each 2048-wide expert into 256-wide slices, so the FP8
            # block-scaled grouped GEMMs are small and far from peak, on top of the TP all-reduces and the MoE
            # routing / permutation; the sparse MLA and indexer kernels are young.
            efficiency=0.25,
            link_bandwidth=EFA_16X200,
            link_latency=XFER_LATENCY,
            step_overhead=STEP_OVERHEAD_TP8,
            hbm_capacity=H200_HBM_BYTES,
            link_message_rate=EFA_8GPU_MESSAGE_RATE,
            request_overhead=REQUEST_OVERHEAD_PD,
        ),
        block_size=64,
    ),
    kv_capacity_tokens=0,
    max_num_batched_tokens=MAX_BATCHED,
    max_num_seqs=MAX_SEQS,
    block_size=64,  # vLLM's sparse FlashMLA backend only supports 64-token blocks
    sources=(
        "model: zai-org/GLM-5 config (GlmMoeDsaConfig) and README (744B / 40B active, DSA)",
        "kv: vLLM fp8_ds_mla 656 B + DSA indexer 132 B per token per layer, replicated on each TP rank",
        "hardware: NVIDIA H200 SXM data sheet (dense FP8 1979 TFLOPS, 4.8 TB/s, 141 GB); 16 x 200 Gb/s EFA",
        "kv transfer: one descriptor per (layer, MLA or indexer cache, 64-token block); ~2.4 us per descriptor per"
        " GPU (ai-dynamo/nixl issue #1514)",
        "ASSUMPTION: efficiency 0.25; absorbed-MLA attention FLOPs; FP8 KV cache (--kv-cache-dtype fp8);"
        " serving overhead not modelled (0)",
        "tool calls: vLLM's GLM-5 recipe serves it with --tool-call-parser glm47 (recipes.vllm.ai); the format"
        " <tool_call>name<arg_key>..</arg_key><arg_value>..</arg_value></tool_call> is vllm/parser/glm47_moe.py's",
    ),
    # GLM-5 writes tool calls in GLM-4.7's XML-like format; vLLM serves it with --tool-call-parser glm47.
    tool_call_parser="glm47",
)


def _sized(preset: Preset) -> Preset:
    """The preset with its KV capacity computed from HBM, weights and bytes per token (vLLM's budget)."""
    return Preset(
        name=preset.name,
        description=preset.description,
        cost=preset.cost,
        kv_capacity_tokens=preset.cost.kv_capacity_tokens(),
        max_num_batched_tokens=preset.max_num_batched_tokens,
        max_num_seqs=preset.max_num_seqs,
        block_size=preset.block_size,
        sources=preset.sources,
        tool_call_parser=preset.tool_call_parser,
    )


LLAMA_8B_H100 = _sized(LLAMA_8B_H100)
QWEN3_32B_H200_TP8 = _sized(QWEN3_32B_H200_TP8)
GLM5_FP8_H200_TP8 = _sized(GLM5_FP8_H200_TP8)

PRESETS: dict[str, Preset] = {p.name: p for p in (TOY, LLAMA_8B_H100, QWEN3_32B_H200_TP8, GLM5_FP8_H200_TP8)}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise UnknownPreset(name) from None
