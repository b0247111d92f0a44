"""``kvtether demo``: one real run (quick, traced) as a user would start it, and its output parsed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from kvtether.cli.cmd_demo import comparable, demo_sessions

# One row of the side-by-side table:
# session │ turn │ prompt │ no pull │ reverse pull │ kvtether │ speed-up │ source │ reused.
ROW = re.compile(
    r"│\s*(agent-\d+)\s*│\s*(\d+)\s*│\s*(\d+)\s*│\s*([\d,]+)\s*│\s*([\d,]+)\s*│\s*([\d,]+)\s*│\s*([\d.]+)×\s*│"
    r"\s*(\w+)\s*│\s*(\d+)\s*│"
)
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
    assert "TTFT no pull" in out and "TTFT reverse pull" in out and "TTFT kvtether" in out and "simulated ms" in out
    rows = [m.groups() for m in ROW.finditer(out.partition("Where each turn's TTFT went")[0])]
    assert [int(r[1]) for r in rows] == [0, 1, 2, 3, 4], out
    for _sid, turn, prompt, base, pulled, ours, x, source, reused in rows:
        base_ms, ours_ms = float(base.replace(",", "")), float(ours.replace(",", ""))
        assert base_ms > 0 and ours_ms > 0 and float(pulled.replace(",", "")) > 0 and int(prompt) > 2000
        assert abs(float(x) - base_ms / ours_ms) < 0.05 * float(x) + 0.02  # the speed-up is the ratio shown
        assert source in SOURCES
        if int(turn) > 0:
            # Later turns reuse the session's history from somewhere: the pinned decode node, or P's cache.
            assert source != "none" and int(reused) > 0
    assert re.search(r"Median TTFT speed-up on late turns \(turn ≥ 3\): [\d.]+×", out)
    assert re.search(r"Median TTFT speed-up of the reverse pull alone on late turns \(turn ≥ 3\): [\d.]+×", out)
    assert re.search(r"Correctness: answers identical in 5/5 turns between no-pull and pull and auto — OK", out)
    _, _, trace = out.partition("Where each turn's TTFT went")
    assert trace, out
    timeline = [m.groups() for m in TRACE_ROW.finditer(trace)]
    assert [int(t[1]) for t in timeline] == [0, 1, 2, 3, 4], out
    assert all(t[3] in {"tokenize", "guard", "plan", "prefill", "decode", "gateway"} for t in timeline)
