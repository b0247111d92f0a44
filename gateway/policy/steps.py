"""When a decode node's engine steps end, as the gateway sees them: the arrival times of streamed chunks.

Every request decoding on a node gets one chunk per engine step, so the chunks the gateway relays from that
node arrive in bursts, one burst per step. A decode-local turn's first chunk comes out of the step that
prefilled its suffix (the *mixed* step); the burst before it marks the end of the step before. The time
between the two is what that mixed step took, which is what the running batch waited for its next token:
the signal to learn a local prefill's cost (and so its stall) from. The turn's own time to first token is
not: it also holds D's request handling and the wait for the step in flight when it arrived, which the
running requests do not lose.

Pure apart from a bounded per-node record the shell appends to; times come from the caller's clock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence


def step_start(arrivals: Sequence[float], sent_at: float, first_at: float, min_gap_s: float) -> float | None:
    """The end of the step before the one that produced a chunk at `first_at`, or None if not seen.

    `arrivals`: other streams' chunk times on the same node (any order). Those within `min_gap_s` before
    `first_at` came out of the same step (relay jitter); the latest one before that ends the previous step.
    Arrivals before `sent_at` are not counted: the turn's mixed step cannot have begun before it was sent,
    and without a burst in between (nothing else streaming there) there is no step boundary to read.
    """
    cut = first_at - max(0.0, min_gap_s)
    return max((a for a in arrivals if sent_at < a < cut), default=None)


class ChunkTimes:
    """The last `keep` chunk arrival times per node (bounded: old ones fall off, unknown nodes are cheap)."""

    def __init__(self, keep: int = 256, max_nodes: int = 256) -> None:
        if keep < 1 or max_nodes < 1:
            raise ValueError("keep and max_nodes must be >= 1")
        self.keep = keep
        self.max_nodes = max_nodes
        self._by_node: dict[str, deque[float]] = {}

    def record(self, node: str, at: float) -> None:
        times = self._by_node.get(node)
        if times is None:
            if len(self._by_node) >= self.max_nodes:
                self._by_node.pop(next(iter(self._by_node)))  # the node first seen longest ago
            times = self._by_node[node] = deque(maxlen=self.keep)
        times.append(at)

    def since(self, node: str, after: float) -> tuple[float, ...]:
        """Arrivals on `node` later than `after` (oldest first)."""
        times = self._by_node.get(node)
        if not times:
            return ()
        out: list[float] = []
        for t in reversed(times):
            if t <= after:
                break
            out.append(t)
        return tuple(reversed(out))
