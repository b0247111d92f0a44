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

import time
from collections.abc import Callable

Clock = Callable[[], float]

DEFAULT_CLOCK: Clock = time.perf_counter
