"""When a decode node's engine steps end, as the gateway sees them: the arrival times of streamed chunks.

Every request decoding on a node gets one chunk per engine step, so the chunks the gateway relays from that
node arrive in bursts, one burst per step. A decode-local turn's first chunk comes out of the step that
prefilled its suffix (the *mixed* step); the burst before it marks the end of the step before. The time
between the two is what that mixed step took, which is what the running batch waited for its next token:
the signal to learn a local prefill's cost (and so its stall) from. The turn's own time to first token is
not: it also holds D's request handling and the wait for the step in flight when it arrived, which the
running requests do not lose.

Relaying is not instantaneous: on a loaded gateway the turn's own first chunk may be read well after the
other streams' chunks of the same step. The mixed step is therefore found as the longest step seen, not as
the one that ends at the turn's first chunk (that would take the relay delay for the step).

Pure apart from a bounded per-node record the shell appends to; times come from the caller's clock.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence


def mixed_step_s(arrivals: Sequence[float], sent_at: float, first_at: float, min_gap_s: float) -> float | None:
    """How long the step that prefilled a turn sent at `sent_at` took, read off other streams' chunks on the
    node; None when no step boundary was seen.

    `arrivals`: other streams' chunk times on the same node (any order); `first_at`: the turn's own first
    chunk. Only the steps that ended after the send count: the first arrival after it ends the step in flight
    (whose start is unknown), and each gap from one arrival to the next, up to `first_at`, is a step. The
    mixed step is the longest of them: the others are the running batch's plain decode steps while D took the
    request in, and a gap to a first chunk relayed late is relay delay, not a step. Gaps of `min_gap_s` or
    less are chunks of one step (relay jitter): with no longer one (nothing else streaming there, or only
    chunks of the mixed step itself) there is nothing to read.
    """
    points = sorted(a for a in arrivals if sent_at < a < first_at)
    points.append(first_at)
    longest = max((b - a for a, b in itertools.pairwise(points)), default=0.0)
    return longest if longest > max(0.0, min_gap_s) else None


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
