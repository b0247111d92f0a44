"""Configuration of one simulated vLLM node (the knobs of vLLM's --kv-transfer-config that matter)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from kvtether.sim.template import TOOL_FORMATS

ROLES = ("prefill", "decode", "aggregated")
# The hold logic (TTL, tracking, release) is the same in all three; they differ in what the handle and the
# stream carry (see `emulate`) and in the NIXL handshake, whose compatibility hash includes the version.
EMULATED_VERSIONS = {"0.32": "0.32.0", "0.33": "0.33.0", "0.34": "0.34.0"}
FAILURE_POLICIES = ("fail", "recompute")


@dataclass(slots=True)
class NodeConfig:
    role: str = "aggregated"  # prefill | decode | aggregated (kv_both)
    preset: str = "toy"
    speed: float = 1.0  # simulated seconds per real second
    # "0.33" and "0.34": the handle also on the streamed finish chunk and with remote_registration_generation;
    # "0.32": on non-streamed bodies only, without that key. Nodes of different versions cannot transfer KV.
    emulate: str = "0.33"
    bidirectional: bool = True  # bidirectional_kv_xfer
    decoder_kv_blocks_ttl: float = 480.0  # simulated seconds a handle's blocks stay held (never renewed)
    kv_lease_duration: float = 30.0  # simulated seconds a prefill holds blocks for the decode's read
    # Real seconds a prefill lease lasts at least, whatever the speed-up: at speed 50 a 30 s lease is 0.6 s
    # of wall time, less than a CPU stall of this process on a loaded machine, so a normal P→D hop could
    # find its blocks gone. The default equals vLLM's 30 s lease: at speed 1 nothing changes.
    kv_lease_real_floor_s: float = 30.0
    kv_recompute_threshold: int = 64
    enable_prefix_caching: bool = True  # vLLM --enable-prefix-caching / --no-enable-prefix-caching
    kv_load_failure_policy: str = "fail"
    side_channel_host: str = "localhost"  # remote_host advertised in kv_transfer_params
    model_name: str = "kvtether-sim"
    engine_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    # The simulated model's seed for unseeded sampling (sim/model.py): a cluster's nodes share it.
    seed: int = 0
    max_model_len: int = 131_072
    # Prefill declines a handle this close to its expiry (vLLM: 5 s), in simulated seconds.
    expiry_margin: float = 5.0
    # vLLM --num-gpu-blocks-override: a smaller KV cache than the preset's memory budget gives, e.g. to
    # stand for a node whose cache the rest of a large cluster's traffic shares. None: the preset's.
    num_gpu_blocks_override: int | None = None
    # vLLM --tool-call-parser: "hermes" (Qwen3) or "glm47" (GLM-4.7 / GLM-5). None: the preset's model's.
    tool_call_parser: str | None = None
    # The function names the simulated model may call (no vLLM counterpart): an agent run on the simulator offers
    # all its tools, which are rendered into the prompt as ever, but a random call of a sub-agent or shell tool
    # would make the run an agent's, not the gateway's, experiment. None: any tool offered.
    callable_tools: tuple[str, ...] | None = None
    # vLLM --stream-interval: a stream sends its first token at once, then a chunk every this many tokens, and
    # its last at the finish (vLLM's output processor). Fewer chunks, less host work; the same token times.
    stream_interval: int = 1

    def validate(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.emulate not in EMULATED_VERSIONS:
            raise ValueError(f"emulate must be one of {sorted(EMULATED_VERSIONS)}, got {self.emulate!r}")
        if self.kv_load_failure_policy not in FAILURE_POLICIES:
            raise ValueError(f"kv_load_failure_policy must be one of {FAILURE_POLICIES}")
        if self.speed <= 0:
            raise ValueError("speed must be > 0")
        if self.kv_lease_real_floor_s < 0:
            raise ValueError("kv_lease_real_floor_s must be >= 0")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError("num_gpu_blocks_override must be >= 1")
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {self.stream_interval}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_FORMATS:
            raise ValueError(f"tool_call_parser must be one of {TOOL_FORMATS}, got {self.tool_call_parser!r}")

    @property
    def version(self) -> str:
        return EMULATED_VERSIONS[self.emulate]
