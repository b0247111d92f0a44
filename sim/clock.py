"""Simulated time: the engine thinks in simulated seconds and sleeps them divided by the speed-up.

A node's clock reads one source: the OS's monotonic clock by default (a live simulated cluster, ``speed`` times
real time), or the clock it is handed, such as a virtual event loop's ``loop.time`` (sim/virtual.py), where
sleeps are exact and the speed is 1. Nothing else in the simulator reads the time (the lint refuses it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import anyio
import anyio.lowlevel

Source = Callable[[], float]


def running_source() -> Source | None:
    """The running event loop's time when that loop runs on virtual time (sim/virtual.py), else None."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return None
    return loop.time if getattr(loop, "virtual_time", False) else None


class SimClock:
    def __init__(self, speed: float = 1.0, source: Source | None = None) -> None:
        """`source`: the clock to read; None: the running loop's on virtual time, else the OS's monotonic one."""
        if speed <= 0:
            raise ValueError("speed must be > 0")
        self.speed = speed
        source = source or running_source()
        # A clock handed in is the event loop's own (virtual time): its sleeps end exactly when asked.
        self.exact = source is not None
        self.source: Source = source or time.monotonic
        self._t0 = self.source()

    def now(self) -> float:
        """Simulated seconds since the node started (node-local, opaque to other nodes)."""
        return (self.source() - self._t0) * self.speed

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
    make a sped-up clock run far slower than asked; the pacer carries the difference forward. On an exact clock
    (virtual time) every step is slept as it is: its tokens leave at the step's end to the microsecond.
    """

    def __init__(self, clock: SimClock, min_real_sleep: float = 0.001) -> None:
        self._clock = clock
        self._min = 0.0 if clock.exact else min_real_sleep
        self._debt = 0.0  # real seconds owed (negative: overslept)

    async def sleep(self, sim_seconds: float) -> None:
        self._debt += max(0.0, sim_seconds) / self._clock.speed
        if self._debt <= 0.0 or self._debt < self._min:
            await anyio.lowlevel.checkpoint()
            return
        t0 = self._clock.source()
        await anyio.sleep(self._debt)
        self._debt -= self._clock.source() - t0
