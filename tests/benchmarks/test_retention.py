"""`benchmarks/retention.py`: decode memory under many agent sessions, on the simulator.

The benchmark's figures are not checked here; what is: the workload it generates (who ends with a signal, time
scaling), and that a `--quick` run (in virtual time) prints its table for every run with figures that can be true
at all: the reference proxy releases nothing, auto releases, no held-KV share above 1, classic P/D holds nothing,
and no run loses a turn.
"""

from __future__ import annotations

import json
import types

import pytest

from tests.support import benchmark_scripts

RUNS = ("no-pull", "reference", "auto", "auto-unlimited")


def _bench() -> types.ModuleType:
    benchmark_scripts.load("placement_policies")  # retention.py imports its helpers by that name
    return benchmark_scripts.load("retention")


def test_sessions_signal_their_end_by_the_flag_and_times_scale_down() -> None:
    bench = _bench()
    args = bench.parse_args(["--sessions", "40", "--final-share", "0.25", "--time-scale", "1"])
    plans = bench.make_plans(args)
    assert len(plans) == 40
    assert 5 <= sum(p.final for p in plans) <= 15  # a quarter, drawn
    assert all(3 <= p.turns <= 12 and len(p.think_s) == p.turns - 1 for p in plans)
    assert all(1.0 <= t <= 300.0 for p in plans for t in p.think_s)
    assert [p.arrive_s for p in plans] == sorted(p.arrive_s for p in plans)

    assert not any(p.final for p in bench.make_plans(bench.parse_args(["--final-share", "0"])))
    # The same sessions with every time ÷ 4: think times and arrivals, never the token counts.
    scaled = bench.make_plans(bench.parse_args(["--sessions", "40", "--final-share", "0.25", "--time-scale", "4"]))
    assert [p.result_tokens for p in scaled] == [p.result_tokens for p in plans]
    assert [p.think_s for p in scaled] == [[t / 4 for t in p.think_s] for p in plans]
    assert scaled[-1].arrive_s == pytest.approx(plans[-1].arrive_s / 4)
    # The gateway gets the retention times ÷ time scale ÷ speed, in its real seconds.
    settings = bench.gateway_settings("auto", bench.parse_args(["--time-scale", "4", "--realtime", "--speed", "2"]),
                                      "qwen3-32b-h200-tp8")
    assert settings["engine_kv_ttl_s"] == pytest.approx(480 / 8)
    assert settings["session_ttl_s"] == pytest.approx(450 / 8)
    assert settings["retention_interval_s"] == pytest.approx(1 / 8)
    assert "idle_release_s" not in settings  # no release on a timer to scale


def test_an_unknown_run_is_refused_before_anything_runs() -> None:
    bench = _bench()
    with pytest.raises(SystemExit):
        bench.parse_args(["--runs", "auto,autoo"])
    assert bench.parse_run("auto-unlimited@held_kv_budget=0.3") == ("auto", True, {"held_kv_budget": 0.3})


def test_quick_run_prints_every_run_with_sane_figures(capsys: pytest.CaptureFixture[str]) -> None:
    bench = _bench()
    bench.main(["--quick", "--json"])
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "| metric | " + " | ".join(RUNS) + " |" in lines
    for name in ("D held KV share p50 / p95 / max", "D preemptions", "D waiting requests", "late TTFT p95 s",
                 "late TTFT p99 s", "decode TPOT p50 / p95 s", "reuse rate", "releases by reason"):
        assert any(line.startswith(f"| {name}") and line.count("|") == len(RUNS) + 2 for line in lines), name
    assert "Time scaling:" in out and "SIMULATED" in out
    data = json.loads(next(line for line in reversed(lines) if line.startswith("{")))
    s = data["summary"]
    assert list(s) == list(RUNS)
    planned = sum(p.turns for p in bench.make_plans(bench.parse_args(["--quick"])))
    for run in RUNS:
        assert s[run]["errors"] == 0 and s[run]["turns"] == planned == len(data["turns"][run]), run
        assert 0.0 <= s[run]["held_share_max"] <= 1.0 and 0.0 <= s[run]["usage_max"] <= 1.0, run
        assert 0.0 <= s[run]["reuse_rate"] <= 1.0, run
        assert s[run]["late_turns"] > 0 and s[run]["late_ttft_p95"] > 0, run
    # The reference proxy holds everything until a pull or the TTL; auto releases (the last turns of the sessions
    # that say so).
    assert s["reference"]["releases_total"] == 0
    assert s["auto"]["releases_total"] > 0
    assert s["auto"]["budget"] == 0.5 and s["reference"]["budget"] is None
    # Classic P/D (no bidirectional_kv_xfer) keeps nothing on D and reuses nothing.
    assert s["no-pull"]["held_share_max"] == 0.0 and s["no-pull"]["reuse_rate"] == 0.0
    assert s["no-pull"]["releases_total"] == 0
    # Unlimited decode memory: the preset's KV, far above the quick run's small D.
    assert s["auto-unlimited"]["decode_tokens"] > 100 * s["auto"]["decode_tokens"]
