"""The cluster `kvtether assess` judges the traffic against: a simulator preset, optionally with parts replaced
(model layers, KV heads, head dim, KV dtype; GPUs per node; link Gb/s; the decode TTL; node counts).

Pure: builds plain values from the preset's cost model (``sim/cost.py``) and keeps nothing global, except
:func:`register_preset`, which adds a changed shape to the simulator's preset table so that the in-process
simulated cluster of question 4 runs the same shape the first three questions were computed on.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

from kvtether.cli.simstack import DEFAULT_PREFILL_PREFIX_CACHING
from kvtether.sim.cost import CostModel, Hardware, ModelShape
from kvtether.sim.presets import PRESETS, Preset, get_preset, gqa_kv_bytes_per_token, gqa_kv_regions

GBIT = 1e9 / 8  # bytes/s in one Gb/s
KV_DTYPE_BYTES = {"fp8": 1.0, "bf16": 2.0, "fp16": 2.0, "fp32": 4.0}
DEFAULT_PRESET = "llama-3.1-8b-h100"
# The gateway's defaults (gateway/config.py): a handle is sent for at most session_ttl_s, a read below
# min_reuse_tokens is computed instead (vLLM's kv_recompute_threshold), and the gateway keeps the held KV of each
# decode node under held_kv_budget of its capacity.
DEFAULT_SESSION_TTL_S = 450.0
DEFAULT_MIN_REUSE_TOKENS = 64
DEFAULT_HELD_KV_BUDGET = 0.5


@dataclass(frozen=True, slots=True)
class ClusterShape:
    """What the four answers need to know of the cluster (times in seconds, sizes in tokens and bytes)."""

    preset: Preset  # the simulator preset, with any replaced parts already in its cost model
    base_preset: str  # the preset it was built from
    prefill: int
    decode: int
    decoder_kv_blocks_ttl_s: float  # vLLM's decoder_kv_blocks_ttl: D frees a hold after this, whatever happens
    session_ttl_s: float = DEFAULT_SESSION_TTL_S  # the gateway stops sending a handle after this
    min_reuse_tokens: int = DEFAULT_MIN_REUSE_TOKENS
    held_kv_budget: float | None = DEFAULT_HELD_KV_BUDGET  # None: no budget (the reference proxy holds all)
    # Off by default, as replay's simulated cluster (cli/replay/sim.py): the simulated P serves only these sessions, so
    # with it on P would keep every history cached, which a P shared by a production cluster's other sessions does
    # not, and no-pull would look as if it reused what the pull moves. vLLM's own default is on; so are the
    # colocated option's nodes (their prefix cache is how a session-affine replica reuses the history).
    prefill_prefix_caching: bool = DEFAULT_PREFILL_PREFIX_CACHING
    changed: tuple[str, ...] = ()  # the parts replaced on the preset, as "name=value"

    @property
    def cost(self) -> CostModel:
        return self.preset.cost

    @property
    def gpus_per_node(self) -> int:
        return self.cost.hardware.n_gpus

    @property
    def nodes(self) -> int:
        return self.prefill + self.decode

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def link_gbps(self) -> float:
        """The configured link, line rate, Gb/s (the achieved rate is ``efficiency`` times this)."""
        return self.cost.hardware.link_bandwidth / GBIT

    @property
    def kv_bytes_per_token(self) -> float:
        return self.cost.model.kv_bytes_per_token

    @property
    def kv_capacity_tokens(self) -> int:
        return self.preset.kv_capacity_tokens

    @property
    def handle_lifetime_s(self) -> float:
        """How long a handle stays usable after its turn: the gateway's TTL, below the engine's."""
        return min(self.session_ttl_s, self.decoder_kv_blocks_ttl_s)

    def describe(self) -> dict[str, Any]:
        m, hw = self.cost.model, self.cost.hardware
        return {
            "preset": self.preset.name, "base_preset": self.base_preset, "changed": list(self.changed),
            "model": m.name, "layers": m.n_layers, "kv_bytes_per_token": m.kv_bytes_per_token,
            "gpus_per_node": hw.n_gpus, "prefill_nodes": self.prefill, "decode_nodes": self.decode, "gpus": self.gpus,
            "link_gbps": round(self.link_gbps, 3), "efficiency": hw.efficiency,
            "kv_capacity_tokens_per_node": self.kv_capacity_tokens, "block_size": self.preset.block_size,
            "max_num_batched_tokens": self.preset.max_num_batched_tokens,
            "decoder_kv_blocks_ttl_s": self.decoder_kv_blocks_ttl_s, "session_ttl_s": self.session_ttl_s,
            "min_reuse_tokens": self.min_reuse_tokens, "held_kv_budget": self.held_kv_budget,
            "prefill_prefix_caching": self.prefill_prefix_caching,
        }


def build_shape(
    preset: str = DEFAULT_PRESET,
    *,
    prefill: int = 1,
    decode: int = 1,
    layers: int | None = None,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    kv_dtype: str | None = None,
    gpus_per_node: int | None = None,
    link_gbps: float | None = None,
    decoder_kv_blocks_ttl_s: float = 480.0,
    session_ttl_s: float = DEFAULT_SESSION_TTL_S,
    held_kv_budget: float | None = DEFAULT_HELD_KV_BUDGET,
    prefill_prefix_caching: bool = DEFAULT_PREFILL_PREFIX_CACHING,
) -> ClusterShape:
    """The preset with the given parts replaced. Raises ``UnknownPreset`` or ``ValueError``.

    KV parts: any of layers / KV heads / head dim / dtype given recomputes the KV bytes per token with the GQA
    formula (2 · layers · kv_heads · head_dim · bytes), the missing ones taken from the preset where it is GQA;
    an MLA preset (GLM-5) needs all four. The compute side (parameters, FLOPs) stays the preset's, with the
    layer count scaling it when changed; the KV capacity is recomputed from the memory budget."""
    base = get_preset(preset)
    if prefill < 1 or decode < 1:
        raise ValueError("a P/D cluster needs at least one prefill and one decode node")
    if session_ttl_s >= decoder_kv_blocks_ttl_s:
        # The gateway refuses this too: a handle it still sends must not be gone on D already.
        session_ttl_s = max(1.0, decoder_kv_blocks_ttl_s - 30.0)
    m, kv_changed = _kv_parts(base, preset, layers=layers, kv_heads=kv_heads, head_dim=head_dim, kv_dtype=kv_dtype)
    hw, hw_changed = _hardware_parts(base.cost.hardware, gpus_per_node=gpus_per_node, link_gbps=link_gbps)
    changed = kv_changed + hw_changed
    shaped = _shaped(base, dataclasses.replace(base.cost, model=m, hardware=hw), changed)
    return ClusterShape(
        preset=shaped, base_preset=base.name, prefill=prefill, decode=decode,
        decoder_kv_blocks_ttl_s=decoder_kv_blocks_ttl_s, session_ttl_s=session_ttl_s,
        held_kv_budget=held_kv_budget, prefill_prefix_caching=prefill_prefix_caching, changed=tuple(changed),
    )


def _kv_parts(base: Preset, name: str, *, layers: int | None, kv_heads: int | None, head_dim: int | None,
              kv_dtype: str | None) -> tuple[ModelShape, list[str]]:
    """The preset's model with its KV parts replaced (the GQA formula), and the parts changed as "name=value"."""
    m = base.cost.model
    if all(v is None for v in (layers, kv_heads, head_dim, kv_dtype)):
        return m, []
    known = _gqa_parts(base)
    n_layers = layers if layers is not None else m.n_layers
    heads = kv_heads if kv_heads is not None else known.get("kv_heads")
    dim = head_dim if head_dim is not None else known.get("head_dim")
    if kv_dtype is not None and kv_dtype not in KV_DTYPE_BYTES:
        raise ValueError(f"kv dtype must be one of {', '.join(KV_DTYPE_BYTES)}, not {kv_dtype!r}")
    dtype_bytes = KV_DTYPE_BYTES[kv_dtype] if kv_dtype is not None else known.get("dtype_bytes")
    if heads is None or dim is None or dtype_bytes is None:
        raise ValueError(f"preset {name} is not a GQA model: give --layers, --kv-heads, --head-dim and "
                         "--kv-dtype together")
    scale = n_layers / m.n_layers
    m = dataclasses.replace(
        m,
        n_layers=n_layers,
        active_params=m.active_params * scale,
        weight_bytes=m.weight_bytes * scale,
        kv_bytes_per_token=gqa_kv_bytes_per_token(n_layers, int(heads), int(dim), float(dtype_bytes)),
        kv_regions=gqa_kv_regions(n_layers),
        indexer_bytes_per_token=0.0,
        indexer_dim=0,
    )
    return m, [f"{k}={v}" for k, v in (("layers", layers), ("kv_heads", kv_heads), ("head_dim", head_dim),
                                       ("kv_dtype", kv_dtype)) if v is not None]


def _hardware_parts(hw: Hardware, *, gpus_per_node: int | None,
                    link_gbps: float | None) -> tuple[Hardware, list[str]]:
    """The node's hardware with its GPU count and link replaced, and the parts changed as "name=value"."""
    changed: list[str] = []
    if gpus_per_node is not None:
        if gpus_per_node < 1:
            raise ValueError("gpus per node must be >= 1")
        # Each GPU posts its own descriptors: the node's message rate scales with its GPUs.
        rate = hw.link_message_rate * gpus_per_node / hw.n_gpus if math.isfinite(hw.link_message_rate) else math.inf
        hw = dataclasses.replace(hw, n_gpus=gpus_per_node, link_message_rate=rate)
        changed.append(f"gpus_per_node={gpus_per_node}")
    if link_gbps is not None:
        if link_gbps <= 0:
            raise ValueError("link Gb/s must be > 0")
        hw = dataclasses.replace(hw, link_bandwidth=link_gbps * GBIT)
        changed.append(f"link_gbps={link_gbps:g}")
    return hw, changed


def _shaped(base: Preset, cost: CostModel, changed: list[str]) -> Preset:
    """The preset as changed, under a name of its own (the base itself when nothing changed); its KV capacity
    recomputed from the memory the weights leave."""
    if not changed:
        return base
    capacity = cost.kv_capacity_tokens() if cost.hardware.hbm_capacity > 0 else base.kv_capacity_tokens
    if capacity <= 0:
        raise ValueError("the model's weights do not leave room for a KV cache on these GPUs")
    digest = hashlib.sha1(json.dumps(changed).encode()).hexdigest()[:8]
    return dataclasses.replace(base, name=f"{base.name}~{digest}", cost=cost, kv_capacity_tokens=capacity,
                               description=f"{base.description}, with {', '.join(changed)}")


def _gqa_parts(p: Preset) -> dict[str, float]:
    """KV heads, head dim and dtype of a GQA preset, read back from its bytes per token (none for MLA)."""
    m = p.cost.model
    if m.indexer_dim or m.kv_regions != 2 * m.n_layers or m.qk_head_dim != m.v_head_dim:
        return {}
    per_layer_head = m.kv_bytes_per_token / (2 * m.n_layers * m.qk_head_dim)  # kv_heads * dtype_bytes
    for dtype_bytes in (2.0, 1.0, 4.0):
        heads = per_layer_head / dtype_bytes
        if heads >= 1 and abs(heads - round(heads)) < 1e-9:
            return {"kv_heads": round(heads), "head_dim": m.qk_head_dim, "dtype_bytes": dtype_bytes}
    return {}


def register_preset(shape: ClusterShape) -> str:
    """The preset name the simulator knows the shape by: a changed shape is added to its table (in this process;
    the simulated nodes of question 4 run in it)."""
    PRESETS.setdefault(shape.preset.name, shape.preset)
    return shape.preset.name
