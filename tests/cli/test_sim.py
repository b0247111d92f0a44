"""``kvtether sim``: JSON line of URLs, serving until interrupted, clear errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from typing import Any

import httpx
import pytest
import typer
from kvtether.cli.sim import register
from typer.testing import CliRunner

from tests.support.processes import Spawn, read_line, start_with_sigint_ignored, wait_exit

SCRIPT = textwrap.dedent(
    """
    import sys, typer
    from kvtether.cli.sim import register
    app = typer.Typer()
    register(app)
    @app.callback()
    def _root() -> None: ...
    app(sys.argv[1:])
    """
)


def make_app() -> typer.Typer:
    app = typer.Typer()
    register(app)

    @app.callback()
    def _root() -> None: ...

    return app


def test_unknown_preset_is_one_clear_error() -> None:
    result = CliRunner().invoke(make_app(), ["sim", "--preset", "nope"])
    assert result.exit_code == 2
    assert "unknown preset 'nope'" in result.output


def _start_sim(spawn: Spawn, *args: str, sigint_ignored: bool = False) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """`kvtether sim --json` in its own process group (killed on teardown): the process and its URLs."""
    proc: subprocess.Popen[str] = spawn(
        [sys.executable, "-c", SCRIPT, "sim", *args, "--json"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        preexec_fn=start_with_sigint_ignored if sigint_ignored else None,
    )
    line = read_line(proc, 60)
    if not line:
        proc.wait(timeout=30)
        pytest.fail(f"kvtether sim exited {proc.returncode} before its JSON line: "
                    f"{proc.stderr.read() if proc.stderr else ''}")
    return proc, dict(json.loads(line))


def test_json_line_then_serves_until_interrupted(spawn: Spawn) -> None:
    proc, urls = _start_sim(spawn, "--prefill", "1", "--decode", "2", "--speed", "100")
    assert len(urls["prefill"]) == 1 and len(urls["decode"]) == 2 and urls["aggregated"] == []
    r = httpx.post(urls["decode"][1] + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200
    proc.send_signal(signal.SIGINT)
    rc = wait_exit(proc, 15)
    assert rc is not None, "kvtether sim still runs 15 s after SIGINT"
    assert rc == 0, proc.stderr.read() if proc.stderr else ""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_stops_on_signal_even_when_sigint_came_in_ignored(spawn: Spawn, sig: signal.Signals) -> None:
    """A background job of a non-interactive shell (a CI runner, `nohup ... &`) starts with SIGINT ignored, and
    Python keeps that: `kvtether sim` must stop on SIGINT and SIGTERM all the same, exit 0, ports closed."""
    proc, urls = _start_sim(spawn, "--prefill", "1", "--decode", "1", "--speed", "100", sigint_ignored=True)
    assert httpx.get(urls["decode"][0] + "/health", trust_env=False).status_code == 200
    proc.send_signal(sig)
    rc = wait_exit(proc, 10)
    assert rc is not None, f"kvtether sim still runs 10 s after {sig.name}"
    assert rc == 0, proc.stderr.read() if proc.stderr else ""
    for url in (*urls["prefill"], *urls["decode"]):
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health", trust_env=False)
