"""What `kvtether up` starts, as plain data: its options, and the plan of children it makes of them
(`launcher.plan_cluster`): every child's argv, environment additions and URL."""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

Device = Literal["cpu", "cuda"]
# "node": a pool instance, kv_both with prefix caching, that decodes its own sessions and prefills for others.
Role = Literal["prefill", "decode", "node"]

DEFAULT_DECODE_TTL_S = 480.0
DEFAULT_GATEWAY_PORT = 8000
DEFAULT_SIDE_CHANNEL_BASE_PORT = 5600
DEFAULT_GATEWAY_LOG_LEVEL = "warning"

# Gateway settings that follow from the cluster `up` starts; `ClusterOptions.gateway_settings` may not set them.
GATEWAY_OWN_KEYS: frozenset[str] = frozenset(
    {"prefill", "decode", "nodes", "aggregated", "host", "port", "session_ttl_s", "engine_kv_ttl_s"}
)


@dataclass(frozen=True)
class GpuInfo:
    """Device 0 as vLLM sees it when it picks its defaults (step_budget.py): total memory and name."""

    memory_mib: int
    name: str


@dataclass(frozen=True)
class ChildCommand:
    """One child process: a name for logs, its argv, env additions, and (for servers) its base URL."""

    name: str
    argv: tuple[str, ...]
    env: Mapping[str, str]
    url: str | None = None
    health_path: str = "/health"

    def shell(self) -> str:
        """The command as one copy-pasteable shell line (env additions first)."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        cmd = shlex.join(self.argv)
        return f"{env} {cmd}" if env else cmd


@dataclass(frozen=True)
class InstanceSpec:
    role: Role
    index: int
    port: int
    side_channel_port: int
    command: ChildCommand


@dataclass(frozen=True)
class GatewaySpec:
    port: int
    host: str
    session_ttl_s: float
    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    command: ChildCommand
    node_urls: tuple[str, ...] = ()
    # The gateway child's arguments after `gateway` (see the module docstring), so that `up` can build the
    # child's configuration from exactly what the child will receive, before anything is started.
    child_args: tuple[str, ...] = ()
    config_file: str | None = None


@dataclass(frozen=True)
class ClusterPlan:
    model: str
    device: Device
    decode_ttl_s: float
    prefill: tuple[InstanceSpec, ...]
    decode: tuple[InstanceSpec, ...]
    gateway: GatewaySpec | None
    # Gateway replicas after the first (`--gateways N`), on the ports after its port; they share the store.
    more_gateways: tuple[GatewaySpec, ...] = ()
    # Pool instances (`--nodes N`), after the prefill and decode instances.
    nodes: tuple[InstanceSpec, ...] = ()

    @property
    def instances(self) -> tuple[InstanceSpec, ...]:
        return self.prefill + self.decode + self.nodes

    @property
    def gateways(self) -> tuple[GatewaySpec, ...]:
        return (self.gateway, *self.more_gateways) if self.gateway is not None else ()

    def urls(self) -> dict[str, object]:
        out: dict[str, object] = {
            "gateway": self.gateway.command.url if self.gateway else None,
            "prefill": [i.command.url for i in self.prefill],
            "decode": [i.command.url for i in self.decode],
        }
        if self.nodes:
            out["nodes"] = [i.command.url for i in self.nodes]
        if self.more_gateways:
            out["gateways"] = [g.command.url for g in self.gateways]
        return out

    def commands(self) -> list[ChildCommand]:
        return [i.command for i in self.instances] + [g.command for g in self.gateways]


@dataclass(frozen=True)
class ClusterOptions:
    model: str
    # Unset: one each for a prefill/decode cluster, none beside pool instances (`prefill_count`, `decode_count`).
    prefill: int | None = None
    decode: int | None = None
    # Pool instances: each takes both roles (kv_both, prefix caching on); the gateway gets them as `nodes`.
    nodes: int = 0
    device: Device = "cpu"
    vllm_python: str = "python"
    decode_ttl_s: float = DEFAULT_DECODE_TTL_S
    gateway_port: int = DEFAULT_GATEWAY_PORT
    host: str = "127.0.0.1"
    # First vLLM HTTP port; defaults to gateway_port + 100 (prefill first, then decode, then pool instances).
    vllm_base_port: int | None = None
    side_channel_base_port: int = DEFAULT_SIDE_CHANNEL_BASE_PORT
    kv_load_failure_policy: Literal["fail", "recompute"] = "fail"
    kv_recompute_threshold: int | None = None
    # kv_producer/kv_consumer (default) or kv_both on the prefill and decode instances; pool instances are always
    # kv_both.
    kv_both: bool = False
    kv_cache_space_gib: int = 1
    # Prefix caching on the prefill instances. vLLM's published reverse-pull figures turn it off, so that
    # P's own cache (which, lightly loaded, still holds the last turn's prompt) does not stand in for the pull.
    prefill_prefix_caching: bool = True
    cpu_count: int | None = None
    cpu_binds: Sequence[str] | None = None
    extra_vllm_args: Sequence[str] = ()
    gateway: bool = True
    # Gateway replicas on consecutive ports from gateway_port; more than one needs a shared store (settings).
    gateways: int = 1
    gateway_python: str = "python"
    gateway_policy: str | None = None
    gateway_session_ttl_s: float | None = None
    # A TOML gateway config (as `kvtether serve --config` reads), absolute: the child may not share our cwd.
    gateway_config_file: str | None = None
    # Further gateway settings (GatewayConfig field names) over the file's; GATEWAY_OWN_KEYS are refused.
    gateway_settings: Mapping[str, object] = field(default_factory=dict)
    gateway_log_level: str = DEFAULT_GATEWAY_LOG_LEVEL
    served_model_name: str | None = None
    extra_env: Mapping[str, str] = field(default_factory=dict)
    # The GPU the instances will see (--device cuda; None: not known), for vLLM's default step budget.
    gpu: GpuInfo | None = None

    @property
    def prefill_count(self) -> int:
        return self._count(self.prefill)

    @property
    def decode_count(self) -> int:
        return self._count(self.decode)

    def _count(self, given: int | None) -> int:
        # Pool instances prefill and decode themselves: beside them, prefill and decode ones only when asked for.
        if given is not None:
            return given
        return 0 if self.nodes else 1


def url_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "") else host
