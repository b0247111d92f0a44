"""The `kvtether` command's options as a user meets them: every one documented, flags that read as flags, log
levels checked up front, `--version`, and usage lines that read as they parse. In-process, nothing started."""

from __future__ import annotations

from importlib import metadata
from typing import Any

import pytest
import typer
from kvtether.cli import serve as cmd_serve
from kvtether.cli.common.options import LOG_LEVELS
from kvtether.cli.main import app
from typer.testing import CliRunner

runner = CliRunner()
ROOT: Any = typer.main.get_command(app)
COMMANDS: dict[str, Any] = dict(ROOT.commands)
WIDE = {"COLUMNS": "200"}


def _help(*command: str) -> str:
    r = runner.invoke(app, [*command, "--help"], env=WIDE)
    assert r.exit_code == 0, r.output
    return r.stdout


def test_every_option_and_argument_of_every_command_has_help() -> None:
    assert set(COMMANDS) >= {"serve", "sim", "replay", "sessions", "gen", "convert", "up", "demo"}
    missing = [f"kvtether {name} {param.opts[0] if param.opts else param.name}"
               for name, cmd in [("", ROOT), *COMMANDS.items()] for param in cmd.params
               if not (getattr(param, "help", None) or "").strip()]
    assert missing == []


def test_every_boolean_option_is_an_on_off_flag_shown_without_a_type() -> None:
    for name, cmd in COMMANDS.items():
        for param in cmd.params:
            if getattr(param, "is_bool_flag", False):
                # --quick/--no-quick: a value after it (`--quick true`) is not what it takes, and says so.
                assert [o[:5] for o in param.secondary_opts] == ["--no-"], f"kvtether {name} {param.opts[0]}"
        text = _help(name)
        assert "<bool>" not in text, f"kvtether {name} --help shows a flag as taking a value:\n{text}"
    assert "<bool>" not in _help()


def test_demo_flags_have_both_forms_and_take_no_value() -> None:
    text = _help("demo")
    for flag in ("--quick", "--no-quick", "--trace", "--no-trace", "--prefill-cache", "--no-prefill-cache"):
        assert flag in text
    ctx = COMMANDS["demo"].make_context("demo", ["--quick", "--no-trace"], resilient_parsing=False)
    assert ctx.params["quick"] is True and ctx.params["trace"] is False
    # The former negative-only switches keep their spelling.
    for command, flag, param in [("sim", "--no-bidirectional", "bidirectional"), ("up", "--no-gateway", "with_gateway"),
                                 ("replay", "--no-progress", "progress"),
                                 ("sim", "--no-prefill-prefix-caching", "prefill_prefix_caching")]:
        args = ["--model", "m"] if command == "up" else ["f.jsonl"] if command == "replay" else []
        ctx = COMMANDS[command].make_context(command, [*args, flag], resilient_parsing=False)
        assert ctx.params[param] is False, (command, flag)


def test_version() -> None:
    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0, r.output
    assert r.stdout == f"kvtether {metadata.version('kvtether')}\n"
    assert "--version" in _help()


@pytest.mark.parametrize("value", ["verbose", "trace", "5"])
def test_serve_refuses_an_unknown_log_level_in_one_line(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def never(*_a: object, **_kw: object) -> None:
        raise AssertionError("the gateway started")

    monkeypatch.setattr(cmd_serve, "run_gateway_until_stopped", never)
    r = runner.invoke(app, ["serve", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
                            "--log-level", value])
    assert r.exit_code == 2, r.output
    assert r.stderr == (f"kvtether serve: --log-level must be one of debug, info, warning, error, critical; "
                        f"got {value!r}\n")
    assert r.stdout == ""


def test_serve_takes_a_log_level_in_any_case(monkeypatch: pytest.MonkeyPatch) -> None:
    got: list[str] = []
    monkeypatch.setattr(cmd_serve, "run_gateway_until_stopped",
                        lambda _cfg, *, log_level, workers: got.append(log_level))
    r = runner.invoke(app, ["serve", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
                            "--port", "0", "--log-level", "WARNING"])
    assert r.exit_code == 0, r.output
    assert got == ["warning"]
    assert " | ".join(LOG_LEVELS) in _help("serve")


def test_up_refuses_an_unknown_gateway_log_level_in_one_line() -> None:
    r = runner.invoke(app, ["up", "--model", "m", "--vllm-python", "/v/python", "--dry-run",
                            "--gateway-log-level", "verbose"])
    assert r.exit_code == 2, r.output
    assert r.stderr == ("kvtether up: --gateway-log-level must be one of debug, info, warning, error, critical; "
                        "got 'verbose'\n")
    assert r.stdout == ""


def test_up_vllm_base_port_is_documented() -> None:
    (param,) = [p for p in COMMANDS["up"].params if "--vllm-base-port" in p.opts]
    assert "First vLLM HTTP port" in param.help and "--port + 100" in param.help


def test_gen_system_tokens_says_tokens() -> None:
    (param,) = [p for p in COMMANDS["gen"].params if "--system-tokens" in p.opts]
    assert "tokens" in param.help and "(words)" not in param.help


def test_replay_usage_line_reads_file_then_policies() -> None:
    usage = next(line for line in _help("replay").splitlines() if "Usage:" in line)
    assert "kvtether replay [OPTIONS]" in usage
    assert "FILE" in usage and "[POLICY]..." in usage
    assert "[POLICY ...]" not in usage and "{FILE [" not in usage
    # Which word is the file and which the policies is still read from the words: a policy may come first.
    r = runner.invoke(app, ["replay", "no-pull,auto", "missing.jsonl", "--gateway", "http://127.0.0.1:9"])
    assert r.exit_code == 2 and "policies no-pull auto given without --compare" in r.stderr, r.output
