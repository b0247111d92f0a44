"""Question 4's runs: the same sessions on the simulator, once per serving option, at the same GPU count.

- ``no-pull``, ``reference``, ``auto``: P/D (the shape's prefill and decode nodes) behind the kvtether gateway
  with that policy: classic disaggregation (P recomputes the history), vLLM's reference proxy (round-robin,
  the handle attached whenever held), and kvtether's per-turn choice.
- ``hybrid``: as many pool instances (kv_both), behind the gateway's ``auto`` policy, which runs each turn on the
  session's instance or prefills it on another one that pulls the history (docs/pool.md).
- ``colocated``: as many aggregated nodes as the P/D cluster has nodes, each serving prefill and decode with its
  own prefix cache (vLLM's default), behind the same gateway in aggregated mode, which pins every session to a
  replica (``plan_aggregated``): session affinity, so a replica's prefix cache serves the session's history.
  That is the "colocated serving with cache-aware routing" of the public comparisons, run by the same engine
  model as the P/D options: the only difference between the runs is the topology and the policy.

Each run is a fresh simulated stack in this process (``cli/simstack``: the cluster and the gateway in front),
replayed with ``cli/replay/engine.py`` (closed loop, the sessions' recorded gaps, the answers the simulated model
gives threaded into the next turn's history). The simulator's clock runs ``speed`` times faster than real time;
the gateway's clock is real, so the stack gives it its time settings (handle TTLs, retention interval) divided by
``speed``, and estimator seeds calibrated on the cost model at that speed.

TTFT is the client's measurement (real time × ``speed``). TPOT is the engine's own (:class:`DecodeTimes`): the
time between a request's first and last token counted in the cost model's step durations, so that the TPOT
objective, which decides which options may win, does not move with this machine's load: a decode step lasts
milliseconds, the same order as the Python work of streaming its token through the node, the gateway and the
client, which the client's clock multiplies by ``speed``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
from kvtether.cli.assess.analysis import TurnTiming
from kvtether.cli.assess.cluster import ClusterShape, register_preset
from kvtether.cli.replay.engine import (
    OPEN_LOOP_CAP,
    Arrivals,
    ReplayOptions,
    ReplayRun,
    ThinkTime,
    TurnResult,
    join_engine_tpot,
    new_session_suffix,
    run_replay,
)
from kvtether.cli.simstack import COLOCATED, HYBRID, SimStack, StackSpec, StackTimes, sim_stack
from kvtether.cli.simstack.decode_times import DecodeTimes
from kvtether.cli.simstack.gateway_cost import default_cost
from kvtether.cli.streaming import loop_clock_ns, now_ns
from kvtether.sdk.sessionfile import SessionRecord

PD_POLICIES: tuple[str, ...] = ("no-pull", "reference", "auto")
OPTIONS: tuple[str, ...] = (*PD_POLICIES, COLOCATED, HYBRID)
DESCRIPTIONS = {
    "no-pull": "P/D, P recomputes the history (classic disaggregation)",
    "reference": "P/D, vLLM's reference proxy: round-robin, handle attached whenever held",
    "auto": "P/D behind kvtether: per turn decode-local, pull or cold",
    "pull": "P/D behind kvtether: always pull when a verified handle is held",
    COLOCATED: "aggregated nodes (prefill + decode each), session-affine routing to the replica's prefix cache",
    HYBRID: "a pool of instances that take both roles behind kvtether: per turn local on the session's instance, "
            "or prefilled on another that pulls the history",
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
    tpot_objective_ms: float | None = None  # what auto holds decode-local turns to (None: the gateway's default)
    ttft_objective_ms: float | None = None  # what auto's look-ahead never trades a turn past (None: none)
    # Closed loop (the sessions as recorded together) or open loop: each session at its start offset ÷ rate.
    arrivals: Arrivals = "closed"
    rate: float = 1.0
    # On one virtual clock (sim/virtual.py): each option's run in a fresh virtual loop at speed 1, its figures
    # exact and repeatable, the gateway's CPU modelled. Off: the wall clock × `speed`.
    virtual: bool = False

    def __post_init__(self) -> None:
        if self.virtual and self.speed != 1.0:
            raise ValueError("a virtual run is at speed 1")


def option_stack_spec(shape: ClusterShape, speed: float) -> StackSpec:
    """The simulated stack of `shape` (its preset, as changed, known to the simulator), its clock at `speed`."""
    return StackSpec(preset=register_preset(shape), prefill=shape.prefill, decode=shape.decode, speed=speed,
                     times=StackTimes(engine_kv_ttl_s=shape.decoder_kv_blocks_ttl_s, session_ttl_s=shape.session_ttl_s),
                     prefill_prefix_caching=shape.prefill_prefix_caching)


@asynccontextmanager
async def option_gateway(option: str, shape: ClusterShape, speed: float, learn_estimates: bool = True,
                         decode_times: DecodeTimes | None = None,
                         tpot_objective_ms: float | None = None,
                         ttft_objective_ms: float | None = None, gateway_workers: int = 1,
                         tuning: Mapping[str, Any] | None = None) -> AsyncIterator[SimStack]:
    """A fresh simulated stack of `shape` for `option` (simstack), yielded: its URL, model name and modelled
    gateway. The gateway keeps the shape's held-KV budget and polls its nodes every 0.5 s; `learn_estimates` off
    keeps the calibrated seeds.
    `decode_times`, when given, watches the nodes that decode (decode and aggregated). `tpot_objective_ms`: the
    TPOT objective (simulated ms) the auto policy holds decode-local turns to (its tpot_budget_s);
    `ttft_objective_ms`: the TTFT objective its look-ahead never trades a turn past (its ttft_objective_s).
    `gateway_workers`: in virtual time, the gateway processes modelled (cli/simstack/gateway_cost.py).
    `tuning`: [gateway.tuning] overrides (a rule under evaluation, say) for every option but colocated serving."""
    # Connections to the nodes: as many as the cluster runs requests (every node's max_num_seqs), twice over for
    # P/D's two legs, as an operator sizes them; the gateway's default (512) would cap the load where the nodes
    # do not (chat at ×64 and more keeps hundreds of answers streaming on three nodes).
    connections = max(512, 2 * (shape.prefill + shape.decode) * shape.preset.max_num_seqs)
    settings: dict[str, Any] = {
        "held_kv_budget": shape.held_kv_budget if shape.held_kv_budget is not None else 1.0,
        "metrics_poll_interval_s": 0.5, "learn_estimates": learn_estimates,
        "max_connections": connections}
    if tpot_objective_ms and option != COLOCATED:
        # The gateway runs on the real clock, the engines at `speed`: a simulated objective is 1/speed of it.
        settings["tpot_budget_s"] = tpot_objective_ms / 1000.0 / speed
    if ttft_objective_ms and option != COLOCATED:
        settings["ttft_objective_s"] = ttft_objective_ms / 1000.0 / speed
    if tuning and option != COLOCATED:
        settings["tuning"] = dict(tuning)
    cost = default_cost(aggregated=option == COLOCATED, workers=gateway_workers)
    async with sim_stack(option_stack_spec(shape, speed), option, gateway=settings, gateway_cost=cost) as stack:
        if decode_times is not None and stack.cluster is not None:
            decode_times.watch_decoding(stack.cluster)
        yield stack


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
        # A fresh cluster per run needs no suffix; a virtual run keeps the recorded ids, so it repeats exactly.
        session_suffix="" if settings.virtual else new_session_suffix(),
        arrivals=settings.arrivals,
        rate=settings.rate,
        # In virtual time the network is in memory: no cap on sessions in flight (engine.OPEN_LOOP_CAP).
        open_loop_cap=None if settings.virtual else OPEN_LOOP_CAP,
    )
    decode_times = DecodeTimes()
    async with option_gateway(option, shape, settings.speed, settings.learn_estimates, decode_times,
                              settings.tpot_objective_ms, settings.ttft_objective_ms) as stack:
        opts.model = stack.model
        run = await run_replay(sessions, stack.url, opts, on_result,
                               clock_ns=loop_clock_ns() if settings.virtual else now_ns, lean_http=settings.virtual)
        run.gateway_model = stack.gateway_model()
    join_engine_tpot(run.results, decode_times.tpot_by_request())  # each turn judged by its engine TPOT
    return OptionRun(run, decode_times.tpot_ms())


def run_option_sync(option: str, sessions: Sequence[SessionRecord], shape: ClusterShape,
                    settings: RunSettings) -> OptionRun:
    """`run_option` in an event loop of its own: a fresh virtual loop when `settings.virtual`."""
    if settings.virtual:
        from kvtether.sim.virtual import run_virtual

        return run_virtual(run_option, option, sessions, shape, settings)
    return anyio.run(run_option, option, sessions, shape, settings)


def timings(run: ReplayRun) -> list[TurnTiming]:
    return [TurnTiming(turn=r.turn, ttft_ms=r.ttft_ms, tpot_ms=r.tpot_ms, ok=r.ok)
            for r in run.results if not r.skipped]
