"""Cost model: how long an engine step, a prefill chunk and a KV transfer take.

A roofline model from public numbers: model shape (parameters, layers, heads, KV bytes per token, from the
model's config.json) and hardware (peak FLOP/s, HBM bandwidth, NIC bandwidth, from the vendor's data sheet).
Each hardware preset carries ONE efficiency factor (achieved / peak), applied alike to compute, HBM and the
network, documented where the preset is defined (`presets.py`); nothing is fitted point by point.

Applying the same factor to every resource is a deliberate choice: the time of any phase is then
``fixed latency + work / (peak * efficiency)``, so ratios between two ways of serving a turn (for instance
prefill-from-scratch against pull-then-compute-the-suffix) depend on public specs, not on the one knob.

Two costs are deliberately NOT scaled by that factor, because their public figures are already achieved
values, not peaks: the NIC-side message rate of a KV transfer (`Hardware.link_message_rate`, measured
descriptor-posting time of NIXL) and the fixed per-request serving overhead (`Hardware.request_overhead`).
Where they matter (small-descriptor transfers, short prompts) ratios do depend on the one factor; see
`presets.py` for the values and `benchmarks/README.md` for what that does to the sweep.

Times are seconds of *simulated* time. The engine runs its clock `speed` times faster than real time and
divides by it (see `wall_seconds`); a uniform division leaves every ratio unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the cost model needs to know about a model, all TP ranks of a node together."""

    name: str
    active_params: float  # parameters multiplied per token (MoE: shared part + top-k experts; no embedding lookup)
    weight_bytes: float  # bytes of all weights held by one node (all GPUs together)
    n_layers: int
    n_heads: int  # query heads
    qk_head_dim: int  # per-head dim of the Q·K product (MLA in absorbed form: kv_lora_rank + rope dim)
    v_head_dim: int  # per-head dim of the attention-weighted V product (MLA absorbed: kv_lora_rank)
    # KV-cache bytes per token, all layers and all TP ranks of one node together. This is both what one node
    # stores and what crosses the network when a node pulls it: with MLA every TP rank keeps a full copy of
    # the latent, so replicated bytes count once per rank.
    kv_bytes_per_token: float
    # Sparse attention (DeepSeek Sparse Attention): each query attends to at most this many keys; None = dense.
    attention_window: int | None = None
    # DSA's lightning indexer scores every (query, key) pair densely before the top-k: index_n_heads *
    # index_head_dim per layer. 0 = no indexer.
    indexer_dim: int = 0
    # Bytes per token of the indexer's key cache (included in kv_bytes_per_token): a decode step reads it over
    # the whole context, while the main KV is read only for the top-k keys.
    indexer_bytes_per_token: float = 0.0
    # Mixture of experts: routed experts per MoE layer, how many a token uses, and the routed experts' share
    # of weight_bytes. A decode step reads only the experts its batch touches.
    n_experts: int = 0
    experts_per_token: int = 0
    expert_weight_bytes: float = 0.0
    # KV-cache regions one GPU registers with NIXL: one per (layer, K/V) for backends that keep K and V in
    # separate tensors (FlashAttention: [K0, V0, K1, V1, ...]), one per layer for MLA, plus one per layer
    # for a separate cache such as DSA's indexer keys. vLLM's NIXL connector builds one transfer descriptor
    # per (region, block) (`_get_block_descs_ids`: region_id * num_blocks + block_id), so a read of B blocks
    # posts kv_regions * B descriptors on every GPU. 0 = unknown (no per-descriptor cost).
    kv_regions: int = 0

    @staticmethod
    def causal_pairs(new_tokens: int, context_before: int, window: int | None = None) -> float:
        """(query, key) pairs of causal attention for `new_tokens` queries after `context_before` cached
        tokens; query q (1-based) sees context_before + q keys, at most `window` of them."""
        if new_tokens <= 0:
            return 0.0
        first, last = context_before + 1, context_before + new_tokens  # keys seen by the first and last query
        if window is None or last <= window:
            return (first + last) * new_tokens / 2.0
        if first >= window:
            return float(new_tokens) * window
        below = window - first + 1  # queries that still see fewer than `window` keys (first .. window)
        return (first + window) * below / 2.0 + float(new_tokens - below) * window

    def attention_flops(self, new_tokens: int, context_before: int) -> float:
        """FLOPs of causal attention (plus the sparse-attention indexer, if any) for `new_tokens` queries."""
        if new_tokens <= 0:
            return 0.0
        per_pair = 2.0 * self.n_layers * self.n_heads * (self.qk_head_dim + self.v_head_dim)
        flops = per_pair * self.causal_pairs(new_tokens, context_before, self.attention_window)
        if self.indexer_dim:
            # The indexer is dense: it is what makes DSA's prefill still quadratic, with a small constant.
            flops += 2.0 * self.n_layers * self.indexer_dim * self.causal_pairs(new_tokens, context_before)
        return flops

    def dense_flops(self, tokens: int) -> float:
        return 2.0 * self.active_params * tokens

    def weight_bytes_read(self, batch_tokens: int) -> float:
        """Weight bytes one forward pass over `batch_tokens` tokens reads from HBM.

        Dense models read everything. An MoE layer reads only the experts its tokens are routed to: with
        uniform routing, expert e is untouched by a token with probability 1 - k/E, so the expected fraction
        read is 1 - (1 - k/E)^tokens (a single decode token reads k/E of them, a prefill chunk nearly all).
        """
        if batch_tokens <= 0:
            return 0.0
        if not self.n_experts or not self.expert_weight_bytes:
            return self.weight_bytes
        untouched = (1.0 - self.experts_per_token / self.n_experts) ** batch_tokens
        return self.weight_bytes - self.expert_weight_bytes * untouched

    def kv_bytes_read(self, context: int) -> float:
        """KV bytes one query reads over `context` tokens (sparse attention: top-k main KV, full indexer)."""
        if context <= 0:
            return 0.0
        main = self.kv_bytes_per_token - self.indexer_bytes_per_token
        attended = context if self.attention_window is None else min(context, self.attention_window)
        return main * attended + self.indexer_bytes_per_token * context


@dataclass(frozen=True, slots=True)
class Hardware:
    """One node (all its GPUs) and its link to the other nodes. Peaks are per GPU, from the data sheet."""

    name: str
    n_gpus: int
    peak_flops: float  # per GPU, dense (no 2:4 sparsity), in the dtype the model's GEMMs run in
    hbm_bandwidth: float  # bytes/s per GPU
    efficiency: float  # THE one factor of the preset: achieved / peak, for compute, HBM and network alike
    link_bandwidth: float  # bytes/s out of / into one node, all its NICs together (line rate)
    link_latency: float  # seconds per transfer (side-channel handshake, descriptor exchange, notification)
    step_overhead: float  # seconds of scheduler / launch overhead per engine step
    hbm_capacity: float = 0.0  # bytes per GPU (0 = not given); sizes the KV cache of a preset
    # Transfer descriptors per second the node can post and complete, all GPUs (each with its own NIXL agent
    # and posting thread) together. An ACHIEVED rate, not scaled by `efficiency`: the public figure is a
    # measured posting time per descriptor (see presets.py). inf = no per-descriptor cost.
    link_message_rate: float = math.inf
    # Seconds a request spends in the serving path outside the engine's steps and the KV bytes: API server
    # (chat template, tokenization, detokenization), the P/D connector's per-request hand-over, scheduler
    # hand-offs. Charged once per request when it reaches the engine (`Engine.submit`); not scaled by
    # `efficiency` (it is host-side, not GPU work). 0 = none.
    request_overhead: float = 0.0

    @property
    def flops(self) -> float:
        return self.peak_flops * self.n_gpus * self.efficiency

    @property
    def bandwidth(self) -> float:
        return self.hbm_bandwidth * self.n_gpus * self.efficiency

    @property
    def link(self) -> float:
        """Achieved node-to-node bandwidth (bytes/s): the same efficiency as compute and HBM."""
        return self.link_bandwidth * self.efficiency


@dataclass(frozen=True, slots=True)
class CostModel:
    model: ModelShape
    hardware: Hardware
    block_size: int = 16  # tokens per KV block (vLLM --block-size): sets how many descriptors a transfer posts

    def prefill_seconds(self, chunks: Sequence[tuple[int, int]]) -> float:
        """Compute time of prefill chunks, each ``(new_tokens, context_before)``, batched in one step."""
        flops = sum(self.model.dense_flops(n) + self.model.attention_flops(n, c) for n, c in chunks)
        return flops / self.hardware.flops

    def decode_seconds(self, contexts: Sequence[int]) -> float:
        """One decode token for each running request with the given context lengths (batched)."""
        if not contexts:
            return 0.0
        flops = sum(self.model.dense_flops(1) + self.model.attention_flops(1, c) for c in contexts)
        bytes_read = self.model.weight_bytes_read(len(contexts)) + sum(self.model.kv_bytes_read(c) for c in contexts)
        return max(flops / self.hardware.flops, bytes_read / self.hardware.bandwidth)

    def step_seconds(self, prefill_chunks: Sequence[tuple[int, int]], decode_contexts: Sequence[int]) -> float:
        """One engine step: chunked-prefill parts plus a decode token per running request.

        The weights are read once per step whatever the batch, so a mixed step costs the larger of
        its compute and its memory traffic, plus the fixed per-step overhead.
        """
        if not prefill_chunks and not decode_contexts:
            return 0.0
        m = self.model
        flops = sum(m.dense_flops(n) + m.attention_flops(n, c) for n, c in prefill_chunks)
        flops += sum(m.dense_flops(1) + m.attention_flops(1, c) for c in decode_contexts)
        batch_tokens = sum(n for n, _ in prefill_chunks) + len(decode_contexts)
        # A prefill chunk writes its own KV and reads its context's once (flash attention keeps it on chip
        # per tile); a decode token reads its context's.
        kv = sum(m.kv_bytes_read(c) + m.kv_bytes_per_token * n for n, c in prefill_chunks)
        kv += sum(m.kv_bytes_read(c) for c in decode_contexts)
        bytes_read = m.weight_bytes_read(batch_tokens) + kv
        compute = flops / self.hardware.flops
        memory = bytes_read / self.hardware.bandwidth
        return self.hardware.step_overhead + max(compute, memory)

    def lone_prefill_seconds(self, new_tokens: int, context_before: int, max_num_batched_tokens: int) -> float:
        """Prefill of one request alone on a node, chunked as vLLM's scheduler does (`max_num_batched_tokens`
        per step), each chunk attending to everything before it. The analytic twin of what the engine does."""
        if new_tokens <= 0:
            return 0.0
        budget = max(1, max_num_batched_tokens)
        total, done = 0.0, 0
        while done < new_tokens:
            n = min(budget, new_tokens - done)
            total += self.step_seconds([(n, context_before + done)], [])
            done += n
        return total

    def transfer_descriptors(self, n_tokens: int) -> int:
        """Descriptors one GPU posts to read the KV of `n_tokens` (block-aligned, as vLLM's reads are):
        one per (registered KV region, block)."""
        if n_tokens <= 0:
            return 0
        return self.model.kv_regions * math.ceil(n_tokens / self.block_size)

    def transfer_seconds(self, n_tokens: int) -> float:
        """Moving the KV of `n_tokens` between two nodes (NIXL read).

        ``latency + max(bytes / bandwidth, descriptors / message rate)``: each GPU posts its descriptors in a
        loop while the NICs already move the ones posted (a posted RDMA read is asynchronous), so the two
        overlap and the slower one bounds the transfer. Large descriptors (MLA blocks of tens of KB) are
        bandwidth bound; small ones (one KV head of a 16-token block: 4 KiB) are message-rate bound.
        """
        if n_tokens <= 0:
            return 0.0
        hw = self.hardware
        wire = n_tokens * self.model.kv_bytes_per_token / hw.link
        messages = self.transfer_descriptors(n_tokens) * hw.n_gpus / hw.link_message_rate
        return hw.link_latency + max(wire, messages)

    def kv_capacity_tokens(self, gpu_memory_utilization: float = 0.9, reserve_fraction: float = 0.05) -> int:
        """Tokens of KV one node can hold: vLLM's budget (utilization x HBM) less weights and a reserve for
        activations / CUDA graphs (`reserve_fraction` of HBM, an assumption), divided by bytes per token."""
        hw = self.hardware
        if hw.hbm_capacity <= 0:
            raise ValueError(f"{hw.name}: hbm_capacity not given")
        free = hw.hbm_capacity * hw.n_gpus * (gpu_memory_utilization - reserve_fraction) - self.model.weight_bytes
        return max(0, math.floor(free / self.model.kv_bytes_per_token))


def wall_seconds(sim_seconds: float, speed: float) -> float:
    """Real seconds the engine waits for `sim_seconds` of simulated time with its clock `speed` x faster.

    A single uniform division: any ratio of two simulated durations is the same in wall time.
    """
    if speed <= 0:
        raise ValueError("speed must be positive")
    return sim_seconds / speed
