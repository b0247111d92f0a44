"""What ``kvtether demo`` prints: the turns of the three runs side by side, and the summary (the late turns'
median speed-up, why, and whether every run gave the same answers)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, cast

from kvtether.cli.demo.run import LATE_TURN, DemoRun, DemoTurn
from rich import box
from rich.console import Console
from rich.table import Table

# A pull that costs at least this share of recomputing the history saves "about nothing" in the demo's summary.
PULL_ABOUT_RECOMPUTE = 0.7


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


@dataclass(slots=True)
class _Tally:
    """What the summary counts over the turns the runs share: speed-ups (kvtether's and the pull's over the
    baseline), kvtether's late turns, and whether the answers agree."""

    late: list[float] = field(default_factory=list)
    late_pull: list[float] = field(default_factory=list)
    all: list[float] = field(default_factory=list)
    first: list[float] = field(default_factory=list)
    late_ours: list[DemoTurn] = field(default_factory=list)
    same: int = 0
    differ: int = 0

    def add(self, b: DemoTurn, o: DemoTurn, pt: DemoTurn | None) -> float | None:
        """One turn of the baseline `b`, kvtether's `o` and the pull's `pt`; returns kvtether's speed-up."""
        x = speedup(b, o)
        if x is not None:
            self.all.append(x)
            if b.turn >= LATE_TURN:
                self.late.append(x)
            if b.turn == 0:
                self.first.append(x)
        if b.turn >= LATE_TURN:
            self.late_ours.append(o)
        xp = speedup(b, pt) if pt is not None else None
        if xp is not None and b.turn >= LATE_TURN:
            self.late_pull.append(xp)
        others = [o] + ([pt] if pt is not None else [])
        if b.answer is not None and all(t.answer is not None for t in others):
            # Every policy must give the baseline's answer: reuse may change the time, never the tokens.
            if all(comparable(b.answer) == comparable(cast(dict[str, Any], t.answer)) for t in others):
                self.same += 1
            else:
                self.differ += 1
        return x


def _rows(table: Table, base: DemoRun, ours: DemoRun, pulled: DemoRun | None) -> _Tally:
    """One row per turn of the baseline that kvtether's run has too, a section per session."""
    by_key = {(t.session_id, t.turn): t for t in ours.turns}
    pull_by_key = {(t.session_id, t.turn): t for t in pulled.turns} if pulled else {}
    tally = _Tally()
    prev_sid = None
    for b in base.turns:
        o = by_key.get((b.session_id, b.turn))
        if o is None:
            continue
        pt = pull_by_key.get((b.session_id, b.turn))
        x = tally.add(b, o, pt)
        if prev_sid is not None and b.session_id != prev_sid:
            table.add_section()
        prev_sid = b.session_id
        xs = "-" if x is None else f"{x:.2f}×"
        style = "green" if x is not None and x >= 1.2 else ("red" if x is not None and x < 0.9 else "")
        pull_cell = [_ms(pt.ttft_ms if pt is not None else None)] if pulled else []
        table.add_row(b.session_id, str(b.turn), str(o.prompt_tokens or b.prompt_tokens or "-"), _ms(b.ttft_ms),
                      *pull_cell, _ms(o.ttft_ms), f"[{style}]{xs}[/]" if style else xs, o.source or "?")
    return tally


def _print_summary(console: Console, summary: dict[str, Any], runs: list[DemoRun], tally: _Tally,
                   failed: list[DemoTurn]) -> None:
    base, ours = runs[0], runs[-1]
    med = summary["median_speedup_late"]
    med_pull = summary["median_speedup_late_pull"]
    headline = (f"Late turns (turn ≥ {LATE_TURN}): median TTFT "
                + (f"[bold]{med:.2f}×[/] below {base.policy} with {ours.policy} (kvtether)" if med is not None
                   else "n/a")
                + (f", {med_pull:.2f}× with the reverse pull alone" if med_pull is not None else ""))
    console.print(headline + ".")
    if summary["why"]:
        console.print(summary["why"], highlight=False)
    if tally.all and tally.first:
        console.print(f"All turns: {summary['median_speedup_all']:.2f}×; first turns, where every run does the same "
                      f"work: {summary['median_speedup_first']:.2f}×.")
    compared = summary["answers_compared"]
    verdict = "[green]OK[/]" if compared and tally.differ == 0 and not failed else "[red]MISMATCH[/]"
    names = " and ".join(r.policy for r in runs)
    console.print(f"Correctness: answers identical in {tally.same}/{compared} turns between {names} — {verdict}")
    for t in failed:
        console.print(f"[red]failed:[/] {t.session_id} turn {t.turn}: {t.error or 'no token'}")


def render(console: Console, base: DemoRun, ours: DemoRun, speed: float, preset: str,
           pulled: DemoRun | None = None) -> dict[str, Any]:
    """The side-by-side table and the summary; returns the summary numbers (also used by the tests).

    `pulled` is the reverse-pull run (policy ``pull``), shown between the baseline and kvtether when given."""
    table = turn_table(f"TTFT per turn in simulated ms: {preset}, 1 prefill + 2 decode, clock = real × {speed:g}",
                       pulled=pulled is not None)
    tally = _rows(table, base, ours, pulled)
    console.print(table)
    runs = [r for r in (base, pulled, ours) if r is not None]
    failed = [t for r in runs for t in r.turns if not t.ok]
    summary = {
        "median_speedup_late": statistics.median(tally.late) if tally.late else None,
        "median_speedup_late_pull": statistics.median(tally.late_pull) if tally.late_pull else None,
        "median_speedup_all": statistics.median(tally.all) if tally.all else None,
        # Turn 0 has nothing to reuse: the same work in both runs. Far from 1×, the machine was busy.
        "median_speedup_first": statistics.median(tally.first) if tally.first else None,
        "answers_identical": tally.same,
        "answers_compared": tally.same + tally.differ,
        "failed_turns": len(failed),
        "wall_s": {r.policy: round(r.wall_s, 1) for r in runs},
        "why": why_line(preset, ours.policy, tally.late_ours),
    }
    _print_summary(console, summary, runs, tally, failed)
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
