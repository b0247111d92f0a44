"""The runs of ``kvtether demo``: the bundled agent sessions through the SDK, once per policy, each on a fresh
simulated stack (cli/simstack), so that none sees another's caches; every turn's TTFT in simulated milliseconds
(the client's clock × ``--speed``)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, cast

from kvtether.cli.gen.generate import GenParams, generate_sessions
from kvtether.cli.simstack import StackSpec, sim_stack
from kvtether.cli.streaming import CHAT, TokenClock, now_ns, reader_for
from kvtether.gateway import telemetry as T
from kvtether.sdk.sessionfile import SessionRecord, TurnRecord

DEMO_PRESET = "qwen3-32b-h200-tp8"
# Simulated time = real × speed, so a clock slower than real time shrinks the simulator's own CPU cost: at 0.25
# the 20-40 ms of real CPU per turn (client, two HTTP hops through the gateway, tokenizing a few thousand words,
# JSON) shows up as 5-10 simulated ms next to TTFTs of 40-400 ms. The price is wall time: the full demo
# (2 runs × 3 sessions × 10 turns) takes about a minute on 2 idle cores (1.5 min at load 9 on 2 cores).
DEFAULT_SPEED = 0.25
# Replies are text (TOOL_CHOICE); 16 tokens keep the decode time, which no KV reuse changes, short.
MAX_TOKENS = 16
# The simulator, like a non-streaming tool parser, holds a tool call back until it is complete: a tool-call
# turn's TTFT would then be the whole call's decode time, which no KV reuse changes. "none" keeps the tools in
# the prompt (the agent's real prefix) and makes TTFT about the prompt; the answers are the model's replies.
TOOL_CHOICE = "none"
# Turns from this index on count as "late" in the summary: the history is long by then.
LATE_TURN = 3


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
    """A fresh simulated 1P+2D stack (cli/simstack) whose gateway runs `policy`; yields the gateway URL. Ctrl-C
    and SIGTERM stop the demo, which stops the gateway (the stack leaves signals alone)."""
    # Prefix caching off on P by default, as in the vLLM blog's bidirectional-transfer runs: P recomputes what it
    # does not pull. With it on, one prefill node serving three sessions in turn keeps every history cached,
    # which a loaded cluster (many sessions, several P nodes) does not.
    spec = StackSpec(preset=preset, prefill=1, decode=2, speed=speed, prefill_prefix_caching=prefill_cache)
    async with sim_stack(spec, policy, tracer_provider=tracer_provider) as stack:
        yield stack.url


async def _turn(client: Any, record: SessionRecord, turn: TurnRecord, messages: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None, speed: float) -> DemoTurn:
    """One turn through the SDK's client, its stream read by the one streaming reader (kvtether.cli.streaming):
    TTFT in simulated ms, the answer as the next turn resends it. A failed request raises."""
    res = DemoTurn(record.session_id, turn.index, ok=False)
    extra = {k: v for k, v in turn.params.items() if k != "max_tokens"}
    clock = TokenClock(t0=now_ns())
    reader = reader_for(CHAT, clock)
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
        async for chunk in stream:
            now = now_ns()  # first: nothing else may sit between arrival and stamp
            clock.event(now)
            reader.read(chunk.to_dict(), now)
    clock.end = now_ns()
    res.ttft_ms = clock.ttft_ms(speed)
    res.ok = reader.error is None and res.ttft_ms is not None
    res.prompt_tokens = reader.prompt_tokens
    res.answer = reader.message()
    return res


async def _run_session(url: str, record: SessionRecord, speed: float, emit: Callable[[DemoTurn], None]) -> None:
    from kvtether.sdk import AgentSession, StampedAsyncOpenAI

    live: list[dict[str, Any] | None] = []
    async with AgentSession(session_id=record.session_id) as session:
        client = StampedAsyncOpenAI(session=session, base_url=f"{url}/v1", api_key="kvtether-demo", max_retries=0,
                                    timeout=120.0)
        try:
            for turn, messages, tools in record.requests("live", live):
                try:
                    res = await _turn(client, record, turn, messages, tools, speed)
                except Exception as exc:  # one failed turn ends its session (its history would be wrong)
                    emit(DemoTurn(record.session_id, turn.index, ok=False, error=f"{type(exc).__name__}: {exc}"[:200]))
                    return
                live.append(res.answer)
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
