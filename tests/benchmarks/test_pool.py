"""`placement_policies.py --pool`: runs made as separate processes are pooled into one verdict.

Single paced runs of the GLM-5 benchmark move the verdict's ratios by ±10 % between processes (docs/placement.md,
"Benchmark"), so verdicts are read off several runs pooled; these tests pin down that the pooling counts every
run's turns once, keeps each run apart for the per-run lines, and fails loudly on a file without turns.
"""

from __future__ import annotations

import json
import pathlib
import types
from typing import Any

import pytest

from tests.support import benchmark_scripts


def _bench() -> types.ModuleType:
    return benchmark_scripts.load("placement_policies")


def _turns(ttft_s: float, tpot_s: float, source: str, n: int = 4) -> list[dict[str, Any]]:
    """`n` late turns (turn 10 on) of one session with the same TTFT and TPOT."""
    return [{"session": 0, "turn": 10 + i, "ttft_s": ttft_s, "tpot_s": tpot_s, "prompt_tokens": 20_000 + i,
             "source": source, "sent_s": 0.0, "first_s": 0.0, "last_s": 0.0, "repeat": 0, "ttfc_s": ttft_s}
            for i in range(n)]


def _run_file(tmp: pathlib.Path, name: str, no_pull: float, reference: float, auto: float, auto_tpot: float) -> str:
    path = tmp / name
    body = {"no-pull": _turns(no_pull, 0.015, "none"), "reference": _turns(reference, 0.015, "decode_pull"),
            "auto": _turns(auto, auto_tpot, "decode_local")}
    # What a run prints: progress and tables, then its turns as the last JSON line.
    path.write_text("### glm-5-fp8-h200-tp8: ...\n| table |\n" + json.dumps(body) + "\n")
    return str(path)


def test_pooling_counts_every_runs_turns_once_and_keeps_the_runs_apart(tmp_path: pathlib.Path) -> None:
    bench = _bench()
    a = _run_file(tmp_path, "seed0.txt", no_pull=1.2, reference=0.3, auto=0.2, auto_tpot=0.018)
    b = _run_file(tmp_path, "seed1.txt", no_pull=0.8, reference=0.3, auto=0.2, auto_tpot=0.015)
    results = bench.pooled([a, b])

    assert sorted(results) == ["auto", "no-pull", "reference"]
    assert [len(r.turns) for r in results.values()] == [8, 8, 8]
    assert sorted({t.repeat for t in results["auto"].turns}) == [0, 1]
    assert results["auto"].options == {"decode_local": 8}
    # Pooled: no-pull's p50 over both runs' turns (four at 0.8, four at 1.2; the helper's nearest rank takes
    # the upper middle) against auto's 0.2.
    pooled = bench.verdict(results, "auto").splitlines()
    assert pooled[0].startswith("auto late-turn p50 TTFT: 6.00× lower than no-pull")
    assert "1.50× lower than reference" in pooled[0]
    assert pooled[2].endswith("+20.0 % (target within 10 %)")  # TPOT p95 of all eight: run one's 0.018
    # Every auto turn was local at 0.2 s: the ceiling against no-pull is the ratio itself.
    assert pooled[3].startswith("auto late decode-local turns' TTFT p50 0.200 s: no-pull's late p50 is 6.00× that")
    assert pooled[3].endswith("8 of 8 were)")
    # Each run on its own: 6× and 4× against no-pull, TPOT +20 % and 0 %.
    per_run = bench.per_repeat(results, "auto").splitlines()
    assert len(per_run) == 2
    assert "6.00× lower than no-pull" in per_run[0] and "+20.0 %" in per_run[0]
    assert "4.00× lower than no-pull" in per_run[1] and "+0.0 %" in per_run[1]


def test_a_file_without_turns_is_refused_by_name(tmp_path: pathlib.Path) -> None:
    bench = _bench()
    empty = tmp_path / "crashed.txt"
    empty.write_text("  glm-5-fp8-h200-tp8 no-pull (repeat 0): 0 turns, 3 errors\n")
    with pytest.raises(SystemExit, match=r"crashed\.txt: no --json line"):
        bench.pooled([str(empty)])
