"""`kvtether assess` end to end on the simulator: the topology call on two contrasting workloads, the engine's
own TPOT measurement that call rests on, and --gateway against a running gateway on a simulated cluster."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest
from kvtether.cli.main import app
from kvtether.cli.replay import ReplayOptions, run_replay
from kvtether.sdk.sessionfile import read_sessions
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[2]
SMALL = ROOT / "examples" / "sessions" / "agent-small.jsonl"


def assess(*args: str) -> dict:
    result = CliRunner().invoke(app, ["assess", *args, "--json", "-q"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def run_cli(*args: str) -> None:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output


def test_colocated_wins_a_coding_agent_on_a_slow_link(tmp_path: Path) -> None:
    """Short tool results on a growing history, a 10 Gb/s P↔D link: every pull costs more than the prefix cache of a
    session-affine replica, which holds the history for free (late TTFT p95 ~0.2 s against ~1.6 s), and the short
    prefills barely touch the replicas' decode steps, so colocated meets the default 100 ms TPOT objective."""
    doc = assess(str(SMALL), "--limit", "2", "--link-gbps", "10", "--options", "reference,colocated",
                 "--report", str(tmp_path / "r.html"))
    q4 = doc["answers"]["q4"]
    assert q4["best"] == "colocated", q4["verdict"]
    assert q4["tpot_slo_ms"] == 100 and "miss" not in q4["verdict"]
    assert q4["margin"] > 2
    assert doc["answers"]["q2"]["pays_share"] < 1.0  # the slow link shows up in question 2 too
    assert (tmp_path / "r.html").read_text().count("<svg") >= 5


def test_pd_with_the_pull_wins_long_tool_results_under_a_tpot_objective(tmp_path: Path) -> None:
    """Four agents at once on Qwen3-32B, two H200 per node, an 800 Gb/s link; each turn adds a ~2k-token tool result
    to a 6k-token system prompt and answers in a few tokens. Colocated, every node interleaves the other sessions'
    ~2k-token prefills (~0.2 s a step) with its decode steps (~20 ms): a few-token answer waits out a whole chunk,
    and its TPOT p95 lands near 75 ms. P/D keeps D's steps free of prefill (TPOT ~20 ms); with P's prefix cache
    off, no-pull recomputes the whole history on P, which queues (late TTFT p95 ~8 s), while the pull reads it
    from D (~3 s). Under a 40 ms TPOT objective alone (no TTFT objective: neither P/D option keeps 2 s here),
    colocated misses it on most turns and both P/D options meet it on every turn; among those two the late TTFT
    tail decides, and the call is the pull, by more than 2× over no-pull.

    Both TPOTs are the engine's, in the cost model's time (DecodeTimes). The TTFTs are the client's on the virtual
    clock (assess's default): the cost model's time plus the gateway's modelled CPU, so this machine's load
    cannot move them either."""
    sessions = tmp_path / "long-results.jsonl"
    run_cli("gen", "--sessions", "4", "--turns", "5", "--system-tokens", "6000", "--new-tokens", "1600-2400",
            "--output-tokens", "6-10", "--think-ms", "300", "--user-prob", "0", "--seed", "3", "-o", str(sessions))
    doc = assess(str(sessions), "--preset", "qwen3-32b-h200-tp8", "--gpus-per-node", "2", "--link-gbps", "800",
                 "--options", "no-pull,pull,colocated", "--tpot-slo", "40", "--ttft-slo", "0",
                 "--report", str(tmp_path / "r.html"))
    assert doc["cluster"]["prefill_prefix_caching"] is False  # the default, as replay's
    q4 = doc["answers"]["q4"]
    opts = q4["options"]
    assert q4["best"] == "pull", q4["verdict"]
    # Virtual time: the same margin on every run, whatever the machine's load.
    assert q4["runner_up"] == "no-pull" and q4["margin"] > 1.2, q4["verdict"]
    assert q4["ranking"]["decided_by"] == "late_ttft_p95" and q4["ranking"]["tied_on"] == ["attainment"]
    assert q4["ranking"]["order"][-1] == "colocated"  # behind both by the share of turns meeting TPOT <= 40 ms
    assert "turns meeting TPOT <= 40 ms" in q4["verdict"]
    assert all(o["tpot_source"] == "engine" and o["errors"] == 0 for o in opts.values())
    # The call is no coin toss at the objective: colocated's TPOT p95 is well above it, P/D's well below.
    assert opts["colocated"]["tpot_ms"]["p95"] > 55 and opts["pull"]["tpot_ms"]["p95"] < 30, opts
    assert doc["answers"]["q2"]["pays_share"] == 1.0


@pytest.mark.anyio
async def test_engine_tpot_is_the_cost_models_whatever_the_clock() -> None:
    """At 500× real time the client's clock sees Python overhead, not decode steps; the engine's TPOT is still the
    cost model's decode step, since DecodeTimes counts each step's modelled duration and nothing else."""
    import httpx
    from kvtether.cli.simstack.decode_times import DecodeTimes
    from kvtether.sim.cluster import ClusterSpec, SimCluster

    spec = ClusterSpec(prefill=0, decode=0, aggregated=1, speed=500)
    times = DecodeTimes()
    async with SimCluster(spec) as cluster:
        node = cluster.nodes[0]
        times.watch(node.engine)
        async with httpx.AsyncClient(timeout=30) as client:
            r = await client.post(f"{node.url}/v1/chat/completions", json={
                "model": spec.model_name, "messages": [{"role": "user", "content": "hello " * 200}],
                "max_tokens": 33, "ignore_eos": True})
        assert r.status_code == 200, r.text
        prompt = r.json()["usage"]["prompt_tokens"]
    [tpot] = times.tpot_ms()
    cost = node.engine.preset.cost
    # 32 decode steps after the first token, alone on the node, over contexts prompt … prompt+31.
    expected = sum(cost.step_seconds([], [prompt + k]) for k in range(32)) * 1000 / 32
    assert tpot == pytest.approx(expected, rel=1e-6)


@pytest.mark.anyio
async def test_assess_reads_a_running_gateway(tmp_path: Path) -> None:
    from kvtether.cli.simstack import StackSpec, sim_stack

    sessions = read_sessions(SMALL)[:2]
    # The gateway's own defaults but for these: the subject is what assess reads of it.
    gateway = {"metrics_poll_interval_s": 0.5, "learn_estimates": False}
    async with sim_stack(StackSpec(preset="toy", speed=20), "pull", gateway=gateway, calibrated=False) as stack:
        run = await run_replay(sessions, stack.url, ReplayOptions(concurrency=2, time_scale=20, model=stack.model))
        assert all(r.ok for r in run.results)
        report = tmp_path / "gw.html"
        doc = await anyio.to_thread.run_sync(lambda: assess(
            str(SMALL), "--limit", "2", "--gateway", stack.url, "--no-simulate", "--report", str(report)))
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


def test_the_simulated_runs_log_to_the_engine_log_not_the_console(tmp_path: Path) -> None:
    """Each option's simulated cluster logs (the gateway every turn, the vLLM nodes their holds' fate); with
    --engine-log FILE all of it goes there, across the runs of every option, and none to the console."""
    sessions, log = tmp_path / "s.jsonl", tmp_path / "engines.log"
    run_cli("gen", "--sessions", "1", "--turns", "2", "--system-tokens", "50", "--new-tokens", "20-40",
            "--output-tokens", "4", "--think-ms", "0", "-o", str(sessions))
    result = CliRunner().invoke(app, ["assess", str(sessions), "--preset", "toy", "--options", "reference,no-pull",
                                      "--no-virtual", "--speed", "50", "--report", str(tmp_path / "r.html"),
                                          "--engine-log", str(log)])
    assert result.exit_code == 0, result.output
    assert "simulating no-pull" in result.stderr  # the console still says what runs
    assert "kvtether.gateway" not in result.stdout + result.stderr
    turns = [line for line in log.read_text().splitlines() if "INFO kvtether.gateway.turn.remember: turn " in line]
    sessions = {line.split(" of ")[1].split(":")[0] for line in turns}
    assert len(sessions) == 2, turns  # one session, replayed once per option (each run's own session id suffix)


def test_attainment_and_goodput_per_option(tmp_path: Path) -> None:
    """Each option's share of turns meeting both objectives (TTFT from the client, TPOT from the engine), and with
    --goodput the open-loop sweep: objectives nothing misses give every option all its turns and the highest rate
    as goodput; a TTFT objective no first token can meet gives none and no goodput."""
    sessions = tmp_path / "s.jsonl"
    run_cli("gen", "--sessions", "3", "--turns", "3", "--system-tokens", "300", "--new-tokens", "20-60",
            "--output-tokens", "8-16", "--think-ms", "200", "--seed", "5", "-o", str(sessions))
    report = tmp_path / "r.html"
    doc = assess(str(sessions), "--preset", "toy", "--options", "no-pull,auto",
                 "--ttft-slo", "600000", "--tpot-slo", "600000", "--goodput", "1,4", "--report", str(report))
    q4 = doc["answers"]["q4"]
    for o in q4["options"].values():
        assert o["attainment"]["turns"] == 9 and o["attainment"]["attainment"] == 1.0, o["attainment"]
    # Each option's modelled gateway process (virtual time): busy, far from saturated at three sessions.
    assert set(q4["gateway_model"]) == {"no-pull", "auto"}
    assert all(0 < g["utilisation"] < 0.7 and g["saturated"] is False for g in q4["gateway_model"].values())
    sweep = {p["policy"]: p for p in q4["goodput"]["policies"]}
    assert set(sweep) == {"no-pull", "auto"}
    assert all([x["rate"] for x in p["levels"]] == [1.0, 4.0] and p["goodput"] == 4.0 for p in sweep.values())
    assert "goodput (open loop" in report.read_text()

    strict = assess(str(sessions), "--preset", "toy", "--options", "no-pull", "--ttft-slo", "0.001",
                    "--goodput", "1")
    opt = strict["answers"]["q4"]["options"]["no-pull"]
    assert opt["attainment"]["attainment"] == 0.0 and opt["attainment"]["met"] == 0
    assert strict["answers"]["q4"]["goodput"]["policies"][0]["goodput"] is None


def test_goodput_needs_rates_and_an_objective(tmp_path: Path) -> None:
    for args in (["--goodput", "0,2"], ["--goodput", "1", "--ttft-slo", "0", "--tpot-slo", "0"]):
        result = CliRunner().invoke(app, ["assess", str(SMALL), *args, "-q"])
        assert result.exit_code == 2, result.output


def test_the_summary_goes_to_stdout_and_with_json_to_stderr(tmp_path: Path) -> None:
    """`assess … > summary.txt`: stdout gets the answers and verdicts; stderr what runs and where the HTML went.
    With --json stdout is the document alone and the summary goes to stderr."""
    argv = ["assess", str(SMALL), "--limit", "1", "--preset", "toy", "--options", "no-pull",
            "--report", str(tmp_path / "r.html")]
    plain = CliRunner().invoke(app, argv)
    assert plain.exit_code == 0, plain.stderr
    assert "verdict:" in plain.stdout and "verdict:" not in plain.stderr
    assert "simulating no-pull" in plain.stderr and f"report: {tmp_path / 'r.html'}" in plain.stderr
    assert "simulating" not in plain.stdout
    as_json = CliRunner().invoke(app, [*argv, "--json"])
    assert as_json.exit_code == 0, as_json.stderr
    assert json.loads(as_json.stdout)["schema"] == "kvtether.assess/1"
    assert "verdict:" in as_json.stderr


def test_an_option_whose_modelled_gateway_saturated_is_named_in_the_notes(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A saturated gateway's queue is in every turn's TTFT, so the verdict would judge the topology with a gateway
    process too few: the report says so. (Three sessions cannot saturate it; the run's model is marked so.)"""
    from kvtether.cli.assess import answers

    real_run = answers._run

    def saturated(*args: object, **kwargs: object) -> object:
        run = real_run(*args, **kwargs)
        if run.replay.gateway_model is not None and args[2] == "auto":
            run.replay.gateway_model = {**run.replay.gateway_model, "utilisation": 0.93, "saturated": True}
        return run

    monkeypatch.setattr(answers, "_run", saturated)
    sessions = tmp_path / "s.jsonl"
    run_cli("gen", "--sessions", "2", "--turns", "2", "--system-tokens", "300", "--new-tokens", "20-60",
            "--output-tokens", "8-16", "--think-ms", "200", "--seed", "5", "-o", str(sessions))
    doc = assess(str(sessions), "--preset", "toy", "--options", "no-pull,auto")
    assert doc["answers"]["q4"]["gateway_model"]["auto"]["saturated"] is True
    assert [n for n in doc["notes"] if "gateway" in n] == [
        "auto: the modelled gateway process was 93% busy (saturated): its queue is in these turns' TTFT; a "
        "deployment at this rate needs more gateway workers"]
