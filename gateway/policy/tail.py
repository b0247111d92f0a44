"""Where the tail of recent turns' time to first token starts (pure state): a running quantile.

The cost policy's tail-aware objective (``PolicyKnobs.tail_weight``) charges every second of an option's
estimated TTFT above this threshold extra. The threshold is a quantile of the estimates of the options
the policy *chose* for the last ``capacity`` turns, not of measured TTFTs: the comparison is then between
two numbers of the same model, and a bias the estimates share does not shift which turns count as tail.
A fixed window (not a decaying sketch) is enough: a few hundred floats, and it forgets a past load level
as fast as the cluster turns over that many turns.
"""

from __future__ import annotations

import bisect
import math
from collections import deque


class TailTracker:
    def __init__(self, quantile: float = 0.9, capacity: int = 256, min_samples: int = 32) -> None:
        if not 0.0 < quantile < 1.0:
            raise ValueError("quantile must be in (0, 1)")
        if capacity < 1 or not 1 <= min_samples <= capacity:
            raise ValueError("capacity >= 1 and 1 <= min_samples <= capacity")
        self.quantile = quantile
        self.min_samples = min_samples
        self._window: deque[float] = deque(maxlen=capacity)
        self._sorted: list[float] = []

    def __len__(self) -> int:
        return len(self._window)

    def observe(self, seconds: float) -> None:
        if not math.isfinite(seconds) or seconds < 0.0:
            return  # a forced or infeasible estimate says nothing about the usual tail
        if len(self._window) == self._window.maxlen:
            old = self._window[0]
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        self._window.append(seconds)
        bisect.insort(self._sorted, seconds)

    def threshold(self) -> float:
        """The quantile of the window (nearest rank); inf until `min_samples` turns were seen."""
        n = len(self._sorted)
        if n < self.min_samples:
            return math.inf
        return self._sorted[min(n - 1, math.ceil(self.quantile * n) - 1)]
