"""Pure command construction for `kvtether up`: the vLLM prefill/decode instances and the gateway in front.

Nothing here starts a process; `plan_cluster()` returns a `ClusterPlan` with, for every child, the exact
argv and the environment *additions* (on top of the caller's environment). Process management lives in
`cmd_up.py`; tests (`tests/test_launcher.py`) check the construction without vLLM installed.

The gateway child gets its settings on its command line: `python -m kvtether.cli.cmd_up gateway '<settings JSON>'
[--config FILE] --log-level LEVEL`, where it calls `load_config(FILE, **settings)`. The settings `up` derives
itself (`GATEWAY_OWN_KEYS`: the cluster URLs, host, port and TTLs) are keyword overrides there, so they win over
the file; reading and validating the file is left to `cmd_up.py`. `gateways > 1` plans that many replicas of
the gateway on consecutive ports, alike but for the port (they must share a session store).
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

Device = Literal["cpu", "cuda"]
Role = Literal["prefill", "decode"]

# Environment every vLLM child gets: never reach the hub, never phone home.
OFFLINE_ENV: dict[str, str] = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
}

# On CPU, NIXL's progress thread busy-polls (pthrDelay = 0); our vLLM plugin (cli/vllm_plugin.py) raises it.
CPU_NIXL_PTHR_DELAY_US = 1000
# vLLM's shared-memory queue re-check (5 s in 0.32) after a lost wake-up; the plugin lowers it on CPU.
CPU_SHM_RECHECK_MS = 50

DEFAULT_DECODE_TTL_S = 480.0
DEFAULT_GATEWAY_PORT = 8000
DEFAULT_SIDE_CHANNEL_BASE_PORT = 5600
DEFAULT_GATEWAY_LOG_LEVEL = "warning"

# Gateway settings that follow from the cluster `up` starts; `ClusterOptions.gateway_settings` may not set them.
GATEWAY_OWN_KEYS: frozenset[str] = frozenset(
    {"prefill", "decode", "aggregated", "host", "port", "session_ttl_s", "engine_kv_ttl_s"}
)


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

    @property
    def instances(self) -> tuple[InstanceSpec, ...]:
        return self.prefill + self.decode

    @property
    def gateways(self) -> tuple[GatewaySpec, ...]:
        return (self.gateway, *self.more_gateways) if self.gateway is not None else ()

    def urls(self) -> dict[str, object]:
        out: dict[str, object] = {
            "gateway": self.gateway.command.url if self.gateway else None,
            "prefill": [i.command.url for i in self.prefill],
            "decode": [i.command.url for i in self.decode],
        }
        if self.more_gateways:
            out["gateways"] = [g.command.url for g in self.gateways]
        return out

    def commands(self) -> list[ChildCommand]:
        return [i.command for i in self.instances] + [g.command for g in self.gateways]


@dataclass(frozen=True)
class ClusterOptions:
    model: str
    prefill: int = 1
    decode: int = 1
    device: Device = "cpu"
    vllm_python: str = "python"
    decode_ttl_s: float = DEFAULT_DECODE_TTL_S
    gateway_port: int = DEFAULT_GATEWAY_PORT
    host: str = "127.0.0.1"
    # First vLLM HTTP port; defaults to gateway_port + 100 (prefill first, then decode).
    vllm_base_port: int | None = None
    side_channel_base_port: int = DEFAULT_SIDE_CHANNEL_BASE_PORT
    kv_load_failure_policy: Literal["fail", "recompute"] = "fail"
    kv_recompute_threshold: int | None = None
    # kv_producer/kv_consumer (default) or kv_both on every instance.
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


def gateway_session_ttl(decode_ttl_s: float) -> float:
    """The gateway must drop a handle well before decode frees its blocks: 0.9x and at least 10 s less.

    Prefill declines a read within 5 s of the handle's expiry (vLLM ≤0.28 and still in 0.32's pull worker),
    and the turn itself takes time before P reads: 10 s leaves room for both.
    480 -> 432; 60 -> 50; 30 -> 20; 20 -> 10; never below 1 s.
    """
    ttl = min(0.9 * decode_ttl_s, decode_ttl_s - 10.0)
    return max(1.0, round(ttl, 3))


def kv_transfer_config(
    role: Role,
    *,
    device: Device,
    decode_ttl_s: float,
    failure_policy: str = "fail",
    kv_both: bool = False,
    recompute_threshold: int | None = None,
) -> str:
    """The `--kv-transfer-config` value (one argv element, compact JSON) for NixlConnector, bidirectional."""
    extra: dict[str, object] = {
        "bidirectional_kv_xfer": True,
        "decoder_kv_blocks_ttl": _num(decode_ttl_s),
    }
    if recompute_threshold is not None:
        extra["kv_recompute_threshold"] = recompute_threshold
    kv_role = "kv_both" if kv_both else ("kv_producer" if role == "prefill" else "kv_consumer")
    cfg = {
        "kv_connector": "NixlConnector",
        "kv_role": kv_role,
        "kv_buffer_device": device,
        "kv_load_failure_policy": failure_policy,
        "kv_connector_extra_config": extra,
    }
    return json.dumps(cfg, separators=(",", ":"))


def _num(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x


def cpu_binds_for(n_instances: int, cpu_count: int) -> list[str]:
    """`VLLM_CPU_OMP_THREADS_BIND` per instance: split the cores into contiguous ranges, one per instance;
    with more instances than cores, instances share cores round-robin."""
    if n_instances <= 0:
        return []
    cpu_count = max(1, cpu_count)
    if n_instances >= cpu_count:
        return [str(i % cpu_count) for i in range(n_instances)]
    per = cpu_count // n_instances
    binds = []
    for i in range(n_instances):
        lo = i * per
        hi = cpu_count - 1 if i == n_instances - 1 else lo + per - 1
        binds.append(str(lo) if lo == hi else f"{lo}-{hi}")
    return binds


def vllm_instance_command(
    opts: ClusterOptions,
    role: Role,
    index: int,
    port: int,
    side_channel_port: int,
    device_env: Mapping[str, str],
) -> ChildCommand:
    argv: list[str] = [
        opts.vllm_python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        opts.model,
        "--host",
        opts.host,
        "--port",
        str(port),
        "--enable-prefix-caching" if role == "decode" or opts.prefill_prefix_caching else "--no-enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--kv-transfer-config",
        kv_transfer_config(
            role,
            device=opts.device,
            decode_ttl_s=opts.decode_ttl_s,
            failure_policy=opts.kv_load_failure_policy,
            kv_both=opts.kv_both,
            recompute_threshold=opts.kv_recompute_threshold,
        ),
    ]
    if opts.served_model_name:
        argv += ["--served-model-name", opts.served_model_name]
    if opts.device == "cpu" and "--enforce-eager" not in opts.extra_vllm_args:
        argv.append("--enforce-eager")
    argv += list(opts.extra_vllm_args)
    env: dict[str, str] = dict(OFFLINE_ENV)
    env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1" if opts.host in ("127.0.0.1", "localhost") else opts.host
    env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_channel_port)
    env.update(device_env)
    if opts.device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(opts.kv_cache_space_gib)
        env["KVTETHER_NIXL_PTHR_DELAY_US"] = str(CPU_NIXL_PTHR_DELAY_US)
        # AMX CPUs: vLLM's CPU attention kernel needs the AMX permission before its first decode step.
        env["KVTETHER_CPU_REQUEST_AMX"] = "1"
        # Bounds the cost of a lost engine-core <-> worker wake-up under CPU contention (cli/vllm_plugin.py).
        env["KVTETHER_VLLM_SHM_RECHECK_MS"] = str(CPU_SHM_RECHECK_MS)
        # No sched_yield spinning after each message: a decode holding handles would starve the prefill.
        env["KVTETHER_VLLM_SHM_BUSY_LOOP_MS"] = "0"
    env.update(opts.extra_env)
    return ChildCommand(
        name=f"{role}-{index}",
        argv=tuple(argv),
        env=env,
        url=f"http://{_url_host(opts.host)}:{port}",
        health_path="/health",
    )


def gateway_config(
    opts: ClusterOptions, prefill_urls: Sequence[str], decode_urls: Sequence[str], session_ttl_s: float,
    index: int = 0,
) -> dict[str, object]:
    """Keyword settings for `kvtether.gateway.config.load_config(config_file, **settings)`: the caller's extra
    settings, then `up`'s own (cluster, host, port, TTLs, policy) on top. ``index``: which gateway replica."""
    cfg: dict[str, object] = {
        **opts.gateway_settings,
        "prefill": list(prefill_urls),
        "decode": list(decode_urls),
        "host": opts.host,
        "port": opts.gateway_port + index,
        "session_ttl_s": session_ttl_s,
        "engine_kv_ttl_s": opts.decode_ttl_s,
    }
    if opts.gateway_policy:
        cfg["policy"] = opts.gateway_policy
    if "tokenizer" not in cfg and not _file_sets(opts.gateway_config_file, "tokenizer"):
        # The guard tokenizes with the served model's own tokenizer (checked against /tokenize at start-up);
        # `--gateway-set tokenizer=` (empty) turns that off.
        cfg["tokenizer"] = served_tokenizer(opts)
    return cfg


def served_tokenizer(opts: ClusterOptions) -> str:
    """The tokenizer the vLLM instances load: their `--tokenizer` argument, else the model."""
    args = list(opts.extra_vllm_args)
    for i, arg in enumerate(args):
        if arg == "--tokenizer" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--tokenizer="):
            return arg.split("=", 1)[1]
    return opts.model


def _file_sets(path: str | None, key: str) -> bool:
    """Whether the gateway's TOML file (top level or [gateway]) sets `key`; a file that cannot be read sets
    nothing here (`up` reports it when it validates the configuration)."""
    if path is None:
        return False
    import tomllib

    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError):
        return False
    table = raw.get("gateway", raw)
    return isinstance(table, dict) and any(k.replace("-", "_") == key for k in table)


def gateway_child_args(opts: ClusterOptions, settings: Mapping[str, object]) -> tuple[str, ...]:
    """The gateway child's arguments after `python -m kvtether.cli.cmd_up gateway`."""
    try:
        encoded = json.dumps(dict(settings), separators=(",", ":"))
    except (TypeError, ValueError) as e:
        raise ValueError(f"gateway settings must be JSON values: {e}") from e
    args: tuple[str, ...] = (encoded,)
    if opts.gateway_config_file is not None:
        args += ("--config", opts.gateway_config_file)
    return (*args, "--log-level", opts.gateway_log_level)


def gateway_command(
    opts: ClusterOptions, prefill_urls: Sequence[str], decode_urls: Sequence[str], session_ttl_s: float,
    index: int = 0,
) -> ChildCommand:
    """The gateway in front of the instances (replica ``index``), as a child with the project's python.

    Runs `python -m kvtether.cli.cmd_up gateway '<settings JSON>' [--config FILE] --log-level L` (the gateway's own
    `run_gateway(load_config(FILE, **settings))`) so that it does not depend on the `serve` command's flags.
    """
    settings = gateway_config(opts, prefill_urls, decode_urls, session_ttl_s, index)
    argv = (opts.gateway_python, "-m", "kvtether.cli.cmd_up", "gateway", *gateway_child_args(opts, settings))
    return ChildCommand(
        name="gateway" if index == 0 else f"gateway-{index}",
        argv=argv,
        env={},
        url=f"http://{_url_host(opts.host)}:{opts.gateway_port + index}",
        health_path="/health",
    )


def _fmt(x: float) -> str:
    return str(_num(x))


def _url_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "") else host


def plan_cluster(opts: ClusterOptions) -> ClusterPlan:
    if opts.prefill < 1 or opts.decode < 1:
        raise ValueError("need at least one prefill and one decode instance")
    if opts.decode_ttl_s <= 0:
        raise ValueError("decode TTL must be positive")
    n = opts.prefill + opts.decode
    base = opts.vllm_base_port if opts.vllm_base_port is not None else opts.gateway_port + 100
    ports = [base + i for i in range(n)]
    if opts.gateways < 1:
        raise ValueError("need at least one gateway (or no gateway at all)")
    gateway_ports = {opts.gateway_port + i for i in range(opts.gateways)} if opts.gateway else set()
    if gateway_ports & set(ports):
        raise ValueError(f"gateway port(s) {sorted(gateway_ports & set(ports))} collide with a vLLM port")
    side = [opts.side_channel_base_port + i for i in range(n)]
    overlap = set(side) & (set(ports) | gateway_ports)
    if overlap:
        raise ValueError(f"NIXL side-channel ports collide with HTTP ports: {sorted(overlap)}")
    own = sorted(GATEWAY_OWN_KEYS & set(opts.gateway_settings))
    if own:
        raise ValueError(f"gateway settings {', '.join(own)} follow from the cluster and cannot be set")
    if opts.gateway_config_file is not None and not os.path.isabs(opts.gateway_config_file):
        raise ValueError(f"gateway config file must be an absolute path: {opts.gateway_config_file}")

    device_envs: list[dict[str, str]]
    if opts.device == "cpu":
        if opts.cpu_binds is not None:
            if len(opts.cpu_binds) != n:
                raise ValueError(f"--cpu-binds needs {n} entries (prefill first, then decode)")
            binds = list(opts.cpu_binds)
        else:
            binds = cpu_binds_for(n, opts.cpu_count or os.cpu_count() or 1)
        device_envs = [{"VLLM_CPU_OMP_THREADS_BIND": b} for b in binds]
    else:
        device_envs = [{"CUDA_VISIBLE_DEVICES": str(i)} for i in range(n)]

    roles: list[tuple[Role, int]] = [("prefill", i) for i in range(opts.prefill)] + [
        ("decode", i) for i in range(opts.decode)
    ]
    specs = [
        InstanceSpec(
            role=role,
            index=idx,
            port=ports[k],
            side_channel_port=side[k],
            command=vllm_instance_command(opts, role, idx, ports[k], side[k], device_envs[k]),
        )
        for k, (role, idx) in enumerate(roles)
    ]
    prefill = tuple(s for s in specs if s.role == "prefill")
    decode = tuple(s for s in specs if s.role == "decode")
    gws: list[GatewaySpec] = []
    if opts.gateway:
        ttl = opts.gateway_session_ttl_s
        if ttl is None:
            ttl = gateway_session_ttl(opts.decode_ttl_s)
        p_urls = tuple(str(s.command.url) for s in prefill)
        d_urls = tuple(str(s.command.url) for s in decode)
        gws = [
            GatewaySpec(
                port=opts.gateway_port + k,
                host=opts.host,
                session_ttl_s=ttl,
                prefill_urls=p_urls,
                decode_urls=d_urls,
                command=gateway_command(opts, p_urls, d_urls, ttl, k),
                child_args=gateway_child_args(opts, gateway_config(opts, p_urls, d_urls, ttl, k)),
                config_file=opts.gateway_config_file,
            )
            for k in range(opts.gateways)
        ]
    return ClusterPlan(
        model=opts.model, device=opts.device, decode_ttl_s=opts.decode_ttl_s, prefill=prefill, decode=decode,
        gateway=gws[0] if gws else None, more_gateways=tuple(gws[1:]),
    )


def dry_run_text(plan: ClusterPlan) -> str:
    """What `kvtether up --dry-run` prints: every command with its env additions, one block per child."""
    lines: list[str] = []
    for c in plan.commands():
        lines.append(f"# {c.name}" + (f"  ({c.url})" if c.url else ""))
        lines.append(c.shell())
        lines.append("")
    return "\n".join(lines)
