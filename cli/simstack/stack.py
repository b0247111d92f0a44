"""One simulated stack: a simulated vLLM cluster of a given shape and the kvtether gateway in front of it, in this
process, configured for a serving option. `replay --sim`, `assess`, `demo` and the benchmarks all start it here.

A serving option is a gateway policy on a P/D cluster (``no-pull``, ``reference``, ``pull``, ``auto``, ``dynamo``,
``llm-d``); ``colocated``: as many aggregated nodes as the P/D shape has nodes (the same GPU count), each
serving prefill and decode with its own prefix cache, behind the gateway in aggregated mode; or ``hybrid``: as many
pool instances (kv_both, bidirectional), behind the gateway's ``auto`` policy, which runs each turn on the session's
instance or prefills it on another that pulls the history (docs/pool.md).

Time. On a virtual clock (the stack started inside ``sim.virtual.run_virtual``: the running loop is a
``VirtualLoop``) everything reads one clock, the loop's: the nodes, the gateway (``create_app(clock=…)``) and the
caller's clients; the speed is 1, every figure is exact and repeatable, and the gateway's own CPU, which virtual
time does not see, is modelled (gateway_cost.py). On the wall clock the simulator's clock runs ``speed`` times
real time and the gateway's clock is real. So every time setting of the stack is given in simulated seconds
(``StackTimes``) and the gateway gets each as simulated / speed real seconds (``time_settings``, the one rule):
its session TTL below the engines' ``decoder_kv_blocks_ttl``, the engine TTL it checks that against, its
retention review and its expired-session sweep. The engines get their TTL as it is (their clock is the
simulated one).

Estimator seeds. On a P/D cluster the gateway's estimator starts from seeds calibrated on the preset's cost model
and converted to real seconds at ``speed`` (``seed_settings``, calibration.py): what an operator sets from a short
benchmark of the cluster, so that ``auto`` decides as on a cluster whose speed it has measured.

Everything else is the gateway's default unless the caller overrides it (``gateway=``, applied last). A caller
that sets the gateway's settings itself (a test pinning a mechanism down) asks for ``calibrated=False``: the
gateway's defaults, the option's policy and ``gateway=``, no time rule and no seeds. ``oracle=True`` starts one
more node beside the cluster, an aggregated node that answers the same requests directly, to compare the
gateway's answers with.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import sys
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from kvtether.cli.simstack.gateway_cost import CostedGateway, GatewayCost, default_cost

if TYPE_CHECKING:
    from kvtether.gateway.config import GatewayConfig
    from kvtether.gateway.shell.app import GatewayApp
    from kvtether.gateway.stores import SessionStore
    from kvtether.sim.cluster import ClusterSpec, SimCluster

COLOCATED = "colocated"
HYBRID = "hybrid"
ONE_POOL = (COLOCATED, HYBRID)  # options whose cluster is instances that take both roles
# Prefix caching on a simulated cluster's prefill nodes. Off, as in vLLM's published P/D runs: a simulated
# cluster serves only the sessions run on it, so with it on one P keeps every history cached, which a P shared
# by the rest of a production cluster's sessions does not; the pull would then have nothing left to save.
DEFAULT_PREFILL_PREFIX_CACHING = False
# The floors of the two intervals in real seconds: a fast clock must not turn the review or the sweep into a
# busy loop (below them the gateway would spend its time reviewing, not serving).
MIN_RETENTION_INTERVAL_S = 0.05
MIN_SWEEP_INTERVAL_S = 1.0


@dataclass(frozen=True, slots=True)
class StackTimes:
    """The stack's time settings, in simulated seconds (the gateway's defaults, vLLM's decoder_kv_blocks_ttl)."""

    engine_kv_ttl_s: float = 480.0  # the engines' decoder_kv_blocks_ttl, and the gateway's engine_kv_ttl_s
    session_ttl_s: float = 450.0  # the gateway stops sending a handle after this: below the engine's TTL
    retention_interval_s: float = 1.0  # the gateway reviews its held handles this often
    sweep_interval_s: float = 10.0  # and drops expired sessions this often
    # The most a turn waits for a limit to clear, and how often it is placed again meanwhile: engine time, like
    # the objectives the wait protects. None: the gateway's defaults.
    defer_max_s: float | None = None
    defer_step_s: float | None = None


@dataclass(frozen=True, slots=True)
class StackSpec:
    """The shape of a simulated stack: a P/D cluster of `prefill` + `decode` nodes of `preset` (the colocated
    option: as many aggregated nodes), its clock `speed` times real time."""

    preset: str
    prefill: int = 1
    decode: int = 1
    speed: float = 1.0
    times: StackTimes = field(default_factory=StackTimes)
    prefill_prefix_caching: bool = DEFAULT_PREFILL_PREFIX_CACHING
    # Further ClusterSpec fields (kv_lease_duration, bidirectional, tool_call_parser, …), as given.
    cluster: Mapping[str, Any] = field(default_factory=dict)


def time_settings(times: StackTimes, speed: float) -> dict[str, float]:
    """The gateway's time settings in its real seconds: each simulated time ÷ speed (the intervals floored)."""
    return {
        "session_ttl_s": times.session_ttl_s / speed,
        "engine_kv_ttl_s": times.engine_kv_ttl_s / speed,
        "retention_interval_s": max(MIN_RETENTION_INTERVAL_S, times.retention_interval_s / speed),
        "sweep_interval_s": max(MIN_SWEEP_INTERVAL_S, times.sweep_interval_s / speed),
    }


def seed_settings(preset: str, speed: float) -> dict[str, float]:
    """The gateway estimator's seeds calibrated on `preset`'s cost model, in real seconds at `speed`."""
    from kvtether.cli.simstack.calibration import calibrated_seeds
    from kvtether.sim.presets import get_preset

    return calibrated_seeds(get_preset(preset), speed)


def gateway_settings(spec: StackSpec, option: str) -> dict[str, Any]:
    """The gateway's settings for `option` on a stack of `spec`, but for the node URLs: the time rule, and on a
    P/D cluster the policy and the calibrated seeds."""
    if option == COLOCATED:
        return time_settings(spec.times, spec.speed)
    from kvtether.gateway.policy.knobs import PolicyKnobs

    policy = "auto" if option == HYBRID else option
    times, knobs = spec.times, PolicyKnobs()
    defer_max = knobs.defer_max_s if times.defer_max_s is None else times.defer_max_s
    defer_step = knobs.defer_step_s if times.defer_step_s is None else times.defer_step_s
    from kvtether.sim.presets import get_preset

    # The engines' step budget (vLLM --max-num-batched-tokens), as an operator sets chunk_tokens to it: with the
    # gateway's 2,048 against the presets' 8,192, a 5k-token prefill leg was planned as three steps of a third of
    # its stall each, and an answer placed beside it took all of it in one.
    return {"policy": policy, **time_settings(times, spec.speed), **seed_settings(spec.preset, spec.speed),
            "chunk_tokens": get_preset(spec.preset).max_num_batched_tokens,
            "defer_max_s": defer_max / spec.speed, "tuning": {"defer_step_s": defer_step / spec.speed}}


def _policy_settings(option: str) -> dict[str, Any]:
    """The gateway's settings for `option` when the caller sets the rest (``calibrated=False``): its policy."""
    return {} if option == COLOCATED else {"policy": "auto" if option == HYBRID else option}


def cluster_spec(spec: StackSpec, option: str) -> ClusterSpec:
    from kvtether.sim.cluster import ClusterSpec

    colocated = option in ONE_POOL
    return ClusterSpec(prefill=0 if colocated else spec.prefill, decode=0 if colocated else spec.decode,
                       aggregated=spec.prefill + spec.decode if colocated else 0, preset=spec.preset,
                       speed=spec.speed, decoder_kv_blocks_ttl=spec.times.engine_kv_ttl_s,
                       prefill_prefix_caching=spec.prefill_prefix_caching, **spec.cluster)


def _sample_sums(registry: Any, name: str, label: str | None = None) -> dict[str, float]:
    """Sum a metric's samples, by the value of `label` (or under "" for all), from a prometheus registry."""
    out: dict[str, float] = {}
    for family in registry.collect():
        for sample in family.samples:
            if sample.name == name:
                key = sample.labels.get(label, "") if label else ""
                out[key] = out.get(key, 0.0) + float(sample.value)
    return out


@dataclass(slots=True)
class SimStack:
    """A running simulated stack: the gateway's URL, the model it serves, its configuration and app, and the
    cluster (None when it runs in a process of its own); on a virtual clock, the clock and the modelled gateway."""

    url: str
    model: str
    config: GatewayConfig
    app: GatewayApp
    cluster: SimCluster | None
    urls: dict[str, list[str]]  # the nodes by role: prefill, decode, aggregated
    clock: Callable[[], float] | None = None  # the virtual loop's time; None on the wall clock
    costed: CostedGateway | None = None  # the gateway's modelled CPU (virtual time only)
    oracle: str | None = None  # the URL of the aggregated node answering directly (``oracle=True``)

    @property
    def virtual(self) -> bool:
        return self.clock is not None

    def gateway_model(self) -> dict[str, Any] | None:
        """The modelled gateway's parameters and what it did (gateway_cost.py); None on the wall clock."""
        return None if self.costed is None else self.costed.report()

    def counters(self) -> dict[str, Any]:
        """What the run did to the handles and where each node's prompt tokens came from, as counted so far.

        ``handle_outcomes``: the gateway's ``kvtether_handle_outcomes_total`` by outcome (``truncated``: the new
        prompt departed from what D held, and only the common prefix was reused). ``prompt_tokens_by_source``:
        per role (prefill, decode), vLLM's ``prompt_tokens_by_source`` summed over the role's nodes
        (``local_compute``, ``local_cache_hit``: the node's own prefix cache, ``external_kv_transfer``: pulled or
        pushed KV). ``prefix_cache_hits`` / ``prefix_cache_queries``: vLLM's counters, tokens, per role.
        """
        assert self.cluster is not None, "the counters read the in-process cluster's nodes"
        metrics = self.app.state.gateway.metrics
        outcomes = _sample_sums(metrics.registry, "kvtether_handle_outcomes_total", "outcome")
        by_role: dict[str, dict[str, float]] = {}
        hits: dict[str, float] = {}
        queries: dict[str, float] = {}
        for node in self.cluster.nodes:
            role = node.cfg.role
            reg = node.metrics.registry
            sources = by_role.setdefault(role, {})
            for source, v in _sample_sums(reg, "vllm:prompt_tokens_by_source_total", "source").items():
                sources[source] = sources.get(source, 0.0) + v
            hits[role] = hits.get(role, 0.0) + sum(_sample_sums(reg, "vllm:prefix_cache_hits_total").values())
            queries[role] = queries.get(role, 0.0) + sum(_sample_sums(reg, "vllm:prefix_cache_queries_total").values())
        return {
            "handle_outcomes": {k: int(v) for k, v in sorted(outcomes.items()) if v},
            "reused_tokens": int(sum(_sample_sums(metrics.registry, "kvtether_reused_tokens_total").values())),
            "prompt_tokens_by_source": {r: {k: int(v) for k, v in sorted(s.items())} for r, s in by_role.items()},
            "prefix_cache_hits": {k: int(v) for k, v in hits.items()},
            "prefix_cache_queries": {k: int(v) for k, v in queries.items()},
        }


# The cluster in a child process of its own (what `kvtether sim --json` does), printing its URLs.
_SERVE_SIM = """
import asyncio, json, sys
from kvtether.sim.cluster import ClusterSpec, SimCluster

async def main():
    async with SimCluster(ClusterSpec(**json.loads(sys.argv[1]))) as cluster:
        print(json.dumps(cluster.urls()), flush=True)
        await asyncio.Event().wait()

asyncio.run(main())
"""


@contextlib.asynccontextmanager
async def _cluster(spec: ClusterSpec, separate: bool,
                   clock: Callable[[], float] | None) -> AsyncIterator[tuple[dict[str, list[str]], SimCluster | None]]:
    """(the nodes' URLs by role, the in-process cluster or None). In-process by default: one Python process (one
    GIL) then runs the engines, the gateway and the clients, so the gateway's CPU time also delays the simulated
    engines. Separate: the engines get a core of their own, as vLLM's servers would."""
    from kvtether.sim.cluster import SimCluster

    if not separate:
        async with SimCluster(spec, clock=clock) as cluster:
            yield cluster.urls(), cluster
        return
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", _SERVE_SIM, json.dumps(asdict(spec)),
                                                stdout=asyncio.subprocess.PIPE)
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 120)
        if not line:
            raise RuntimeError(f"the simulated cluster exited before it listened (rc {await proc.wait()})")
        yield json.loads(line), None
    finally:
        if proc.returncode is None:
            proc.terminate()
            await proc.wait()


@contextlib.asynccontextmanager
async def _oracle(spec: ClusterSpec, wanted: bool, clock: Callable[[], float] | None) -> AsyncIterator[str | None]:
    """The oracle's URL (None unless `wanted`): an aggregated node of the cluster's preset, speed, model and seed,
    the simulator's defaults otherwise, so its answers are the ones the cluster's nodes give."""
    if not wanted:
        yield None
        return
    from kvtether.sim.cluster import ClusterSpec, SimCluster

    ospec = ClusterSpec(prefill=0, decode=0, aggregated=1, preset=spec.preset, speed=spec.speed,
                        model_name=spec.model_name, seed=spec.seed)
    async with SimCluster(ospec, clock=clock) as oracle:
        yield oracle.aggregated_urls[0]


def _config(spec: StackSpec, option: str, urls: Mapping[str, list[str]],
            overrides: Mapping[str, Any], calibrated: bool) -> GatewayConfig:
    """The gateway's configuration: its defaults, the stack's settings (only the policy unless `calibrated`),
    then `overrides`. Not from the environment: a simulated stack must not take the operator's secrets (API
    keys) for its own."""
    from kvtether.gateway.config import GatewayConfig

    nodes: dict[str, Any] = ({"aggregated": list(urls["aggregated"])} if option == COLOCATED
                             else {"nodes": list(urls["aggregated"])} if option == HYBRID
                             else {"prefill": list(urls["prefill"]), "decode": list(urls["decode"])})
    stack = gateway_settings(spec, option) if calibrated else _policy_settings(option)
    # The gateway knows the nodes' --stream-interval, as an operator sets it to what vLLM runs with.
    chunks = {"stream_interval": spec.cluster["stream_interval"]} if "stream_interval" in spec.cluster else {}
    settings: dict[str, Any] = {**nodes, **stack, **chunks, **overrides}
    return dataclasses.replace(GatewayConfig(), **settings).validate()


def _virtual_clock(spec: StackSpec, separate_process: bool, calibrated: bool) -> Callable[[], float] | None:
    """The running virtual loop's clock, or None on a real loop; what a virtual stack cannot be refused (a
    calibrated one runs at speed 1: its figures are the cost model's, exactly)."""
    from kvtether.sim.virtual import current_virtual_loop

    loop = current_virtual_loop()
    if loop is None:
        return None
    if calibrated and spec.speed != 1.0:
        raise ValueError("a stack on a virtual clock runs at speed 1 (its time is exact; --speed is for live runs)")
    if separate_process:
        raise ValueError("a stack on a virtual clock runs in one process: the cluster cannot have one of its own")
    return loop.time


@contextlib.asynccontextmanager
async def sim_stack(spec: StackSpec, option: str, *, gateway: Mapping[str, Any] | None = None,
                    calibrated: bool = True, oracle: bool = False, store: SessionStore | None = None,
                    tracer_provider: Any = None, separate_process: bool = False,
                    gateway_cost: GatewayCost | None = None) -> AsyncIterator[SimStack]:
    """A fresh simulated cluster of `spec`'s shape for `option` and an in-process gateway in front of it.

    `gateway`: settings over the stack's (GatewayConfig field names, real seconds). `calibrated=False`: the stack
    as the caller spells it, for a test that pins each setting itself: `gateway` over the gateway's defaults and
    the option's policy, the nodes as `spec` says at any speed, and on a virtual loop the lease's real-time floor
    kept and the gateway free unless `gateway_cost` is given. `oracle`: an aggregated node beside the
    cluster that answers directly (``SimStack.oracle``). `store`: the gateway's session store (None: the one its
    configuration names). `tracer_provider`: the gateway's spans go there. `separate_process`: the cluster runs in a
    child process (no ``cluster`` then).
    On a virtual loop (``sim.virtual.run_virtual``) the stack runs on its clock (module docstring), its gateway
    behind `gateway_cost` (None: the measured default for the option, gateway_cost.py; ``NO_COST``: free); it
    keeps its sessions in memory (a Redis store would wait on real I/O: refused).
    A stop signal (Ctrl-C, SIGTERM) stops the gateway as after a normal run before it goes on: handed the
    cancellation, the server would be cancelled mid-shutdown and uvicorn would log its lifespan's traceback."""
    from kvtether.gateway.shell.app import create_app
    from kvtether.gateway.shell.server import serve_gateway

    clock = _virtual_clock(spec, separate_process, calibrated)
    cspec = cluster_spec(spec, option)
    if clock is not None and calibrated:
        # The lease's real-time floor guards a live run against this machine's stalls; virtual time has none.
        cspec = dataclasses.replace(cspec, kv_lease_real_floor_s=0.0)
    async with _cluster(cspec, separate_process, clock) as (urls, cluster), \
            _oracle(cspec, oracle, clock) as oracle_url:
        config = _config(spec, option, urls, gateway or {}, calibrated)
        if clock is not None and config.store != "memory":
            raise ValueError("a stack on a virtual clock keeps its sessions in memory: a Redis or Valkey store "
                             "answers on the wall clock (leave the `store` setting unset)")
        app = create_app(config, store=store, tracer_provider=tracer_provider, clock=clock)
        free = not calibrated and gateway_cost is None
        costed = None if clock is None or free else CostedGateway(
            app, gateway_cost or default_cost(aggregated=option == COLOCATED, workers=1), clock)
        stopped: BaseException | None = None
        async with serve_gateway(config, app=costed or app) as url:
            try:
                yield SimStack(url=str(url), model=cspec.model_name, config=config, app=app, cluster=cluster,
                               urls=urls, clock=clock, costed=costed, oracle=oracle_url)
            except (asyncio.CancelledError, KeyboardInterrupt) as e:
                stopped = e
        if stopped is not None:
            raise stopped
