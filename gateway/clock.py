"""The gateway's one clock: a ``Clock`` is a function returning seconds on a monotonic scale.

Every time the gateway reads (when a turn arrived, a leg's TTFT, handle ages, TTLs of the memory store, health
backoffs, the learning's step boundaries, keep-alive expiry) comes from the clock handed to ``create_app``, so that
one clock drives them all: ``time.perf_counter`` in production (monotonic, high resolution on every OS), the
event loop's virtual time when the whole stack runs on a simulated clock (docs/simulator.md). Sleeps and timeouts
are the event loop's own and follow it by themselves. Reading ``time.monotonic``/``time.perf_counter`` anywhere
else in the gateway is refused by the lint (ruff's banned-api), because a second clock would silently stop
working in virtual time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

Clock = Callable[[], float]

DEFAULT_CLOCK: Clock = time.perf_counter


def running_clock() -> Clock:
    """The clock for an app made now: the running event loop's own time when that loop runs on virtual time (it
    says so with a true ``virtual_time`` attribute, as sim/virtual.py's loop does), else ``DEFAULT_CLOCK``. So a
    gateway started inside a virtual run follows its clock without being told, and one started anywhere else
    reads the OS's."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return DEFAULT_CLOCK
    return loop.time if getattr(loop, "virtual_time", False) else DEFAULT_CLOCK
