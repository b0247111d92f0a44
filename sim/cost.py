"""Cost model: how long an engine step, a prefill chunk and a KV transfer take.

A roofline model from public numbers: model shape (parameters, layers, heads, KV bytes per token)
and hardware (peak FLOP/s, HBM bandwidth, interconnect). Each hardware preset carries ONE efficiency
factor for compute and memory (documented where the preset is defined); nothing is fitted point by
point. Times are in seconds of simulated time; the engine divides by its clock speed-up.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelShape:
    name: str
    active_params: float  # parameters touched per token (MoE: active experts only)
    weight_bytes: float  # bytes of weights read per decode step (whole model, all GPUs together)
    n_layers: int
    n_heads: int  # query heads
    qk_head_dim: int  # per-head dim of the Q·K product (MLA: nope + rope)
    v_head_dim: int  # per-head dim of the attention-weighted V product
    kv_bytes_per_token: float  # KV-cache bytes per token, all layers (what crosses the network)
    # Attention reads only this many context tokens per query (sparse attention); None = dense.
    attention_window: int | None = None

    def attention_flops(self, new_tokens: int, context_before: int) -> float:
        """FLOPs of causal attention for `new_tokens` queries after `context_before` cached tokens."""
        if new_tokens <= 0:
            return 0.0
        per_pair = 2.0 * self.n_layers * self.n_heads * (self.qk_head_dim + self.v_head_dim)
        # Sum over queries q of the number of keys it sees: context_before + q (causal), capped by a window.
        pairs = new_tokens * context_before + new_tokens * (new_tokens + 1) / 2.0
        if self.attention_window is not None:
            pairs = min(pairs, float(new_tokens) * self.attention_window)
        return per_pair * pairs

    def dense_flops(self, tokens: int) -> float:
        return 2.0 * self.active_params * tokens


@dataclass(frozen=True, slots=True)
class Hardware:
    name: str
    n_gpus: int
    peak_flops: float  # per GPU, in the dtype the model runs in
    hbm_bandwidth: float  # bytes/s per GPU
    efficiency: float  # one factor for the preset: achieved / peak, compute and memory alike
    link_bandwidth: float  # bytes/s between two nodes (all NICs together)
    link_latency: float  # seconds per transfer (handshake, descriptor exchange)
    step_overhead: float  # seconds of scheduler/launch overhead per engine step

    @property
    def flops(self) -> float:
        return self.peak_flops * self.n_gpus * self.efficiency

    @property
    def bandwidth(self) -> float:
        return self.hbm_bandwidth * self.n_gpus * self.efficiency


@dataclass(frozen=True, slots=True)
class CostModel:
    model: ModelShape
    hardware: Hardware

    def prefill_seconds(self, chunks: Sequence[tuple[int, int]]) -> float:
        """Compute time of prefill chunks, each ``(new_tokens, context_before)``, batched in one step."""
        flops = sum(self.model.dense_flops(n) + self.model.attention_flops(n, c) for n, c in chunks)
        return flops / self.hardware.flops

    def decode_seconds(self, contexts: Sequence[int]) -> float:
        """One decode token for each running request with the given context lengths (batched)."""
        if not contexts:
            return 0.0
        flops = sum(self.model.dense_flops(1) + self.model.attention_flops(1, c) for c in contexts)
        bytes_read = self.model.weight_bytes + self.model.kv_bytes_per_token * sum(contexts)
        return max(flops / self.hardware.flops, bytes_read / self.hardware.bandwidth)

    def step_seconds(
        self, prefill_chunks: Sequence[tuple[int, int]], decode_contexts: Sequence[int]
    ) -> float:
        """One engine step: chunked-prefill parts plus a decode token per running request.

        The weights are read once per step whatever the batch, so a mixed step costs the larger of
        its compute and its memory traffic, plus the fixed per-step overhead.
        """
        if not prefill_chunks and not decode_contexts:
            return 0.0
        flops = sum(self.model.dense_flops(n) + self.model.attention_flops(n, c) for n, c in prefill_chunks)
        flops += sum(self.model.dense_flops(1) + self.model.attention_flops(1, c) for c in decode_contexts)
        kv_read = sum(c + n for n, c in prefill_chunks) + sum(decode_contexts)
        bytes_read = self.model.weight_bytes + self.model.kv_bytes_per_token * kv_read
        compute = flops / self.hardware.flops
        memory = bytes_read / self.hardware.bandwidth
        return self.hardware.step_overhead + max(compute, memory)

    def transfer_seconds(self, n_tokens: int) -> float:
        """Moving the KV of `n_tokens` between two nodes (NIXL read)."""
        if n_tokens <= 0:
            return 0.0
        return self.hardware.link_latency + n_tokens * self.model.kv_bytes_per_token / self.hardware.link_bandwidth
