"""Decode memory at the scale where it matters: many agent sessions on a decode node too small for all of them.

Every P/D turn leaves its KV held on its decode node D (bidirectional_kv_xfer) until a prefill pulls it, the
gateway releases it (a one-token prefill carrying the handle), or D's ``decoder_kv_blocks_ttl`` runs out.
Held blocks count as used KV and nothing evicts them: once they fill D, new requests wait and running ones are
preempted (docs/operations.md, "Decode memory"). This benchmark runs the same generated sessions through the
gateway against a fresh simulated cluster per run:

  no-pull         classic P/D: the simulated nodes run *without* bidirectional_kv_xfer (the faithful classic
                  set-up: D keeps nothing after a turn) and the gateway never attaches a handle
  reference       vLLM's reference multi-turn proxy: round-robin P and D, the last handle attached unchecked,
                  nothing ever released (every hold lasts until a pull or the TTL; release_handles has no
                  effect there)
  auto            kvtether's cost-based placement with the retention manager (gateway defaults: held_kv_budget
                  0.5, releases when D's memory is wanted or a handle expires, the session's last turn released)
  auto-unlimited  the same on decode nodes with the preset's full KV (millions of tokens): nothing is ever
                  short of memory, so its reuse is the ceiling of what auto can reuse on these sessions

A variant ``NAME@setting=value+setting=value`` runs beside them with gateway settings overridden, as given (a
time is the gateway's real seconds, not converted; e.g. ``auto@held_kv_budget=0.3``).

Workload (defaults): 200 agent sessions arriving as a Poisson stream over ``--arrival-s``; each a tool loop of
3–10 turns (``--turns``, ~1,340 turns in all) on a shared 2k-token system prompt; after each answer a tool runs
for a heavy-tailed think time (``--think-mix``, log-uniform within each band: 70 % 1–10 s, 25 % 10–60 s, 5 %
1–5 min) and its result (``--suffix-mix``: mostly 50–500 tokens, some 1–4k) is appended, so prompts grow to
~2.5–13k tokens (4.5k on average). Half the sessions (``--final-share``) mark their last turn with
``x-kvtether-session-final: true``; the others just stop, never to return, without any end signal. Answers are
pinned to ``--output`` tokens (min_tokens + ignore_eos), written as the preset model's tool calls (Qwen3's
hermes). Prefill prefix caching is off (as in vLLM's published reverse-pull figures), so every reused token
comes from D.

Decode memory: D's KV cache is ``--decode-kv-tokens`` per node (vLLM --num-gpu-blocks-override; default 128k
tokens, against the preset's 3.4M), sized so that D cannot hold every session's history for the TTL: the header
prints what that would take (at the defaults 2.7× both D's at peak, 1.5× on average).

Time: two factors, both printed with the results. ``--time-scale`` F (default 3) divides every time of the
workload and of retention: arrivals, think times (1–10 s becomes 0.33–3.3 s), the engine's
decoder_kv_blocks_ttl (480 → 160 s) and the gateway's session_ttl_s (450), engine_kv_ttl_s (480),
retention_interval_s (1), the retention policy's expected gap of a session with one turn so far (180 s, a
constant in gateway/policy/retention.py that orders releases, set on the running gateway) and sweep_interval_s
(10). Compute is not scaled: the
preset's GPU times stay, so the sessions offer F times the load per simulated second they would unscaled (200
sessions over 200 s instead of 600 s); at F = 3 the one prefill node is ~45 % busy on average under no-pull
(~60 % while all sessions are in), at F = 4 it saturated.

Clock: by default the run is in virtual time (docs/simulator.md): the clients, the gateway and the simulated
nodes share one simulated clock, the gateway's CPU is modelled, and every figure is exact and the same on every
machine; the four runs take about two minutes of CPU. ``--realtime`` runs on the wall clock instead, with
``--speed`` S (default 1) as the simulator's clock: the gateway gets every simulated time as simulated / S real
seconds (the above, tpot_budget_s and the estimator seeds); its /metrics poll stays at 1 real s, its fail-safe
timeouts (pull_timeout_s, prefill_timeout_s) as configured, and every reported time is *simulated* (client real
× S). There one Python process runs the engines, the gateway and 200 clients, its CPU time per streamed token
weighs S times more against a simulated GPU step of ~6 ms (at S = 6 TPOT came out ~6× the preset's), and the
four runs take ~25 minutes on a 2-core machine.

Per run: D's held KV (every ``--sample-s`` simulated s: the distinct blocks of D's retained holds over D's
blocks, from the engine itself, so a system prompt shared by many holds counts once; and the gateway's own
view, the one its budget checks: each handle's blocks summed), D's KV usage, preemptions and waiting requests
on D, D's queue time per P/D decode leg (arrival → its KV read starts), late-turn TTFT p50/p95/p99 (turns ≥
``--late-turn``, client-measured), decode TPOT p95, the reuse rate, handle outcomes and releases by reason.

    .venv/bin/python benchmarks/retention.py [--sessions 200] [--decode 2] [--decode-kv-tokens N] [--time-scale 3]
        [--final-share 0.5] [--runs no-pull,reference,auto,auto-unlimited] [--json] [--realtime [--speed 1]]
    .venv/bin/python benchmarks/retention.py --quick      # a few sessions, a few seconds
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import math
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from kvtether.cli import simstack
from kvtether.cli.gen.generate import parse_mix
from kvtether.cli.simstack import StackSpec, StackTimes, sim_stack
from kvtether.cli.streaming import StreamFailure, loop_clock_ns, now_ns, stream_answer
from kvtether.gateway.config import load_config
from kvtether.gateway.policy import PolicyKnobs
from kvtether.gateway.policy.retention import RELEASE_REASONS, RetentionKnobs
from kvtether.gateway.telemetry import HANDLE_OUTCOMES, RELEASE_FAILURES
from kvtether.protocol.contract import FINAL_HEADER
from kvtether.sim.cluster import SimCluster
from kvtether.sim.presets import get_preset
from kvtether.sim.virtual import run_virtual
from placement_policies import (  # benchmarks/ is on sys.path when run as a script
    MODEL,
    SIM_SECONDS_KNOBS,
    TOOLS,
    _pct,
    _words,
    parse_policy,
)

RUNS = ("no-pull", "reference", "auto", "auto-unlimited")
BASES = ("no-pull", "reference", "pull", "auto", "auto-unlimited")
# Gateway defaults (GatewayConfig), in seconds before --time-scale; the gateway gets them ÷ time scale ÷ speed.
SESSION_TTL_MARGIN_S = 30.0  # session_ttl_s = TTL − this (450 at vLLM's 480, the gateway's default)
FIRST_GAP_S = RetentionKnobs().first_gap_s
RETENTION_INTERVAL_S = 1.0
SWEEP_S = 10.0
# The gateway polls the nodes' /metrics (load, KV capacity) this often, real seconds: it follows the engines'
# compute time scale, which --time-scale leaves alone; every poll renders each node's registry (CPU time here).
METRICS_POLL_REAL_S = 1.0
TOKENS_PER_TURN_OVERHEAD = 40  # chat-template tokens around an answer and a tool result (approximate, for the plan)


@dataclass(frozen=True)
class SessionPlan:
    arrive_s: float  # simulated seconds after the run starts (already divided by --time-scale)
    task: str
    results: list[str]  # the tool result appended after each turn but the last
    result_tokens: list[int]
    think_s: list[float]  # simulated seconds the tool runs after each turn but the last (÷ --time-scale)
    final: bool  # its last turn carries x-kvtether-session-final

    @property
    def turns(self) -> int:
        return len(self.results) + 1


@dataclass
class TurnResult:
    session: int
    turn: int
    ttft_s: float  # simulated
    tpot_s: float | None  # simulated seconds per output token after the first
    prompt_tokens: int
    reused_tokens: int  # prompt tokens whose KV came from a held history (see reuse rate)
    source: str  # x-kvtether-reuse-source


@dataclass
class Sample:
    at_s: float  # simulated seconds since the run started
    node: int  # decode node index
    held_share: float  # distinct blocks of D's retained holds / D's blocks
    usage: float  # D's kv_cache_usage_perc
    waiting: int  # requests in D's waiting queue (not counting KV reads in flight)
    gateway_share: float | None  # the gateway's held view of D (handles' blocks summed) / D's capacity


@dataclass
class Result:
    run: str
    turns: list[TurnResult] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    d_queue_s: list[float] = field(default_factory=list)  # per P/D decode leg: arrival → its KV read starts
    preemptions: float | None = None  # None: the simulator does not export vllm:num_preemptions
    expired_holds: float = 0.0  # D holds freed by decoder_kv_blocks_ttl (vllm:nixl_num_kv_expired_reqs)
    outcomes: dict[str, float] = field(default_factory=dict)
    releases: dict[str, float] = field(default_factory=dict)
    release_failures: dict[str, float] = field(default_factory=dict)
    errors: int = 0
    wall_s: float = 0.0
    budget: float | None = None  # the held-KV budget share the gateway ran with (auto runs)
    decode_tokens: int = 0  # KV of each decode node, in tokens


# ---- the workload ---------------------------------------------------------------------------------------

def _log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(max(lo, 1e-3)), math.log(max(hi, lo, 1e-3))))


def human(args: argparse.Namespace, seconds: float) -> float:
    """A workload or retention time (think time, TTL, review interval, ...) in simulated seconds: ÷ --time-scale."""
    return seconds / args.time_scale


def make_plans(args: argparse.Namespace) -> list[SessionPlan]:
    """The same sessions for every run (seeded); times in simulated seconds (÷ --time-scale)."""
    rng = random.Random(args.seed)
    suffix = parse_mix(args.suffix_mix)
    think = parse_mix(args.think_mix)
    lo, _, hi = args.turns.partition("-")
    t_lo, t_hi = int(lo), int(hi or lo)
    plans = []
    at = 0.0
    for s in range(args.sessions):
        at += rng.expovariate(args.sessions / human(args, args.arrival_s)) if s else 0.0  # Poisson arrivals
        n = rng.randint(t_lo, t_hi)
        sizes, thinks = [], []
        for _ in range(n - 1):
            r = rng.choices(suffix, weights=[m.weight for m in suffix])[0]
            sizes.append(rng.randint(r.lo, r.hi))
            b = rng.choices(think, weights=[m.weight for m in think])[0]
            thinks.append(human(args, _log_uniform(rng, b.lo, b.hi)))  # heavy tail: seconds to minutes
        plans.append(SessionPlan(at, f"Task {s}: " + _words(rng, 60), [_words(rng, k) for k in sizes], sizes,
                                 thinks, rng.random() < args.final_share))
    return plans


def hold_demand(plans: list[SessionPlan], args: argparse.Namespace) -> tuple[float, float]:
    """What keeping every session's latest history on D until the TTL would take (the reference proxy's holds),
    with zero service time: (peak tokens, time-averaged tokens over the arrivals' span and one TTL). The
    shared system prompt is counted once."""
    events: list[tuple[float, int]] = []
    for p in plans:
        t, held = p.arrive_s, args.system_tokens + 80
        for k in range(p.turns):
            held += args.output + TOKENS_PER_TURN_OVERHEAD
            end = t + (p.think_s[k] if k < p.turns - 1 else human(args, args.ttl_s))
            events += [(t, held - args.system_tokens), (end, -(held - args.system_tokens))]
            if k < p.turns - 1:
                held += p.result_tokens[k]
                t = end
    events.sort()
    level = peak = area = 0.0
    last = 0.0
    horizon = max(p.arrive_s for p in plans) + human(args, args.ttl_s)
    for t, d in events:
        if t > horizon:
            break
        area += level * (t - last)
        level += d
        last = t
        peak = max(peak, level)
    return peak + args.system_tokens, area / horizon + args.system_tokens


# ---- a turn ---------------------------------------------------------------------------------------------

async def _chat(client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str],
                speed: float, virtual: bool) -> tuple[dict[str, Any], float, float | None, int, int, str]:
    """One streamed turn: (answer, TTFT, TPOT (simulated s), prompt tokens, reused tokens, reuse source).

    TTFT and TPOT are the CLI's streaming client's (kvtether.cli.streaming): the first token of any kind, and
    the first token to the last over completion_tokens − 1. Reused tokens: on a P/D turn what P got from D's held
    KV (the gateway's x-kvtether-reuse-tokens, P's own cached_tokens); on a decode-local turn D's prefix-cache
    hit (its usage's cached_tokens), measured by the engine, not the gateway's estimate."""
    try:
        got = await stream_answer(client, f"{url}/v1/chat/completions", body, headers,
                                  clock_ns=loop_clock_ns() if virtual else now_ns)
    except StreamFailure as e:
        raise RuntimeError(e.message) from e
    r = got.reader
    source = got.headers.get("x-kvtether-reuse-source", "")
    header_reuse = int(got.headers.get("x-kvtether-reuse-tokens") or 0)
    reused = (r.cached_tokens or 0) if source == "decode_local" else header_reuse
    ttft_ms = got.ttft_ms(speed)
    tpot_ms = got.tpot_ms(speed)
    answer = {"content": r.text, "calls": r.tool_calls}
    return (answer, (ttft_ms if ttft_ms is not None else got.e2e_ms(speed) or 0.0) / 1000,
            None if tpot_ms is None else tpot_ms / 1000, r.prompt_tokens or 0, reused, source)


async def _session(client: httpx.AsyncClient, gw: str, s: int, plan: SessionPlan, system: str,
                   args: argparse.Namespace, result: Result) -> None:
    await asyncio.sleep(plan.arrive_s / args.speed)
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}, {"role": "user", "content": plan.task}]
    for t in range(plan.turns):
        headers = {"x-session-id": f"retention-{s}"}
        if plan.final and t == plan.turns - 1:
            headers[FINAL_HEADER] = "true"
        body = {"model": MODEL, "messages": messages, "tools": TOOLS, "temperature": 0,
                "max_tokens": args.output, "min_tokens": args.output, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        try:
            answer, ttft, tpot, prompt, reused, source = await _chat(client, gw, body, headers, args.speed,
                                                                     args.virtual)
        except (RuntimeError, httpx.HTTPError) as exc:
            result.errors += 1
            print(f"  {result.run} session {s} turn {t}: {exc!r}", file=sys.stderr)
            return
        result.turns.append(TurnResult(s, t, ttft, tpot, prompt, reused, source))
        if t == plan.turns - 1:
            return  # final or silent, the session never comes back
        # The loop goes on with a tool result whatever the model said (live answers, planned sizes).
        call_id = f"call_{s}_{t}"
        messages = [*messages,
                    {"role": "assistant", "content": answer["content"],
                     "tool_calls": [{"id": call_id, "type": "function",
                                     "function": {"name": "read_file", "arguments": json.dumps({"path": f"f{t}"})}}]},
                    {"role": "tool", "tool_call_id": call_id, "content": plan.results[t]}]
        await asyncio.sleep(plan.think_s[t] / args.speed)


# ---- a run ----------------------------------------------------------------------------------------------

def parse_run(name: str) -> tuple[str, bool, dict[str, Any]]:
    """``auto-unlimited@held_kv_budget=0.3`` → (gateway policy, unlimited decode memory, gateway overrides)."""
    base, _, rest = name.partition("@")
    if base not in BASES:
        raise ValueError(f"unknown run {name!r}: the part before @ must be one of {', '.join(BASES)}")
    unlimited = base == "auto-unlimited"
    policy, knobs = parse_policy(("auto" if unlimited else base) + (f"@{rest}" if rest else ""))
    return policy, unlimited, knobs


def stack_spec(policy: str, args: argparse.Namespace, preset: str, unlimited: bool = False) -> StackSpec:
    """The simulated stack of a run: the retention's times ÷ --time-scale like the workload's (the stack gives
    the gateway each as simulated / speed real seconds), classic P/D for no-pull, a small D unless unlimited."""
    return StackSpec(
        preset=preset, prefill=args.prefill, decode=args.decode, speed=args.speed,
        times=StackTimes(engine_kv_ttl_s=human(args, args.ttl_s),
                         session_ttl_s=human(args, args.ttl_s - SESSION_TTL_MARGIN_S),
                         retention_interval_s=human(args, RETENTION_INTERVAL_S),
                         sweep_interval_s=human(args, SWEEP_S)),
        prefill_prefix_caching=args.prefill_prefix_caching == "on",
        cluster={"bidirectional": policy != "no-pull",
                 "decode_num_gpu_blocks": None if unlimited else decode_blocks(args)})


def own_settings(policy: str, args: argparse.Namespace, preset: str) -> dict[str, Any]:
    """This benchmark's gateway settings over the stack's: no handles without bidirectional_kv_xfer, the /metrics
    poll in real seconds, and the TPOT budget, simulated / speed like every engine time."""
    return {
        "bidirectional_prefill": policy != "no-pull",
        "metrics_poll_interval_s": METRICS_POLL_REAL_S,
        "chunk_tokens": get_preset(preset).max_num_batched_tokens,
        **{k: getattr(PolicyKnobs(), k) / args.speed for k in SIM_SECONDS_KNOBS},
    }


def gateway_settings(policy: str, args: argparse.Namespace, preset: str) -> dict[str, Any]:
    """The gateway's settings for a run, in its real seconds: the stack's (the retention times ÷ --time-scale,
    then simulated / speed; the estimator seeds calibrated at speed) and this benchmark's own."""
    return {**simstack.gateway_settings(stack_spec(policy, args, preset), policy), **own_settings(policy, args, preset)}


def decode_blocks(args: argparse.Namespace) -> int:
    return max(1, args.decode_kv_tokens // get_preset(args.preset).block_size)


def _prom(text: str, name: str, **labels: str) -> float | None:
    """Sum of a Prometheus series' samples whose labels include `labels`; None when the series is absent."""
    total, seen = 0.0, False
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if any(f'{k}="{v}"' not in line for k, v in labels.items()):
            continue
        total += float(line.rsplit(" ", 1)[1])
        seen = True
    return total if seen else None


async def _sample(cluster: SimCluster, app: Any, args: argparse.Namespace, result: Result, start: float) -> None:
    """D's memory every --sample-s simulated seconds, read off the engines (in process) and the gateway."""
    gw_nodes = {n.url: n for n in app.state.gateway.cluster.role("decode")}
    while True:
        at = (asyncio.get_running_loop().time() - start) * args.speed
        for i, url in enumerate(cluster.decode_urls):
            e = cluster.node(url).engine
            held = {id(b) for h in e.holds.all("retained") for b in h.blocks}
            g = gw_nodes.get(url)
            gshare = (g.held_kv_tokens / g.kv_capacity_tokens
                      if g is not None and g.kv_capacity_tokens else None)
            result.samples.append(Sample(at, i, len(held) / e.pool.num_blocks, e.pool.usage(), len(e.waiting),
                                         gshare))
        await asyncio.sleep(args.sample_s / args.speed)


def _watch_queue(cluster: SimCluster, result: Result) -> None:
    """Each P/D decode leg's wait on D: its arrival to the start of its KV read (the engine admits a request,
    and so starts its read, only once its blocks are allocated: memory full means waiting here)."""
    for url in cluster.decode_urls:
        engine = cluster.node(url).engine
        arrived: dict[str, float] = {}

        def on_event(e: Any, arrived: dict[str, float] = arrived) -> None:
            if e.kind == "submit":
                arrived[e.request_id] = e.at
            elif e.kind == "kv_read" and e.request_id in arrived:
                result.d_queue_s.append(max(0.0, e.at - arrived.pop(e.request_id)))
            elif e.kind == "prompt_done":
                arrived.pop(e.request_id, None)

        engine.on_event = on_event


async def run_one(name: str, plans: list[SessionPlan], system: str, args: argparse.Namespace) -> Result:
    policy, unlimited, knobs = parse_run(name)
    result = Result(name)
    t0 = time.perf_counter()
    settings = {**own_settings(policy, args, args.preset), **knobs}
    async with sim_stack(stack_spec(policy, args, args.preset, unlimited), policy, gateway=settings) as stack:
        cluster, app, gw = stack.cluster, stack.app, stack.url
        assert cluster is not None
        _watch_queue(cluster, result)
        retention = app.state.gateway.retention
        # The retention policy's expected first gap is a constant in gateway seconds: scaled like the other
        # retention times.
        retention.knobs = dataclasses.replace(retention.knobs, first_gap_s=human(args, FIRST_GAP_S) / args.speed)
        # A budget only means something where handles are kept for a pull (no-pull keeps none).
        result.budget = retention.knobs.budget_share if retention.enabled and policy in ("auto", "pull") else None
        d0 = cluster.node(cluster.decode_urls[0]).engine
        result.decode_tokens = d0.pool.num_blocks * get_preset(args.preset).block_size
        limits = httpx.Limits(max_connections=args.sessions + 50, keepalive_expiry=2.0)
        async with httpx.AsyncClient(timeout=3600, limits=limits) as client:
            start = asyncio.get_running_loop().time()  # virtual time on a virtual loop
            sampler = asyncio.ensure_future(_sample(cluster, app, args, result, start))
            try:
                await asyncio.gather(*(_session(client, gw, s, p, system, args, result) for s, p in enumerate(plans)))
            finally:
                sampler.cancel()
                await asyncio.gather(sampler, return_exceptions=True)
            text = (await client.get(f"{gw}/metrics")).text
            result.outcomes = {o: _prom(text, "kvtether_handle_outcomes_total", outcome=o) or 0.0
                               for o in HANDLE_OUTCOMES}
            result.releases = {r: _prom(text, "kvtether_handle_releases_total", reason=r) or 0.0
                               for r in RELEASE_REASONS}
            result.release_failures = {c: _prom(text, "kvtether_handle_release_failures_total", cause=c) or 0.0
                                       for c in RELEASE_FAILURES}
            for url in cluster.decode_urls:
                node_text = (await client.get(f"{url}/metrics")).text
                pre = _prom(node_text, "vllm:num_preemptions_total")
                if pre is not None:
                    result.preemptions = (result.preemptions or 0.0) + pre
                result.expired_holds += _prom(node_text, "vllm:nixl_num_kv_expired_reqs_total") or 0.0
    result.wall_s = time.perf_counter() - t0
    return result


# ---- the report -----------------------------------------------------------------------------------------

def summary(r: Result, late_turn: int) -> dict[str, Any]:
    """The figures the table prints, per run (also the --json output)."""
    late = [t.ttft_s for t in r.turns if t.turn >= late_turn]
    tpots = [t.tpot_s for t in r.turns if t.tpot_s is not None]
    later = [t for t in r.turns if t.turn >= 1]
    prompt = sum(t.prompt_tokens for t in later)
    nodes = sorted({s.node for s in r.samples})
    held_max = {n: max((s.held_share for s in r.samples if s.node == n), default=0.0) for n in nodes}
    gw_max = {n: max((s.gateway_share or 0.0 for s in r.samples if s.node == n), default=0.0) for n in nodes}
    span = max((s.at_s for s in r.samples), default=0.0)
    with_handle = sum(r.outcomes.values())
    pulled = r.outcomes.get("attached", 0.0) + r.outcomes.get("truncated", 0.0)
    return {
        "turns": len(r.turns), "errors": r.errors, "wall_s": r.wall_s, "simulated_s": span,
        "late_turns": len(late),
        "late_ttft_p50": _pct(late, .5), "late_ttft_p95": _pct(late, .95), "late_ttft_p99": _pct(late, .99),
        "tpot_p50": _pct(tpots, .5), "tpot_p95": _pct(tpots, .95),
        "held_share_p50": _pct([s.held_share for s in r.samples], .5),
        "held_share_p95": _pct([s.held_share for s in r.samples], .95),
        "held_share_max": max(held_max.values(), default=0.0),
        "held_share_max_per_d": [held_max[n] for n in nodes],
        "gateway_share_max_per_d": [gw_max[n] for n in nodes],
        "budget": r.budget,
        "over_budget_samples": (sum(1 for s in r.samples if s.held_share > r.budget) / len(r.samples)
                                if r.budget is not None and r.samples else None),
        "usage_p50": _pct([s.usage for s in r.samples], .5), "usage_max": max((s.usage for s in r.samples),
                                                                                default=0.0),
        "waiting_mean": (sum(s.waiting for s in r.samples) / len(r.samples)) if r.samples else 0.0,
        "waiting_max": max((s.waiting for s in r.samples), default=0),
        "d_queue_p50": _pct(r.d_queue_s, .5), "d_queue_p95": _pct(r.d_queue_s, .95),
        "d_queue_max": max(r.d_queue_s, default=float("nan")), "d_legs": len(r.d_queue_s),
        "preemptions": r.preemptions, "expired_holds": r.expired_holds,
        "reuse_rate": sum(t.reused_tokens for t in later) / prompt if prompt else 0.0,
        "pull_rate": pulled / with_handle if with_handle else 0.0, "turns_with_handle": with_handle,
        "sources": {src: sum(1 for t in r.turns if t.source == src) for src in sorted({t.source for t in r.turns})},
        "outcomes": {k: v for k, v in r.outcomes.items() if v},
        "releases": dict(r.releases), "releases_total": sum(r.releases.values()),
        "release_failures": {k: v for k, v in r.release_failures.items() if v},
        "decode_tokens": r.decode_tokens,
    }


def _ratio(v: float, ref: float) -> str:
    return f"×{v / ref:.2f}" if ref and ref == ref and v == v else "×–"


def table(s: dict[str, dict[str, Any]], late_turn: int) -> str:
    runs = list(s)
    auto = "auto" if "auto" in s else None
    ceiling = "auto-unlimited" if "auto-unlimited" in s else None
    rows: list[tuple[str, list[str]]] = []

    def row(name: str, cell: Any) -> None:
        rows.append((name, [cell(s[r], r) for r in runs]))

    row("D KV, tokens per decode node", lambda x, r: f"{x['decode_tokens']:,}")
    row("D held KV share p50 / p95 / max (engine: distinct held blocks)",
        lambda x, r: f"{x['held_share_p50']:.2f} / {x['held_share_p95']:.2f} / {x['held_share_max']:.2f}")
    row("held share max per D: engine (gateway's view: each handle's blocks summed)",
        lambda x, r: ", ".join(f"{e:.2f} ({g:.2f})" for e, g in zip(x["held_share_max_per_d"],
                                                                    x["gateway_share_max_per_d"], strict=True)))
    row("under its budget (samples over it)",
        lambda x, r: "–" if x["budget"] is None else
        f"{'yes' if x['held_share_max'] <= x['budget'] else 'NO'} ≤ {x['budget']:g} ({x['over_budget_samples']:.1%})")
    row("D KV usage p50 / max", lambda x, r: f"{x['usage_p50']:.2f} / {x['usage_max']:.2f}")
    row("D preemptions", lambda x, r: "n/a" if x["preemptions"] is None else f"{x['preemptions']:.0f}")
    row("D waiting requests mean / max (samples)", lambda x, r: f"{x['waiting_mean']:.2f} / {x['waiting_max']}")
    row("D queue s per P/D leg p50 / p95 / max",
        lambda x, r: f"{x['d_queue_p50']:.3f} / {x['d_queue_p95']:.3f} / {x['d_queue_max']:.2f}"
        if x["d_legs"] else "–")
    row("D holds expired at the TTL", lambda x, r: f"{x['expired_holds']:.0f}")
    for q in ("p50", "p95", "p99"):
        row(f"late TTFT {q} s (turns ≥ {late_turn}; × auto)",
            lambda x, r, q=q: f"{x[f'late_ttft_{q}']:.3f} ({_ratio(x[f'late_ttft_{q}'], s[auto][f'late_ttft_{q}'])})"
            if auto else f"{x[f'late_ttft_{q}']:.3f}")
    base = s.get("no-pull")
    row("decode TPOT p50 / p95 s (p95 vs no-pull)",
        lambda x, r: f"{x['tpot_p50']:.4f} / {x['tpot_p95']:.4f}"
        + (f" ({(x['tpot_p95'] / base['tpot_p95'] - 1) * 100:+.1f} %)" if base else ""))
    row("reuse rate (of ceiling)",
        lambda x, r: f"{x['reuse_rate']:.1%}" + (f" ({x['reuse_rate'] / s[ceiling]['reuse_rate']:.0%})"
                                                 if ceiling and s[ceiling]["reuse_rate"] else ""))
    row("pulls / turns with a handle", lambda x, r: f"{x['pull_rate']:.1%} of {x['turns_with_handle']:.0f}")
    row("turns by reuse source", lambda x, r: ", ".join(f"{k or '?'} {v}" for k, v in x["sources"].items()))
    row("handle outcomes", lambda x, r: ", ".join(f"{k} {v:.0f}" for k, v in x["outcomes"].items()) or "–")
    row("releases by reason", lambda x, r: f"{x['releases_total']:.0f}: " + (", ".join(
        f"{k} {v:.0f}" for k, v in x["releases"].items() if v) or "none"))
    row("release failures", lambda x, r: ", ".join(f"{k} {v:.0f}" for k, v in x["release_failures"].items())
        or "0")
    row("turns (late) / errors", lambda x, r: f"{x['turns']} ({x['late_turns']}) / {x['errors']}")
    row("simulated s / wall s", lambda x, r: f"{x['simulated_s']:.0f} / {x['wall_s']:.0f}")
    lines = ["| metric | " + " | ".join(runs) + " |", "|---|" + "---|" * len(runs)]
    lines += [f"| {name} | " + " | ".join(cells) + " |" for name, cells in rows]
    return "\n".join(lines)


def verdict(s: dict[str, dict[str, Any]]) -> str:
    """The issue's "done when", measured: what auto reached against each target."""
    if not all(r in s for r in ("no-pull", "reference", "auto")):
        return ""
    a = s["auto"]
    out = []
    if a["budget"] is not None:
        per_d = ", ".join(f"{x:.2f}" for x in a["held_share_max_per_d"])
        ok = a["held_share_max"] <= a["budget"]
        out.append(f"- every D under its budget {a['budget']:g}: {'yes' if ok else 'NO'} "
                   f"(max held share per D {per_d}; {a['over_budget_samples']:.1%} of samples over)")
    for q in ("p95", "p99"):
        key = f"late_ttft_{q}"
        others = {r: s[r][key] for r in ("no-pull", "reference")}
        ok = all(a[key] < v for v in others.values())
        best = min(others, key=lambda r: others[r])
        out.append(f"- late TTFT {q} lowest of the three: {'yes' if ok else 'NO'} (auto {a[key]:.3f} s, no-pull "
                   f"{others['no-pull']:.3f} s, reference {others['reference']:.3f} s; auto/{best} "
                   f"{a[key] / others[best]:.2f})")
    tp = (a["tpot_p95"] / s["no-pull"]["tpot_p95"] - 1) * 100
    out.append(f"- decode TPOT p95 at most +10 % over no-pull: {'yes' if tp <= 10 else 'NO'} ({tp:+.1f} %)")
    if "auto-unlimited" in s:
        c = s["auto-unlimited"]["reuse_rate"]
        out.append(f"- reuse beside the unlimited-memory ceiling: auto {a['reuse_rate']:.1%} vs {c:.1%} "
                   f"({a['reuse_rate'] / c:.0%} of it)" if c else "- reuse ceiling: 0")
    return "\n".join(out)


def header(args: argparse.Namespace, plans: list[SessionPlan]) -> str:
    peak, mean = hold_demand(plans, args)
    cap = args.decode * args.decode_kv_tokens
    turns = sum(p.turns for p in plans)
    finals = sum(p.final for p in plans)
    f, sp = args.time_scale, args.speed

    def both(seconds: float) -> str:  # a workload time: as given → as simulated
        return f"{seconds:g}" if f == 1 else f"{seconds:g} → {seconds / f:.3g}"

    return (
        f"### {args.preset}: {args.prefill}P {args.decode}D, D KV {args.decode_kv_tokens:,} tokens each "
        f"(auto-unlimited: the preset's), prefill prefix caching {args.prefill_prefix_caching}\n"
        f"{len(plans)} sessions arriving over {args.arrival_s:g} s (Poisson), {args.turns} turns each ({turns} in "
        f"all), think times {args.think_mix} s (log-uniform per band), tool results {args.suffix_mix} tok, "
        f"{args.output} output tok/turn, {args.system_tokens}-token system prompt; {finals} sessions end with "
        f"{FINAL_HEADER}: true, {len(plans) - finals} stop without a signal.\n"
        f"Every session's latest history held until the TTL (zero service time) would take {peak:,.0f} tokens "
        f"at peak, {mean:,.0f} on average: {peak / cap:.1f}× / {mean / cap:.1f}× the decode nodes' KV.\n"
        f"Time scaling: the workload's and the retention's times ÷ {f:g} (--time-scale), in simulated s: "
        f"arrivals and think times, decoder_kv_blocks_ttl {both(args.ttl_s)}, and the gateway's session_ttl_s "
        f"{both(args.ttl_s - SESSION_TTL_MARGIN_S)}, engine_kv_ttl_s {both(args.ttl_s)}, retention_interval_s "
        f"{both(RETENTION_INTERVAL_S)}, the expected first gap {both(FIRST_GAP_S)}, sweep_interval_s "
        f"{both(SWEEP_S)}; compute is not scaled (the preset's GPU times). "
        + (f"The run is in virtual time: the clients, the gateway and the simulated nodes share one "
           f"simulated clock, exact and repeatable; the gateway's /metrics poll every {METRICS_POLL_REAL_S:g} s of "
           f"it. Every reported time is SIMULATED.\n" if args.virtual else
           f"The simulator runs at speed {sp:g} (simulated s per real s): the gateway gets each of those times as "
           f"simulated / {sp:g} real s, its estimator seeds and TPOT budget likewise; its /metrics poll every "
           f"{METRICS_POLL_REAL_S:g} real s. Every reported time is SIMULATED (client real × {sp:g}).\n")
        + "no-pull: nodes without bidirectional_kv_xfer (classic P/D). Reuse rate: prompt tokens of turns ≥ 1 whose "
        "KV came from D's held history (pulled by P, or D's prefix cache on a decode-local turn; "
        "engine-reported) over those turns' prompt tokens. Pulls / turns with a handle: the gateway's "
        "kvtether_handle_outcomes_total attached + truncated over all its outcomes."
    )


QUICK = {"sessions": 8, "turns": "3-5", "arrival_s": 20.0, "think_mix": "2-8:0.8,20-40:0.2", "system_tokens": 1000,
         "suffix_mix": "50-400", "output": 16, "decode_kv_tokens": 16384, "speed": 2.0, "late_turn": 2,
         "decode": 1}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-32b-h200-tp8")
    ap.add_argument("--runs", default=",".join(RUNS),
                    help="comma-separated: no-pull, reference, pull, auto, auto-unlimited, each with optional "
                         "@setting=value+setting=value gateway overrides")
    ap.add_argument("--sessions", type=int, default=200)
    ap.add_argument("--turns", default="3-10", help="turns per session, LO-HI (uniform)")
    ap.add_argument("--arrival-s", type=float, default=600.0,
                    help="sessions arrive over about this long (s, before --time-scale)")
    ap.add_argument("--think-mix", default="1-10:0.7,10-60:0.25,60-300:0.05",
                    help="tool time after each answer (s, before --time-scale): LO-HI:WEIGHT bands, log-uniform "
                         "within one")
    ap.add_argument("--suffix-mix", default="50-500:0.85,1000-4000:0.15", help="tool-result tokens per turn")
    ap.add_argument("--system-tokens", type=int, default=2000)
    ap.add_argument("--output", type=int, default=32, help="answer tokens per turn (pinned)")
    ap.add_argument("--final-share", type=float, default=0.5,
                    help="share of sessions whose last turn carries x-kvtether-session-final: true (the others "
                         "stop without any signal)")
    ap.add_argument("--prefill", type=int, default=1)
    ap.add_argument("--decode", type=int, default=2)
    ap.add_argument("--decode-kv-tokens", type=int, default=131_072,
                    help="KV of each decode node, in tokens (vLLM --num-gpu-blocks-override × block size)")
    ap.add_argument("--ttl-s", type=float, default=480.0, help="decoder_kv_blocks_ttl (s, before --time-scale)")
    ap.add_argument("--prefill-prefix-caching", choices=("off", "on"), default="off")
    ap.add_argument("--time-scale", type=float, default=3.0,
                    help="divide every workload and retention time (arrivals, think times, the engine's TTL, the "
                         "gateway's session TTL, review interval) by this; compute is not scaled")
    ap.add_argument("--speed", type=float, default=1.0, help="--realtime: simulated seconds per real second")
    ap.add_argument("--realtime", action="store_true",
                    help="run on the wall clock at --speed (default: virtual time, docs/simulator.md: exact and "
                         "repeatable, the gateway's CPU modelled, taking the CPU the run needs rather than its "
                         "simulated seconds)")
    ap.add_argument("--sample-s", type=float, default=1.0, help="D's memory is sampled every this many simulated s")
    ap.add_argument("--late-turn", type=int, default=5, help="late turns: this index on (0-based)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="also print the summaries and turns as one JSON line")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: " + ", ".join(f"{k}={v}" for k, v in QUICK.items()) + " (< 60 s)")
    args = ap.parse_args(argv)
    args.virtual = not args.realtime
    if args.virtual and args.speed != ap.get_default("speed"):
        ap.error("--speed is for runs on the wall clock: virtual time is exact at speed 1")
    if args.quick:
        for k, v in QUICK.items():
            if getattr(args, k) == ap.get_default(k) and not (k == "speed" and args.virtual):
                setattr(args, k, v)
    if not 0.0 <= args.final_share <= 1.0:
        ap.error("--final-share must be in [0, 1]")
    for name in args.runs.split(","):  # a misspelt run fails now, not after the runs before it
        try:
            policy, _, knobs = parse_run(name.strip())
            load_config(None, prefill=["http://p:1"], decode=["http://d:1"],
                        **{**gateway_settings(policy, args, args.preset), **knobs})
        except ValueError as exc:
            ap.error(str(exc))
    return args


async def run_all(args: argparse.Namespace, plans: list[SessionPlan]) -> dict[str, Result]:
    system = "You are a coding agent. " + _words(random.Random(args.seed + 1), args.system_tokens)
    out = {}
    for name in (n.strip() for n in args.runs.split(",") if n.strip()):
        r = await run_one(name, plans, system, args)
        print(f"  {name}: {len(r.turns)} turns, {r.errors} errors, {r.wall_s:.0f} s", file=sys.stderr)
        out[name] = r
    return out


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    args = parse_args(argv)
    # The simulated prefill logs each expiring one-block lease a release leaves behind (vLLM's warning): noise here.
    logging.getLogger("kvtether.sim").setLevel(logging.ERROR)
    plans = make_plans(args)
    print(header(args, plans) + "\n", flush=True)
    results = run_virtual(run_all, args, plans) if args.virtual else asyncio.run(run_all(args, plans))
    s = {name: summary(r, args.late_turn) for name, r in results.items()}
    print(table(s, args.late_turn))
    v = verdict(s)
    if v:
        print("\n" + v)
    if args.json:
        print(json.dumps({"summary": s, "turns": {n: [dataclasses.asdict(t) for t in r.turns]
                                                  for n, r in results.items()}}))
    return s


if __name__ == "__main__":
    main()
