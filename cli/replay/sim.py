"""Replay on a simulated cluster: a fresh simulated P/D cluster and gateway per run, its counters read before
it stops."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from kvtether.cli.replay.engine import ReplayOptions, ReplayRun, TurnResult, join_engine_tpot, run_replay
from kvtether.cli.simstack import DEFAULT_PREFILL_PREFIX_CACHING
from kvtether.sdk.sessionfile import SessionRecord

if TYPE_CHECKING:
    from kvtether.gateway.shell.app import GatewayApp
    from kvtether.sim.cluster import SimCluster



@dataclass(frozen=True, slots=True)
class SimTarget:
    """A simulated P/D cluster (a hardware preset and its shape) behind an in-process gateway, fresh per run."""

    preset: str
    prefill: int = 1
    decode: int = 2
    speed: float = 1.0  # simulated seconds per real second; a replay on it reports simulated time
    prefill_prefix_caching: bool = DEFAULT_PREFILL_PREFIX_CACHING

    def describe(self) -> str:
        caching = "on" if self.prefill_prefix_caching else "off"
        return (
            f"simulated {self.preset}, {self.prefill} prefill + {self.decode} decode, "
            f"prefix caching on P {caching}, clock = real × {self.speed:g}"
        )

    def to_json(self) -> dict[str, Any]:
        return {"kind": "sim", **asdict(self)}


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
class SimGateway:
    """A running simulated cluster and the gateway in front of it (``sim_gateway``)."""

    url: str
    model: str
    cluster: SimCluster
    app: GatewayApp

    def counters(self) -> dict[str, Any]:
        """What the run did to the handles and where each node's prompt tokens came from, as counted so far.

        ``handle_outcomes``: the gateway's ``kvtether_handle_outcomes_total`` by outcome (``truncated``: the new
        prompt departed from what D held, and only the common prefix was reused). ``prompt_tokens_by_source``:
        per role (prefill, decode), vLLM's ``prompt_tokens_by_source`` summed over the role's nodes
        (``local_compute``, ``local_cache_hit``: the node's own prefix cache, ``external_kv_transfer``: pulled or
        pushed KV). ``prefix_cache_hits`` / ``prefix_cache_queries``: vLLM's counters, tokens, per role.
        """
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


@asynccontextmanager
async def sim_gateway(target: SimTarget, policy: str) -> AsyncIterator[SimGateway]:
    """A fresh simulated cluster and an in-process gateway (with `policy`) in front of it."""
    # Imported here: a replay against a running gateway must not pay for (or depend on) the simulator.
    from kvtether.gateway.config import GatewayConfig
    from kvtether.gateway.shell.app import create_app
    from kvtether.gateway.shell.server import serve_gateway
    from kvtether.sim.cluster import ClusterSpec, SimCluster

    spec = ClusterSpec(
        prefill=target.prefill,
        decode=target.decode,
        preset=target.preset,
        speed=target.speed,
        prefill_prefix_caching=target.prefill_prefix_caching,
    )
    async with SimCluster(spec) as cluster:
        config = GatewayConfig(prefill=list(cluster.prefill_urls), decode=list(cluster.decode_urls), policy=policy)
        app = create_app(config.validate())
        async with serve_gateway(config, app=app) as url:
            yield SimGateway(url=str(url), model=spec.model_name, cluster=cluster, app=app)


async def replay_sim(
    sessions: Sequence[SessionRecord],
    target: SimTarget,
    policy: str,
    opts: ReplayOptions,
    on_result: Callable[[TurnResult], None] | None = None,
) -> ReplayRun:
    """Replay `sessions` on a fresh simulated cluster behind a gateway running `policy`.

    Times are simulated (``opts.time_scale`` is set to the target's speed); the model name defaults to the
    simulator's (it serves one). The run's ``counters`` are read before the cluster stops. Each answer's
    ``engine_tpot_ms`` is the decoding engine's own (``assess.topology.DecodeTimes``), which this machine's load
    does not inflate as it does the client's.
    """
    from kvtether.cli.assess.topology import DecodeTimes  # here: it imports this module

    async with sim_gateway(target, policy) as gw:
        decode_times = DecodeTimes()
        for node in gw.cluster.nodes:
            if node.cfg.role != "prefill":
                decode_times.watch(node.engine)
        run_opts = dataclasses.replace(opts, model=opts.model or gw.model, time_scale=target.speed)
        run = await run_replay(sessions, gw.url, run_opts, on_result)
        run.counters = gw.counters()
    join_engine_tpot(run.results, decode_times.tpot_by_request())
    run.engine_tpot = True
    return run
