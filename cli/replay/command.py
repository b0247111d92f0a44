"""``kvtether replay``: replay session files against a gateway or an in-process simulated cluster.

Exit codes (docs/replay.md): 0 ok; 1 run failed (unreachable gateway, error rate above
``--max-error-rate``); 2 usage error (bad flags, malformed file, unknown preset); 3 SLO missed.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import anyio
import typer
from kvtether.cli.common.options import FLAG, kvtether_version
from kvtether.cli.gen.importers import FORMATS, ImportFormatError, import_file
from kvtether.cli.replay.engine import (
    ARRIVALS,
    ReplayOptions,
    ReplayRun,
    TurnResult,
    Unreachable,
    check_reachable,
    new_session_suffix,
    parse_think_time,
    run_replay,
)
from kvtether.cli.replay.history import DEFAULT_HISTORY, HISTORY_MODES, HISTORY_NOTES
from kvtether.cli.replay.report import (
    DEFINITIONS,
    SCHEMA_VERSION,
    Slo,
    attainment,
    check_slos,
    goodput_report,
    parse_objectives,
    parse_slo,
    render_compare,
    render_goodput,
    render_run,
    render_slos,
    summarize_run,
)
from kvtether.cli.replay.sim import DEFAULT_PREFILL_PREFIX_CACHING, SimTarget, replay_sim
from kvtether.cli.simstack.logs import ClusterLogs
from kvtether.gateway.config import POLICIES
from kvtether.sdk.sessionfile import History, SessionFileError, SessionRecord, read_sessions
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_SLO = 0, 1, 2, 3

# The gateway's policies; the three of the comparison: no reverse pull, the reference
# proxy's behaviour, and kvtether's own choice.
KNOWN_POLICIES: tuple[str, ...] = POLICIES
DEFAULT_COMPARE: tuple[str, ...] = ("no-pull", "reference", "auto")


def _fail(console: Console, code: int, message: str) -> NoReturn:
    console.print(f"[red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def load_sessions(path: Path, fmt: str, model: str | None) -> list[SessionRecord]:
    """Read a session file (or import another tool's format); raises SessionFileError/ImportFormatError/OSError."""
    if fmt == "session":
        return read_sessions(path)
    return import_file(path, fmt, model=model or "default")


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


def _split_args(args: list[str]) -> tuple[list[str], list[str]]:
    """Separate ``FILE [POLICY ...]``: an argument that names a policy and is not a file is a policy."""
    files, policies = [], []
    for a in args:
        for part in a.split(",") if "," in a and not Path(a).exists() else [a]:
            if part in KNOWN_POLICIES and not Path(part).exists():
                policies.append(part)
            elif part:
                files.append(part)
    return files, policies


def parse_rates(spec: str) -> list[float]:
    """``0.5,1,2,4``: the --goodput rate multipliers, each > 0, in the order given (duplicates dropped)."""
    rates: list[float] = []
    for part in spec.split(","):
        try:
            rate = float(part)
        except ValueError:
            rate = 0.0
        if not rate > 0 or rate == float("inf"):
            raise ValueError(f"bad --goodput {spec!r} (expected rate multipliers > 0, e.g. 0.5,1,2,4)")
        if rate not in rates:
            rates.append(rate)
    return rates


def register(app: typer.Typer) -> None:
    @app.command("replay")
    def replay(
        # Two arguments, so that the usage line reads FILE [POLICY]...; _split_args then sorts the words as
        # before (a policy may come first, or be a comma-separated list).
        file: str = typer.Argument(..., metavar="FILE", help="Session file (or --format's input file)."),
        policies_given: list[str] | None = typer.Argument(
            None, metavar="POLICY",
            help=f"With --compare: the policies to compare ({', '.join(KNOWN_POLICIES)}; default: "
            f"{' '.join(DEFAULT_COMPARE)}).",
        ),
        gateway: str | None = typer.Option(None, "--gateway", metavar="URL", help="Replay against this gateway."),
        sim: str | None = typer.Option(
            None, "--sim", metavar="PRESET", help="Start an in-process simulated cluster + gateway (e.g. toy)."
        ),
        compare: bool = typer.Option(
            False,
            "--compare/--no-compare",
            metavar=FLAG,
            help="Run the sessions once per policy, each on a fresh cluster (needs --sim); policies follow "
            "FILE (default: no-pull reference auto).",
        ),
        policy: str = typer.Option("auto", "--policy", help="Gateway policy for a single --sim run."),
        prefill: int = typer.Option(1, "--prefill", min=1, help="--sim: prefill nodes."),
        decode: int = typer.Option(2, "--decode", min=1, help="--sim: decode nodes."),
        speed: float = typer.Option(
            1.0, "--speed", min=0.001, help="--sim: simulated time = real time × speed; reported numbers are simulated."
        ),
        input_format: str = typer.Option(
            "session", "--format", help=f"Input format: session, {', '.join(FORMATS)} (imported on the fly)."
        ),
        concurrency: int = typer.Option(
            8, "--concurrency", "-c", min=1, help="Sessions in flight (--arrivals closed)."
        ),
        arrivals: str = typer.Option(
            "closed",
            "--arrivals",
            help="closed: --concurrency sessions at a time; trace: open loop, each session starts at its "
            "metadata.start_offset_ms (0 without one), whatever the others do.",
        ),
        rate: float = typer.Option(
            1.0, "--rate", min=0.001, help="--arrivals trace: start offsets ÷ this (think times unchanged)."
        ),
        objective: list[str] | None = typer.Option(
            None, "--objective", help="Per-turn objective, ttft=MS or tpot=MS; repeatable; reports SLO attainment."
        ),
        goodput_rates: str | None = typer.Option(
            None,
            "--goodput",
            metavar="RATES",
            help="e.g. 0.5,1,2,4: replay open loop at each --rate, report attainment per rate and goodput "
            "(the highest rate at which 90 % of turns meet every --objective).",
        ),
        think_time: str = typer.Option(
            "recorded",
            "--think-time",
            help="recorded | none | scale:F | fixed:MS (between an answer and the next turn).",
        ),
        max_think_ms: float | None = typer.Option(None, "--max-think-ms", min=0, help="Cap on one think time."),
        history: str = typer.Option(
            DEFAULT_HISTORY,
            "--history",
            help="live: each turn resends the answers received in this replay, as the agent would; recorded: the "
            "file's answers (identical prompts across runs, e.g. to replay the cluster that recorded them).",
        ),
        prefill_prefix_caching: bool = typer.Option(
            DEFAULT_PREFILL_PREFIX_CACHING,
            "--prefill-prefix-caching/--no-prefill-prefix-caching",
            metavar=FLAG,
            help="--sim: prefix caching on the prefill nodes (default off, as in vLLM's P/D benchmarks: a P shared "
            "by a whole cluster's sessions rarely still holds one's history).",
        ),
        model: str | None = typer.Option(None, "--model", help="Override the sessions' model name."),
        limit: int | None = typer.Option(None, "--limit", min=1, help="Replay only the first N sessions."),
        timeout: float = typer.Option(600.0, "--timeout", min=0.001, help="Per-request timeout, seconds."),
        slo: list[str] | None = typer.Option(
            None, "--slo", help="e.g. ttft_p95=500 (ms) or error_rate=0.01; repeatable; exit 3 when missed."
        ),
        max_error_rate: float = typer.Option(
            0.0, "--max-error-rate", min=0.0, max=1.0, help="Exit 1 when the error rate of a run is above this."
        ),
        keep_session_ids: bool = typer.Option(
            False, "--keep-session-ids/--no-keep-session-ids", metavar=FLAG,
            help="Send the recorded session ids (default: add a per-run suffix)."
        ),
        as_json: bool = typer.Option(False, "--json/--no-json", metavar=FLAG,
                                     help="Write the full result (incl. every request) to stdout."),
        progress: bool = typer.Option(True, "--progress/--no-progress", metavar=FLAG,
                                      help="A progress bar on stderr (only when stderr is a terminal)."),
        quiet: bool = typer.Option(False, "--quiet/--no-quiet", "-q", metavar=FLAG,
                                   help="No tables on stderr (errors only)."),
        engine_log: str | None = typer.Option(
            None, "--engine-log", metavar="FILE",
            help="--sim: write the simulated cluster's logs (vLLM nodes, in-process gateway) to FILE, - for stderr "
            "(default: dropped, errors still shown).",
        ),
    ) -> None:
        """Replay recorded agent sessions and report TTFT per turn index, TTFC, TPOT, E2E, reuse and errors."""
        err = Console(stderr=True)
        files, policies = _split_args([file, *(policies_given or [])])
        if len(files) != 1:
            _fail(err, EXIT_USAGE, f"give exactly one session file (got {', '.join(files) or 'none'})")
        if policies and not compare:
            _fail(err, EXIT_USAGE, f"policies {' '.join(policies)} given without --compare")
        if (gateway is None) == (sim is None):
            _fail(err, EXIT_USAGE, "give exactly one of --gateway URL or --sim PRESET")
        if compare and sim is None:
            _fail(err, EXIT_USAGE, "--compare needs --sim: an external gateway runs one policy, fixed at its start")
        if engine_log is not None and sim is None:
            _fail(err, EXIT_USAGE, "--engine-log needs --sim: a gateway given by URL logs where it runs")
        if policy not in KNOWN_POLICIES:
            _fail(err, EXIT_USAGE, f"unknown policy {policy!r}; known: {', '.join(KNOWN_POLICIES)}")
        if history not in HISTORY_MODES:
            _fail(err, EXIT_USAGE, f"--history must be live or recorded, not {history!r}")
        if input_format not in ("session", *FORMATS):
            _fail(err, EXIT_USAGE, f"--format must be one of session, {', '.join(FORMATS)}")
        if arrivals not in ARRIVALS:
            _fail(err, EXIT_USAGE, f"--arrivals must be closed or trace, not {arrivals!r}")
        try:
            think = parse_think_time(think_time)
            slos: list[Slo] = [parse_slo(s) for s in slo or []]
            objectives = parse_objectives(objective or [])
            rates = parse_rates(goodput_rates) if goodput_rates is not None else None
        except ValueError as e:
            _fail(err, EXIT_USAGE, str(e))
        if rates is not None and not objectives:
            _fail(err, EXIT_USAGE, "--goodput needs at least one --objective (ttft=MS, tpot=MS)")
        if rate != 1.0 and (arrivals != "trace" or rates is not None):
            _fail(err, EXIT_USAGE, "--rate needs --arrivals trace (and --goodput sets the rates itself)")
        open_loop = arrivals == "trace" or rates is not None
        if sim is not None:
            from kvtether.sim.presets import UnknownPreset, get_preset

            try:
                get_preset(sim)
            except UnknownPreset as e:
                _fail(err, EXIT_USAGE, str(e))
        path = Path(files[0])
        try:
            sessions = load_sessions(path, input_format, model)
        except FileNotFoundError:
            _fail(err, EXIT_USAGE, f"{path}: no such file")
        except (SessionFileError, ImportFormatError) as e:
            _fail(err, EXIT_USAGE, f"malformed session file: {e}")
        except (OSError, UnicodeDecodeError) as e:
            _fail(err, EXIT_USAGE, f"{path}: cannot read ({e})")
        if limit is not None:
            sessions = sessions[:limit]
        if not sessions:
            _fail(err, EXIT_USAGE, f"{path}: no sessions")
        run_policies = (policies or list(DEFAULT_COMPARE)) if compare else [policy]
        time_scale = speed if sim is not None else 1.0
        time_note = f"simulated time = real × {speed:g}" if sim is not None else "real time"
        history_mode: History = "live" if history == "live" else "recorded"
        target = (
            SimTarget(
                preset=sim, prefill=prefill, decode=decode, speed=speed, prefill_prefix_caching=prefill_prefix_caching
            )
            if sim is not None
            else None
        )
        opts = ReplayOptions(
            concurrency=concurrency,
            think_time=think,
            history=history_mode,
            max_think_ms=max_think_ms,
            timeout_s=timeout,
            model=model,
            time_scale=time_scale,
            arrivals="trace" if open_loop else "closed",
            rate=rate,
        )
        arrivals_note = (
            "open loop: each session starts at its start_offset_ms "
            + (f"÷ {', '.join(f'{r:g}' for r in rates)} (one run per rate)" if rates is not None else f"÷ {rate:g}")
            if open_loop
            else f"closed loop, {concurrency} sessions at a time"
        )
        # One run per policy, or per policy and rate multiplier for --goodput.
        jobs: list[tuple[str, float]] = [(p, r) for p in run_policies for r in (rates or [rate])]

        def run_label(policy_name: str, job_rate: float) -> str:
            return f"{policy_name} ×{job_rate:g}" if rates is not None else policy_name

        n_turns = sum(len(s.turns) for s in sessions)
        show_progress = progress and not quiet and err.is_terminal
        announced = quiet

        def announce() -> None:
            """Said before the first run (once the gateway answers): both change the numbers more than any policy."""
            nonlocal announced
            if announced:
                return
            announced = True
            err.print(
                f"replaying {len(sessions)} sessions, {n_turns} turns, on "
                + (target.describe() if target is not None else f"the gateway at {gateway}"),
                highlight=False,
                soft_wrap=True,
            )
            err.print(f"history: {HISTORY_NOTES[history_mode]}", highlight=False, soft_wrap=True)
            err.print(f"arrivals: {arrivals_note}", highlight=False, soft_wrap=True)

        async def run_all() -> list[tuple[str, ReplayRun]]:
            out: list[tuple[str, ReplayRun]] = []
            progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("turns · {task.fields[errors]} errors"),
                TimeElapsedColumn(),
                console=err,
                disable=not show_progress,
            )
            with progress:
                for policy_name, job_rate in jobs:
                    label = run_label(policy_name, job_rate)
                    task = progress.add_task(label if sim is not None else gateway or "", total=n_turns, errors=0)
                    errors = 0

                    def tick(r: TurnResult, task: Any = task) -> None:
                        nonlocal errors
                        errors += 0 if r.ok or r.skipped else 1
                        progress.update(task, advance=1, errors=errors)

                    opts.session_suffix = "" if keep_session_ids else new_session_suffix()
                    opts.rate = job_rate
                    out.append((label, await _run_one(policy_name, tick)))
            return out

        async def _run_one(label: str, tick: Callable[[TurnResult], None]) -> ReplayRun:
            if gateway is not None:
                await check_reachable(gateway)
                announce()
                return await run_replay(sessions, gateway, opts, tick)
            assert target is not None
            announce()
            return await replay_sim(sessions, target, label, opts, tick)

        try:
            cluster_logs = ClusterLogs(engine_log)
        except OSError as e:
            _fail(err, EXIT_USAGE, f"--engine-log: cannot write {engine_log} ({e})")
        started = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        try:
            with cluster_logs:
                runs = anyio.run(run_all)
        except Unreachable as e:
            _fail(err, EXIT_FAILED, f"{e}; is the gateway running? (kvtether serve …)")
        except ModuleNotFoundError as e:
            _fail(err, EXIT_FAILED, f"--sim needs the simulator and gateway, not available in this build ({e})")
        except ValueError as e:
            _fail(err, EXIT_USAGE, str(e))

        summaries = [summarize_run(label, run, len(sessions)) for label, run in runs]
        if objectives:
            for s, (_, run) in zip(summaries, runs, strict=True):
                s["attainment"] = attainment(run.results, objectives, "engine" if run.engine_tpot else "client")
        goodput_doc = None
        if rates is not None:
            goodput_doc = goodput_report([(p, r, s) for (p, r), s in zip(jobs, summaries, strict=True)])
        slo_checks = {s["label"]: check_slos(s, slos) for s in summaries} if slos else {}
        failed_runs = [s["label"] for s in summaries if s["error_rate"] > max_error_rate]
        slo_missed = any(not c["ok"] for checks in slo_checks.values() for c in checks)
        code = EXIT_FAILED if failed_runs else EXIT_SLO if slo_missed else EXIT_OK

        if not quiet:
            if goodput_doc is not None:
                render_goodput(err, goodput_doc, time_note)
                for s in summaries:
                    err.print(f"  {escape(s['label'])}: {s['requests']} requests, {s['errors']} errors, "
                              f"{s['skipped']} skipped", highlight=False, soft_wrap=True)
            elif len(summaries) == 1:
                render_run(err, summaries[0], time_note)
            else:
                render_compare(err, summaries, time_note)
            for label, run in runs:
                if run.counters is not None and goodput_doc is None:
                    render_counters(err, label, run.counters)
            err.print(f"history: {HISTORY_NOTES[history_mode]}", highlight=False, soft_wrap=True)
            if target is not None:
                err.print(f"cluster: {target.describe()}", highlight=False, soft_wrap=True)
            for label, checks in slo_checks.items():
                render_slos(err, label, checks)
        if failed_runs:
            err.print(
                f"[red]run failed:[/] error rate above --max-error-rate {max_error_rate:g} in: {', '.join(failed_runs)}"
            )
        elif slo_missed:
            err.print("[red]SLO missed[/]")

        if as_json:
            target_doc: dict[str, Any] = target.to_json() if target is not None else {"kind": "gateway", "url": gateway}
            doc = {
                "schema": f"kvtether.replay/{SCHEMA_VERSION}",
                "kvtether_version": kvtether_version(),
                "command": sys.argv,
                "started_at": started,
                "file": str(path),
                "sessions": len(sessions),
                "turns": n_turns,
                "target": target_doc,
                "time": time_note,
                "options": {
                    "concurrency": concurrency if not open_loop else None,
                    "arrivals": opts.arrivals,
                    "rate": rate if open_loop and rates is None else None,
                    "goodput_rates": rates,
                    "objectives": {"ttft_ms": objectives.ttft_ms, "tpot_ms": objectives.tpot_ms},
                    "think_time": str(think),
                    "max_think_ms": max_think_ms,
                    "history": history_mode,
                    "model": model,
                    "timeout_s": timeout,
                    "max_error_rate": max_error_rate,
                    "policies": run_policies if sim is not None else None,
                },
                "definitions": DEFINITIONS,
                "runs": [
                    {
                        **s,
                        "policy": policy_name if sim is not None else None,
                        "rate": job_rate if open_loop else None,
                        **({"cluster": run.counters} if run.counters is not None else {}),
                        "turn_results": [r.to_json() for r in run.results],
                    }
                    for s, (_, run), (policy_name, job_rate) in zip(summaries, runs, jobs, strict=True)
                ],
                "goodput": goodput_doc,
                "slo": slo_checks,
                "exit_code": code,
            }
            typer.echo(json.dumps(doc, indent=2))
        raise typer.Exit(code)
