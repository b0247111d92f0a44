"""Percentile maths against values worked out by hand (numpy's default linear interpolation)."""

from __future__ import annotations

import pytest
from kvtether.cli.common.stats import p99_warning, percentile, summarize
from kvtether.cli.replay.report import _ranges, check_slos, parse_slo


def test_percentile_hand_computed() -> None:
    xs = [4.0, 1.0, 3.0, 2.0]  # sorted: 1 2 3 4, n-1 = 3
    assert percentile(xs, 0) == 1.0
    assert percentile(xs, 100) == 4.0
    assert percentile(xs, 50) == pytest.approx(2.5)  # rank 1.5 → 2 + 0.5 × (3 − 2)
    assert percentile(xs, 95) == pytest.approx(3.85)  # rank 2.85 → 3 + 0.85 × 1
    assert percentile(xs, 99) == pytest.approx(3.97)  # rank 2.97
    ys = [15.0, 20.0, 35.0, 40.0, 50.0]  # n-1 = 4
    assert percentile(ys, 40) == pytest.approx(29.0)  # rank 1.6 → 20 + 0.6 × 15
    assert percentile(ys, 50) == 35.0  # exact rank 2
    assert percentile(ys, 95) == pytest.approx(48.0)  # rank 3.8 → 40 + 0.8 × 10
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile(xs, 101)


def test_percentile_of_1_to_100() -> None:
    xs = [float(i) for i in range(1, 101)]  # rank of p = 0.99 p
    assert percentile(xs, 50) == pytest.approx(50.5)
    assert percentile(xs, 95) == pytest.approx(95.05)
    assert percentile(xs, 99) == pytest.approx(99.01)


def test_summarize_skips_missing() -> None:
    s = summarize([1.0, None, 3.0])
    assert (s.n, s.mean, s.p50, s.min, s.max) == (2, 2.0, 2.0, 1.0, 3.0)
    empty = summarize([None])
    assert empty.n == 0 and empty.p99 is None


def test_p99_warning() -> None:
    assert p99_warning(0, "TTFT") is None
    assert p99_warning(100, "TTFT") is None
    w = p99_warning(12, "TTFT")
    assert w is not None and "12 samples" in w


def test_slo_parse_and_check() -> None:
    assert parse_slo("ttft_p95=500").key == "ttft_p95"
    assert parse_slo("E2E_P99<=2000").limit == 2000.0
    assert parse_slo("error_rate=0.01").stat is None
    for bad in ("ttft=5", "ttft_p95", "foo_p95=1", "ttft_p95=-1", "ttft_p95=abc"):
        with pytest.raises(ValueError):
            parse_slo(bad)
    run = {"error_rate": 0.0, "ttft_ms": {"p95": 400.0}, "e2e_ms": {"p99": None}}
    checks = check_slos(run, [parse_slo("ttft_p95=500"), parse_slo("ttft_p95=300"), parse_slo("e2e_p99=1")])
    assert [c["ok"] for c in checks] == [True, False, False]  # no data cannot meet an SLO


def test_ranges() -> None:
    assert _ranges([0, 1, 2, 5, 7, 8]) == "0–2, 5, 7–8"
