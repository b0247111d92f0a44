"""What `kvtether replay`'s runs come to: each run summarized and judged (objectives, goodput, SLOs, the error
rate allowed), the exit code, the report (tables on stdout, on stderr with ``--json``), why the command fails (on
stderr), and the result document (``--json``, on stdout)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import typer
from kvtether.cli.common.document import document, dumps
from kvtether.cli.common.exits import EXIT_FAILED, EXIT_OK, EXIT_SLO
from kvtether.cli.replay.engine import ReplayRun
from kvtether.cli.replay.history import HISTORY_NOTES
from kvtether.cli.replay.plan import ReplayPlan
from kvtether.cli.replay.report import (
    DEFINITIONS,
    SCHEMA_VERSION,
    attainment,
    check_slos,
    goodput_report,
    render_compare,
    render_goodput,
    render_run,
    render_slos,
    summarize_run,
)
from kvtether.sdk.sessionfile import SessionRecord
from rich.console import Console
from rich.markup import escape


@dataclass(frozen=True, slots=True)
class Outcome:
    summaries: list[dict[str, Any]]  # one per run, in run order
    goodput: dict[str, Any] | None  # --goodput's report
    slo_checks: dict[str, list[dict[str, Any]]]  # by run label
    failed_runs: list[str]  # labels of the runs whose error rate is above --max-error-rate
    slo_missed: bool

    @property
    def code(self) -> int:
        return EXIT_FAILED if self.failed_runs else EXIT_SLO if self.slo_missed else EXIT_OK


def judge(plan: ReplayPlan, runs: Sequence[tuple[str, ReplayRun]], sessions: int) -> Outcome:
    summaries = [summarize_run(label, run, sessions) for label, run in runs]
    if plan.objectives:
        for s, (_, run) in zip(summaries, runs, strict=True):
            s["attainment"] = attainment(run.results, plan.objectives, "engine" if run.engine_tpot else "client")
    goodput = None
    if plan.rates is not None:
        goodput = goodput_report([(p, r, s) for (p, r), s in zip(plan.jobs, summaries, strict=True)])
    slo_checks = {s["label"]: check_slos(s, plan.slos) for s in summaries} if plan.slos else {}
    return Outcome(
        summaries=summaries, goodput=goodput, slo_checks=slo_checks,
        failed_runs=[s["label"] for s in summaries if s["error_rate"] > plan.flags.max_error_rate],
        slo_missed=any(not c["ok"] for checks in slo_checks.values() for c in checks),
    )


def _share(part: float, whole: float) -> str:
    return f"{part / whole:.0%}" if whole else "–"


def render_counters(console: Console, label: str, counters: dict[str, Any]) -> None:
    """One line per simulated run: what became of the handles, and where P's prompt tokens came from."""
    outcomes = counters["handle_outcomes"]
    handles = ", ".join(f"{k} {v}" for k, v in outcomes.items()) or "none"
    p = counters["prompt_tokens_by_source"].get("prefill", {})
    total = sum(p.values())
    computed, cached, pulled = (p.get(k, 0) for k in ("local_compute", "local_cache_hit", "external_kv_transfer"))
    console.print(
        f"  [bold]{escape(label)}[/] cluster: handles: {escape(handles)}; prefill prompt tokens {total:,}: "
        f"computed {_share(computed, total)}, from P's prefix cache {_share(cached, total)}, "
        f"pulled from D {_share(pulled, total)}",
        soft_wrap=True,
        highlight=False,
    )


def _render_tables(out: Console, plan: ReplayPlan, runs: Sequence[tuple[str, ReplayRun]], o: Outcome) -> None:
    if o.goodput is not None:
        render_goodput(out, o.goodput, plan.time_note)
        for s in o.summaries:
            out.print(f"  {escape(s['label'])}: {s['requests']} requests, {s['errors']} errors, "
                      f"{s['skipped']} skipped", highlight=False, soft_wrap=True)
    elif len(o.summaries) == 1:
        render_run(out, o.summaries[0], plan.time_note)
    else:
        render_compare(out, o.summaries, plan.time_note)
    for label, run in runs:
        if run.counters is not None and o.goodput is None:
            render_counters(out, label, run.counters)
    out.print(f"history: {HISTORY_NOTES[plan.opts.history]}", highlight=False, soft_wrap=True)
    if plan.target is not None:
        out.print(f"cluster: {plan.target.describe()}", highlight=False, soft_wrap=True)
    for label, checks in o.slo_checks.items():
        render_slos(out, label, checks)


def render(err: Console, out: Console, plan: ReplayPlan, runs: Sequence[tuple[str, ReplayRun]], o: Outcome) -> None:
    """The report on `out` (unless --quiet), then why the command fails, if it does, on `err`."""
    if not plan.flags.quiet:
        _render_tables(out, plan, runs, o)
    if o.failed_runs:
        err.print(f"[red]run failed:[/] error rate above --max-error-rate {plan.flags.max_error_rate:g} in: "
                  f"{', '.join(o.failed_runs)}")
    elif o.slo_missed:
        err.print("[red]SLO missed[/]")


def _options(plan: ReplayPlan) -> dict[str, Any]:
    f, opts = plan.flags, plan.opts
    return {
        "concurrency": f.concurrency if not plan.open_loop else None,
        "arrivals": opts.arrivals,
        "rate": f.rate if plan.open_loop and plan.rates is None else None,
        "goodput_rates": plan.rates,
        "objectives": {"ttft_ms": plan.objectives.ttft_ms, "tpot_ms": plan.objectives.tpot_ms},
        "think_time": str(opts.think_time),
        "max_think_ms": f.max_think_ms,
        "history": opts.history,
        "model": f.model,
        "timeout_s": f.timeout,
        "max_error_rate": f.max_error_rate,
        "policies": plan.policies if plan.target is not None else None,
    }


def _runs(plan: ReplayPlan, runs: Sequence[tuple[str, ReplayRun]], o: Outcome) -> list[dict[str, Any]]:
    return [
        {
            **s,
            "policy": policy if plan.target is not None else None,
            "rate": rate if plan.open_loop else None,
            **({"cluster": run.counters} if run.counters is not None else {}),
            "turn_results": [r.to_json() for r in run.results],
        }
        for s, (_, run), (policy, rate) in zip(o.summaries, runs, plan.jobs, strict=True)
    ]


def write_document(plan: ReplayPlan, sessions: Sequence[SessionRecord], runs: Sequence[tuple[str, ReplayRun]],
                   o: Outcome, started: str) -> None:
    """The full result, every request included, to stdout (docs/replay.md, *The result document*)."""
    target = plan.target.to_json() if plan.target is not None else {"kind": "gateway", "url": plan.flags.gateway}
    doc = document(
        f"kvtether.replay/{SCHEMA_VERSION}", started, file=str(plan.path), sessions=len(sessions),
        turns=sum(len(s.turns) for s in sessions), target=target, time=plan.time_note, options=_options(plan),
        definitions=DEFINITIONS, runs=_runs(plan, runs, o), goodput=o.goodput, slo=o.slo_checks, exit_code=o.code)
    typer.echo(dumps(doc))
