"""`kvtether replay --sim toy`: the real simulator and gateway, in process (small and fast)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import typer
from kvtether.cli.gen.generate import GenParams, generate_sessions
from kvtether.cli.replay import command as cmd_replay
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


def test_the_simulated_clusters_logs_stay_off_the_console_unless_sent_to_a_file(tmp_path: Path) -> None:
    """Think times past D's decoder_kv_blocks_ttl (600 s against 480) behind the reference proxy, which never
    releases a hold: the simulated vLLM node releases each session's hold at its TTL and logs it, as vLLM does,
    and the gateway logs every turn. A user who asked for a table gets none of it on the console; --engine-log
    FILE gets all of it, the table still on stdout."""
    f = tmp_path / "g.jsonl"
    params = GenParams(sessions=1, turns=2, new_tokens="20-40", output_tokens="4", think_ms=0, system_tokens=50)
    write_sessions(f, generate_sessions(params))
    app = typer.Typer()
    app.callback()(lambda: None)
    cmd_replay.register(app)
    argv = ["replay", str(f), "--sim", "toy", "--speed", "500", "--policy", "reference", "--think-time",
            "fixed:600000", "--max-error-rate", "1", "--no-progress"]
    log = tmp_path / "engines.log"
    by_default = CliRunner().invoke(app, argv)
    to_file = CliRunner().invoke(app, [*argv, "--engine-log", str(log)])
    for r in (by_default, to_file):
        assert r.exit_code == 0, r.stderr
        assert "latency in ms" in r.stdout  # the table
        console = r.stdout + r.stderr
        assert "Releasing expired KV blocks" not in console and "kvtether.gateway" not in console, console
    written = log.read_text()
    assert "WARNING kvtether.sim.engine: Releasing expired KV blocks for request" in written
    assert "INFO kvtether.gateway.turn.remember: turn 0 of" in written


def test_engine_log_needs_the_simulator(tmp_path: Path) -> None:
    f = tmp_path / "g.jsonl"
    write_sessions(f, generate_sessions(GenParams(sessions=1, turns=1)))
    app = typer.Typer()
    app.callback()(lambda: None)
    cmd_replay.register(app)
    r = CliRunner().invoke(app, ["replay", str(f), "--gateway", "http://127.0.0.1:9", "--engine-log", "x.log"])
    assert r.exit_code == 2 and "--engine-log needs --sim" in r.stderr
    r = CliRunner().invoke(app, ["replay", str(f), "--sim", "toy", "--engine-log", str(tmp_path / "no" / "x.log")])
    assert r.exit_code == 2 and "--engine-log: cannot write" in r.stderr


def _small_file(tmp_path: Path) -> Path:
    f = tmp_path / "g.jsonl"
    params = GenParams(sessions=2, turns=2, new_tokens="20-40", output_tokens="4", think_ms=0, system_tokens=50)
    write_sessions(f, generate_sessions(params))
    return f


def test_the_report_goes_to_stdout_and_the_notes_to_stderr(tmp_path: Path) -> None:
    """`kvtether replay … > report.txt 2> notes.txt`, as a shell runs it: the file gets the report (tables, the
    history and cluster lines, the SLO lines); stderr what is run; the failing SLO's verdict is an error, on
    stderr."""
    f = _small_file(tmp_path)
    kvtether = Path(sys.executable).parent / "kvtether"  # the console script of this environment
    report, notes = tmp_path / "report.txt", tmp_path / "notes.txt"
    argv = [str(kvtether), "replay", str(f), "--sim", "toy", "--virtual", "--slo", "ttft_p95=0.001"]
    with report.open("w") as out, notes.open("w") as err:
        proc = subprocess.run(argv, stdout=out, stderr=err, timeout=300, check=False)
    stdout, stderr = report.read_text(), notes.read_text()
    assert proc.returncode == 3, stderr
    assert "latency in ms" in stdout and "TTFT by turn index" in stdout and "cluster: simulated toy" in stdout
    assert "SLO auto ttft_p95" in stdout and "MISSED" in stdout
    assert stderr.startswith("replaying 2 sessions, 4 turns, on simulated toy") and "arrivals:" in stderr
    assert "latency in ms" not in stderr and "SLO missed" in stderr and "SLO missed" not in stdout
    assert "\x1b[" not in stdout  # no terminal codes in a file


def test_json_stdout_is_the_document_alone(tmp_path: Path) -> None:
    """--json: stdout parses as one JSON document; the report goes to stderr, where --quiet drops it."""
    f = _small_file(tmp_path)
    app = typer.Typer()
    app.callback()(lambda: None)
    cmd_replay.register(app)
    argv = ["replay", str(f), "--sim", "toy", "--virtual", "--json"]
    r = CliRunner().invoke(app, argv)
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["schema"] == "kvtether.replay/1"
    assert "latency in ms" in r.stderr and "replaying 2 sessions" in r.stderr
    quiet = CliRunner().invoke(app, [*argv, "--quiet"])
    assert quiet.exit_code == 0, quiet.stderr
    assert json.loads(quiet.stdout)["schema"] == "kvtether.replay/1" and quiet.stderr == ""
