"""benchmarks/goodput.py: its workloads have the arrivals an open-loop replay needs, its table and goodput read
the runs right, and a tiny run of two options end to end gives an attainment per load."""

from __future__ import annotations

import argparse
import types
from pathlib import Path

import pytest

from tests.support import benchmark_scripts


def _bench() -> types.ModuleType:
    return benchmark_scripts.load("goodput")


@pytest.mark.parametrize("name", ["chat", "coding", "long-docs", "trace", "coding-long"])
def test_every_workload_has_sessions_that_arrive_over_time(name: str) -> None:
    g = _bench()
    sessions = g.workload(name, g.Settings(sessions=4))
    assert 1 <= len(sessions) <= 4 and all(len(s.turns) >= 2 for s in sessions)
    offsets = [s.metadata.get("start_offset_ms", 0.0) for s in sessions]
    assert offsets[0] == 0.0 or name == "trace"
    assert len(set(offsets)) == len(offsets), offsets  # not all at once: open loop has something to compress


def test_coding_long_adds_file_sized_tool_results_to_the_coding_sessions() -> None:
    g = _bench()

    def largest_append(name: str) -> int:
        # Words of the largest tool result (the generator writes about a token a word).
        return max(len(str(m.get("content", "")).split()) for s in g.workload(name, g.Settings(sessions=8))
                   for t in s.turns for m in (t.new_messages or ()) if m.get("role") == "tool")

    assert largest_append("coding") <= 6000 < 12000 <= largest_append("coding-long")


def test_the_table_names_each_options_goodput_and_late_turn_figures() -> None:
    g = _bench()

    def row(option: str, rate: float, share: float) -> dict[str, object]:
        return {"option": option, "rate": rate, "attainment": share, "late_ttft_ms": {"p50": 1, "p95": 2, "p99": 3},
                "tpot_p95_ms": 7.0}

    out = {"loads": [1.0, 2.0], "workloads": {"chat": {
        "sessions": 2, "turns": 8, "runs": [row("auto", 1.0, 0.95), row("auto", 2.0, 0.5), row("no-pull", 1.0, 0.2),
                                            row("no-pull", 2.0, 0.1)],
        "goodput": {"auto": 1.0, "no-pull": None}}}}
    out["workloads"]["chat"]["runs"][1]["errors"] = 3  # type: ignore[index]
    text = g.render(out)
    assert "| auto | 95.0 % | 50.0 % | ×1 | 1 / 2 / 3 | 7.0 | 0 / 3 |" in text  # turns that got no answer
    assert "| no-pull | 20.0 % | 10.0 % | none |" in text


def test_seeds_pool_into_one_table_of_every_turn() -> None:
    """Attainment pooled is met over turns of all seeds together (not a mean of shares), percentiles are of
    the samples together, and goodput is read off the pooled attainment."""
    g = _bench()

    def run(seed: int, met: int, turns: int, late: list[float]) -> dict[str, object]:
        r = {"option": "auto", "rate": 1.0, "attainment": met / turns, "met": met, "turns": turns, "errors": 0,
             "late_ttft_samples": late, "tpot_samples": [7.0] * len(late)}
        return {"settings": {"seed": seed}, "loads": [1.0], "workloads": {"chat": {
            "sessions": 2, "turns": turns, "runs": [r], "goodput": {"auto": None}}}}

    out = g.pool([run(1, 9, 10, [100.0, 200.0]), run(2, 28, 30, [300.0, 400.0])])
    pooled = out["workloads"]["chat"]
    (row,) = pooled["runs"]
    assert (row["met"], row["turns"]) == (37, 40) and row["attainment"] == pytest.approx(0.925)
    assert row["late_ttft_ms"]["p50"] == 300.0 and row["late_ttft_ms"]["p99"] == 400.0
    assert pooled["goodput"] == {"auto": 1.0} and out["seeds"] == [1, 2]

    # One seed's options run in two goes (files): its sessions count once, its rows pool as one seed's.
    other = run(1, 10, 10, [50.0])
    other["workloads"]["chat"]["runs"][0]["option"] = "hybrid"
    out = g.pool([run(1, 9, 10, [100.0]), other])
    assert out["seeds"] == [1] and out["workloads"]["chat"]["sessions"] == 2
    assert {r["option"]: r["turns"] for r in out["workloads"]["chat"]["runs"]} == {"auto": 10, "hybrid": 10}


def test_the_trace_workload_takes_a_different_window_per_seed() -> None:
    g = _bench()
    first = g.workload("trace", g.Settings(sessions=4, seed=1))
    second = g.workload("trace", g.Settings(sessions=4, seed=2))
    assert {s.session_id for s in first}.isdisjoint({s.session_id for s in second})
    assert min(s.metadata["start_offset_ms"] for s in second) == 0.0  # arrivals from the window's first


@pytest.mark.timeout(300)
def test_a_tiny_run_gives_attainment_and_goodput_per_option(tmp_path: Path) -> None:
    g = _bench()
    args = argparse.Namespace(workloads="chat", options="auto,colocated", loads="1,4", preset="toy", speed=10.0,
                              ttft=60_000.0, tpot=1_000.0, sessions=2, seed=3)
    out = g.main_sync(args)  # virtual time, the default
    res = out["workloads"]["chat"]
    assert [(r["option"], r["rate"]) for r in res["runs"]] == [("auto", 1.0), ("auto", 4.0), ("colocated", 1.0),
                                                               ("colocated", 4.0)]
    # Load ×k is k times the users: ×4 replays four times the sessions (in the same window).
    assert [r["turns"] for r in res["runs"]] == [16, 64, 16, 64] and not any(r["errors"] for r in res["runs"])
    # Objectives this loose are met by every turn: goodput is the highest load tried.
    assert all(r["attainment"] == 1.0 for r in res["runs"]) and res["goodput"] == {"auto": 4.0, "colocated": 4.0}
    assert all(r["tpot_p95_ms"] is not None for r in res["runs"])
    g.plot(out, tmp_path / "goodput.png")
    assert (tmp_path / "goodput.png").stat().st_size > 1000


@pytest.mark.timeout(300)
def test_a_run_lists_the_turns_it_missed_with_the_gateways_choice() -> None:
    """Every turn that misses an objective is listed with what the gateway chose for it (its plan and the
    reason's bucket), so a policy's lost turns can be read, not only counted."""
    g = _bench()
    st = g.Settings(preset="toy", ttft_ms=0.001, tpot_ms=1_000.0, sessions=2, seed=3)
    sessions = g.workload("chat", st)
    row = g.run_job(("chat", "auto", 1.0, st))
    assert row["clock"] == "virtual" and row["simulated_s"] > 0
    assert row["met"] == 0 and len(row["missed"]) == row["turns"] == 16
    first = [m for m in row["missed"] if m["turn"] == 0]
    assert len(first) == 2 and all(m["reason"] == "first_turn" and m["plan"] == "none" for m in first), first
    assert all(m["ttft_ms"] is not None and m["ttft_ms"] > 0.001 and m["error"] is None for m in row["missed"])
    assert {m["session"] for m in row["missed"]} == {s.session_id for s in sessions}


@pytest.mark.parametrize("name", ["chat", "coding", "long-docs", "trace", "coding-long"])
def test_a_load_is_that_many_times_the_sessions_arriving_in_the_same_window(name: str) -> None:
    """×k must raise the load past the point where every session of ×1 is under way (each has one request out
    at a time): k times the sessions, whose offsets the replay divides by k, so they arrive in ×1's window."""
    g = _bench()
    st = g.Settings(sessions=16, seed=2)
    base, four = g.workload(name, st), g.workload(name, st, 4.0)
    assert len(four) == 4 * len(base) or (name == "trace" and len(four) == 40)  # the sample has 40 conversations
    assert len({s.session_id for s in four}) == len(four)
    window = max(s.metadata.get("start_offset_ms", 0.0) for s in base)
    four_window = max(s.metadata.get("start_offset_ms", 0.0) for s in four) / 4.0
    assert 0.5 * window < four_window < 2.0 * window
    # Below ×1: the same users, further apart (the replay divides their offsets by the load).
    assert [s.session_id for s in g.workload(name, st, 0.25)] == [s.session_id for s in base]


def test_workloads_run_at_loads_of_their_own_pool_and_render_each_with_its_loads() -> None:
    """A seed's workloads may come from separate runs at different loads (a workload past its knee at ×2 need
    not run ×4): the pooled table has every workload, each with the loads it ran."""
    g = _bench()

    def out(seed: int, w: str, rates: list[float]) -> dict[str, object]:
        runs = [{"option": "auto", "rate": r, "attainment": 1.0, "met": 4, "turns": 4, "errors": 0,
                 "late_ttft_samples": [1.0], "tpot_samples": [1.0], "late_ttft_ms": {"p50": 1, "p95": 1, "p99": 1},
                 "tpot_p95_ms": 1.0} for r in rates]
        return {"settings": {"seed": seed}, "loads": rates,
                "workloads": {w: {"sessions": 1, "turns": 4, "runs": runs, "goodput": {"auto": max(rates)}}}}

    pooled = g.pool([out(1, "chat", [1.0, 2.0, 4.0]), out(1, "coding-long", [1.0, 2.0]),
                     out(2, "chat", [1.0, 2.0, 4.0]), out(2, "coding-long", [1.0, 2.0])])
    assert list(pooled["workloads"]) == ["chat", "coding-long"] and pooled["seeds"] == [1, 2]
    assert {r["rate"]: r["turns"] for r in pooled["workloads"]["coding-long"]["runs"]} == {1.0: 8, 2.0: 8}
    text = g.render(pooled)
    chat, long = text.split("## coding-long")
    assert "attain. ×4" in chat and "attain. ×4" not in long and "| auto | 100.0 % | 100.0 % | ×2 |" in long


@pytest.mark.timeout(300)
def test_a_run_reports_its_modelled_gateway_and_more_workers_share_its_load() -> None:
    """In virtual time a run says how busy its modelled gateway processes were (a saturated gateway's queue is in
    every turn's TTFT); the same turns on two processes keep each half as busy."""
    g = _bench()
    one, two = (g.run_job(("chat", "auto", 1.0, g.Settings(preset="toy", sessions=2, seed=3, gateway_workers=n)))
                for n in (1, 2))
    assert one["turns"] == two["turns"] == 16
    assert 0 < one["gateway_utilisation"] < 0.7 and one["gateway_saturated"] is False
    assert two["gateway_utilisation"] == pytest.approx(one["gateway_utilisation"] / 2, rel=0.05)
    # Its busiest 10 s window, shared alike; two sessions never made a turn wait for it.
    assert two["gateway_peak_utilisation"] == pytest.approx(one["gateway_peak_utilisation"] / 2, rel=0.05)
    assert one["gateway_peak_utilisation"] > one["gateway_utilisation"]  # ramps up and down in a 33 s run
    assert one["gateway_queue_ms"] == two["gateway_queue_ms"] == {"p50": 0.0, "p99": 0.0, "max": 0.0}


def test_a_tuning_override_reaches_the_gateway_of_every_option_but_colocated_serving() -> None:
    """--tuning KEY=VALUE switches a rule under evaluation on for the runs: true/false for a switch, else a number;
    colocated serving has no policy to tune."""
    from kvtether.cli.assess.cluster import build_shape
    from kvtether.cli.assess.topology import option_gateway
    from kvtether.gateway.turn.place import policy_knobs
    from kvtether.sim.virtual import run_virtual

    g = _bench()
    assert g.tuning_pair("release_lost_answers=true") == ("release_lost_answers", True)
    assert g.tuning_pair("defer_min_clear_rate=0.3") == ("defer_min_clear_rate", 0.3)
    assert g.tuning_pair("defer_probe_every=4") == ("defer_probe_every", 4)
    for bad in ("release_lost_answers", "x=maybe", "=1"):
        with pytest.raises(argparse.ArgumentTypeError):
            g.tuning_pair(bad)
    shape = build_shape("qwen3-32b-h200-tp8", prefill=1, decode=2)

    async def knob(option: str) -> object:
        async with option_gateway(option, shape, 1.0, tuning={"release_lost_answers": True}) as stack:
            return policy_knobs(stack.app.state.gateway.config).release_lost_answers

    assert [run_virtual(knob, o) for o in ("colocated", "auto", "hybrid")] == [False, True, True]
    # The table of such runs says so (the settings as goodput.json keeps them).
    out = {"settings": {"tuning": [["release_lost_answers", True]]}, "loads": [1.0], "workloads": {}}
    assert g.render(out).startswith("[gateway.tuning] for every option but colocated: release_lost_answers = true")
