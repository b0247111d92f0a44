"""``kvtether demo``: one real run (quick, traced) as a user would start it, and its output parsed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from kvtether.cli.demo.render import comparable, render
from kvtether.cli.demo.run import DemoRun, DemoTurn, demo_sessions
from rich.console import Console

# One row of the side-by-side table (columns apart by spaces):
# session  turn  prompt  no pull  reverse pull  kvtether  speed-up  source.
ROW = re.compile(r"^(agent-\d+) +(\d+) +(\d+) +([\d,]+) +([\d,]+) +([\d,]+) +([\d.]+)× +(\w+) *$", re.M)
# One row of the --trace timeline: session │ turn │ KV │ TTFT │ 6 phases │ dominant │ bar.
TRACE_ROW = re.compile(r"│\s*(agent-\d+)\s*│\s*(\d+)\s*│[^│]*│\s*([\d.,]+)\s*│(?:[^│]*│){6}\s*(\w+)")
SOURCES = {"decode_pull", "prefill_cache", "decode_local", "none"}


def test_bundled_sessions_are_deterministic_and_grow() -> None:
    a, b = demo_sessions(), demo_sessions()
    assert [s.session_id for s in a] == ["agent-1", "agent-2", "agent-3"]
    assert [len(s.turns) for s in a] == [10, 10, 10]
    assert [t.new_messages for s in a for t in s.turns] == [t.new_messages for s in b for t in s.turns]
    # The history grows to several thousand words (≈ tokens) by the last turn.
    last = list(a[0].requests("recorded"))[-1][1]
    assert sum(len(str(m.get("content") or "").split()) for m in last) > 4000
    assert comparable({"content": "x", "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": "{}"}}]}) \
        == comparable({"content": "x", "tool_calls": [{"id": "2", "function": {"name": "f", "arguments": "{}"}}]})


def test_demo_quick_prints_the_side_by_side_table_and_the_correctness_line() -> None:
    exe = Path(sys.executable).with_name("kvtether")
    # speed 1: the test checks what is printed, not the numbers; a faster clock keeps it short.
    proc = subprocess.run([str(exe), "demo", "--quick", "--trace", "--speed", "1"], capture_output=True, text=True,
                          timeout=180, env={**os.environ, "COLUMNS": "160"})
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "no pull" in out and "reverse" in out and "kvtether" in out and "simulated ms" in out
    rows = [m.groups() for m in ROW.finditer(out.partition("Where each turn's TTFT went")[0])]
    assert [int(r[1]) for r in rows] == [0, 1, 2, 3, 4], out
    for _sid, turn, prompt, base, pulled, ours, x, source in rows:
        base_ms, ours_ms = float(base.replace(",", "")), float(ours.replace(",", ""))
        assert base_ms > 0 and ours_ms > 0 and float(pulled.replace(",", "")) > 0 and int(prompt) > 2000
        assert abs(float(x) - base_ms / ours_ms) < 0.05 * float(x) + 0.02  # the speed-up is the ratio shown
        assert source in SOURCES
        if int(turn) > 0:
            # Later turns reuse the session's history from somewhere: the pinned decode node, or P's cache.
            assert source != "none"
    text = " ".join(out.split())  # the summary's lines may wrap
    assert re.search(r"Late turns \(turn ≥ 3\): median TTFT [\d.]+× below no-pull with auto \(kvtether\), [\d.]+× "
                     r"with the reverse pull alone\.", text), out
    # Why auto wins where the pull alone does not, from the preset's cost model, in one line.
    assert re.search(r"Why: on qwen3-32b-h200-tp8, NIXL's transfer is message-rate bound, so pulling a [\d,]+-token "
                     r"history back \(≈[\d,]+ ms\) costs about what recomputing it does \(≈[\d,]+ ms\); auto runs "
                     r"the short new part \(~[\d,]+ tokens, ≈[\d,]+ ms\) on the decode node that already holds the "
                     r"history, which skips both the prefill hop and the transfer\.", text), out
    assert re.search(r"Correctness: answers identical in 5/5 turns between no-pull and pull and auto — OK", out)
    _, _, trace = out.partition("Where each turn's TTFT went")
    assert trace, out
    timeline = [m.groups() for m in TRACE_ROW.finditer(trace)]
    assert [int(t[1]) for t in timeline] == [0, 1, 2, 3, 4], out
    assert all(t[3] in {"tokenize", "guard", "plan", "prefill", "decode", "gateway"} for t in timeline)


def _turn(sid: str, turn: int, ttft: float, source: str | None, prompt: int = 12_345) -> DemoTurn:
    return DemoTurn(sid, turn, ok=True, prompt_tokens=prompt, ttft_ms=ttft, source=source, reuse_tokens=prompt - 600,
                    answer={"content": "ok"})


def test_the_turn_table_fits_80_columns_with_nothing_cut() -> None:
    """The widest values the demo can print (every KV source, five-digit prompts and TTFTs, a two-digit turn and
    speed-up) in an 80-column terminal: no label or value loses its tail to an ellipsis, no line is wider."""
    sources = ["none", "decode_local", "decode_pull", "prefill_cache"]
    sessions = [f"agent-{i}" for i in (1, 2, 3)]
    keys = [(sid, turn) for sid in sessions for turn in range(12)]
    base = DemoRun("no-pull", [_turn(sid, t, 99_999.0, None) for sid, t in keys])
    pulled = DemoRun("pull", [_turn(sid, t, 12_345.0, "decode_pull") for sid, t in keys])
    ours = DemoRun("auto", [_turn(sid, t, 8_100.0, sources[t % 4]) for sid, t in keys])
    console = Console(width=80, record=True, force_terminal=True, color_system=None)
    render(console, base, ours, speed=0.25, preset="qwen3-32b-h200-tp8", pulled=pulled)
    out = console.export_text()
    assert "…" not in out, out
    assert max(len(line) for line in out.splitlines()) <= 80
    table = out[: out.index("Late turns")]
    for label in ("session", "turn", "prompt", "tokens", "TTFT", "no pull", "reverse", "pull", "kvtether",
                  "speed-up", "KV source", "(kvtether)", *sources, *sessions, "99,999", "12,345", "12.35×"):
        assert label in table, label
    rows = ROW.findall(table)
    assert len(rows) == len(keys), table


def test_a_wrong_policy_is_a_usage_error_on_stderr() -> None:
    exe = Path(sys.executable).with_name("kvtether")
    proc = subprocess.run([str(exe), "demo", "--quick", "--policy", "no-pull"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout
    assert "error: --policy must be" in proc.stderr and "'no-pull'" in proc.stderr
