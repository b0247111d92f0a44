"""``kvtether demo``: the reverse KV pull, end to end, in one command and without a GPU.

Starts an in-process simulated P/D cluster (1 prefill + 2 decode of a realistic preset), the gateway in
front of it, and runs a small bundled set of agent sessions through the SDK three times: with the gateway
policy ``no-pull`` (every turn recomputes its history on prefill), with ``pull`` (vLLM's reverse pull: P
pulls the verified history back from the decode node and computes only the suffix), and with ``auto``
(kvtether's per-turn cost-based choice between the suffix on the pinned decode node, the pull, and a cold
prefill). Each run gets a fresh cluster, so none sees another's caches. Prints one row per turn with the
three TTFTs side by side.

Times are *simulated* milliseconds: the simulator's clock runs at ``--speed`` × real time, and every
client-side measurement is multiplied by it. A clock slower than real time (speed < 1) makes the
simulator's own CPU work (HTTP hops, tokenizing, JSON) a small share of what it reports.
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import anyio
import typer
from kvtether.cli.common.options import FLAG
from kvtether.cli.common.signals import stop_signals_interrupt
from kvtether.cli.gen.generate import GenParams, generate_sessions
from kvtether.gateway import telemetry as T
from kvtether.sdk.sessionfile import SessionRecord
from rich import box
from rich.console import Console
from rich.table import Table

DEMO_PRESET = "qwen3-32b-h200-tp8"
# Simulated time = real × speed, so a clock slower than real time shrinks the simulator's own CPU cost: at 0.25
# the 20-40 ms of real CPU per turn (client, two HTTP hops through the gateway, tokenizing a few thousand words,
# JSON) shows up as 5-10 simulated ms next to TTFTs of 40-400 ms. The price is wall time: the full demo
# (2 runs × 3 sessions × 10 turns) takes about a minute on 2 idle cores (1.5 min at load 9 on 2 cores).
DEFAULT_SPEED = 0.25
# The engine's retention of a finished request's KV on D (decoder_kv_blocks_ttl, simulated seconds), and the
# gateway's session TTL kept below it with the same margin as the gateway's defaults (450 s < 480 s).
ENGINE_KV_TTL_SIM_S = 480.0
SESSION_TTL_SIM_S = 450.0
# Replies are text (TOOL_CHOICE); 16 tokens keep the decode time, which no KV reuse changes, short.
MAX_TOKENS = 16
# The simulator, like a non-streaming tool parser, holds a tool call back until it is complete: a tool-call
# turn's TTFT would then be the whole call's decode time, which no KV reuse changes. "none" keeps the tools in
# the prompt (the agent's real prefix) and makes TTFT about the prompt; the answers are the model's replies.
TOOL_CHOICE = "none"
# Turns from this index on count as "late" in the summary: the history is long by then.
LATE_TURN = 3

# A pull that costs at least this share of recomputing the history saves "about nothing" in the demo's summary.
PULL_ABOUT_RECOMPUTE = 0.7

POLICY_BASELINE = "no-pull"
POLICY_PULL = "pull"
POLICY_KVTETHER = "auto"



def demo_sessions(quick: bool = False) -> list[SessionRecord]:
    """The bundled agent sessions: deterministic (fixed seed), a coding agent's tool loop.

    A 1.2k-token system prompt plus tools, then tool results of 250-600 tokens per turn: the history grows to
    ~5-6k tokens by the last turn. Answers are the model's own (a tool call or a short reply, then eos; not
    pinned to max_tokens): a cut-off tool call would stream no visible token at all.
    """
    records = generate_sessions(GenParams(
        sessions=1 if quick else 3,
        turns=5 if quick else 10,
        new_tokens="250-600",
        output_tokens=str(MAX_TOKENS),
        pin_output=False,
        think_ms=0.0,
        user_message_prob=0.2,
        system_tokens=1200,
        task_tokens=80,
        seed=7,
        id_prefix="demo",
    ))
    # Short ids for the tables (the generator's are seed-qualified, for files that get merged).
    return [dataclasses.replace(r, session_id=f"agent-{i + 1}") for i, r in enumerate(records)]


@dataclass(slots=True)
class DemoTurn:
    session_id: str
    turn: int
    ok: bool
    prompt_tokens: int | None = None
    ttft_ms: float | None = None  # simulated
    source: str | None = None
    reuse_tokens: int | None = None
    plan: str | None = None
    answer: dict[str, Any] | None = None
    error: str | None = None


@dataclass(slots=True)
class DemoRun:
    policy: str
    turns: list[DemoTurn] = field(default_factory=list)
    wall_s: float = 0.0
    spans: list[Any] = field(default_factory=list)  # ReadableSpan, when traced


@asynccontextmanager
async def demo_gateway(policy: str, speed: float, preset: str, tracer_provider: Any = None,
                       prefill_cache: bool = False) -> AsyncIterator[str]:
    """A fresh simulated 1P+2D cluster and an in-process gateway; yields the gateway URL."""
    from kvtether.gateway.config import GatewayConfig
    from kvtether.gateway.shell.app import create_app
    from kvtether.gateway.shell.server import serve_gateway
    from kvtether.sim.cluster import ClusterSpec, SimCluster

    spec = ClusterSpec(prefill=1, decode=2, preset=preset, speed=speed, decoder_kv_blocks_ttl=ENGINE_KV_TTL_SIM_S,
                       # As in the vLLM blog's bidirectional-transfer runs: P recomputes what it does not pull.
                       # With it on, one prefill node serving three sessions in turn keeps every history cached,
                       # which a loaded cluster (many sessions, several P nodes) does not.
                       prefill_prefix_caching=prefill_cache)
    async with SimCluster(spec) as cluster:
        # The gateway's clock is real time, the engine's is simulated: the same TTLs in real seconds.
        config = GatewayConfig(prefill=list(cluster.prefill_urls), decode=list(cluster.decode_urls), policy=policy,
                               session_ttl_s=SESSION_TTL_SIM_S / speed, engine_kv_ttl_s=ENGINE_KV_TTL_SIM_S / speed,
                               sweep_interval_s=max(1.0, 10.0 / speed))
        app = create_app(config.validate(), tracer_provider=tracer_provider)
        stopped: BaseException | None = None
        async with serve_gateway(config, app=app) as url:
            # Ctrl-C and SIGTERM stop the demo, which stops the gateway (serve_gateway leaves signals alone).
            try:
                yield str(url)
            except (asyncio.CancelledError, KeyboardInterrupt) as e:
                # A stop signal: the gateway stops as after a normal run. Handed the cancellation, serve_gateway
                # would cancel the server mid-shutdown, and uvicorn would log its lifespan's traceback.
                stopped = e
        if stopped is not None:
            raise stopped


async def _run_session(url: str, record: SessionRecord, speed: float, emit: Callable[[DemoTurn], None]) -> None:
    from kvtether.sdk import AgentSession, StampedAsyncOpenAI

    live: list[dict[str, Any] | None] = []
    async with AgentSession(session_id=record.session_id) as session:
        client = StampedAsyncOpenAI(session=session, base_url=f"{url}/v1", api_key="kvtether-demo", max_retries=0,
                                    timeout=120.0)
        try:
            for turn, messages, tools in record.requests("live", live):
                res = DemoTurn(record.session_id, turn.index, ok=False)
                extra = {k: v for k, v in turn.params.items() if k != "max_tokens"}
                try:
                    stream = await client.chat.completions.create(
                        model=record.model, messages=cast(Any, messages), tools=cast(Any, tools), stream=True,
                        stream_options={"include_usage": True}, temperature=0, tool_choice=cast(Any, TOOL_CHOICE),
                        max_tokens=turn.params.get("max_tokens"), extra_body=extra)
                    headers = stream.response.headers
                    res.source = headers.get(T.HEADER_REUSE_SOURCE)
                    tokens = headers.get(T.HEADER_REUSE_TOKENS)
                    res.reuse_tokens = int(tokens) if tokens and tokens.isdigit() else None
                    res.plan = headers.get(T.HEADER_PLAN)
                    async with stream:
                        async for _ in stream:
                            pass
                except Exception as exc:  # one failed turn ends its session (its history would be wrong)
                    res.error = f"{type(exc).__name__}: {exc}"[:200]
                    emit(res)
                    return
                m = session.last_turn
                assert m is not None
                res.ok = m.error is None and m.ttft_ms is not None
                res.ttft_ms = m.ttft_ms * speed if m.ttft_ms is not None else None
                res.prompt_tokens = m.prompt_tokens
                res.answer = m.answer
                live.append(m.answer)
                emit(res)
                if not res.ok:
                    return
        finally:
            await client.close()


async def run_policy(policy: str, sessions: list[SessionRecord], *, speed: float = DEFAULT_SPEED,
                     preset: str = DEMO_PRESET, trace: bool = False, prefill_cache: bool = False,
                     on_turn: Callable[[DemoTurn], None] | None = None) -> DemoRun:
    """All sessions, one after the other (a turn's TTFT is then its own, not a neighbour's queueing)."""
    run = DemoRun(policy)
    exporter = provider = None
    if trace:
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))

    def emit(t: DemoTurn) -> None:
        run.turns.append(t)
        if on_turn is not None:
            on_turn(t)

    t0 = time.perf_counter()
    async with demo_gateway(policy, speed, preset, provider, prefill_cache) as url:
        for record in sessions:
            await _run_session(url, record, speed, emit)
    run.wall_s = time.perf_counter() - t0
    if exporter is not None:
        run.spans = list(exporter.get_finished_spans())
    return run


# ---- rendering --------------------------------------------------------------------------------------------


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}"


def comparable(answer: dict[str, Any]) -> dict[str, Any]:
    """What two correct runs must agree on. Tool-call ids are random by design (and not in the prompt)."""
    calls = [(c.get("function", {}).get("name"), c.get("function", {}).get("arguments"))
             for c in answer.get("tool_calls") or []]
    return {"content": answer.get("content") or "", "tool_calls": calls}


def speedup(base: DemoTurn, ours: DemoTurn) -> float | None:
    if base.ttft_ms is None or ours.ttft_ms is None or ours.ttft_ms <= 0:
        return None
    return base.ttft_ms / ours.ttft_ms


def render(console: Console, base: DemoRun, ours: DemoRun, speed: float, preset: str,
           pulled: DemoRun | None = None) -> dict[str, Any]:
    """The side-by-side table and the summary; returns the summary numbers (also used by the tests).

    `pulled` is the reverse-pull run (policy ``pull``), shown between the baseline and kvtether when given."""
    by_key = {(t.session_id, t.turn): t for t in ours.turns}
    pull_by_key = {(t.session_id, t.turn): t for t in pulled.turns} if pulled else {}
    table = turn_table(f"TTFT per turn in simulated ms: {preset}, 1 prefill + 2 decode, clock = real × {speed:g}",
                       pulled=pulled is not None)
    late: list[float] = []
    late_pull: list[float] = []
    all_x: list[float] = []
    first: list[float] = []
    late_ours: list[DemoTurn] = []
    same = differ = 0
    prev_sid = None
    for b in base.turns:
        o = by_key.get((b.session_id, b.turn))
        if o is None:
            continue
        x = speedup(b, o)
        if x is not None:
            all_x.append(x)
            if b.turn >= LATE_TURN:
                late.append(x)
            if b.turn == 0:
                first.append(x)
        if b.turn >= LATE_TURN:
            late_ours.append(o)
        pt = pull_by_key.get((b.session_id, b.turn))
        xp = speedup(b, pt) if pt is not None else None
        if xp is not None and b.turn >= LATE_TURN:
            late_pull.append(xp)
        others = [o] + ([pt] if pt is not None else [])
        if b.answer is not None and all(t.answer is not None for t in others):
            # Every policy must give the baseline's answer: reuse may change the time, never the tokens.
            if all(comparable(b.answer) == comparable(cast(dict[str, Any], t.answer)) for t in others):
                same += 1
            else:
                differ += 1
        if prev_sid is not None and b.session_id != prev_sid:
            table.add_section()
        prev_sid = b.session_id
        xs = "-" if x is None else f"{x:.2f}×"
        style = "green" if x is not None and x >= 1.2 else ("red" if x is not None and x < 0.9 else "")
        pull_cell = [_ms(pt.ttft_ms if pt is not None else None)] if pulled else []
        table.add_row(b.session_id, str(b.turn), str(o.prompt_tokens or b.prompt_tokens or "-"), _ms(b.ttft_ms),
                      *pull_cell, _ms(o.ttft_ms), f"[{style}]{xs}[/]" if style else xs, o.source or "?")
    console.print(table)
    failed = [t for t in (*base.turns, *(pulled.turns if pulled else ()), *ours.turns) if not t.ok]
    compared = same + differ
    summary = {
        "median_speedup_late": statistics.median(late) if late else None,
        "median_speedup_late_pull": statistics.median(late_pull) if late_pull else None,
        "median_speedup_all": statistics.median(all_x) if all_x else None,
        # Turn 0 has nothing to reuse: the same work in both runs. Far from 1×, the machine was busy.
        "median_speedup_first": statistics.median(first) if first else None,
        "answers_identical": same,
        "answers_compared": compared,
        "failed_turns": len(failed),
        "wall_s": {r.policy: round(r.wall_s, 1) for r in (base, pulled, ours) if r is not None},
        "why": why_line(preset, ours.policy, late_ours),
    }
    med = summary["median_speedup_late"]
    med_pull = summary["median_speedup_late_pull"]
    headline = (f"Late turns (turn ≥ {LATE_TURN}): median TTFT "
                + (f"[bold]{med:.2f}×[/] below {base.policy} with {ours.policy} (kvtether)" if med is not None
                   else "n/a")
                + (f", {med_pull:.2f}× with the reverse pull alone" if med_pull is not None else ""))
    console.print(headline + ".")
    if summary["why"]:
        console.print(summary["why"], highlight=False)
    if all_x and first:
        console.print(f"All turns: {summary['median_speedup_all']:.2f}×; first turns, where every run does the same "
                      f"work: {summary['median_speedup_first']:.2f}×.")
    verdict = "[green]OK[/]" if compared and differ == 0 and not failed else "[red]MISMATCH[/]"
    names = " and ".join(r.policy for r in (base, pulled, ours) if r is not None)
    console.print(f"Correctness: answers identical in {same}/{compared} turns between {names} — {verdict}")
    for t in failed:
        console.print(f"[red]failed:[/] {t.session_id} turn {t.turn}: {t.error or 'no token'}")
    return summary


def turn_table(title: str, *, pulled: bool) -> Table:
    """The per-turn table, narrow enough for an 80-column terminal with nothing cut: columns apart by two spaces
    rather than rules, and headers on several lines, so that each column is as wide as its widest value (the KV
    source: `prefill_cache`) and not as its header."""
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAVY, show_edge=False, pad_edge=False,
                  collapse_padding=True)
    table.add_column("session")
    table.add_column("turn", justify="right")
    table.add_column("prompt\ntokens", justify="right")
    table.add_column("TTFT\nno pull", justify="right")
    if pulled:
        table.add_column("TTFT\nreverse\npull", justify="right")
    table.add_column("TTFT\nkvtether", justify="right")
    table.add_column("speed-up", justify="right")
    table.add_column("KV source\n(kvtether)")
    return table


def why_line(preset: str, policy: str, late: list[DemoTurn]) -> str | None:
    """One line on why the kvtether run's late turns were as fast as they were, from the preset's cost model
    (one request alone on a node), for the way most of them took; None when that is neither decode-local nor a
    pull. The history is what those turns reused, the new part the rest of their prompt."""
    from kvtether.sim.presets import UnknownPreset, get_preset

    by_source: dict[str, list[DemoTurn]] = {}
    for t in late:
        if t.ok and t.source and t.reuse_tokens and t.prompt_tokens:
            by_source.setdefault(t.source, []).append(t)
    if not by_source:
        return None
    source, turns = max(by_source.items(), key=lambda kv: len(kv[1]))
    if source not in ("decode_local", "decode_pull"):
        return None
    try:
        p = get_preset(preset)
    except UnknownPreset:
        return None
    cost, hw = p.cost, p.cost.hardware
    history = int(statistics.median(cast(int, t.reuse_tokens) for t in turns))
    new = max(1, int(statistics.median(cast(int, t.prompt_tokens) - cast(int, t.reuse_tokens) for t in turns)))
    transfer = cost.transfer_seconds(history) * 1e3
    recompute = cost.lone_prefill_seconds(history, 0, p.max_num_batched_tokens) * 1e3
    suffix = cost.lone_prefill_seconds(new, history, p.max_num_batched_tokens) * 1e3
    wire = history * cost.model.kv_bytes_per_token / hw.link
    messages = cost.transfer_descriptors(history) * hw.n_gpus / hw.link_message_rate
    bound = "message-rate bound" if messages > wire else "bandwidth bound"
    pull = f"pulling a {history:,}-token history back (≈{transfer:,.0f} ms)"
    if source == "decode_pull":
        return f"Why: on {preset}, {pull} costs less than recomputing it (≈{recompute:,.0f} ms)."
    local = (f"{policy} runs the short new part (~{new:,} tokens, ≈{suffix:,.0f} ms) on the decode node that already "
             "holds the history, which skips both the prefill hop and the transfer")
    if transfer >= PULL_ABOUT_RECOMPUTE * recompute:
        return (f"Why: on {preset}, NIXL's transfer is {bound}, so {pull} costs about what recomputing it does "
                f"(≈{recompute:,.0f} ms); {local}.")
    return f"Why: {pull} beats recomputing it (≈{recompute:,.0f} ms), and {local}."


def register(app: typer.Typer) -> None:
    @app.command("demo")
    def demo(
        quick: bool = typer.Option(False, "--quick/--no-quick", metavar=FLAG,
                                   help="One short session (5 turns) instead of three of ten."),
        speed: float = typer.Option(DEFAULT_SPEED, "--speed", min=0.01, max=100.0,
                                    help="Simulated time = real time × speed; reported times are simulated."),
        preset: str = typer.Option(DEMO_PRESET, "--preset", help="Simulator preset (see `kvtether sim --help`)."),
        trace: bool = typer.Option(False, "--trace/--no-trace", metavar=FLAG,
                                   help="Capture the gateway's spans and print a per-turn phase timeline of the "
                                        "kvtether run."),
        policy: str = typer.Option(POLICY_KVTETHER, "--policy",
                                   help="The kvtether side's gateway policy: auto (cost-based), pull (always pull "
                                        "D's KV back when the guard verifies it) or reference."),
        prefill_cache: bool = typer.Option(False, "--prefill-cache/--no-prefill-cache", metavar=FLAG,
                                           help="Keep prefix caching on the prefill node (off by default, as in "
                                                "the vLLM blog's runs: a busy P rarely still holds a history)."),
    ) -> None:
        """Run bundled agent sessions on a simulated 1P+2D cluster: no pull, reverse pull, and kvtether's choice."""
        console = Console()
        if policy not in ("auto", "pull", "reference"):
            console.print(f"[red]error:[/] --policy must be auto, pull or reference; got {policy!r}")
            raise typer.Exit(2)
        if not console.is_terminal:
            # Piped or captured (CI, tests, README snippets): the turn table fits 80 columns, but the --trace
            # timeline (a column per phase) needs more than rich's default of 80.
            console = Console(width=max(console.width, 120))
        sessions = demo_sessions(quick)
        n_turns = sum(len(s.turns) for s in sessions)
        console.print(f"kvtether demo: {len(sessions)} agent session(s), {n_turns} turns, on a simulated "
                      f"{preset} cluster (1 prefill + 2 decode; prefix caching on P "
                      f"{'on' if prefill_cache else 'off'}), clock = real × {speed:g}. "
                      f"Policies {POLICY_BASELINE} (P recomputes the history)"
                      + (f", {POLICY_PULL} (reverse pull of the verified history)" if policy != POLICY_PULL else "")
                      + f" and {policy} (kvtether), each on a fresh cluster.")
        policies = [POLICY_BASELINE] + ([POLICY_PULL] if policy != POLICY_PULL else []) + [policy]

        async def run_all() -> list[DemoRun]:
            runs = []
            for p in policies:
                with console.status(f"running policy {p} …"):
                    runs.append(await run_policy(p, sessions, speed=speed, preset=preset, trace=trace and p == policy,
                                                 prefill_cache=prefill_cache))
            return runs

        t0 = time.perf_counter()
        # Ctrl-C and SIGTERM abort the demo (exit code 130, typer's for KeyboardInterrupt), also when the process
        # started with SIGINT ignored.
        with stop_signals_interrupt():
            runs = anyio.run(run_all)
        base, ours = runs[0], runs[-1]
        summary = render(console, base, ours, speed, preset, pulled=runs[1] if len(runs) == 3 else None)
        if trace:
            from kvtether.cli.demo.trace_view import render_timeline

            render_timeline(console, ours.spans, speed)
        console.print(f"[dim]wall time {time.perf_counter() - t0:.1f} s[/]")
        if summary["failed_turns"] or summary["answers_identical"] != summary["answers_compared"]:
            raise typer.Exit(1)
