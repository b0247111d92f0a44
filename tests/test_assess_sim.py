"""`kvtether assess` end to end on the simulator: the topology call on two contrasting workloads, and --gateway
against a running gateway on a simulated cluster."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest
from kvtether.cli.main import app
from kvtether.cli.replay import ReplayOptions, run_replay
from kvtether.sdk.sessionfile import read_sessions
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]
SMALL = ROOT / "examples" / "sessions" / "agent-small.jsonl"


def assess(*args: str) -> dict:
    result = CliRunner().invoke(app, ["assess", *args, "--json", "-q"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_colocated_wins_a_coding_agent_on_a_slow_link(tmp_path: Path) -> None:
    """Short tool results on a growing history, a 10 Gb/s P↔D link: every pull costs more than the prefix cache of a
    session-affine replica, which holds the history for free."""
    doc = assess(str(SMALL), "--limit", "2", "--link-gbps", "10", "--options", "reference,colocated",
                 "--speed", "2", "--tpot-slo", "0", "--report", str(tmp_path / "r.html"))
    q4 = doc["answers"]["q4"]
    assert q4["best"] == "colocated", q4["verdict"]
    assert q4["margin"] > 1.2
    assert doc["answers"]["q2"]["pays_share"] < 1.0  # the slow link shows up in question 2 too
    assert (tmp_path / "r.html").read_text().count("<svg") >= 5


@pytest.mark.anyio
async def test_assess_reads_a_running_gateway(tmp_path: Path) -> None:
    from kvtether.gateway.config import load_config
    from kvtether.gateway.shell.app import create_app
    from kvtether.gateway.shell.server import serve_gateway
    from kvtether.sim.cluster import ClusterSpec, SimCluster

    sessions = read_sessions(SMALL)[:2]
    spec = ClusterSpec(prefill=1, decode=1, speed=20, prefill_prefix_caching=False)
    async with SimCluster(spec) as cluster:
        cfg = load_config(None, prefill=cluster.prefill_urls, decode=cluster.decode_urls, policy="pull",
                          metrics_poll_interval_s=0.5, learn_estimates=False)
        async with serve_gateway(cfg, app=create_app(cfg)) as url:
            run = await run_replay(sessions, url, ReplayOptions(concurrency=2, time_scale=20, model=spec.model_name))
            assert all(r.ok for r in run.results)
            report = tmp_path / "gw.html"
            doc = await anyio.to_thread.run_sync(lambda: assess(
                str(SMALL), "--limit", "2", "--gateway", url, "--no-simulate", "--report", str(report)))
    gw = doc["gateway"]
    assert gw["mode"] == "pd" and gw["policy"] == "pull"
    assert gw["pinned_sessions"] == 2
    # Every turn after a session's first reused its handle: whole, or truncated where the recorded answer resent
    # differs from the one the simulated model gave (the guard cuts the handle at the first differing token).
    reused = gw["handle_outcomes"].get("attached", 0) + gw["handle_outcomes"].get("truncated", 0)
    assert reused == 10, gw["handle_outcomes"]
    assert gw["reused_share"] > 0.5 and gw["ttft_ms_by_source"]["decode_pull"]["n"] >= 8
    assert doc["cluster"]["prefill_nodes"] == 1 and doc["cluster"]["decode_nodes"] == 1  # read from /ready
    assert "q1" in doc["answers"] and "q4" not in doc["answers"]
    assert "What the gateway" in report.read_text()
