"""When a streamed answer's events and tokens arrived, and the times the CLI reports from them (package docstring)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

# The definitions (package docstring), one line each, as result documents carry them.
TIME_DEFINITIONS = {
    "ttfc": "request sent → first SSE chunk of any kind",
    "ttft": "request sent → first chunk with content, reasoning, a refusal or a tool call (its name or arguments): "
            "the first token of any kind",
    "tpot": "(end of generation − first token chunk) / (completion_tokens − 1; without usage, the token chunks "
            "counted); the end of generation is the event that says why the answer ended (finish_reason, "
            "stop_reason, response.completed), else the last token chunk",
    "e2e": "request sent → end of stream",
}


def now_ns() -> int:
    return time.perf_counter_ns()


def loop_clock_ns() -> Callable[[], int]:
    """The running event loop's clock in nanoseconds: on a virtual loop (sim/virtual.py), virtual time, which the
    simulated stack reads too (a client on it measures exactly what the stack did)."""
    time_of = asyncio.get_running_loop().time
    return lambda: round(time_of() * 1e9)


@dataclass(slots=True)
class TokenClock:
    """Arrival times (``perf_counter_ns``) of one answer, stamped before any other work on an event: ``t0`` when
    the request is sent, then the first event of any kind, the first and the last event that carried a token,
    and the end of the stream."""

    t0: int
    first_event: int | None = None
    first_token: int | None = None
    last_token: int | None = None
    # The event that said why the answer ended: it came with the step that sampled the last token, the end of
    # sequence included, which has no text of its own and so no token event.
    finish: int | None = None
    end: int | None = None
    events: int = 0
    token_events: int = 0

    def event(self, now: int) -> None:
        self.events += 1
        if self.first_event is None:
            self.first_event = now

    def token(self, now: int) -> None:
        self.token_events += 1
        if self.first_token is None:
            self.first_token = now
        self.last_token = now

    def finished(self, now: int) -> None:
        if self.finish is None:
            self.finish = now

    def _ms(self, at: int | None, scale: float) -> float | None:
        return None if at is None else (at - self.t0) / 1e6 * scale

    def ttfc_ms(self, scale: float = 1.0) -> float | None:
        return self._ms(self.first_event, scale)

    def ttft_ms(self, scale: float = 1.0) -> float | None:
        return self._ms(self.first_token, scale)

    def e2e_ms(self, scale: float = 1.0) -> float | None:
        return self._ms(self.end, scale)

    def tpot_ms(self, tokens: int | None, scale: float = 1.0) -> float | None:
        """(end of generation − first token) / (tokens − 1); `tokens` the answer's completion tokens (None or 0:
        the token events counted), the end of generation the finish event when one came (it arrives with the step
        that sampled the last token, an end of sequence included, which `tokens` counts), else the last token
        event. So a lone stream's TPOT is the engine's step time. None for an answer of one token, or none."""
        if self.first_token is None or self.last_token is None:
            return None
        n = tokens if tokens else self.token_events
        if n < 2:
            return None
        last = self.last_token if self.finish is None or not tokens else max(self.last_token, self.finish)
        return (last - self.first_token) / 1e6 * scale / (n - 1)
