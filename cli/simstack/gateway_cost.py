"""The gateway's own CPU, modelled: in virtual time the gateway's Python costs no simulated time, which would hide
a saturated gateway exactly where the load is highest. So a simulated stack on a virtual clock puts its gateway
behind a model of it: ``workers`` servers (one per gateway process) that each turn holds, first-come first-served,
for ``turn_s`` plus ``per_body_kb_s`` per kB of its request body before the gateway sees it, and for ``per_chunk_s``
per streamed chunk once its answer is out. A turn that finds every server busy waits: queueing appears at
saturation as it would on a real gateway, and what the servers were busy for is reported as the modelled
utilisation, beside the CPU the run really took (never fed back: that would bring this machine's noise back).

The default costs are the gateway's as ``benchmarks/gateway_overhead.py`` measured them (benchmarks/README.md: CPU
per request on fake backends): 1.10 ms per aggregated turn and 1.88 ms per P/D turn (16-chunk streams), 16.8 and
18.4 µs per further chunk (256-chunk streams), and on guarded P/D turns of ~16k-token histories (~60 kB bodies)
13.9 ms, i.e. 0.2 ms per kB of body above the plain turn: D's token ids parsed, the body re-serialized per leg,
the held sequence hashed. Colocated serving skips that work (no guard, no token ids), so its turns are charged
the aggregated rows only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
from kvtether.cli.common.stats import percentile
from starlette.types import Message, Receive, Scope, Send

# The paths of the turns (the gateway's chat, completions, Responses and Messages endpoints).
TURN_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")
# Above this modelled utilisation a run's gateway is saturated: its figures include queueing in the gateway.
SATURATED_UTILISATION = 0.7
# The window of the busiest-window utilisation (simulated seconds): a run's mean hides a burst (arrivals that
# ramp up and down, a trace's busy minute), and ten seconds of a server busier than it can be is a queue that
# the turns in it wait in, whatever the run's mean.
PEAK_WINDOW_S = 10.0


@dataclass(frozen=True, slots=True)
class GatewayCost:
    """What one turn costs a gateway process, in seconds (module docstring), and how many processes serve."""

    turn_s: float
    per_body_kb_s: float
    per_chunk_s: float
    workers: int = 1

    def __post_init__(self) -> None:
        if min(self.turn_s, self.per_body_kb_s, self.per_chunk_s) < 0 or self.workers < 1:
            raise ValueError("gateway costs must be >= 0 and workers >= 1")

    @property
    def free(self) -> bool:
        return self.turn_s == self.per_body_kb_s == self.per_chunk_s == 0.0

    def to_json(self) -> dict[str, Any]:
        return {"turn_ms": self.turn_s * 1e3, "per_body_kb_ms": self.per_body_kb_s * 1e3,
                "per_chunk_us": self.per_chunk_s * 1e6, "workers": self.workers}


# Measured on benchmarks/gateway_overhead.py (module docstring).
AGGREGATED_COST = GatewayCost(turn_s=1.10e-3, per_body_kb_s=0.0, per_chunk_s=16.8e-6)
PD_COST = GatewayCost(turn_s=1.88e-3, per_body_kb_s=0.2e-3, per_chunk_s=18.4e-6)
NO_COST = GatewayCost(turn_s=0.0, per_body_kb_s=0.0, per_chunk_s=0.0)


def default_cost(aggregated: bool, workers: int = 1) -> GatewayCost:
    base = AGGREGATED_COST if aggregated else PD_COST
    return GatewayCost(base.turn_s, base.per_body_kb_s, base.per_chunk_s, workers)


@dataclass(slots=True)
class CostLedger:
    """What the modelled gateway did: turns, seconds its servers were busy, seconds turns waited for a server."""

    turns: int = 0
    busy_s: float = 0.0
    queued_s: float = 0.0
    chunks: int = 0
    since: float | None = None  # the clock when the first turn came
    # Busy seconds per PEAK_WINDOW_S window from `since` (window index -> seconds, all servers together).
    busy_by_window: dict[int, float] = field(default_factory=dict)
    # Each turn's wait for a server before the gateway began it (seconds): it is in the turn's TTFT.
    waits_s: list[float] = field(default_factory=list)

    def utilisation(self, now: float, workers: int) -> float | None:
        if self.since is None or now <= self.since:
            return None
        return self.busy_s / ((now - self.since) * workers)

    def busy(self, start: float, seconds: float) -> None:
        """A server busy from `start` for `seconds`, counted in the run's total and in each window it covers."""
        self.busy_s += seconds
        if self.since is None:
            return
        at, end = start - self.since, start - self.since + seconds
        while at < end:
            window = int(at // PEAK_WINDOW_S)
            upto = min(end, (window + 1) * PEAK_WINDOW_S)
            self.busy_by_window[window] = self.busy_by_window.get(window, 0.0) + (upto - at)
            at = upto

    def peak_utilisation(self, now: float, workers: int) -> float | None:
        """The busiest whole window's utilisation; None before the first whole window ends."""
        if self.since is None:
            return None
        whole = int((now - self.since) // PEAK_WINDOW_S)
        if whole < 1:
            return None
        return max(self.busy_by_window.get(w, 0.0) for w in range(whole)) / (PEAK_WINDOW_S * workers)


@dataclass(slots=True)
class CostedGateway:
    """An ASGI app: the gateway `app` behind the modelled servers of `cost`, on `clock` (the virtual loop's)."""

    app: Any
    cost: GatewayCost
    clock: Callable[[], float]
    ledger: CostLedger = field(default_factory=CostLedger)
    _servers: anyio.Semaphore | None = None

    def _semaphore(self) -> anyio.Semaphore:
        if self._servers is None:  # made on the running loop, at the first turn
            self._servers = anyio.Semaphore(self.cost.workers)
        return self._servers

    async def _hold(self, seconds: float, *, turn: bool = False) -> None:
        """Take a server for `seconds`, after the turns before this one (FIFO). `turn`: a turn's first hold, whose
        wait is in its TTFT (recorded per turn)."""
        if seconds <= 0:
            if turn:
                self.ledger.waits_s.append(0.0)
            return
        asked = self.clock()
        async with self._semaphore():
            start = self.clock()
            self.ledger.queued_s += start - asked
            if turn:
                self.ledger.waits_s.append(start - asked)
            self.ledger.busy(start, seconds)
            await anyio.sleep(seconds)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in TURN_PATHS \
                or self.cost.free:
            await self.app(scope, receive, send)
            return
        if self.ledger.since is None:
            self.ledger.since = self.clock()
        messages: list[Message] = []
        size = 0
        while True:  # the whole body first: its size prices the turn
            message = await receive()
            messages.append(message)
            size += len(message.get("body", b""))
            if message["type"] != "http.request" or not message.get("more_body", False):
                break
        self.ledger.turns += 1
        await self._hold(self.cost.turn_s + self.cost.per_body_kb_s * size / 1024, turn=True)
        chunks = 0

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        async def counting_send(message: Message) -> None:
            nonlocal chunks
            if message["type"] == "http.response.body":
                chunks += message.get("body", b"").count(b"data:")
            await send(message)

        try:
            await self.app(scope, replay, counting_send)
        finally:
            self.ledger.chunks += chunks
            # The relay's cost per chunk, charged once the answer is out: the client saw its tokens as they came,
            # and the turns after it wait for the server meanwhile.
            with anyio.CancelScope(shield=True):
                await self._hold(self.cost.per_chunk_s * chunks)

    def report(self) -> dict[str, Any]:
        """The model and what it did, for a run's results."""
        now = self.clock()
        util = self.ledger.utilisation(now, self.cost.workers)
        peak = self.ledger.peak_utilisation(now, self.cost.workers)
        return {**self.cost.to_json(), "turns": self.ledger.turns, "chunks": self.ledger.chunks,
                "busy_s": round(self.ledger.busy_s, 6), "queued_s": round(self.ledger.queued_s, 6),
                "utilisation": None if util is None else round(util, 4),
                "peak_utilisation": None if peak is None else round(peak, 4), "peak_window_s": PEAK_WINDOW_S,
                "queue_ms": {k: None if (v := percentile(self.ledger.waits_s, q)) is None else round(v * 1e3, 3)
                             for k, q in (("p50", 50.0), ("p99", 99.0), ("max", 100.0))},
                "saturated": util is not None and util > SATURATED_UTILISATION}

