"""``kvtether replay``: replay session files against a gateway or an in-process simulated cluster.

The command checks its flags (a usage error exits 2 before anything is read), loads the sessions, runs them once
per policy and rate (``runs.py``), then judges and renders the runs (``outcome.py``). Exit codes
(common/exits.py, docs/replay.md): 0 ok; 1 run failed (unreachable gateway, error rate above
``--max-error-rate``); 2 usage error (bad flags, malformed file, unknown preset); 3 SLO missed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import typer
from kvtether.cli.common.document import report_console
from kvtether.cli.common.exits import EXIT_USAGE
from kvtether.cli.common.failures import fail
from kvtether.cli.common.options import FLAG
from kvtether.cli.common.sessions import SESSION_FORMAT, load_sessions_or_fail
from kvtether.cli.gen.importers import FORMATS
from kvtether.cli.replay.engine import ARRIVALS, ReplayOptions, parse_think_time
from kvtether.cli.replay.history import DEFAULT_HISTORY, HISTORY_MODES
from kvtether.cli.replay.outcome import judge, render, write_document
from kvtether.cli.replay.plan import DEFAULT_COMPARE, KNOWN_POLICIES, ReplayFlags, ReplayPlan
from kvtether.cli.replay.report import parse_objectives, parse_rates, parse_slo
from kvtether.cli.replay.runs import run_jobs
from kvtether.cli.replay.sim import SimTarget
from kvtether.cli.simstack import DEFAULT_PREFILL_PREFIX_CACHING
from rich.console import Console

# The command's arguments and options, in the order of its help.
# Two arguments, so that the usage line reads FILE [POLICY]...; _split_args then sorts the words as before (a
# policy may come first, or be a comma-separated list).
_FILE = typer.Argument(..., metavar="FILE", help="Session file (or --format's input file).")
_POLICIES = typer.Argument(
    None, metavar="POLICY",
    help=f"With --compare: the policies to compare ({', '.join(KNOWN_POLICIES)}; default: "
    f"{' '.join(DEFAULT_COMPARE)}).")
_GATEWAY = typer.Option(None, "--gateway", metavar="URL", help="Replay against this gateway.")
_SIM = typer.Option(None, "--sim", metavar="PRESET", help="Start an in-process simulated cluster + gateway (e.g. toy).")
_COMPARE = typer.Option(
    False, "--compare/--no-compare", metavar=FLAG,
    help="Run the sessions once per policy, each on a fresh cluster (needs --sim); policies follow FILE (default: "
    "no-pull reference auto).")
_POLICY = typer.Option("auto", "--policy", help="Gateway policy for a single --sim run.")
_PREFILL = typer.Option(1, "--prefill", min=1, help="--sim: prefill nodes.")
_DECODE = typer.Option(2, "--decode", min=1, help="--sim: decode nodes.")
_SPEED = typer.Option(
    1.0, "--speed", min=0.001, help="--sim: simulated time = real time × speed; reported numbers are simulated.")
_VIRTUAL = typer.Option(
    False, "--virtual/--no-virtual", metavar=FLAG,
    help="--sim: run the cluster, the gateway and the clients on one virtual clock (exact, repeatable figures, as "
    "fast as the CPU allows; the gateway's own CPU is modelled). --no-virtual (default): the wall clock × --speed.")
_STREAM_INTERVAL = typer.Option(
    1, "--stream-interval", min=1,
    help="--sim: the nodes' vLLM --stream-interval (a chunk every N tokens; the same token times, a fraction of "
    "the chunks to relay: for long replays).")
_FORMAT = typer.Option(
    SESSION_FORMAT, "--format", help=f"Input format: session, {', '.join(FORMATS)} (imported on the fly).")
_CONCURRENCY = typer.Option(8, "--concurrency", "-c", min=1, help="Sessions in flight (--arrivals closed).")
_ARRIVALS = typer.Option(
    "closed", "--arrivals",
    help="closed: --concurrency sessions at a time; trace: open loop, each session starts at its "
    "metadata.start_offset_ms (0 without one), whatever the others do.")
_RATE = typer.Option(1.0, "--rate", min=0.001, help="--arrivals trace: start offsets ÷ this (think times unchanged).")
_OBJECTIVE = typer.Option(
    None, "--objective", help="Per-turn objective, ttft=MS or tpot=MS; repeatable; reports SLO attainment.")
_GOODPUT = typer.Option(
    None, "--goodput", metavar="RATES",
    help="e.g. 0.5,1,2,4: replay open loop at each --rate, report attainment per rate and goodput (the highest rate "
    "at which 90 % of turns meet every --objective).")
_THINK_TIME = typer.Option(
    "recorded", "--think-time", help="recorded | none | scale:F | fixed:MS (between an answer and the next turn).")
_MAX_THINK_MS = typer.Option(None, "--max-think-ms", min=0, help="Cap on one think time.")
_HISTORY = typer.Option(
    DEFAULT_HISTORY, "--history",
    help="live: each turn resends the answers received in this replay, as the agent would; recorded: the file's "
    "answers (identical prompts across runs, e.g. to replay the cluster that recorded them).")
_PREFILL_PREFIX_CACHING = typer.Option(
    DEFAULT_PREFILL_PREFIX_CACHING, "--prefill-prefix-caching/--no-prefill-prefix-caching", metavar=FLAG,
    help="--sim: prefix caching on the prefill nodes (default off, as in vLLM's P/D benchmarks: a P shared by a "
    "whole cluster's sessions rarely still holds one's history).")
_MODEL = typer.Option(None, "--model", help="Override the sessions' model name.")
_LIMIT = typer.Option(None, "--limit", min=1, help="Replay only the first N sessions.")
_TIMEOUT = typer.Option(600.0, "--timeout", min=0.001, help="Per-request timeout, seconds.")
_SLO = typer.Option(
    None, "--slo", help="e.g. ttft_p95=500 (ms) or error_rate=0.01; repeatable; exit 3 when missed.")
_MAX_ERROR_RATE = typer.Option(
    0.0, "--max-error-rate", min=0.0, max=1.0, help="Exit 1 when the error rate of a run is above this.")
_KEEP_SESSION_IDS = typer.Option(
    False, "--keep-session-ids/--no-keep-session-ids", metavar=FLAG,
    help="Send the recorded session ids (default: add a per-run suffix).")
_JSON = typer.Option(
    False, "--json/--no-json", metavar=FLAG,
    help="Write the full result (incl. every request) to stdout; the report then goes to stderr.")
_PROGRESS = typer.Option(
    True, "--progress/--no-progress", metavar=FLAG, help="A progress bar on stderr (only when stderr is a terminal).")
_QUIET = typer.Option(
    False, "--quiet/--no-quiet", "-q", metavar=FLAG,
    help="No report and no notes (errors only). The report goes to stdout, or to stderr with --json.")
_ENGINE_LOG = typer.Option(
    None, "--engine-log", metavar="FILE",
    help="--sim: write the simulated cluster's logs (vLLM nodes, in-process gateway) to FILE, - for stderr (default: "
    "dropped, errors still shown).")


def replay(
    file: str = _FILE, policies_given: list[str] | None = _POLICIES, gateway: str | None = _GATEWAY,
    sim: str | None = _SIM, compare: bool = _COMPARE, policy: str = _POLICY, prefill: int = _PREFILL,
    decode: int = _DECODE, speed: float = _SPEED, virtual: bool = _VIRTUAL,
    stream_interval: int = _STREAM_INTERVAL, input_format: str = _FORMAT,
    concurrency: int = _CONCURRENCY,
    arrivals: str = _ARRIVALS, rate: float = _RATE, objective: list[str] | None = _OBJECTIVE,
    goodput_rates: str | None = _GOODPUT, think_time: str = _THINK_TIME, max_think_ms: float | None = _MAX_THINK_MS,
    history: str = _HISTORY, prefill_prefix_caching: bool = _PREFILL_PREFIX_CACHING, model: str | None = _MODEL,
    limit: int | None = _LIMIT, timeout: float = _TIMEOUT, slo: list[str] | None = _SLO,
    max_error_rate: float = _MAX_ERROR_RATE, keep_session_ids: bool = _KEEP_SESSION_IDS, as_json: bool = _JSON,
    progress: bool = _PROGRESS, quiet: bool = _QUIET, engine_log: str | None = _ENGINE_LOG,
) -> None:
    """Replay recorded agent sessions and report TTFT per turn index, TTFC, TPOT, E2E, reuse and errors."""
    flags = ReplayFlags(**locals())  # first: the parameters are all the locals there are yet
    err = Console(stderr=True)
    plan = check(err, flags)
    sessions = load_sessions_or_fail(err, plan.path, flags.input_format, flags.model, flags.limit)
    runs, started = run_jobs(err, plan, sessions)
    outcome = judge(plan, runs, len(sessions))
    render(err, report_console(err, flags.as_json), plan, runs, outcome)
    if flags.as_json:
        write_document(plan, sessions, runs, outcome, started)
    raise typer.Exit(outcome.code)


def register(app: typer.Typer) -> None:
    app.command("replay")(replay)


# -- check: the flags, before anything is read ------------------------------------------------------------------


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


@dataclass(frozen=True, slots=True)
class _Words:
    """The positional words sorted out: the one session file, and the policies given after it."""

    file: str
    policies: list[str]


def _check_words(err: Console, f: ReplayFlags) -> _Words:
    files, policies = _split_args([f.file, *(f.policies_given or [])])
    if len(files) != 1:
        fail(err, EXIT_USAGE, f"give exactly one session file (got {', '.join(files) or 'none'})")
    if policies and not f.compare:
        fail(err, EXIT_USAGE, f"policies {' '.join(policies)} given without --compare")
    return _Words(files[0], policies)


def _check_target(err: Console, f: ReplayFlags) -> None:
    """Where to replay, and the choices that must name something known."""
    if (f.gateway is None) == (f.sim is None):
        fail(err, EXIT_USAGE, "give exactly one of --gateway URL or --sim PRESET")
    if f.compare and f.sim is None:
        fail(err, EXIT_USAGE, "--compare needs --sim: an external gateway runs one policy, fixed at its start")
    if f.virtual and f.sim is None:
        fail(err, EXIT_USAGE, "--virtual needs --sim: only a simulated cluster runs on a virtual clock")
    if f.virtual and f.speed != 1.0:
        fail(err, EXIT_USAGE, "--virtual runs at speed 1 (as fast as the CPU allows): --speed is for --no-virtual runs")
    if f.stream_interval != 1 and f.sim is None:
        fail(err, EXIT_USAGE, "--stream-interval needs --sim: a gateway given by URL streams as its vLLM servers do")
    if f.engine_log is not None and f.sim is None:
        fail(err, EXIT_USAGE, "--engine-log needs --sim: a gateway given by URL logs where it runs")
    if f.policy not in KNOWN_POLICIES:
        fail(err, EXIT_USAGE, f"unknown policy {f.policy!r}; known: {', '.join(KNOWN_POLICIES)}")
    if f.history not in HISTORY_MODES:
        fail(err, EXIT_USAGE, f"--history must be live or recorded, not {f.history!r}")
    if f.input_format not in (SESSION_FORMAT, *FORMATS):
        fail(err, EXIT_USAGE, f"--format must be one of session, {', '.join(FORMATS)}")
    if f.arrivals not in ARRIVALS:
        fail(err, EXIT_USAGE, f"--arrivals must be closed or trace, not {f.arrivals!r}")


def _check_preset(err: Console, preset: str | None) -> None:
    if preset is None:
        return
    from kvtether.sim.presets import UnknownPreset, get_preset

    try:
        get_preset(preset)
    except UnknownPreset as e:
        fail(err, EXIT_USAGE, str(e))


def check(err: Console, f: ReplayFlags) -> ReplayPlan:
    """What to run, from the flags; a usage error (exit 2, one line) before anything is read or started."""
    words = _check_words(err, f)
    _check_target(err, f)
    try:
        think = parse_think_time(f.think_time)
        slos = [parse_slo(s) for s in f.slo or []]
        objectives = parse_objectives(f.objective or [])
        rates = parse_rates(f.goodput_rates) if f.goodput_rates is not None else None
    except ValueError as e:
        fail(err, EXIT_USAGE, str(e))
    if rates is not None and not objectives:
        fail(err, EXIT_USAGE, "--goodput needs at least one --objective (ttft=MS, tpot=MS)")
    if f.rate != 1.0 and (f.arrivals != "trace" or rates is not None):
        fail(err, EXIT_USAGE, "--rate needs --arrivals trace (and --goodput sets the rates itself)")
    _check_preset(err, f.sim)
    open_loop = f.arrivals == "trace" or rates is not None
    opts = ReplayOptions(
        concurrency=f.concurrency, think_time=think, history="live" if f.history == "live" else "recorded",
        max_think_ms=f.max_think_ms, timeout_s=f.timeout, model=f.model,
        time_scale=f.speed if f.sim is not None else 1.0, arrivals="trace" if open_loop else "closed", rate=f.rate)
    target = (SimTarget(preset=f.sim, prefill=f.prefill, decode=f.decode, speed=f.speed,
                        prefill_prefix_caching=f.prefill_prefix_caching, virtual=f.virtual,
                        stream_interval=f.stream_interval)
              if f.sim is not None else None)
    policies = (words.policies or list(DEFAULT_COMPARE)) if f.compare else [f.policy]
    return ReplayPlan(flags=f, path=Path(words.file), target=target, opts=opts, policies=policies, rates=rates,
                      objectives=objectives, slos=slos)
