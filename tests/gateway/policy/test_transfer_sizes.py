"""Transfers of long histories are estimated from what transfers of that size took, not only from the linear
fit that the many short reads of ordinary turns pin down."""

from __future__ import annotations

import pytest
from kvtether.gateway.policy.estimates import Estimator, EstimatorSeeds, size_class

D0, P0 = "http://d0", "http://p0"
SEEDS = EstimatorSeeds(transfer_latency_s=0.005, transfer_s_per_token=5e-6)


def _read_s(tokens: int) -> float:
    """The link as it is: the seed's line up to 8k tokens, then each token beyond costs three times as much (a
    read of thousands of descriptors meets the NIC's message rate)."""
    return 0.005 + 5e-6 * tokens + (2 * 5e-6 * (tokens - 8192) if tokens > 8192 else 0.0)


def test_a_long_read_is_estimated_from_long_reads_and_a_short_one_from_short_ones() -> None:
    est = Estimator(SEEDS)
    t = 0.0
    for i in range(60):  # the usual: short reads, with now and then a long history's
        tokens = 65536 if i % 6 == 5 else 2048 + 64 * (i % 5)
        est.observe_transfer(D0, P0, tokens, _read_s(tokens), now=t)
        t += 1.0
    snap = est.snapshot(t)
    assert snap.transfer_s(D0, P0, 65536) == pytest.approx(_read_s(65536), rel=0.05)
    assert snap.transfer_s(D0, P0, 2100) == pytest.approx(_read_s(2100), rel=0.05)
    # The linear fit alone, a compromise between both sizes, is wrong on both: short of the long read, and well
    # over the short ones (the turns whose pull it would wrongly price out).
    assert snap.linear_transfer_s(D0, P0, 65536) < 0.85 * _read_s(65536)
    assert snap.linear_transfer_s(D0, P0, 2100) > 1.3 * _read_s(2100)
    # Another link without reads of its own takes the cluster's classes.
    assert snap.transfer_s(D0, "http://p1", 65536) == pytest.approx(
        snap.linear_transfer_s(D0, "http://p1", 65536) * snap.size_factor("*", 65536))


def test_a_size_class_unobserved_for_long_glides_back_to_the_linear_fit() -> None:
    est = Estimator(SEEDS)
    for i in range(30):
        est.observe_transfer(D0, P0, 65536, 3 * _read_s(65536), now=float(i))
    late = est.snapshot(30.0 + 100 * est.params.half_life_s)
    assert late.size_factor("http://d0|http://p0", 65536) == pytest.approx(1.0, abs=1e-3)


def test_size_classes() -> None:
    assert [size_class(n) for n in (1, 1023, 1024, 2047, 2048, 40000, 65536, 10**7)] == [0, 0, 1, 1, 2, 6, 7, 7]
