"""The gateway child of `kvtether up`: its settings (`--config`, `--gateway-set`), checked before any vLLM
instance starts, and its entry point (`python -m kvtether.cli.up.command gateway '<settings JSON>' …`)."""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import sys
import tomllib
from collections.abc import Sequence
from typing import TYPE_CHECKING, get_type_hints

from kvtether.cli.common.exits import EXIT_USAGE
from kvtether.cli.up.cluster_spec import DEFAULT_GATEWAY_LOG_LEVEL, ClusterPlan, GatewaySpec
from kvtether.cli.up.hub_cache import OFFLINE_VARS

if TYPE_CHECKING:
    from kvtether.gateway.config import GatewayConfig

GATEWAY_LOG_LEVELS = ("critical", "error", "warning", "info", "debug")

# Gateway settings `--gateway-set` refuses, with where they come from instead: one way in for each.
_SET_BY_UP: dict[str, str] = {
    "prefill": "kvtether up points the gateway at the instances it starts (--prefill/--decode/--nodes)",
    "decode": "kvtether up points the gateway at the instances it starts (--prefill/--decode/--nodes)",
    "nodes": "kvtether up points the gateway at the pool instances it starts (--nodes)",
    "aggregated": "kvtether up starts prefill/decode or pool instances, not aggregated replicas",
    "host": "use --host",
    "port": "use --port",
    "session_ttl_s": "derived from --decode-ttl (kept well below the engine's TTL)",
    "engine_kv_ttl_s": "use --decode-ttl",
    "policy": "use --policy",
    "otlp_endpoint": "use --otlp-endpoint",
}


class GatewaySettingError(ValueError):
    """A `--gateway-set` item that names no gateway setting, or one `up` sets itself."""


def parse_gateway_set(items: Sequence[str]) -> dict[str, object]:
    """`--gateway-set KEY=VALUE` items -> load_config keyword settings (a repeated key: the last one wins).

    VALUE is read as a TOML value when it is one (`5000`, `false`, `["http://x:1"]`, `"quoted"`), else taken as
    the string written. String settings keep what was written (`model=7` is the model "7"), and TOML dates stay
    strings too: no gateway setting is a date, and the settings travel to the child as JSON.
    """
    from kvtether.gateway.config import GatewayConfig

    hints = get_type_hints(GatewayConfig)
    out: dict[str, object] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        name = key.strip().replace("-", "_")
        if not sep or not name:
            raise GatewaySettingError(f"--gateway-set {item!r}: expected KEY=VALUE")
        if name not in hints:
            raise GatewaySettingError(f"--gateway-set: unknown gateway setting {key.strip()!r}")
        if name in _SET_BY_UP:
            raise GatewaySettingError(f"--gateway-set: {name} cannot be set here: {_SET_BY_UP[name]}")
        out[name] = _setting_value(raw, hints[name])
    return out


def _setting_value(raw: str, hint: object) -> object:
    try:
        value: object = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw
    if isinstance(value, datetime.date | datetime.time):
        return raw
    if hint in (str, str | None) and not isinstance(value, str):
        return raw
    return value


def gateway_child_config(args: Sequence[str]) -> tuple[GatewayConfig, str]:
    """The gateway child's configuration and log level from its arguments after `gateway` (launcher.py's
    `gateway_child_args`): `load_config(FILE, **settings)`. Raises ConfigError for a configuration that cannot
    work; argparse exits 2 on malformed arguments."""
    from kvtether.gateway.config import load_config

    parser = argparse.ArgumentParser(prog="python -m kvtether.cli.up.command gateway")
    parser.add_argument("settings", help="JSON object of load_config keyword settings")
    parser.add_argument("--config", default=None, help="TOML gateway config")
    parser.add_argument("--log-level", default=DEFAULT_GATEWAY_LOG_LEVEL, choices=GATEWAY_LOG_LEVELS)
    ns = parser.parse_args(list(args))
    settings = json.loads(ns.settings)
    if not isinstance(settings, dict):
        parser.error("settings must be a JSON object")
    return load_config(ns.config, **settings), str(ns.log_level)


def check_gateway_config(plan: ClusterPlan) -> GatewayConfig | None:
    """The configuration the plan's (first) gateway child will run with (None without a gateway); ConfigError if
    it cannot work. Called before any child starts."""
    from kvtether.gateway.config import ConfigError

    if plan.gateway is None:
        return None
    cfg = gateway_child_config(plan.gateway.child_args)[0]
    _check_cluster_is_ups(cfg, plan.gateway)
    if plan.more_gateways and cfg.store == "memory":
        # Replicas with a store each would lose a session's handle whenever its turn reaches another one.
        raise ConfigError(f"{len(plan.gateways)} gateways need a shared session store: --store redis://HOST:PORT "
                          "(or store in --config / --gateway-set)")
    return cfg


def _check_cluster_is_ups(cfg: GatewayConfig, gateway: GatewaySpec) -> None:
    """The gateway's prefill, decode and pool URLs are exactly the instances `up` starts. `up`'s lists win over
    the config file's, but an empty one overrides nothing: a pool-only `up` would keep the file's prefill and
    decode nodes, a prefill/decode one the file's pool, and the gateway would send turns to servers `up` does
    not run."""
    from kvtether.gateway.config import ConfigError

    ups = {"prefill": gateway.prefill_urls, "decode": gateway.decode_urls, "nodes": gateway.node_urls}
    for name, urls in ups.items():
        if list(getattr(cfg, name)) != list(urls):
            where = gateway.config_file or "the gateway settings"
            raise ConfigError(f"{where} sets {name}, but {_SET_BY_UP[name]}: remove {name} from {where}")


def run_gateway_child(args: Sequence[str]) -> None:
    """The gateway child of `kvtether up`: `python -m kvtether.cli.up.command gateway '<settings JSON>' [--config FILE]
    --log-level L`."""
    # `up` made the tokenizer's files local before it started this child (model_files.py): the gateway loads them
    # offline, as the vLLM instances do, rather than ask the hub about each file. Set before anything imports
    # huggingface_hub, which reads it once.
    os.environ.update(dict.fromkeys(OFFLINE_VARS, "1"))
    from kvtether.cli.serve import run_gateway_until_stopped
    from kvtether.gateway.config import ConfigError

    try:
        cfg, log_level = gateway_child_config(args)
    except ConfigError as e:  # `up` checked it; the file may have changed since
        sys.stderr.write(f"kvtether up gateway: {e}\n")
        raise SystemExit(EXIT_USAGE) from None
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # As `kvtether serve`: the supervisor's SIGTERM (or a Ctrl-C) is a normal stop, exit code 0.
    run_gateway_until_stopped(cfg, log_level=log_level)
