"""``kvtether sim``: JSON line of URLs, serving until interrupted, clear errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import httpx
import typer
from kvtether.cli.cmd_sim import register
from typer.testing import CliRunner

SCRIPT = textwrap.dedent(
    """
    import sys, typer
    from kvtether.cli.cmd_sim import register
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


def test_json_line_then_serves_until_interrupted() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, "sim", "--prefill", "1", "--decode", "2", "--speed", "100", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        urls = json.loads(proc.stdout.readline())
        assert len(urls["prefill"]) == 1 and len(urls["decode"]) == 2 and urls["aggregated"] == []
        r = httpx.post(
            urls["decode"][1] + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
        )
        assert r.status_code == 200
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=15)
    assert proc.returncode == 0
