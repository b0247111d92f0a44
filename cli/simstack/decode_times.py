"""The engines' own TPOT: per request, in simulated time free of this machine's load."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtether.sim.cluster import SimCluster
    from kvtether.sim.engine import Engine, Step


class DecodeTimes:
    """TPOT per request on the nodes that decode, in simulated time free of this machine's load.

    Each watched engine gets a clock that advances by the cost model's duration of every step it runs (what
    the engine sleeps, ``Engine.run``) and by nothing else. A request's TPOT is the time on that clock between
    the steps that sampled its first and its last token, over the tokens between: every step of the node in
    between counts, whether the request was in it or not (a long prefill chunk that took the step's whole
    budget), exactly as a client would see it on an unloaded machine. Requests that sampled one token (prefill
    legs) have no TPOT."""

    def __init__(self) -> None:
        self._tokens: dict[str, list[float]] = {}  # request id -> [first token at, last token at, tokens]

    def watch(self, engine: Engine) -> None:
        from kvtether.sim.engine import State

        clock = [0.0]

        def on_step(step: Step) -> None:
            # Called once the step's time has passed, before its tokens are sampled (Engine._apply).
            clock[0] += step.seconds * engine.slow_factor
            for r, n in step.items:
                if r.state is not State.RUNNING or r.num_computed + n < r.num_tokens:
                    continue  # a prefill chunk short of the prompt's end: no token this step
                seen = self._tokens.get(r.request_id)
                if seen is None:
                    self._tokens[r.request_id] = [clock[0], clock[0], 1.0]
                else:
                    seen[1] = clock[0]
                    seen[2] += 1

        engine.on_step = on_step

    def watch_decoding(self, cluster: SimCluster) -> None:
        """Watch every node of `cluster` that decodes (decode and aggregated nodes)."""
        for node in cluster.nodes:
            if node.cfg.role != "prefill":
                self.watch(node.engine)

    def tpot_ms(self) -> list[float]:
        return list(self.tpot_by_request().values())

    def tpot_by_request(self) -> dict[str, float]:
        """TPOT (ms) by engine request id, for the requests that sampled two tokens or more."""
        return {rid: (last - first) * 1000 / (n - 1) for rid, (first, last, n) in self._tokens.items() if n >= 2}
