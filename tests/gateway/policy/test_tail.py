"""The running quantile behind the cost policy's tail-aware objective (gateway/policy/tail.py, pure)."""

from __future__ import annotations

import math
import random

import pytest
from kvtether.gateway.policy.tail import TailTracker


def nearest_rank(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[math.ceil(q * len(s)) - 1]


def test_unknown_until_enough_turns() -> None:
    t = TailTracker(0.9, capacity=64, min_samples=8)
    for i in range(7):
        t.observe(float(i))
    assert math.isinf(t.threshold())
    t.observe(7.0)
    assert t.threshold() == 7.0  # the 0.9 quantile of 0..7 by nearest rank is the 8th value


def test_quantile_of_the_last_capacity_turns() -> None:
    rng = random.Random(3)
    t = TailTracker(0.9, capacity=100, min_samples=10)
    seen: list[float] = []
    for i in range(1000):
        x = rng.expovariate(4.0) + (1.0 if i >= 500 else 0.0)  # the load level changes half way
        t.observe(x)
        seen.append(x)
        if i >= 9:
            assert t.threshold() == nearest_rank(seen[-100:], 0.9)
    assert len(t) == 100
    assert t.threshold() > 1.0  # the old level is forgotten


@pytest.mark.parametrize("bad", [math.nan, math.inf, -0.1])
def test_meaningless_estimates_are_ignored(bad: float) -> None:
    t = TailTracker(0.5, capacity=4, min_samples=1)
    t.observe(0.2)
    t.observe(bad)
    assert len(t) == 1 and t.threshold() == 0.2


@pytest.mark.parametrize("kw", [{"quantile": 0.0}, {"quantile": 1.0}, {"capacity": 0}, {"min_samples": 0},
                                {"capacity": 4, "min_samples": 5}])
def test_validation(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        TailTracker(**kw)  # type: ignore[arg-type]
