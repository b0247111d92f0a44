"""``kvtether assess``: answer the adopter's four questions on a user's own traffic (docs/assess.md).

``kvtether assess SESSIONS.jsonl [cluster]`` analyses a session file (the SDK's recording, ``gen``'s or an
imported one) against a cluster described by a simulator preset or its parts, and runs the sessions on the
simulator once per serving option; ``--gateway URL`` adds what a running gateway has counted. stdout gets the
answers (stderr with ``--json``, whose document stdout then carries alone), ``--report`` one self-contained HTML page
with the plots; stderr what runs and the errors.

The command checks its flags, loads what it works from (``inputs.py``), answers (``answers.py``) and hands the
document back (``output.py``). Exit codes (common/exits.py): 0 ok; 1 the gateway is unreachable or a simulated
run failed to start; 2 usage error.
"""

from __future__ import annotations

from pathlib import Path

import typer
from kvtether.cli.assess.answers import answer
from kvtether.cli.assess.cluster import DEFAULT_PRESET, KV_DTYPE_BYTES
from kvtether.cli.assess.inputs import AssessFlags, load
from kvtether.cli.assess.output import assessment, hand_back
from kvtether.cli.assess.topology import OPTIONS
from kvtether.cli.common.document import started_at
from kvtether.cli.common.exits import EXIT_OK, EXIT_USAGE
from kvtether.cli.common.failures import fail
from kvtether.cli.common.options import FLAG
from kvtether.cli.common.sessions import SESSION_FORMAT
from kvtether.cli.gen.importers import FORMATS
from kvtether.cli.replay.report import parse_rates
from kvtether.cli.simstack import DEFAULT_PREFILL_PREFIX_CACHING
from rich.console import Console

KNOWN_OPTIONS = (*OPTIONS, "pull")
# A live run's clock: 2 × real time (--no-virtual).
DEFAULT_SPEED = 2.0

# The command's arguments and options, in the order of its help.
_FILE = typer.Argument(None, metavar="[SESSIONS]", help="Session file (gen, convert, the SDK recorder; or --format's).")
_GATEWAY = typer.Option(None, "--gateway", metavar="URL",
                        help="Also read what this running gateway has seen (/metrics, …).")
_WATCH = typer.Option(0.0, "--watch", min=0.0, metavar="S",
                      help="--gateway: poll /metrics for S seconds (held KV over time).")
_PRESET = typer.Option(DEFAULT_PRESET, "--preset", help="Simulator preset the cluster starts from.")
_PREFILL = typer.Option(None, "--prefill", min=1, help="Prefill nodes (default 1, or the gateway's).")
_DECODE = typer.Option(None, "--decode", min=1, help="Decode nodes (default 1, or the gateway's).")
_LAYERS = typer.Option(None, "--layers", min=1, help="Model layers (replaces the preset's).")
_KV_HEADS = typer.Option(None, "--kv-heads", min=1, help="KV heads.")
_HEAD_DIM = typer.Option(None, "--head-dim", min=1, help="Head dimension.")
_KV_DTYPE = typer.Option(None, "--kv-dtype", help=f"KV cache dtype: {', '.join(KV_DTYPE_BYTES)}.")
_GPUS_PER_NODE = typer.Option(None, "--gpus-per-node", min=1, help="GPUs per node.")
_LINK_GBPS = typer.Option(None, "--link-gbps", min=0.001, help="P↔D link per node, Gb/s.")
_TTL = typer.Option(480.0, "--ttl", min=1.0, help="D's decoder_kv_blocks_ttl, seconds.")
_SESSION_TTL = typer.Option(450.0, "--session-ttl", min=1.0, help="The gateway's session_ttl_s (below --ttl).")
_HELD_KV_BUDGET = typer.Option(0.5, "--held-kv-budget", min=0.01, max=1.0,
                               help="The gateway's held_kv_budget (1 = none).")
_PREFILL_PREFIX_CACHING = typer.Option(
    DEFAULT_PREFILL_PREFIX_CACHING, "--prefill-prefix-caching/--no-prefill-prefix-caching", metavar=FLAG,
    help="Prefix caching on the simulated prefill nodes (default off, as replay's; vLLM's own: on).")
_FORMAT = typer.Option(SESSION_FORMAT, "--format", help=f"session, {', '.join(FORMATS)}.")
_MODEL = typer.Option(None, "--model", help="Model name for imported files.")
_TOKENIZER = typer.Option(None, "--tokenizer", help="HF tokenizer (name or path) for exact token counts.")
_CONCURRENCY = typer.Option(None, "--concurrency", "-c", min=1,
                            help="Sessions in flight (default: all, as recorded together).")
_OPTIONS = typer.Option(",".join(OPTIONS), "--options",
                        help=f"Serving options to simulate, comma-separated ({', '.join(KNOWN_OPTIONS)}).")
_SIMULATE = typer.Option(True, "--simulate/--no-simulate", metavar=FLAG, help="Run question 4 on the simulator.")
_SPEED = typer.Option(DEFAULT_SPEED, "--speed", min=0.01, help="--no-virtual: simulated time = real time × speed.")
_VIRTUAL = typer.Option(
    True, "--virtual/--no-virtual", metavar=FLAG,
    help="Run the simulations on one virtual clock (default: exact, repeatable figures, as fast as the CPU allows, "
    "the gateway's CPU modelled); --no-virtual: on the wall clock × --speed (to watch a run live).")
_THINK_SCALE = typer.Option(1.0, "--think-scale", min=0.0, help="Recorded gaps × this in the runs.")
_MAX_THINK_MS = typer.Option(None, "--max-think-ms", min=0.0, help="Cap one gap in the runs.")
_TPOT_SLO = typer.Option(100.0, "--tpot-slo", min=0.0,
                         help="TPOT objective (ms) a turn must meet to count as attained (the verdict ranks the "
                         "options by that share), and auto holds its decode-local turns to it; 0 = none.")
_TTFT_SLO = typer.Option(2000.0, "--ttft-slo", min=0.0,
                         help="TTFT objective (ms) a turn must meet to count as attained; 0 = none.")
_GOODPUT = typer.Option(None, "--goodput", metavar="RATES",
                        help="e.g. 1,2,4: also run each option open loop at each arrival-rate multiplier and report "
                        "its goodput (the highest rate at which 90 % of turns meet both objectives).")
_LIMIT = typer.Option(None, "--limit", min=1, help="Only the first N sessions.")
_REPORT = typer.Option(None, "--report", metavar="HTML", help="HTML report path (default: SESSIONS.assess.html).")
_JSON = typer.Option(False, "--json/--no-json", metavar=FLAG,
                     help="The whole document to stdout; the summary then goes to stderr.")
_QUIET = typer.Option(False, "--quiet/--no-quiet", "-q", metavar=FLAG,
                      help="No summary and no progress notes (errors only).")
_ENGINE_LOG = typer.Option(
    None, "--engine-log", metavar="FILE",
    help="Write the simulated clusters' logs (vLLM nodes, in-process gateway) to FILE, - for stderr (default: "
    "dropped, errors still shown).")


def assess(
    file: Path | None = _FILE, gateway: str | None = _GATEWAY, watch: float = _WATCH, preset: str = _PRESET,
    prefill: int | None = _PREFILL, decode: int | None = _DECODE, layers: int | None = _LAYERS,
    kv_heads: int | None = _KV_HEADS, head_dim: int | None = _HEAD_DIM, kv_dtype: str | None = _KV_DTYPE,
    gpus_per_node: int | None = _GPUS_PER_NODE, link_gbps: float | None = _LINK_GBPS, ttl: float = _TTL,
    session_ttl: float = _SESSION_TTL, held_kv_budget: float = _HELD_KV_BUDGET,
    prefill_prefix_caching: bool = _PREFILL_PREFIX_CACHING, input_format: str = _FORMAT, model: str | None = _MODEL,
    tokenizer: str | None = _TOKENIZER, concurrency: int | None = _CONCURRENCY, options: str = _OPTIONS,
    simulate: bool = _SIMULATE, speed: float = _SPEED, virtual: bool = _VIRTUAL, think_scale: float = _THINK_SCALE,
    max_think_ms: float | None = _MAX_THINK_MS, tpot_slo: float = _TPOT_SLO, ttft_slo: float = _TTFT_SLO,
    goodput: str | None = _GOODPUT, limit: int | None = _LIMIT,
    report: Path | None = _REPORT, as_json: bool = _JSON, quiet: bool = _QUIET, engine_log: str | None = _ENGINE_LOG,
) -> None:
    """Answer the four adoption questions (prefix share, pull vs recompute, retention, TTFT by topology)."""
    flags = AssessFlags(**locals())  # first: the parameters are all the locals there are yet
    err = Console(stderr=True)
    run_options = check(err, flags)
    inputs = load(err, flags)
    started = started_at()
    answers, time_note = answer(err, flags, run_options, inputs)
    hand_back(err, flags, assessment(flags, inputs, answers, time_note, started))
    raise typer.Exit(EXIT_OK)


def register(app: typer.Typer) -> None:
    app.command("assess")(assess)


def check(err: Console, f: AssessFlags) -> list[str]:
    """The serving options to simulate; a usage error (exit 2, one line) before anything is read."""
    if f.file is None and f.gateway is None:
        fail(err, EXIT_USAGE, "give a session file, --gateway URL, or both")
    if f.input_format not in (SESSION_FORMAT, *FORMATS):
        fail(err, EXIT_USAGE, f"--format must be one of session, {', '.join(FORMATS)}")
    if f.virtual and f.speed != DEFAULT_SPEED:
        fail(err, EXIT_USAGE, "--speed is for --no-virtual runs: a virtual run is exact at any speed")
    run_options = [o.strip() for o in f.options.split(",") if o.strip()]
    bad = [o for o in run_options if o not in KNOWN_OPTIONS]
    if bad or not run_options:
        fail(err, EXIT_USAGE, f"unknown option(s) {', '.join(bad) or '(none)'}; known: {', '.join(KNOWN_OPTIONS)}")
    if f.goodput is not None:
        try:
            parse_rates(f.goodput)
        except ValueError as e:
            fail(err, EXIT_USAGE, str(e))
        if f.ttft_slo <= 0 and f.tpot_slo <= 0:
            fail(err, EXIT_USAGE, "--goodput needs an objective (--ttft-slo or --tpot-slo above 0)")
    return run_options
