"""Question 4's runs: the same sessions on the simulator, once per serving option, at the same GPU count.

- ``no-pull``, ``reference``, ``auto``: P/D (the shape's prefill and decode nodes) behind the kvtether gateway
  with that policy: classic disaggregation (P recomputes the history), vLLM's reference proxy (round-robin,
  the handle attached whenever held), and kvtether's per-turn choice.
- ``colocated``: as many aggregated nodes as the P/D cluster has nodes, each serving prefill and decode with its
  own prefix cache (vLLM's default), behind the same gateway in aggregated mode, which pins every session to a
  replica (``plan_aggregated``): session affinity, so a replica's prefix cache serves the session's history.
  That is the "colocated serving with cache-aware routing" of the public comparisons, run by the same engine
  model as the P/D options: the only difference between the runs is the topology and the policy.

Each run is a fresh cluster and gateway in this process, replayed with ``cli/replay/engine.py`` (closed loop, the
sessions' recorded gaps, the answers the simulated model gives threaded into the next turn's history). The
simulator's clock runs ``speed`` times faster than real time; the gateway's clock is real, so its time
settings (handle TTLs, idle release, retention interval, estimator seeds) are divided by ``speed``.

TTFT is the client's measurement (real time × ``speed``). TPOT is the engine's own (:class:`DecodeTimes`): the
time between a request's first and last token counted in the cost model's step durations, so that the TPOT
objective, which decides which options may win, does not move with this machine's load: a decode step lasts
milliseconds, the same order as the Python work of streaming its token through the node, the gateway and the
client, which the client's clock multiplies by ``speed``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtether.cli.assess.analysis import TurnTiming
from kvtether.cli.assess.cluster import ClusterShape, register_preset
from kvtether.cli.replay.engine import ReplayOptions, ReplayRun, ThinkTime, TurnResult, new_session_suffix, run_replay
from kvtether.cli.simstack.calibration import calibrated_seeds
from kvtether.sdk.sessionfile import SessionRecord

if TYPE_CHECKING:
    from kvtether.sim.engine import Engine, Step

PD_POLICIES: tuple[str, ...] = ("no-pull", "reference", "auto")
COLOCATED = "colocated"
OPTIONS: tuple[str, ...] = (*PD_POLICIES, COLOCATED)
DESCRIPTIONS = {
    "no-pull": "P/D, P recomputes the history (classic disaggregation)",
    "reference": "P/D, vLLM's reference proxy: round-robin, handle attached whenever held",
    "auto": "P/D behind kvtether: per turn decode-local, pull or cold",
    "pull": "P/D behind kvtether: always pull when a verified handle is held",
    COLOCATED: "aggregated nodes (prefill + decode each), session-affine routing to the replica's prefix cache",
}


@dataclass(frozen=True, slots=True)
class RunSettings:
    speed: float = 10.0  # simulated seconds per real second
    concurrency: int = 8
    think_scale: float = 1.0  # recorded gaps × this (simulated time)
    max_think_ms: float | None = None
    timeout_s: float = 120.0
    # Off: auto decides from the seeds calibrated on the cost model, as the gateway would on a cluster whose
    # speed it has measured; learning from this process's timings would teach it the machine's load instead.
    learn_estimates: bool = False


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

        cost = engine.preset.cost
        clock = [0.0]

        def on_step(step: Step) -> None:
            # Called once the step's time has passed, before its tokens are sampled (Engine._apply).
            clock[0] += cost.step_seconds(step.prefill_chunks, step.decode_contexts) * engine.slow_factor
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

    def tpot_ms(self) -> list[float]:
        return list(self.tpot_by_request().values())

    def tpot_by_request(self) -> dict[str, float]:
        """TPOT (ms) by engine request id, for the requests that sampled two tokens or more."""
        return {rid: (last - first) * 1000 / (n - 1) for rid, (first, last, n) in self._tokens.items() if n >= 2}


@asynccontextmanager
async def option_gateway(option: str, shape: ClusterShape, speed: float, learn_estimates: bool = True,
                         decode_times: DecodeTimes | None = None) -> AsyncIterator[tuple[str, str]]:
    """A fresh simulated cluster for `option` and an in-process gateway in front; yields (URL, model name).
    `decode_times`, when given, watches the nodes that decode (decode and aggregated)."""
    from kvtether.gateway.config import load_config
    from kvtether.gateway.shell.server import serve_gateway
    from kvtether.sim.cluster import ClusterSpec, SimCluster

    preset = register_preset(shape)
    colocated = option == COLOCATED
    spec = ClusterSpec(prefill=0 if colocated else shape.prefill, decode=0 if colocated else shape.decode,
                       aggregated=shape.nodes if colocated else 0, preset=preset, speed=speed,
                       decoder_kv_blocks_ttl=shape.decoder_kv_blocks_ttl_s,
                       prefill_prefix_caching=shape.prefill_prefix_caching)
    async with SimCluster(spec) as cluster:
        if decode_times is not None:
            for node in cluster.nodes:
                if node.cfg.role != "prefill":
                    decode_times.watch(node.engine)
        timing = {
            "session_ttl_s": shape.session_ttl_s / speed, "engine_kv_ttl_s": shape.decoder_kv_blocks_ttl_s / speed,
            "retention_interval_s": max(0.05, 1.0 / speed),
            "held_kv_budget": shape.held_kv_budget if shape.held_kv_budget is not None else 1.0,
            "metrics_poll_interval_s": 0.5, "learn_estimates": learn_estimates,
        }
        if option == COLOCATED:
            config = load_config(None, aggregated=list(cluster.aggregated_urls), **timing)
        else:
            config = load_config(None, prefill=list(cluster.prefill_urls), decode=list(cluster.decode_urls),
                                 policy=option, **timing, **calibrated_seeds(shape.preset, speed))
        async with serve_gateway(config) as url:
            yield str(url), spec.model_name


@dataclass(frozen=True, slots=True)
class OptionRun:
    replay: ReplayRun
    tpot_ms: list[float]  # per decoding request, from the engine (DecodeTimes)


async def run_option(option: str, sessions: Sequence[SessionRecord], shape: ClusterShape, settings: RunSettings,
                     on_result: Callable[[TurnResult], None] | None = None) -> OptionRun:
    opts = ReplayOptions(
        concurrency=settings.concurrency,
        think_time=ThinkTime("scale", settings.think_scale),
        history="live",
        max_think_ms=settings.max_think_ms,
        timeout_s=settings.timeout_s,
        time_scale=settings.speed,
        session_suffix=new_session_suffix(),
    )
    decode_times = DecodeTimes()
    async with option_gateway(option, shape, settings.speed, settings.learn_estimates, decode_times) as (url, model):
        opts.model = model
        run = await run_replay(sessions, url, opts, on_result)
    return OptionRun(run, decode_times.tpot_ms())


def timings(run: ReplayRun) -> list[TurnTiming]:
    return [TurnTiming(turn=r.turn, ttft_ms=r.ttft_ms, tpot_ms=r.tpot_ms, ok=r.ok)
            for r in run.results if not r.skipped]
