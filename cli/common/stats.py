"""Percentiles and summaries for replay results (pure, no I/O).

Method: linear interpolation between closest ranks, the default of ``numpy.percentile`` (and what
vLLM's benchmarks report): for sorted values ``x[0..n-1]`` the q-th percentile sits at rank
``r = (n - 1) * q / 100`` and is ``x[floor(r)] + (x[ceil(r)] - x[floor(r)]) * (r - floor(r))``.
numpy is not a dependency, so the formula is written out here and tested against hand-computed values.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

PERCENTILE_METHOD = "linear interpolation between closest ranks (numpy.percentile default)"

# Below this many samples a p99 is (nearly) the maximum: say so instead of implying precision.
P99_MIN_SAMPLES = 100


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0 ≤ q ≤ 100) of ``values``; None when there are none."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    if not values:
        return None
    xs = sorted(values)
    rank = (len(xs) - 1) * q / 100.0
    lo = math.floor(rank)
    hi = math.ceil(rank)
    if lo == hi:
        return float(xs[lo])
    return float(xs[lo] + (xs[hi] - xs[lo]) * (rank - lo))


@dataclass(frozen=True, slots=True)
class Summary:
    n: int
    mean: float | None
    p50: float | None
    p95: float | None
    p99: float | None
    min: float | None
    max: float | None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def get(self, stat: str) -> float | None:
        """A statistic by name (``p50``, ``p95``, ``p99``, ``mean``, ``min``, ``max``)."""
        if stat not in {"mean", "p50", "p95", "p99", "min", "max"}:
            raise KeyError(stat)
        value: float | None = getattr(self, stat)
        return value


def summarize(values: Iterable[float | None]) -> Summary:
    """Summary of the non-None values (a failed request has no TTFT; it is counted as an error)."""
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return Summary(n=0, mean=None, p50=None, p95=None, p99=None, min=None, max=None)
    return Summary(
        n=len(xs),
        mean=sum(xs) / len(xs),
        p50=percentile(xs, 50),
        p95=percentile(xs, 95),
        p99=percentile(xs, 99),
        min=min(xs),
        max=max(xs),
    )


def p99_warning(n: int, what: str) -> str | None:
    """A warning when a p99 rests on too few samples to mean much."""
    if 0 < n < P99_MIN_SAMPLES:
        return f"{what}: p99 from only {n} samples (< {P99_MIN_SAMPLES}) is close to the maximum"
    return None
