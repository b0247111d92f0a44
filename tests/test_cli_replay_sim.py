"""`kvtether replay --sim toy`: the real simulator and gateway, in process (small and fast)."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from kvtether.cli import cmd_replay
from kvtether.cli.generate import GenParams, generate_sessions
from kvtether.sdk.sessionfile import write_sessions
from typer.testing import CliRunner


def test_compare_three_policies_on_sim(tmp_path: Path) -> None:
    f = tmp_path / "g.jsonl"
    params = GenParams(sessions=2, turns=3, new_tokens="20-40", output_tokens="4", think_ms=0, system_tokens=50)
    write_sessions(f, generate_sessions(params))
    app = typer.Typer()
    app.callback()(lambda: None)  # keep "replay" a sub-command, as in kvtether's app
    cmd_replay.register(app)
    argv = ["replay", str(f), "--sim", "toy", "--speed", "50", "--compare", "--json", "--max-error-rate", "1"]
    r = CliRunner().invoke(app, argv)
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["target"]["kind"] == "sim" and doc["time"] == "simulated time = real × 50"
    assert [run["policy"] for run in doc["runs"]] == ["no-pull", "reference", "auto"]
    for run in doc["runs"]:
        assert run["requests"] >= 2
        assert run["ttft_ms"]["n"] >= 1 and run["ttft_ms"]["p50"] is not None
        assert {"p50", "p95", "p99"} <= set(run["ttft_ms"])
    assert "policies side by side" in r.stderr and "no-pull" in r.stderr
