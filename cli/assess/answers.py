"""The four answers of `kvtether assess`: questions 1-3 from the sessions' tokens and the cluster's cost model
alone (pure), question 4 from the sessions run on the simulator once per serving option."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from kvtether.cli.assess.analysis import (
    RetentionSetup,
    TurnTiming,
    compare_topologies,
    late_from,
    prefix_share,
    pull_economics,
    retention,
    turn_duration_s,
)
from kvtether.cli.assess.cluster import ClusterShape
from kvtether.cli.assess.inputs import AssessFlags, Inputs
from kvtether.cli.assess.tokens import Encoder, turn_facts
from kvtether.cli.assess.topology import DESCRIPTIONS, OptionRun, RunSettings, run_option_sync, timings
from kvtether.cli.common.exits import EXIT_FAILED, EXIT_USAGE
from kvtether.cli.common.failures import fail
from kvtether.cli.replay.report import Objectives, attainment, goodput_report, parse_rates
from kvtether.cli.simstack.logs import ClusterLogs
from kvtether.gateway.policy.retention import RetentionKnobs
from kvtether.sdk.sessionfile import SessionRecord
from rich.console import Console


def assess_sessions(sessions: list[SessionRecord], shape: ClusterShape, encode: Encoder, concurrency: int,
                    ) -> dict[str, Any]:
    """Answers 1-3 (no simulation): token facts, then the pure analyses."""
    facts = turn_facts(sessions, encode)
    cost, preset = shape.cost, shape.preset
    knobs = RetentionKnobs(budget_share=shape.held_kv_budget)
    setup = RetentionSetup(decode_nodes=shape.decode, kv_capacity_tokens=shape.kv_capacity_tokens,
                           block_size=preset.block_size, decoder_ttl_s=shape.decoder_kv_blocks_ttl_s,
                           session_ttl_s=shape.handle_lifetime_s, concurrency=concurrency, knobs=knobs)
    durations = {(t.session_id, t.index): turn_duration_s(t, cost, preset.max_num_batched_tokens)
                 for s in facts for t in s}
    return {
        "q1": prefix_share(facts),
        "q2": pull_economics(facts, cost, preset.max_num_batched_tokens, shape.min_reuse_tokens),
        "q3": retention(facts, setup, durations),
        "_late": late_from(facts),
    }


def _objectives(f: AssessFlags) -> Objectives:
    return Objectives(f.ttft_slo if f.ttft_slo > 0 else None, f.tpot_slo if f.tpot_slo > 0 else None)


def _run(err: Console, f: AssessFlags, option: str, inputs: Inputs, settings: RunSettings,
         cluster_logs: ClusterLogs) -> OptionRun:
    try:
        with cluster_logs:
            return run_option_sync(option, inputs.sessions, inputs.shape, settings)
    except (OSError, ValueError) as e:
        fail(err, EXIT_FAILED, f"the simulated {option} run failed to start: {e}")


def _sweep(err: Console, f: AssessFlags, options: Sequence[str], inputs: Inputs, settings: RunSettings,
           cluster_logs: ClusterLogs, rates: Sequence[float]) -> dict[str, Any]:
    """The goodput sweep: each option open loop (sessions at their start offsets ÷ rate) at every rate, the
    share of turns meeting both objectives at each, and the highest rate where that share is ≥ 90 %."""
    runs = []
    for option in options:
        for rate in rates:
            if not f.quiet:
                err.print(f"  simulating {option} at ×{rate:g} …", highlight=False)
            run = _run(err, f, option, inputs, replace(settings, arrivals="trace", rate=rate), cluster_logs)
            errors = sum(1 for r in run.replay.results if not r.ok and not r.skipped)
            runs.append((option, rate, {"attainment": attainment(run.replay.results, _objectives(f), "engine"),
                                        "errors": errors, "label": option}))
    return goodput_report(runs)


def _simulate(err: Console, f: AssessFlags, options: Sequence[str], inputs: Inputs, late: int,
              concurrency: int) -> dict[str, Any]:
    """Question 4: one run per option, each on a fresh simulated cluster (exit 1 when one cannot start); with
    --goodput, the sweep after."""
    settings = RunSettings(speed=1.0 if f.virtual else f.speed, virtual=f.virtual, concurrency=concurrency,
                           think_scale=f.think_scale,
                           max_think_ms=f.max_think_ms, tpot_objective_ms=f.tpot_slo if f.tpot_slo > 0 else None,
                           ttft_objective_ms=f.ttft_slo if f.ttft_slo > 0 else None)
    runs: dict[str, list[TurnTiming]] = {}
    tpots: dict[str, list[float]] = {}
    t0 = time.monotonic()
    try:
        cluster_logs = ClusterLogs(f.engine_log)
    except OSError as e:
        fail(err, EXIT_USAGE, f"--engine-log: cannot write {f.engine_log} ({e})")
    attained: dict[str, dict[str, Any]] = {}
    gateways: dict[str, dict[str, Any]] = {}
    for option in options:
        if not f.quiet:
            err.print(f"  simulating {option} …", highlight=False)
        run = _run(err, f, option, inputs, settings, cluster_logs)
        runs[option] = timings(run.replay)
        tpots[option] = run.tpot_ms
        attained[option] = attainment(run.replay.results, _objectives(f), "engine")
        model = run.replay.gateway_model
        if model is not None:
            gateways[option] = {"utilisation": model["utilisation"], "saturated": model["saturated"],
                                "peak_utilisation": model["peak_utilisation"],
                                "queue_p99_ms": model["queue_ms"]["p99"]}
            if model["saturated"]:
                # Its queue is in every turn's TTFT: the option is judged with a gateway process too few.
                inputs.notes.append(
                    f"{option}: the modelled gateway process was {model['utilisation']:.0%} busy (saturated): "
                    "its queue is in these turns' TTFT; a deployment at this rate needs more gateway workers")
    slo = f.tpot_slo if f.tpot_slo > 0 else None
    q4 = compare_topologies(runs, late, slo, {k: DESCRIPTIONS[k] for k in runs}, tpots, attained)
    if gateways:
        q4["gateway_model"] = gateways
    if f.goodput is not None:
        q4["goodput"] = _sweep(err, f, options, inputs, settings, cluster_logs, parse_rates(f.goodput))
    q4["wall_s"] = round(time.monotonic() - t0, 1)
    return q4


def answer(err: Console, f: AssessFlags, options: Sequence[str], inputs: Inputs) -> tuple[dict[str, Any], str]:
    """The answers there are sessions for (none without a session file), and the note on simulated time (empty
    when nothing was simulated). A chat template that refuses a recorded message is a usage error."""
    if not inputs.sessions:
        return {}, ""
    concurrency = f.concurrency or max(1, len(inputs.sessions))
    try:
        answers = assess_sessions(inputs.sessions, inputs.shape, inputs.encode, concurrency)
    except Exception as e:  # a tokenizer's chat template may refuse a recorded message
        fail(err, EXIT_USAGE, f"cannot tokenize the sessions: {type(e).__name__}: {e}")
    late = answers.pop("_late")
    if not f.simulate:
        return answers, ""
    answers["q4"] = _simulate(err, f, options, inputs, late, concurrency)
    shape = inputs.shape
    clock = ("virtual time: exact and repeatable, the gateway's CPU modelled" if f.virtual
             else f"simulated time = real × {f.speed:g}")
    time_note = (f"{clock}; {shape.gpus} GPUs in every option "
                 f"({shape.prefill}P+{shape.decode}D or {shape.nodes} colocated nodes × {shape.gpus_per_node})")
    if not f.virtual and f.speed > 4:
        inputs.notes.append(f"--speed {f.speed:g}: the real overheads of the client, gateway and simulator HTTP layer "
                            "are multiplied too; use 1–4 for latency claims")
    return answers, time_note
