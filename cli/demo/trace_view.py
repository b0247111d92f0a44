"""A terminal view of the gateway's spans: one row per turn, its TTFT split into phases.

Input is finished OpenTelemetry spans (``ReadableSpan``, e.g. from an ``InMemorySpanExporter``). Each turn is
one trace (notes §2.4): the gateway's SERVER span with, as children, ``kvtether.tokenize``,
``kvtether.guard``, ``kvtether.plan`` and the CLIENT ``chat {model}`` legs (``kvtether.leg`` = prefill |
decode). The decode leg counts until its ``first_token`` event; what is left of the TTFT is the gateway's
own time. Durations are real nanoseconds × ``speed`` (the simulator's clock), shown in milliseconds.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtether.gateway import telemetry as T
from rich.console import Console
from rich.table import Table

PHASE_ORDER = ("tokenize", "guard", "plan", "prefill", "decode", "gateway")
PHASE_LABELS = {
    "tokenize": "tokenize",
    "guard": "guard",
    "plan": "plan",
    "prefill": "prefill",
    "decode": "decode",
    "gateway": "gateway",
}
# One colour per phase in the bar (rich colour names); the bar shows where each turn's TTFT went.
PHASE_COLOURS = {"tokenize": "cyan", "guard": "magenta", "plan": "yellow", "prefill": "blue", "decode": "green",
                 "gateway": "white"}
BAR_WIDTH = 14


@dataclass(slots=True)
class TurnPhases:
    trace_id: int
    session: str | None
    turn: int | None
    source: str | None
    plan: str | None
    start_ns: int
    ttft_ms: float | None
    phases: dict[str, float] = field(default_factory=dict)  # ms, simulated
    pulled: bool = False

    @property
    def dominant(self) -> str | None:
        if not self.phases:
            return None
        return max(self.phases, key=lambda k: self.phases[k])


def _attr(span: Any, key: str) -> Any:
    attrs = span.attributes or {}
    return attrs.get(key)


def turn_phases(spans: Iterable[Any], speed: float = 1.0) -> list[TurnPhases]:
    """Group spans by trace and split each turn's TTFT into phases (ms × ``speed``), oldest turn first."""
    by_trace: dict[int, list[Any]] = {}
    for s in spans:
        by_trace.setdefault(s.context.trace_id, []).append(s)
    out: list[TurnPhases] = []
    scale = speed / 1e6
    for trace_id, group in by_trace.items():
        servers = [s for s in group if s.kind == T.KIND_SERVER and s.name.startswith("POST ")]
        if not servers:
            continue
        server = servers[0]
        # TTFT as the client sees it from the gateway: request received (SERVER span start) to the first token
        # event; the orchestrator's own kvtether.ttft_s starts after the body was read and validated.
        first_event = next((e.timestamp for e in server.events if e.name == T.EVENT_FIRST_TOKEN), None)
        ttft_s = ((first_event - server.start_time) / 1e9 if first_event is not None and server.start_time
                  else _attr(server, T.ATTR_TTFT))
        tp = TurnPhases(
            trace_id=trace_id,
            session=_attr(server, T.GEN_AI_CONVERSATION_ID),
            turn=_attr(server, T.ATTR_TURN),
            source=_attr(server, T.ATTR_REUSE_SOURCE),
            plan=_attr(server, T.ATTR_PLAN_ACTION),
            start_ns=server.start_time or 0,
            ttft_ms=ttft_s * speed * 1e3 if isinstance(ttft_s, int | float) else None,
        )
        first_token_ns: int | None = None
        for s in group:
            if s is server or s.start_time is None or s.end_time is None:
                continue
            if s.name == T.SPAN_TOKENIZE:
                key = "tokenize"
            elif s.name == T.SPAN_GUARD:
                key = "guard"
            elif s.name == T.SPAN_PLAN:
                key = "plan"
            elif s.kind == T.KIND_CLIENT and _attr(s, T.ATTR_LEG) == "prefill":
                key = "prefill"
            elif s.kind == T.KIND_CLIENT and _attr(s, T.ATTR_LEG) in ("decode", "aggregated"):
                key = "decode"
                first = next((e.timestamp for e in s.events if e.name == T.EVENT_FIRST_TOKEN), None)
                end = first if first is not None else s.end_time
                first_token_ns = end
                tp.phases[key] = tp.phases.get(key, 0.0) + (end - s.start_time) * scale
                continue
            else:
                continue
            tp.phases[key] = tp.phases.get(key, 0.0) + (s.end_time - s.start_time) * scale
        if tp.ttft_ms is None and first_token_ns is not None:
            tp.ttft_ms = (first_token_ns - tp.start_ns) * scale
        if tp.ttft_ms is not None:
            # Whatever the phases do not cover: parsing, validation, session store, relaying (the gateway's own).
            tp.phases["gateway"] = max(0.0, tp.ttft_ms - sum(tp.phases.values()))
        tp.pulled = tp.source == "decode_pull"
        out.append(tp)
    out.sort(key=lambda t: t.start_ns)
    return out


def _bar(tp: TurnPhases, longest: float) -> str:
    if not tp.ttft_ms or longest <= 0:
        return ""
    width = max(1, round(BAR_WIDTH * tp.ttft_ms / longest))
    parts = []
    used = 0
    for key in PHASE_ORDER:
        v = tp.phases.get(key, 0.0)
        n = round(width * v / tp.ttft_ms) if tp.ttft_ms else 0
        n = min(n, width - used)
        if n > 0:
            parts.append(f"[{PHASE_COLOURS[key]}]{'█' * n}[/]")
            used += n
    return "".join(parts)


SOURCE_SHORT = {"decode_pull": "pull", "prefill_cache": "P cache", "decode_local": "D local", "none": "none"}


def render_timeline(console: Console, spans: Sequence[Any], speed: float = 1.0, title: str | None = None) -> None:
    turns = turn_phases(spans, speed)
    if not turns:
        console.print("[yellow]no gateway spans captured[/]")
        return
    longest = max((t.ttft_ms or 0.0) for t in turns)
    table = Table(title=title or f"Where each turn's TTFT went, from the gateway's spans (ms × {speed:g} = "
                                 "simulated ms; prefill includes the pull, decode runs to the first token)",
                  title_justify="left")
    table.add_column("session")
    table.add_column("turn", justify="right")
    table.add_column("KV")
    table.add_column("TTFT", justify="right")
    for key in PHASE_ORDER:
        table.add_column(PHASE_LABELS[key], justify="right")
    table.add_column("dominant")
    table.add_column("timeline", no_wrap=True, overflow="crop")
    prev = None
    for tp in turns:
        if prev is not None and tp.session != prev:
            table.add_section()
        prev = tp.session
        dom = tp.dominant
        cells = []
        for key in PHASE_ORDER:
            v = tp.phases.get(key)
            text = "-" if v is None else f"{v:,.1f}"
            cells.append(f"[bold]{text}[/]" if key == dom else text)
        label = PHASE_LABELS.get(dom, "-") if dom else "-"
        if dom == "prefill" and tp.pulled:
            label += "+pull"
        table.add_row(tp.session or "-", "-" if tp.turn is None else str(tp.turn),
                      SOURCE_SHORT.get(tp.source or "", tp.source or "-"),
                      "-" if tp.ttft_ms is None else f"{tp.ttft_ms:,.1f}", *cells, label, _bar(tp, longest))
    console.print(table)
    legend = "  ".join(f"[{PHASE_COLOURS[k]}]█[/] {PHASE_LABELS[k]}" for k in PHASE_ORDER)
    console.print(legend)
