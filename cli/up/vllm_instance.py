"""The vLLM instances' commands (pure): `vllm.entrypoints.openai.api_server` with a bidirectional NIXL
connector, prefix caching and the environment each instance needs on CPU or GPU. A prefill instance is a
kv_producer and a decode instance a kv_consumer (both kv_both with `kv_both`); a pool instance ("node") is always
kv_both: it decodes its own sessions and prefills for the others, pulling their history from their instance."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from kvtether.cli.up.cluster_spec import ChildCommand, ClusterOptions, Device, Role, url_host

# Environment every vLLM child gets: never reach the hub, never phone home.
OFFLINE_ENV: dict[str, str] = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
}

# On CPU, NIXL's progress thread busy-polls (pthrDelay = 0); our vLLM plugin (vllm_plugin/) raises it.
CPU_NIXL_PTHR_DELAY_US = 1000
# vLLM's shared-memory queue re-check (5 s in 0.32) after a lost wake-up; the plugin lowers it on CPU.
CPU_SHM_RECHECK_MS = 50


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
    kv_role = "kv_both" if kv_both or role == "node" else ("kv_producer" if role == "prefill" else "kv_consumer")
    cfg = {
        "kv_connector": "NixlConnector",
        "kv_role": kv_role,
        "kv_buffer_device": device,
        "kv_load_failure_policy": failure_policy,
        "kv_connector_extra_config": extra,
    }
    return json.dumps(cfg, separators=(",", ":"))


def vllm_arg(args: Sequence[str], flag: str) -> str | None:
    """The value of `flag` among vLLM arguments (`--flag V` or `--flag=V`; vLLM also takes `--flag_name`), the
    last one when repeated, as argparse does."""
    value: str | None = None
    for i, arg in enumerate(args):
        name, eq, rest = arg.partition("=")
        if name.replace("_", "-") != flag:
            continue
        if eq:
            value = rest
        elif i + 1 < len(args):
            value = args[i + 1]
    return value


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
        # Only prefill instances may go without: decode-local turns (a decode's or a pool instance's) reuse the cache.
        "--enable-prefix-caching" if role != "prefill" or opts.prefill_prefix_caching else "--no-enable-prefix-caching",
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
        # Bounds the cost of a lost engine-core <-> worker wake-up under CPU contention (vllm_plugin/).
        env["KVTETHER_VLLM_SHM_RECHECK_MS"] = str(CPU_SHM_RECHECK_MS)
        # No sched_yield spinning after each message: a decode holding handles would starve the prefill.
        env["KVTETHER_VLLM_SHM_BUSY_LOOP_MS"] = "0"
    env.update(opts.extra_env)
    return ChildCommand(
        name=f"{role}-{index}",
        argv=tuple(argv),
        env=env,
        url=f"http://{url_host(opts.host)}:{port}",
        health_path="/health",
    )
