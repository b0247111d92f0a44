"""Reading a decode node's step boundaries off its streamed chunks' arrival times, and what a decode-local
turn on a busy decode node teaches the estimator from them (pure: every time is given explicitly)."""

from __future__ import annotations

import pytest
from kvtether.gateway.policy.estimates import Estimator, EstimatorSeeds, LearningParams
from kvtether.gateway.policy.knobs import PolicyKnobs
from kvtether.gateway.policy.learning import DecodeSample, Learning
from kvtether.gateway.policy.steps import ChunkTimes, mixed_step_s

SAME_STEP = 0.005  # chunks of one step arrive within this of each other (half a 10 ms decode step)


def test_the_mixed_step_runs_from_the_burst_before_the_first_chunk_to_the_first_chunks_burst() -> None:
    # Two other streams decode in 10 ms steps; the local turn is sent at 0.105, its suffix is prefilled in
    # the step from 0.12 to 0.20 (chunks of that step arrive within a ms of its own first chunk).
    others = [0.100, 0.1004, 0.110, 0.1003 + 0.01, 0.120, 0.1205, 0.2001, 0.1999]
    seconds = mixed_step_s(others, sent_at=0.105, first_at=0.2002, min_gap_s=SAME_STEP)
    assert seconds == pytest.approx(0.1999 - 0.1205)


def test_plain_steps_while_decode_takes_the_request_in_are_not_the_mixed_step() -> None:
    # D takes a while to take the request in: the running answer gets three more plain 14 ms steps before
    # the 140 ms step that prefills the suffix. The turn's own wait (0.173 s) holds all of them.
    others = [0.105, 0.119, 0.133, 0.273]
    seconds = mixed_step_s(others, sent_at=0.100, first_at=0.2731, min_gap_s=SAME_STEP)
    assert seconds == pytest.approx(0.140)


def test_a_first_chunk_relayed_late_does_not_shorten_the_mixed_step() -> None:
    # The mixed step runs from 0.110 to 0.250; the gateway reads the running answer's chunk of it at 0.2501
    # and of the plain step after it at 0.264, but gets to the turn's own first chunk only at 0.275. The step
    # the running answer waited through is still 0.140 s, not the 11 ms from its last chunk to the late one.
    others = [0.110, 0.2501, 0.264]
    seconds = mixed_step_s(others, sent_at=0.105, first_at=0.275, min_gap_s=SAME_STEP)
    assert seconds == pytest.approx(0.2501 - 0.110)


def test_no_burst_between_send_and_first_chunk_means_no_reading() -> None:
    # Nothing else streamed there after the send (the only arrivals are older, or from the same step).
    assert mixed_step_s([0.05, 0.09], sent_at=0.1, first_at=0.3, min_gap_s=SAME_STEP) is None
    assert mixed_step_s([0.2995], sent_at=0.1, first_at=0.3, min_gap_s=SAME_STEP) is None
    assert mixed_step_s([0.2995, 0.2998, 0.2999], sent_at=0.1, first_at=0.3, min_gap_s=SAME_STEP) is None
    assert mixed_step_s([], sent_at=0.1, first_at=0.3, min_gap_s=SAME_STEP) is None


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


class RecordingEstimator(Estimator):
    """The estimator, keeping the local-prefill samples it is given."""

    def __init__(self) -> None:
        super().__init__(EstimatorSeeds(), LearningParams())
        self.prefills: list[tuple[str, int, int, float]] = []

    def observe_prefill(self, node: str, tokens: int, context: int, seconds: float, *, now: float) -> None:
        self.prefills.append((node, tokens, context, seconds))
        super().observe_prefill(node, tokens, context, seconds, now=now)


def _learned(load: tuple[float, float], arrivals: tuple[float, ...], first_at: float,
             sent_at: float = 10.0) -> list[tuple[str, int, int, float]]:
    """What a finished decode-local turn (52 new tokens after 645 cached, sent at `sent_at`) teaches."""
    learning = Learning(EstimatorSeeds(), LearningParams(), PolicyKnobs())
    estimator = learning.estimator = RecordingEstimator()
    sample = DecodeSample(node="d0", local=True, load=load, prompt_tokens=697, cached_tokens=645,
                          sent_at=sent_at, first_chunk_at=first_at, arrivals_before_first=arrivals)
    learning.decode_done(sample, now=first_at + 1.0)
    return estimator.prefills


def test_a_local_prefill_on_a_busy_decode_node_is_learned_as_its_mixed_step() -> None:
    # One answer decodes on D in 14 ms steps. The turn is sent at 10.000; the step in flight ends at 10.012,
    # D has taken the request in by then, and the next step (prefill and decode together) ends at 10.150:
    # the running answer waited 0.138 s for its next token. The turn's own first chunk comes at 10.1502
    # (0.150 s after the send: it also waited for the step in flight).
    learned = _learned((1.0, 0.0), (9.984, 9.998, 10.012, 10.1501), first_at=10.1502)
    assert [(n, t, c) for n, t, c, _ in learned] == [("d0", 52, 645)]
    assert learned[0][3] == pytest.approx(0.138, abs=1e-3)


def test_the_mixed_step_is_learned_even_when_the_first_chunk_is_relayed_late() -> None:
    # As above, but the gateway reads the turn's first chunk 30 ms after the running answer's chunk of the
    # same step (a busy gateway), by which time the running answer's next plain step is in too.
    learned = _learned((1.0, 0.0), (9.984, 9.998, 10.012, 10.1501, 10.164), first_at=10.180)
    assert len(learned) == 1 and learned[0][3] == pytest.approx(0.1381, abs=1e-3)


def test_an_idle_decode_node_learns_the_time_to_first_chunk_and_a_queue_teaches_nothing() -> None:
    # Nothing else runs: the turn's own time to first chunk is its prefill (nothing to read a step from).
    learned = _learned((0.0, 0.0), (), first_at=10.09)
    assert len(learned) == 1 and learned[0][3] == pytest.approx(0.09)
    # Requests queued ahead: the wait would be theirs as much as the prefill's.
    assert _learned((1.0, 1.0), (10.012, 10.1501), first_at=10.1502) == []
    # Busy, but no other stream's chunk seen since the send (non-streamed neighbours): no reading, no guess.
    assert _learned((1.0, 0.0), (9.984, 9.998), first_at=10.1502) == []
