"""Simulated time: the engine thinks in simulated seconds and sleeps them divided by the speed-up."""

from __future__ import annotations

import time

import anyio
import anyio.lowlevel


class SimClock:
    def __init__(self, speed: float = 1.0) -> None:
        if speed <= 0:
            raise ValueError("speed must be > 0")
        self.speed = speed
        self._t0 = time.monotonic()

    def now(self) -> float:
        """Simulated seconds since the node started (node-local, opaque to other nodes)."""
        return (time.monotonic() - self._t0) * self.speed

    def advance(self, sim_seconds: float) -> None:
        """Jump simulated time forward (tests: reach a TTL without waiting it out in real time). The engine
        notices at its next wake-up, at most a second of real time later."""
        self._t0 -= max(0.0, sim_seconds) / self.speed

    def real(self, sim_seconds: float) -> float:
        return sim_seconds / self.speed

    async def sleep(self, sim_seconds: float) -> None:
        await anyio.sleep(max(0.0, sim_seconds) / self.speed)


class Pacer:
    """Sleeps a sequence of step durations so that their sum tracks real time.

    Event-loop timers have about a millisecond of resolution, so sleeping each 50 µs step would
    make a sped-up clock run far slower than asked; the pacer carries the difference forward.
    """

    def __init__(self, clock: SimClock, min_real_sleep: float = 0.001) -> None:
        self._clock = clock
        self._min = min_real_sleep
        self._debt = 0.0  # real seconds owed (negative: overslept)

    async def sleep(self, sim_seconds: float) -> None:
        self._debt += max(0.0, sim_seconds) / self._clock.speed
        if self._debt < self._min:
            await anyio.lowlevel.checkpoint()
            return
        t0 = time.monotonic()
        await anyio.sleep(self._debt)
        self._debt -= time.monotonic() - t0
