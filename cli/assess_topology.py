"""Question 4's runs: the same sessions on the simulator, once per serving option, at the same GPU count.

- ``no-pull``, ``reference``, ``auto``: P/D (the shape's prefill and decode nodes) behind the kvtether gateway
  with that policy: classic disaggregation (P recomputes the history), vLLM's reference proxy (round-robin,
  the handle attached whenever held), and kvtether's per-turn choice.
- ``colocated``: as many aggregated nodes as the P/D cluster has nodes, each serving prefill and decode with its
  own prefix cache (vLLM's default), behind the same gateway in aggregated mode, which pins every session to a
  replica (``plan_aggregated``): session affinity, so a replica's prefix cache serves the session's history.
  That is the "colocated serving with cache-aware routing" of the public comparisons, run by the same engine
  model as the P/D options: the only difference between the runs is the topology and the policy.

Each run is a fresh cluster and gateway in this process, replayed with ``cli/replay.py`` (closed loop, the
sessions' recorded gaps, the answers the simulated model gives threaded into the next turn's history). The
simulator's clock runs ``speed`` times faster than real time; the gateway's clock is real, so its time
settings (handle TTLs, idle release, retention interval, estimator seeds) are divided by ``speed``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

from kvtether.cli.assess_analysis import TurnTiming
from kvtether.cli.assess_cluster import ClusterShape, register_preset
from kvtether.cli.replay import ReplayOptions, ReplayRun, ThinkTime, TurnResult, new_session_suffix, run_replay
from kvtether.sdk.sessionfile import SessionRecord

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


def calibrated_seeds(shape: ClusterShape, speed: float) -> dict[str, float]:
    """The gateway estimator's seeds from the shape's cost model, in the gateway's (real) seconds: what an
    operator sets from a short benchmark of the cluster. prefill ≈ a + b·n + c·n·(ctx + n/2) by relative least
    squares; transfer = latency + per token; decode step = base + per sequence; queue = a typical prefill."""
    c, p = shape.cost, shape.preset
    pts = [(n, ctx) for n in (64, 512, 2048, 8192, 16384) for ctx in (0, 8192)]
    rows = [(1.0, float(n), n * (ctx + n / 2)) for n, ctx in pts]
    ys = [c.lone_prefill_seconds(n, ctx, p.max_num_batched_tokens) for n, ctx in pts]
    coef = _lstsq(rows, ys)
    t1, t2 = c.transfer_seconds(1000), c.transfer_seconds(20000)
    per_tok = (t2 - t1) / 19000
    step = c.hardware.step_overhead
    d1, d16 = c.decode_seconds([12000]) + step, c.decode_seconds([12000] * 16) + step
    per_seq = (d16 - d1) / 15
    seeds = {
        "seed_prefill_overhead_s": max(coef[0], 1e-4), "seed_prefill_s_per_token": max(coef[1], 1e-8),
        "seed_prefill_s_per_pair": max(coef[2], 1e-13), "seed_transfer_latency_s": max(t1 - 1000 * per_tok, 1e-4),
        "seed_transfer_s_per_token": max(per_tok, 1e-9), "seed_tpot_base_s": max(d1 - per_seq, 1e-4),
        "seed_tpot_s_per_seq": max(per_seq, 1e-6),
        "seed_queue_s_per_request": c.lone_prefill_seconds(4000, 0, p.max_num_batched_tokens),
    }
    return {k: v / speed for k, v in seeds.items()}


def _lstsq(rows: list[tuple[float, float, float]], ys: list[float]) -> list[float]:
    """Relative least squares (each point weighted by 1/y) for 3 unknowns, by normal equations."""
    a = [[0.0] * 3 for _ in range(3)]
    b = [0.0] * 3
    for row, y in zip(rows, ys, strict=True):
        w = 1.0 / (y * y) if y > 0 else 0.0
        for i in range(3):
            b[i] += w * row[i] * y
            for j in range(3):
                a[i][j] += w * row[i] * row[j]
    # Gaussian elimination with partial pivoting.
    m = [[*a[i], b[i]] for i in range(3)]
    for col in range(3):
        piv = max(range(col, 3), key=lambda r: abs(m[r][col]))
        m[col], m[piv] = m[piv], m[col]
        if abs(m[col][col]) < 1e-300:
            return [0.0, 0.0, 0.0]
        for r in range(3):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col], strict=True)]
    return [m[i][3] / m[i][i] for i in range(3)]


@asynccontextmanager
async def option_gateway(option: str, shape: ClusterShape, speed: float, learn_estimates: bool = True,
                         ) -> AsyncIterator[tuple[str, str]]:
    """A fresh simulated cluster for `option` and an in-process gateway in front; yields (URL, model name)."""
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
        timing = {
            "session_ttl_s": shape.session_ttl_s / speed, "engine_kv_ttl_s": shape.decoder_kv_blocks_ttl_s / speed,
            "idle_release_s": shape.idle_release_s / speed, "retention_interval_s": max(0.05, 1.0 / speed),
            "held_kv_budget": shape.held_kv_budget if shape.held_kv_budget is not None else 1.0,
            "metrics_poll_interval_s": 0.5, "learn_estimates": learn_estimates,
        }
        if option == COLOCATED:
            config = load_config(None, aggregated=list(cluster.aggregated_urls), **timing)
        else:
            config = load_config(None, prefill=list(cluster.prefill_urls), decode=list(cluster.decode_urls),
                                 policy=option, **timing, **calibrated_seeds(shape, speed))
        async with serve_gateway(config) as url:
            yield str(url), spec.model_name


async def run_option(option: str, sessions: Sequence[SessionRecord], shape: ClusterShape, settings: RunSettings,
                     on_result: Callable[[TurnResult], None] | None = None) -> ReplayRun:
    opts = ReplayOptions(
        concurrency=settings.concurrency,
        think_time=ThinkTime("scale", settings.think_scale),
        history="live",
        max_think_ms=settings.max_think_ms,
        timeout_s=settings.timeout_s,
        time_scale=settings.speed,
        session_suffix=new_session_suffix(),
    )
    async with option_gateway(option, shape, settings.speed, settings.learn_estimates) as (url, model):
        opts.model = model
        return await run_replay(sessions, url, opts, on_result)


def timings(run: ReplayRun) -> list[TurnTiming]:
    return [TurnTiming(turn=r.turn, ttft_ms=r.ttft_ms, tpot_ms=r.tpot_ms, ok=r.ok)
            for r in run.results if not r.skipped]
