"""Open-loop replay (sessions start at their trace offsets), per-turn objectives, SLO attainment and goodput."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest
import typer
from kvtether.cli.gen.generate import GenParams, generate_sessions
from kvtether.cli.replay import ReplayOptions, SimTarget, TurnResult, replay_sim
from kvtether.cli.replay import command as cmd_replay
from kvtether.cli.replay.engine import arrival_delays_s, join_engine_tpot, start_offset_ms
from kvtether.cli.replay.report import Objectives, attainment, goodput, goodput_report, parse_objectives
from kvtether.sdk.sessionfile import SessionRecord, write_sessions
from typer.testing import CliRunner


def _turn(ttft: float | None = 100.0, tpot: float | None = 10.0, tokens: int | None = 20, **kw: Any) -> TurnResult:
    fields: dict[str, Any] = {"session_id": "s", "turn": 0, "ok": True, "ttft_ms": ttft, "tpot_ms": tpot,
                    "completion_tokens": tokens, **kw}
    return TurnResult(**fields)


def _sessions(n: int, offsets: list[float | None]) -> list[SessionRecord]:
    params = GenParams(sessions=n, turns=2, new_tokens="20-40", output_tokens="4", think_ms=0, system_tokens=50)
    sessions = generate_sessions(params)
    for s, offset in zip(sessions, offsets, strict=True):
        if offset is not None:
            s.metadata["start_offset_ms"] = offset
    return sessions


# --- pure ------------------------------------------------------------------------------------------------------


def test_attainment_counts_turns_meeting_both_objectives() -> None:
    results = [
        _turn(),  # meets both
        _turn(ttft=2500.0),  # TTFT missed
        _turn(tpot=30.0),  # TPOT missed
        _turn(tpot=None, tokens=1),  # one token: no TPOT, meets it
        _turn(tpot=25.0),  # exactly at the objective: met
        _turn(ok=False, ttft=None, tpot=None, tokens=None, error_kind="http_500"),  # failed
        _turn(ok=False, skipped=True, ttft=None, tpot=None, tokens=None),  # skipped after the failure
        _turn(empty=True, ttft=None, tpot=None, tokens=3),  # no visible token: no TTFT
    ]
    a = attainment(results, Objectives(ttft_ms=2000.0, tpot_ms=25.0), "client")
    assert (a["turns"], a["met"], a["met_ttft"], a["met_tpot"]) == (8, 3, 4, 4)
    assert a["attainment"] == pytest.approx(3 / 8)
    assert a["tpot_source"] == "client" and a["tpot_unmeasured"] == 0
    # Only a TTFT objective: the slow decode no longer misses.
    assert attainment(results, Objectives(ttft_ms=2000.0), "client")["met"] == 4


def test_attainment_from_engine_tpot() -> None:
    results = [
        _turn(tpot=90.0, engine_tpot_ms=12.0),  # the client's TPOT is inflated; the engine's meets
        _turn(tpot=5.0, engine_tpot_ms=40.0),  # and the other way round
        _turn(tpot=5.0, engine_tpot_ms=None),  # not joined: counted, and missed
        _turn(tpot=None, tokens=1),  # one token
    ]
    a = attainment(results, Objectives(tpot_ms=25.0), "engine")
    assert (a["met"], a["tpot_unmeasured"], a["tpot_source"]) == (2, 1, "engine")
    assert attainment(results, Objectives(tpot_ms=25.0), "client")["met"] == 3


def test_goodput_is_the_highest_passing_rate() -> None:
    assert goodput([(0.5, 1.0), (1.0, 0.95), (2.0, 0.9), (4.0, 0.6)]) == 2.0
    # A noisy level below a passing one does not hide it.
    assert goodput([(0.5, 0.97), (1.0, 0.85), (2.0, 0.92), (4.0, None)]) == 2.0
    assert goodput([(0.5, 0.5), (1.0, 0.2)]) is None
    assert goodput([]) is None


def test_goodput_report_per_policy() -> None:
    def summary(label: str, share: float) -> dict[str, Any]:
        return {"label": label, "errors": 0,
                "attainment": {"attainment": share, "met": int(share * 10), "turns": 10, "tpot_source": "engine",
                               "objectives": {"ttft_ms": 2000.0, "tpot_ms": 25.0}}}

    runs = [("no-pull", 1.0, summary("no-pull ×1", 0.8)), ("no-pull", 2.0, summary("no-pull ×2", 0.5)),
            ("auto", 1.0, summary("auto ×1", 1.0)), ("auto", 2.0, summary("auto ×2", 0.9))]
    report = goodput_report(runs)
    assert [(p["policy"], p["goodput"]) for p in report["policies"]] == [("no-pull", None), ("auto", 2.0)]
    assert [x["rate"] for x in report["policies"][1]["levels"]] == [1.0, 2.0]
    assert report["tpot_source"] == "engine" and report["threshold"] == 0.9


def test_parse_objectives() -> None:
    assert parse_objectives(["ttft=2000", "tpot<=25"]) == Objectives(ttft_ms=2000.0, tpot_ms=25.0)
    assert not parse_objectives([])
    for bad in ("ttft", "e2e=5", "tpot=-1", "ttft=x"):
        with pytest.raises(ValueError):
            parse_objectives([bad])


def test_arrival_delays_scale_with_rate_and_clock() -> None:
    sessions = _sessions(3, [0.0, 4000.0, None])
    assert [start_offset_ms(s) for s in sessions] == [0.0, 4000.0, 0.0]
    assert arrival_delays_s(sessions, rate=1.0, time_scale=1.0) == [0.0, 4.0, 0.0]
    assert arrival_delays_s(sessions, rate=4.0, time_scale=1.0) == [0.0, 1.0, 0.0]
    assert arrival_delays_s(sessions, rate=1.0, time_scale=10.0) == [0.0, 0.4, 0.0]  # simulated clock


def test_join_engine_tpot_by_response_id() -> None:
    results = [_turn(response_id="chatcmpl-0123456789abcdef"), _turn(response_id="chatcmpl-fedcba9876543210"),
               _turn(response_id=None)]
    joined = join_engine_tpot(results, {"chatcmpl-0123456789abcdef-1a2b3c4d": 7.5, "cmpl-aaaa-0-12345678": 3.0})
    assert joined == 1
    assert [r.engine_tpot_ms for r in results] == [7.5, None, None]


# --- on the simulator ------------------------------------------------------------------------------------------


def test_open_loop_starts_sessions_at_their_offsets_and_rate_compresses_them() -> None:
    sessions = _sessions(2, [0.0, 2000.0])

    def first_starts(rate: float) -> dict[str, float]:
        opts = ReplayOptions(arrivals="trace", rate=rate)
        run = anyio.run(replay_sim, sessions, SimTarget("toy", speed=1.0), "auto", opts)
        assert all(r.ok for r in run.results)
        return {r.session_id.split("~")[0]: r.start_ms for r in run.results if r.turn == 0}

    ids = [s.session_id for s in sessions]
    starts = first_starts(1.0)
    assert starts[ids[1]] >= 2000.0 > starts[ids[0]]
    compressed = first_starts(8.0)
    assert 2000.0 > compressed[ids[1]] >= 250.0 > compressed[ids[0]]


def test_a_capped_open_loop_counts_the_sessions_it_held_and_virtual_time_holds_none() -> None:
    """On the wall clock the open loop caps the sessions in flight (sockets); a session the cap holds past its
    arrival is counted and the report says the load was below the one asked for. In virtual time, where the
    network is in memory, there is no cap: every session starts at its arrival."""
    from kvtether.cli.replay.report import summarize_run
    from kvtether.sim.virtual import run_virtual

    sessions = _sessions(3, [0.0, 0.0, 0.0])
    capped = ReplayOptions(arrivals="trace", open_loop_cap=1)
    run = anyio.run(replay_sim, sessions, SimTarget("toy", speed=1.0), "auto", capped)
    assert all(r.ok for r in run.results)
    assert run.arrivals_late == 2 and run.arrival_lag_max_s > 0, (run.arrivals_late, run.arrival_lag_max_s)
    summary = summarize_run("auto", run, len(sessions))
    assert summary["arrivals_late"] == 2
    assert any("below the one asked for" in w for w in summary["warnings"]), summary["warnings"]
    virtual = run_virtual(replay_sim, sessions, SimTarget("toy", virtual=True), "auto", capped)
    assert all(r.ok for r in virtual.results) and virtual.arrivals_late == 0
    assert [r.start_ms for r in virtual.results if r.turn == 0] == [0.0, 0.0, 0.0]
    assert "arrivals_late" not in summarize_run("auto", virtual, len(sessions))


def test_cli_goodput_on_sim(tmp_path: Path) -> None:
    f = tmp_path / "trace.jsonl"
    write_sessions(f, _sessions(3, [0.0, 100.0, 200.0]))
    app = typer.Typer()
    app.callback()(lambda: None)
    cmd_replay.register(app)
    # Objectives no turn can miss: attainment 100 % at every rate, so the goodput is the highest rate.
    argv = ["replay", str(f), "--sim", "toy", "--speed", "20", "--goodput", "1,4", "--objective", "ttft=600000",
            "--objective", "tpot=600000", "--json"]
    r = CliRunner().invoke(app, argv)
    assert r.exit_code == 0, r.stderr
    assert "SLO attainment by arrival rate" in r.stderr and "× 4" in r.stderr and "engine TPOT" in r.stderr
    doc = json.loads(r.stdout)
    assert doc["options"]["arrivals"] == "trace" and doc["options"]["goodput_rates"] == [1.0, 4.0]
    assert [(run["policy"], run["rate"]) for run in doc["runs"]] == [("auto", 1.0), ("auto", 4.0)]
    (auto,) = doc["goodput"]["policies"]
    assert auto["goodput"] == 4.0 and [x["attainment"] for x in auto["levels"]] == [1.0, 1.0]
    for run in doc["runs"]:
        a = run["attainment"]
        assert (a["tpot_source"], a["turns"], a["met"], a["tpot_unmeasured"]) == ("engine", 6, 6, 0)
        multi = [t for t in run["turn_results"] if (t["completion_tokens"] or 0) > 1]
        assert multi and all(t["engine_tpot_ms"] is not None for t in multi)
        assert all(t["response_id"].startswith("chatcmpl-") for t in run["turn_results"])


def test_cli_rejects_goodput_without_objective(tmp_path: Path) -> None:
    f = tmp_path / "trace.jsonl"
    write_sessions(f, _sessions(1, [None]))
    app = typer.Typer()
    app.callback()(lambda: None)
    cmd_replay.register(app)
    r = CliRunner().invoke(app, ["replay", str(f), "--sim", "toy", "--goodput", "1,2"])
    assert r.exit_code == 2 and "--objective" in r.stderr
    r = CliRunner().invoke(app, ["replay", str(f), "--sim", "toy", "--rate", "2"])
    assert r.exit_code == 2 and "--arrivals trace" in r.stderr
