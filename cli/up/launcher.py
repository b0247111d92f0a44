"""Pure command construction for `kvtether up`: the plan of the vLLM instances (`vllm_instance.py`): prefill and
decode, or pool instances that take both roles, or both kinds, and the gateway in front (here), over the options
and plan types of `cluster_spec.py`.

Nothing here starts a process; `plan_cluster()` returns a `ClusterPlan` with, for every child, the exact
argv and the environment *additions* (on top of the caller's environment). Process management lives in
`command.py`; tests (`tests/cli/test_up_launcher.py`) check the construction without vLLM installed.

The gateway child gets its settings on its command line: `python -m kvtether.cli.up.command gateway '<settings JSON>'
[--config FILE] --log-level LEVEL`, where it calls `load_config(FILE, **settings)`. The settings `up` derives
itself (`GATEWAY_OWN_KEYS`: the cluster URLs, host, port and TTLs) are keyword overrides there, so they win over
the file; reading and validating the file is left to `command.py`. `gateways > 1` plans that many replicas of
the gateway on consecutive ports, alike but for the port (they must share a session store).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence

from kvtether.cli.up.cluster_spec import (
    GATEWAY_OWN_KEYS,
    ChildCommand,
    ClusterOptions,
    ClusterPlan,
    GatewaySpec,
    InstanceSpec,
    Role,
    url_host,
)
from kvtether.cli.up.step_budget import vllm_step_budget
from kvtether.cli.up.vllm_instance import cpu_binds_for, vllm_arg, vllm_instance_command


def gateway_session_ttl(decode_ttl_s: float) -> float:
    """The gateway must drop a handle well before decode frees its blocks: 0.9x and at least 10 s less.

    Prefill declines a read within 5 s of the handle's expiry (vLLM ≤0.28 and still in 0.32's pull worker),
    and the turn itself takes time before P reads: 10 s leaves room for both.
    480 -> 432; 60 -> 50; 30 -> 20; 20 -> 10; never below 1 s.
    """
    ttl = min(0.9 * decode_ttl_s, decode_ttl_s - 10.0)
    return max(1.0, round(ttl, 3))


def gateway_config(
    opts: ClusterOptions, prefill_urls: Sequence[str], decode_urls: Sequence[str], session_ttl_s: float,
    index: int = 0, node_urls: Sequence[str] = (),
) -> dict[str, object]:
    """Keyword settings for `kvtether.gateway.config.load_config(config_file, **settings)`: the caller's extra
    settings, then `up`'s own (cluster, host, port, TTLs, policy) on top. ``index``: which gateway replica;
    ``node_urls``: the pool instances."""
    cfg: dict[str, object] = {
        **opts.gateway_settings,
        "prefill": list(prefill_urls),
        "decode": list(decode_urls),
        # Only with pool instances: load_config ignores an empty list, and a file's nodes are refused anyway.
        **({"nodes": list(node_urls)} if node_urls else {}),
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
    if "chunk_tokens" not in cfg and not _file_sets(opts.gateway_config_file, "chunk_tokens"):
        # The instances' step budget, so that the gateway prices prefills in the steps they run in.
        budget = vllm_step_budget(opts.extra_vllm_args, opts.device, opts.gpu)
        if budget is not None:
            cfg["chunk_tokens"] = budget
    return cfg


def served_tokenizer(opts: ClusterOptions) -> str:
    """The tokenizer the vLLM instances load: their `--tokenizer` argument, else the model."""
    return vllm_arg(opts.extra_vllm_args, "--tokenizer") or opts.model


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
    """The gateway child's arguments after `python -m kvtether.cli.up.command gateway`."""
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
    index: int = 0, node_urls: Sequence[str] = (),
) -> ChildCommand:
    """The gateway in front of the instances (replica ``index``), as a child with the project's python.

    Runs `python -m kvtether.cli.up.command gateway '<settings JSON>' [--config FILE] --log-level L` (the gateway's own
    `run_gateway(load_config(FILE, **settings))`) so that it does not depend on the `serve` command's flags.
    """
    settings = gateway_config(opts, prefill_urls, decode_urls, session_ttl_s, index, node_urls)
    argv = (opts.gateway_python, "-m", "kvtether.cli.up.command", "gateway", *gateway_child_args(opts, settings))
    return ChildCommand(
        name="gateway" if index == 0 else f"gateway-{index}",
        argv=argv,
        env={},
        url=f"http://{url_host(opts.host)}:{opts.gateway_port + index}",
        health_path="/health",
    )


def instance_roles(opts: ClusterOptions) -> list[tuple[Role, int]]:
    """Every vLLM instance as (role, index within its role): prefill first, then decode, then pool instances.

    Prefill and decode instances beside pool instances are allowed, as the gateway takes both kinds (`kvtether
    serve --node` beside `--prefill`/`--decode`); without pool instances there must be one of each.
    """
    prefill, decode, nodes = opts.prefill_count, opts.decode_count, opts.nodes
    if prefill < 0 or decode < 0 or nodes < 0:
        raise ValueError("instance counts must not be negative")
    if nodes == 0 and (prefill < 1 or decode < 1):
        raise ValueError("need at least one prefill and one decode instance, or pool instances (--nodes N)")
    return ([("prefill", i) for i in range(prefill)] + [("decode", i) for i in range(decode)]
            + [("node", i) for i in range(nodes)])


def plan_cluster(opts: ClusterOptions) -> ClusterPlan:
    roles = instance_roles(opts)
    if opts.decode_ttl_s <= 0:
        raise ValueError("decode TTL must be positive")
    n = len(roles)
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
                raise ValueError(f"--cpu-binds needs {n} entries (prefill first, then decode, then pool instances)")
            binds = list(opts.cpu_binds)
        else:
            binds = cpu_binds_for(n, opts.cpu_count or os.cpu_count() or 1)
        device_envs = [{"VLLM_CPU_OMP_THREADS_BIND": b} for b in binds]
    else:
        device_envs = [{"CUDA_VISIBLE_DEVICES": str(i)} for i in range(n)]

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
    nodes = tuple(s for s in specs if s.role == "node")
    gws: list[GatewaySpec] = []
    if opts.gateway:
        ttl = opts.gateway_session_ttl_s
        if ttl is None:
            ttl = gateway_session_ttl(opts.decode_ttl_s)
        p_urls = tuple(str(s.command.url) for s in prefill)
        d_urls = tuple(str(s.command.url) for s in decode)
        n_urls = tuple(str(s.command.url) for s in nodes)
        gws = [
            GatewaySpec(
                port=opts.gateway_port + k,
                host=opts.host,
                session_ttl_s=ttl,
                prefill_urls=p_urls,
                decode_urls=d_urls,
                node_urls=n_urls,
                command=gateway_command(opts, p_urls, d_urls, ttl, k, n_urls),
                child_args=gateway_child_args(opts, gateway_config(opts, p_urls, d_urls, ttl, k, n_urls)),
                config_file=opts.gateway_config_file,
            )
            for k in range(opts.gateways)
        ]
    return ClusterPlan(
        model=opts.model, device=opts.device, decode_ttl_s=opts.decode_ttl_s, prefill=prefill, decode=decode,
        gateway=gws[0] if gws else None, more_gateways=tuple(gws[1:]), nodes=nodes,
    )


def dry_run_text(plan: ClusterPlan) -> str:
    """What `kvtether up --dry-run` prints: every command with its env additions, one block per child."""
    lines: list[str] = []
    for c in plan.commands():
        lines.append(f"# {c.name}" + (f"  ({c.url})" if c.url else ""))
        lines.append(c.shell())
        lines.append("")
    return "\n".join(lines)
