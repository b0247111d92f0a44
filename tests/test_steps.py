"""Reading a decode node's step boundaries off its streamed chunks' arrival times (pure)."""

from __future__ import annotations

import pytest
from kvtether.gateway.policy.steps import ChunkTimes, step_start


def test_the_step_before_the_first_chunk_ends_at_the_last_burst_before_it() -> None:
    # Two other streams decode in 10 ms steps; the local turn is sent at 0.105, its suffix is prefilled in
    # the step from 0.12 to 0.20 (chunks of that step arrive within a ms of its own first chunk).
    others = [0.100, 0.1004, 0.110, 0.1003 + 0.01, 0.120, 0.1205, 0.2001, 0.1999]
    start = step_start(others, sent_at=0.105, first_at=0.2002, min_gap_s=0.005)
    assert start == pytest.approx(0.1205)


def test_no_burst_between_send_and_first_chunk_means_no_reading() -> None:
    # Nothing else streamed there after the send (the only arrivals are older, or from the same step).
    assert step_start([0.05, 0.09], sent_at=0.1, first_at=0.3, min_gap_s=0.005) is None
    assert step_start([0.2995], sent_at=0.1, first_at=0.3, min_gap_s=0.005) is None
    assert step_start([], sent_at=0.1, first_at=0.3, min_gap_s=0.005) is None


def test_chunk_times_are_bounded_per_node_and_in_nodes() -> None:
    times = ChunkTimes(keep=3, max_nodes=2)
    for t in (1.0, 2.0, 3.0, 4.0):
        times.record("d0", t)
    assert times.since("d0", 0.0) == (2.0, 3.0, 4.0)  # the oldest fell off
    assert times.since("d0", 2.0) == (3.0, 4.0)
    assert times.since("unknown", 0.0) == ()
    times.record("d1", 1.0)
    times.record("d2", 1.0)  # a third node pushes out the one first seen longest ago
    assert times.since("d0", 0.0) == () and times.since("d2", 0.0) == (1.0,)
    with pytest.raises(ValueError):
        ChunkTimes(keep=0)
