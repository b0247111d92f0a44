"""Named simulator set-ups: a model shape on a hardware configuration plus engine limits."""

from __future__ import annotations

from dataclasses import dataclass

from kvtether.sim.cost import CostModel, Hardware, ModelShape


@dataclass(frozen=True, slots=True)
class Preset:
    name: str
    description: str
    cost: CostModel
    kv_capacity_tokens: int  # KV-cache size of one node, in tokens
    max_num_batched_tokens: int  # token budget of one engine step (chunked prefill)
    max_num_seqs: int  # running requests per node
    block_size: int = 16


class UnknownPreset(KeyError):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name

    def __str__(self) -> str:
        return f"unknown preset {self.name!r}; known: {', '.join(sorted(PRESETS))}"


# A tiny CPU-friendly model (the shape of the 2-layer test model of docs/vllm-cpu.md) on one CPU
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
            kv_bytes_per_token=2 * 2 * 2 * 32 * 2,
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
        ),
    ),
    kv_capacity_tokens=262_144,
    max_num_batched_tokens=8192,
    max_num_seqs=64,
)

PRESETS: dict[str, Preset] = {p.name: p for p in (TOY,)}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise UnknownPreset(name) from None
