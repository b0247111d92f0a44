"""``kvtether assess``: answer the adopter's four questions on a user's own traffic (docs/assess.md).

``kvtether assess SESSIONS.jsonl [cluster]`` analyses a session file (the SDK's recording, ``gen``'s or an
imported one) against a cluster described by a simulator preset or its parts, and runs the sessions on the
simulator once per serving option; ``--gateway URL`` adds what a running gateway has counted. The console gets
the answers, ``--report`` one self-contained HTML page with the plots, ``--json`` the whole document on stdout.

Exit codes: 0 ok; 1 the gateway is unreachable or a simulated run failed to start; 2 usage error.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

import anyio
import httpx
import typer
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
from kvtether.cli.assess.cluster import DEFAULT_PRESET, KV_DTYPE_BYTES, ClusterShape, build_shape
from kvtether.cli.assess.gateway import scrape, summarize_gateway
from kvtether.cli.assess.report import render_console, render_html
from kvtether.cli.assess.tokens import Encoder, hf_encoder, sim_encoder, turn_facts
from kvtether.cli.assess.topology import DESCRIPTIONS, OPTIONS, RunSettings, run_option, timings
from kvtether.cli.common.options import FLAG, kvtether_version
from kvtether.cli.gen.importers import FORMATS, ImportFormatError
from kvtether.cli.replay.sim import DEFAULT_PREFILL_PREFIX_CACHING
from kvtether.cli.simstack.logs import ClusterLogs
from kvtether.gateway.policy.retention import RetentionKnobs
from kvtether.sdk.sessionfile import SessionFileError, SessionRecord
from rich.console import Console
from rich.markup import escape

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
SCHEMA = "kvtether.assess/1"
KNOWN_OPTIONS = (*OPTIONS, "pull")


def _fail(console: Console, code: int, message: str) -> NoReturn:
    console.print(f"[red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _load(path: Path, fmt: str, model: str | None) -> list[SessionRecord]:
    # Imported here: cmd_replay pulls in the replay command's own dependencies only when assess runs.
    from kvtether.cli.replay.command import load_sessions

    return load_sessions(path, fmt, model)


def _shape_from_ready(ready: dict[str, Any]) -> tuple[int | None, int | None]:
    nodes = [n for n in ready.get("nodes", []) if isinstance(n, dict)]
    p = sum(1 for n in nodes if n.get("role") == "prefill")
    d = sum(1 for n in nodes if n.get("role") == "decode")
    return (p or None, d or None)


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


def register(app: typer.Typer) -> None:
    @app.command("assess")
    def assess(
        file: Path | None = typer.Argument(None, metavar="[SESSIONS]",
                                           help="Session file (gen, convert, the SDK recorder; or --format's)."),
        gateway: str | None = typer.Option(None, "--gateway", metavar="URL",
                                           help="Also read what this running gateway has seen (/metrics, …)."),
        watch: float = typer.Option(0.0, "--watch", min=0.0, metavar="S",
                                    help="--gateway: poll /metrics for S seconds (held KV over time)."),
        preset: str = typer.Option(DEFAULT_PRESET, "--preset", help="Simulator preset the cluster starts from."),
        prefill: int | None = typer.Option(None, "--prefill", min=1,
                                           help="Prefill nodes (default 1, or the gateway's)."),
        decode: int | None = typer.Option(None, "--decode", min=1, help="Decode nodes (default 1, or the gateway's)."),
        layers: int | None = typer.Option(None, "--layers", min=1, help="Model layers (replaces the preset's)."),
        kv_heads: int | None = typer.Option(None, "--kv-heads", min=1, help="KV heads."),
        head_dim: int | None = typer.Option(None, "--head-dim", min=1, help="Head dimension."),
        kv_dtype: str | None = typer.Option(None, "--kv-dtype", help=f"KV cache dtype: {', '.join(KV_DTYPE_BYTES)}."),
        gpus_per_node: int | None = typer.Option(None, "--gpus-per-node", min=1, help="GPUs per node."),
        link_gbps: float | None = typer.Option(None, "--link-gbps", min=0.001, help="P↔D link per node, Gb/s."),
        ttl: float = typer.Option(480.0, "--ttl", min=1.0, help="D's decoder_kv_blocks_ttl, seconds."),
        session_ttl: float = typer.Option(450.0, "--session-ttl", min=1.0,
                                          help="The gateway's session_ttl_s (below --ttl)."),
        held_kv_budget: float = typer.Option(0.5, "--held-kv-budget", min=0.01, max=1.0,
                                             help="The gateway's held_kv_budget (1 = none)."),
        prefill_prefix_caching: bool = typer.Option(
            DEFAULT_PREFILL_PREFIX_CACHING, "--prefill-prefix-caching/--no-prefill-prefix-caching", metavar=FLAG,
            help="Prefix caching on the simulated prefill nodes (default off, as replay's; vLLM's own: on)."),
        input_format: str = typer.Option("session", "--format", help=f"session, {', '.join(FORMATS)}."),
        model: str | None = typer.Option(None, "--model", help="Model name for imported files."),
        tokenizer: str | None = typer.Option(None, "--tokenizer",
                                             help="HF tokenizer (name or path) for exact token counts."),
        concurrency: int | None = typer.Option(None, "--concurrency", "-c", min=1,
                                               help="Sessions in flight (default: all, as recorded together)."),
        options: str = typer.Option(",".join(OPTIONS), "--options",
                                    help=f"Serving options to simulate, comma-separated ({', '.join(KNOWN_OPTIONS)})."),
        simulate: bool = typer.Option(True, "--simulate/--no-simulate", metavar=FLAG,
                                      help="Run question 4 on the simulator."),
        speed: float = typer.Option(2.0, "--speed", min=0.01, help="Simulated time = real time × speed."),
        think_scale: float = typer.Option(1.0, "--think-scale", min=0.0, help="Recorded gaps × this in the runs."),
        max_think_ms: float | None = typer.Option(None, "--max-think-ms", min=0.0, help="Cap one gap in the runs."),
        tpot_slo: float = typer.Option(100.0, "--tpot-slo", min=0.0,
                                       help="TPOT p95 objective (ms) an option must meet to be best; 0 = none."),
        limit: int | None = typer.Option(None, "--limit", min=1, help="Only the first N sessions."),
        report: Path | None = typer.Option(None, "--report", metavar="HTML",
                                           help="HTML report path (default: SESSIONS.assess.html)."),
        as_json: bool = typer.Option(False, "--json/--no-json", metavar=FLAG, help="The whole document to stdout."),
        quiet: bool = typer.Option(False, "--quiet/--no-quiet", "-q", metavar=FLAG, help="No console summary."),
        engine_log: str | None = typer.Option(
            None, "--engine-log", metavar="FILE",
            help="Write the simulated clusters' logs (vLLM nodes, in-process gateway) to FILE, - for stderr "
            "(default: dropped, errors still shown)."),
    ) -> None:
        """Answer the four adoption questions (prefix share, pull vs recompute, retention, TTFT by topology)."""
        err = Console(stderr=True)
        if file is None and gateway is None:
            _fail(err, EXIT_USAGE, "give a session file, --gateway URL, or both")
        if input_format not in ("session", *FORMATS):
            _fail(err, EXIT_USAGE, f"--format must be one of session, {', '.join(FORMATS)}")
        run_options = [o.strip() for o in options.split(",") if o.strip()]
        bad = [o for o in run_options if o not in KNOWN_OPTIONS]
        if bad or not run_options:
            _fail(err, EXIT_USAGE, f"unknown option(s) {', '.join(bad) or '(none)'}; known: {', '.join(KNOWN_OPTIONS)}")
        notes: list[str] = []

        seen_summary: dict[str, Any] | None = None
        if gateway is not None:
            try:
                seen = anyio.run(lambda: scrape(gateway, watch_s=watch))
            except (httpx.HTTPError, ValueError) as e:
                _fail(err, EXIT_FAILED, f"cannot read the gateway at {gateway} ({type(e).__name__}: {e})")
            seen_summary = summarize_gateway(seen)
            gp, gd = _shape_from_ready(seen.ready)
            prefill = prefill or gp
            decode = decode or gd
        try:
            shape = build_shape(preset, prefill=prefill or 1, decode=decode or 1, layers=layers, kv_heads=kv_heads,
                                head_dim=head_dim, kv_dtype=kv_dtype, gpus_per_node=gpus_per_node,
                                link_gbps=link_gbps, decoder_kv_blocks_ttl_s=ttl, session_ttl_s=session_ttl,
                                held_kv_budget=held_kv_budget if held_kv_budget < 1.0 else None,
                                prefill_prefix_caching=prefill_prefix_caching)
        except (KeyError, ValueError) as e:
            _fail(err, EXIT_USAGE, str(e))
        if shape.session_ttl_s != session_ttl:
            notes.append(f"session TTL {session_ttl:g} s is not below D's TTL {ttl:g} s: "
                         f"used {shape.session_ttl_s:g} s")

        sessions: list[SessionRecord] = []
        if file is not None:
            try:
                sessions = _load(file, input_format, model)
            except FileNotFoundError:
                _fail(err, EXIT_USAGE, f"{file}: no such file")
            except (SessionFileError, ImportFormatError) as e:
                _fail(err, EXIT_USAGE, f"malformed session file: {e}")
            except (OSError, UnicodeDecodeError) as e:
                _fail(err, EXIT_USAGE, f"{file}: cannot read ({e})")
            if limit is not None:
                sessions = sessions[:limit]
            if not sessions:
                _fail(err, EXIT_USAGE, f"{file}: no sessions")

        if tokenizer is not None:
            try:
                encode = hf_encoder(tokenizer)
            except Exception as e:  # transformers raises many kinds (OSError, ValueError, HF hub errors)
                _fail(err, EXIT_USAGE, f"cannot load tokenizer {tokenizer!r}: {type(e).__name__}: {e}")
            token_note = f"{tokenizer} (its tokenizer and chat template)"
        else:
            encode = sim_encoder(shape.preset.tool_call_parser)
            token_note = "the simulator's tokenizer and ChatML template (≈ 1 token per English word)"
        n_conc = concurrency or max(1, len(sessions))
        started = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        answers: dict[str, Any] = {}
        late = 1
        if sessions:
            try:
                got = assess_sessions(sessions, shape, encode, n_conc)
            except Exception as e:  # a tokenizer's chat template may refuse a recorded message
                _fail(err, EXIT_USAGE, f"cannot tokenize the sessions: {type(e).__name__}: {e}")
            late = got.pop("_late")
            answers.update(got)
        time_note = ""
        if sessions and simulate:
            settings = RunSettings(speed=speed, concurrency=n_conc, think_scale=think_scale, max_think_ms=max_think_ms)
            runs: dict[str, list[TurnTiming]] = {}
            tpots: dict[str, list[float]] = {}
            t0 = time.monotonic()
            try:
                cluster_logs = ClusterLogs(engine_log)
            except OSError as e:
                _fail(err, EXIT_USAGE, f"--engine-log: cannot write {engine_log} ({e})")
            for option in run_options:
                if not quiet:
                    err.print(f"  simulating {option} …", highlight=False)
                try:
                    with cluster_logs:
                        run = anyio.run(lambda o=option: run_option(o, sessions, shape, settings))  # type: ignore[misc]
                except (OSError, ValueError) as e:
                    _fail(err, EXIT_FAILED, f"the simulated {option} run failed to start: {e}")
                runs[option] = timings(run.replay)
                tpots[option] = run.tpot_ms
            slo = tpot_slo if tpot_slo > 0 else None
            answers["q4"] = compare_topologies(runs, late, slo, {k: DESCRIPTIONS[k] for k in runs}, tpots)
            answers["q4"]["wall_s"] = round(time.monotonic() - t0, 1)
            time_note = (f"simulated time = real × {speed:g}; {shape.gpus} GPUs in every option "
                         f"({shape.prefill}P+{shape.decode}D or {shape.nodes} colocated nodes × {shape.gpus_per_node})")
            if speed > 4:
                notes.append(f"--speed {speed:g}: the real overheads of the client, gateway and simulator HTTP layer "
                             "are multiplied too; use 1–4 for latency claims")
        if seen_summary is not None and seen_summary.get("policy") and not sessions:
            notes.append("no session file given: questions 1, 2 and 4 need the recording of the traffic "
                         "(AgentSession(record_to=…)); only the gateway's counters are shown")
        doc: dict[str, Any] = {
            "schema": SCHEMA,
            "kvtether_version": kvtether_version(),
            "command": sys.argv,
            "started_at": started,
            "source": str(file) if file is not None else f"gateway {gateway}",
            "sessions": len(sessions),
            "turns": sum(len(s.turns) for s in sessions),
            "tokenizer": token_note,
            "cluster": shape.describe(),
            "time_note": time_note,
            "answers": answers,
            "notes": notes,
        }
        if seen_summary is not None:
            doc["gateway"] = seen_summary
        path = report or (file.with_suffix(".assess.html") if file is not None else Path("kvtether-assess.html"))
        try:
            path.write_text(render_html(doc), encoding="utf-8")
        except OSError as e:
            _fail(err, EXIT_FAILED, f"cannot write the report {path}: {e}")
        doc["report"] = str(path)
        if not quiet:
            render_console(err, doc)
            err.print(f"report: {escape(str(path))}", highlight=False)
        if as_json:
            typer.echo(json.dumps(_finite(doc), indent=2))
        raise typer.Exit(EXIT_OK)


def _finite(o: Any) -> Any:
    """Strict JSON: an infinite break-even (no link is fast enough) becomes null."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, list | tuple):
        return [_finite(v) for v in o]
    return o
