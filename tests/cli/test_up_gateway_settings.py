"""`kvtether up` passes gateway settings (--config, --policy, --otlp-endpoint, --gateway-log-level, --gateway-set)
to its gateway child, and refuses bad ones before any vLLM instance starts. No process is started here."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from kvtether.cli.main import app
from kvtether.cli.up import command as cmd_up
from kvtether.cli.up.cluster_spec import GATEWAY_OWN_KEYS, ClusterOptions
from kvtether.cli.up.command import running_cluster
from kvtether.cli.up.gateway_child import (
    _SET_BY_UP,
    GatewaySettingError,
    gateway_child_config,
    parse_gateway_set,
)
from kvtether.cli.up.launcher import plan_cluster
from kvtether.gateway.config import ConfigError
from typer.testing import CliRunner

BASE = ["up", "--model", "/m/tiny", "--vllm-python", "/v/python", "--decode-ttl", "60", "--port", "9000"]

# A config file as `kvtether serve --config` would read it: its cluster, host, port and TTLs must lose to up's.
SERVE_TOML = """
[gateway]
prefill = ["http://elsewhere:1"]
decode = ["http://elsewhere:2"]
host = "0.0.0.0"
port = 7777
session_ttl_s = 5.0
engine_kv_ttl_s = 10.0
policy = "no-pull"
max_sessions = 123
min_reuse_tokens = 32
read_timeout_s = 600.0
"""


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Record (instead of run) any attempt to start the cluster or a child."""
    started: list[object] = []

    def fake_run_up(plan: object, **_kw: object) -> int:
        started.append(plan)
        return 0

    def fake_start(_self: object, cmd: object) -> object:
        started.append(cmd)
        raise AssertionError("a child was started")

    monkeypatch.setattr(cmd_up, "run_up", fake_run_up)
    monkeypatch.setattr(cmd_up.Supervisor, "start", fake_start)
    return started


def _invoke(*args: str) -> tuple[int, str, str]:
    r = CliRunner().invoke(app, [*BASE, *args])
    return r.exit_code, r.stdout, r.stderr


def _gateway_child_args(dry_run_out: str) -> list[str]:
    """The gateway child's arguments after `gateway`, from the dry-run's gateway block (one shell line)."""
    lines = dry_run_out.splitlines()
    line = lines[next(i for i, ln in enumerate(lines) if ln.startswith("# gateway")) + 1]
    words = shlex.split(line)
    assert words[1:4] == ["-m", "kvtether.cli.up.command", "gateway"]
    return words[4:]


def test_dry_run_shows_every_gateway_setting(tmp_path: Path, no_launch: list[object]) -> None:
    cfg_file = tmp_path / "gw.toml"
    cfg_file.write_text(SERVE_TOML)
    code, out, err = _invoke(
        "--dry-run", "--config", str(cfg_file), "--policy", "pull", "--otlp-endpoint", "http://otel:4318",
        "--gateway-log-level", "DEBUG", "--gateway-set", "max_sessions=5000", "--gateway-set", "partial_reuse=false",
        "--gateway-set", 'unidirectional_prefill=["http://127.0.0.1:9100"]', "--gateway-set", "model=Qwen/Qwen3-0.6B",
    )  # fmt: skip
    assert code == 0, err
    assert no_launch == []
    args = _gateway_child_args(out)
    settings = json.loads(args[0])
    assert settings["policy"] == "pull"
    assert settings["otlp_endpoint"] == "http://otel:4318"
    assert settings["max_sessions"] == 5000
    assert settings["partial_reuse"] is False
    assert settings["unidirectional_prefill"] == ["http://127.0.0.1:9100"]
    assert settings["model"] == "Qwen/Qwen3-0.6B"
    assert args[1:] == ["--config", str(cfg_file), "--log-level", "debug"]


def test_config_file_reaches_the_child_and_up_wins_for_cluster_port_ttl(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_launch: list[object]
) -> None:
    (tmp_path / "gw.toml").write_text(SERVE_TOML)
    monkeypatch.chdir(tmp_path)
    code, out, err = _invoke("--dry-run", "--config", "gw.toml", "--gateway-set", "min_reuse_tokens=128")
    assert code == 0, err
    args = _gateway_child_args(out)
    # A relative path travels absolute: the child need not share up's working directory.
    assert args[args.index("--config") + 1] == str(tmp_path / "gw.toml")
    cfg, log_level = gateway_child_config(args)
    assert log_level == "warning"
    # From the file.
    assert cfg.max_sessions == 123
    assert cfg.read_timeout_s == 600.0
    assert cfg.policy == "no-pull"
    # --gateway-set over the file.
    assert cfg.min_reuse_tokens == 128
    # up's own: the instances it starts, its host and port, TTLs from --decode-ttl 60.
    assert cfg.prefill == ["http://127.0.0.1:9100"]
    assert cfg.decode == ["http://127.0.0.1:9101"]
    assert (cfg.host, cfg.port) == ("127.0.0.1", 9000)
    assert (cfg.session_ttl_s, cfg.engine_kv_ttl_s) == (50.0, 60.0)
    assert no_launch == []


def test_policy_flag_wins_over_the_file(tmp_path: Path) -> None:
    cfg_file = tmp_path / "gw.toml"
    cfg_file.write_text(SERVE_TOML)
    plan = plan_cluster(
        ClusterOptions(model="m", cpu_count=2, gateway_config_file=str(cfg_file), gateway_policy="reference")
    )
    assert plan.gateway is not None
    cfg, _ = gateway_child_config(plan.gateway.child_args)
    assert cfg.policy == "reference"
    assert cfg.max_sessions == 123


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gateway-set", "no_such_setting=1"], "unknown gateway setting 'no_such_setting'"),
        (["--gateway-set", "max_sessions=0"], "max_sessions must be >= 1"),
        (["--gateway-set", "max_sessions=many"], "max_sessions must be int"),
        (["--gateway-set", "partial_reuse=maybe"], "partial_reuse must be bool"),
        (["--gateway-set", "max_sessions"], "expected KEY=VALUE"),
        (["--gateway-set", "port=1"], "port cannot be set here: use --port"),
        (["--gateway-set", "prefill=http://x:1"], "prefill cannot be set here"),
        (["--gateway-set", 'nodes=["http://x:1"]'], "nodes cannot be set here: kvtether up points the gateway"),
        (["--gateway-set", "session_ttl_s=5"], "session_ttl_s cannot be set here"),
        (["--config", "/no/such/gateway.toml"], "config file not found: /no/such/gateway.toml"),
        (["--policy", "fastest"], "policy must be one of"),
        (["--gateway-log-level", "loud"], "--gateway-log-level must be one of"),
        (["--no-gateway", "--otlp-endpoint", "http://otel:4318"], "--otlp-endpoint: gateway options"),
        (["--gateways", "2"], "2 gateways need a shared session store"),
        (["--gateways", "3", "--gateway-set", "store=memory"], "3 gateways need a shared session store"),
        (["--store", "mysql://db"], "store must be 'memory' or a redis://"),
        (["--no-gateway", "--store", "redis://r:6379"], "--store: gateway options"),
    ],
)
@pytest.mark.parametrize("dry_run", [True, False])
def test_bad_gateway_settings_are_usage_errors_that_start_nothing(
    args: list[str], message: str, dry_run: bool, no_launch: list[object]
) -> None:
    code, out, err = _invoke(*args, *(["--dry-run"] if dry_run else []))
    assert code == 2, (out, err)
    assert message in err
    assert err.startswith("kvtether up: ")
    assert out == ""  # not even the dry-run's commands
    assert no_launch == []


def test_bad_config_file_contents_are_usage_errors(tmp_path: Path, no_launch: list[object]) -> None:
    cases = {
        "unknown.toml": ("max_sesions = 5\n", "unknown setting 'max_sesions'"),
        "broken.toml": ("max_sessions = \n", "invalid TOML"),
        "bad_value.toml": ("tpot_budget_s = -1.0\n", "tpot_budget_s must be > 0"),
        "aggregated.toml": ('aggregated = ["http://r:1"]\n', "remove aggregated from"),
        # up starts prefill/decode here: a pool in the file would have the gateway use servers up does not run.
        "pool.toml": ('nodes = ["http://r:1"]\n', "pool.toml sets nodes, but kvtether up points the gateway at"),
    }
    for name, (text, message) in cases.items():
        (tmp_path / name).write_text(text)
        code, _out, err = _invoke("--config", str(tmp_path / name))
        assert code == 2, (name, err)
        assert message in err, (name, err)
    assert no_launch == []


def test_gateway_set_values() -> None:
    s = parse_gateway_set([
        "max_sessions=5000", "partial_reuse=false", 'unidirectional_prefill=["http://x:1"]', "tpot_budget_s=0.05",
        "model=7", "block-size=32", "min_reuse_tokens=1", "min_reuse_tokens=96", 'model="my model"',
    ])  # fmt: skip
    assert s == {
        "max_sessions": 5000,
        "partial_reuse": False,
        "unidirectional_prefill": ["http://x:1"],
        "tpot_budget_s": 0.05,
        "model": "my model",  # the last one wins
        "block_size": 32,
        "min_reuse_tokens": 96,
    }
    # A string setting keeps what was written, even when it reads as a TOML number or date.
    assert parse_gateway_set(["model=7"]) == {"model": "7"}
    assert parse_gateway_set(["model=2025-01-31"]) == {"model": "2025-01-31"}
    # A value that is not TOML is a string; load_config then names the setting whose type is wrong.
    assert parse_gateway_set(["max_sessions=lots"]) == {"max_sessions": "lots"}
    with pytest.raises(GatewaySettingError, match="unknown gateway setting"):
        parse_gateway_set(["nope=1"])
    # Everything the launcher derives itself is refused here too, with where it comes from instead.
    assert set(_SET_BY_UP) >= GATEWAY_OWN_KEYS


def test_launcher_refuses_settings_it_owns_and_relative_config_paths() -> None:
    with pytest.raises(ValueError, match="port"):
        plan_cluster(ClusterOptions(model="m", cpu_count=2, gateway_settings={"port": 1}))
    with pytest.raises(ValueError, match="absolute"):
        plan_cluster(ClusterOptions(model="m", cpu_count=2, gateway_config_file="gw.toml"))


def test_running_cluster_checks_the_gateway_before_starting_anything(no_launch: list[object]) -> None:
    plan = plan_cluster(ClusterOptions(model="m", cpu_count=2, gateway_settings={"max_sessions": 0}))
    with pytest.raises(ConfigError, match="max_sessions"), running_cluster(plan, log_dir=None):
        pass
    assert no_launch == []


def test_gateway_replicas_share_the_store_they_are_given(no_launch: list[object]) -> None:
    code, out, err = _invoke("--dry-run", "--gateways", "3", "--store", "redis://r:6379/0", "--json")
    assert code == 0, err
    blocks = [ln for ln in out.splitlines() if ln.startswith("# gateway")]
    assert blocks == ["# gateway  (http://127.0.0.1:9000)", "# gateway-1  (http://127.0.0.1:9001)",
                      "# gateway-2  (http://127.0.0.1:9002)"]
    assert json.loads(out.splitlines()[-1])["gateways"] == [f"http://127.0.0.1:{p}" for p in (9000, 9001, 9002)]
    plan = plan_cluster(ClusterOptions(model="m", cpu_count=2, gateway_port=9000, gateways=3,
                                       gateway_settings={"store": "redis://r:6379/0"}))
    configs = [gateway_child_config(g.child_args)[0] for g in plan.gateways]
    assert [(c.port, c.store) for c in configs] == [(p, "redis://r:6379/0") for p in (9000, 9001, 9002)]
    assert no_launch == []


def test_nodes_flag_plans_a_pool_behind_the_gateway(no_launch: list[object]) -> None:
    """`--nodes N` without --prefill/--decode: N pool instances and no prefill or decode one."""
    code, out, err = _invoke("--dry-run", "--json", "--nodes", "2")
    assert code == 0, err
    assert [ln for ln in out.splitlines() if ln.startswith("# ") and "  (http" in ln] == [  # the children's blocks
        "# node-0  (http://127.0.0.1:9100)", "# node-1  (http://127.0.0.1:9101)", "# gateway  (http://127.0.0.1:9000)",
    ]  # fmt: skip
    assert out.count('"kv_role":"kv_both"') == 2
    urls = json.loads(out.splitlines()[-1])
    assert urls == {"gateway": "http://127.0.0.1:9000", "prefill": [], "decode": [],
                    "nodes": ["http://127.0.0.1:9100", "http://127.0.0.1:9101"]}  # fmt: skip
    cfg, _ = gateway_child_config(_gateway_child_args(out))
    assert (cfg.prefill, cfg.decode, cfg.nodes) == ([], [], urls["nodes"])
    # Beside --prefill/--decode: those first, then the pool.
    code, out, err = _invoke("--dry-run", "--json", "--nodes", "1", "--prefill", "1", "--decode", "1")
    assert code == 0, err
    urls = json.loads(out.splitlines()[-1])
    assert (urls["prefill"], urls["decode"], urls["nodes"]) == (
        ["http://127.0.0.1:9100"], ["http://127.0.0.1:9101"], ["http://127.0.0.1:9102"])
    assert no_launch == []


def test_a_config_file_cluster_does_not_survive_beside_a_pool(tmp_path: Path, no_launch: list[object]) -> None:
    """A pool-only up overrides no prefill/decode lists (they are empty): the file's would stay, so it is refused."""
    cfg_file = tmp_path / "gw.toml"
    cfg_file.write_text(SERVE_TOML)
    code, out, err = _invoke("--nodes", "2", "--config", str(cfg_file))
    assert code == 2, (out, err)
    assert f"{cfg_file} sets prefill, but kvtether up points the gateway at the instances it starts" in err
    assert f"remove prefill from {cfg_file}" in err
    assert no_launch == []


def test_no_instances_at_all_is_a_usage_error(no_launch: list[object]) -> None:
    code, _out, err = _invoke("--dry-run", "--prefill", "0")
    assert code == 2
    said = " ".join(err.replace("│", " ").split())  # typer's box wraps the message
    assert "need at least one prefill and one decode instance, or pool instances (--nodes N)" in said
    assert no_launch == []
