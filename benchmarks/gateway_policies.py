"""Gateway policies on the simulator: TTFT per turn bucket and wrong answers, for long agent sessions.

Policies compared (same sessions, same cluster shape, a fresh cluster each):

  (a) no-pull    P/D without the reverse pull (handles never attached)
  (b) reference  vLLM's reference multi-turn proxy: handle per conversation, round-robin P and D, no guard
  (c) kvtether   pin + token guard + pull when verified (policy "pull")
  (d) auto       kvtether's cost-based choice per turn: decode-local, pull or cold (the default policy)

Sessions: ``--sessions`` concurrent agent loops of ``--turns`` turns with tools; each turn appends a tool
result (or a user message), so prompts grow from ~2k to ≥16k tokens. Every other session edits its
history at turns 8 and 16 (a tool result removed from the middle, a tool result rewritten) — what agent
frameworks do when they compact or redact. A turn's answer is *wrong* when it differs from what a
single aggregated node (the oracle) answers for the same messages.

TTFT is measured at the client (the CLI's streaming client: the first token of any kind, content, reasoning,
refusal or tool call, of a streamed response) and converted to simulated seconds (× ``--speed``); gateway and
HTTP overhead are scaled too, so small values are slightly inflated — ratios between policies are what this is
for. The default speed is 0.2 (the simulator runs five times *slower* than real time), so the gateway's and the
simulator's own Python CPU time shrinks to a fifth relative to the simulated GPU time it is compared with.

Prefill prefix caching is off by default (``--prefill-prefix-caching off``), as in the published vLLM
figures for the reverse pull; with it on and a working set that fits the prefill nodes' KV cache, all
policies mostly hit P's own cache and the pull has little to add (kvtether then pays its /tokenize).

    .venv/bin/python benchmarks/gateway_policies.py [--sessions 4] [--turns 24] [--speed 1] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from kvtether.cli.simstack import StackSpec, sim_stack
from kvtether.cli.streaming import StreamFailure, stream_answer
from kvtether.sim.cluster import ClusterSpec, SimCluster

MODEL = "kvtether-sim"
POLICIES = (("a", "no-pull", "P/D, no reverse pull"), ("b", "reference", "reference proxy (RR, no guard)"),
            ("c", "pull", "kvtether"), ("d", "auto", "kvtether auto"))
BUCKETS = ((0, 4), (5, 9), (10, 14), (15, 19), (20, 10_000))

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "run_tests", "description": "Run the test suite",
        "parameters": {"type": "object", "properties": {"target": {"type": "string"}}, "required": ["target"]}}},
]
_WORDS = (
    "alpha", "beta", "gamma", "delta", "build", "test", "cache", "node", "block", "token", "prefix",
    "decode", "prefill", "session", "handle", "pull", "error", "file", "line", "value", "config", "module",
    "graph", "queue", "batch", "lease", "assert", "import", "return", "class", "def",
)


def words(seed: str, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(n))


@dataclass
class Turn:
    session: int
    turn: int
    ttft_s: float
    prompt_tokens: int
    wrong: bool


@dataclass
class Result:
    policy: str
    turns: list[Turn] = field(default_factory=list)
    errors: int = 0
    p2p_tokens: float = 0.0
    checks: list[tuple[int, dict[str, Any], dict[str, Any]]] = field(default_factory=list)


def _edit(messages: list[dict[str, Any]], kind: int, tag: str) -> list[dict[str, Any]]:
    tool_idx = [i for i, m in enumerate(messages) if m["role"] == "tool"]
    if not tool_idx:
        return messages
    target = tool_idx[len(tool_idx) // 2]
    if kind == 0:  # compaction: a tool result dropped from the middle
        return messages[:target] + messages[target + 1 :]
    edited = [dict(m) for m in messages]  # redaction: a tool result rewritten
    edited[target]["content"] = "[redacted] " + words(tag, 40)
    return edited


async def _chat(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                headers: dict[str, str]) -> tuple[dict[str, Any], float, int]:
    """Streamed call, read by the CLI's streaming client (kvtether.cli.streaming, which defines TTFT): (answer,
    TTFT seconds real, prompt tokens)."""
    try:
        got = await stream_answer(client, f"{url}/v1/chat/completions", body, headers)
    except StreamFailure as e:
        raise RuntimeError(e.message) from e
    r = got.reader
    answer: dict[str, Any] = {"role": "assistant", "content": r.text or None}
    if r.calls:
        answer["tool_calls"] = r.tool_calls
    ttft_ms = got.ttft_ms()
    return answer, (ttft_ms if ttft_ms is not None else got.e2e_ms() or 0.0) / 1000, r.prompt_tokens or 0


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    def key(m: dict[str, Any]) -> Any:
        return (m.get("content") or "", [(c["function"]["name"], c["function"]["arguments"])
                                          for c in m.get("tool_calls") or []])
    return bool(key(a) == key(b))


async def _session(client: httpx.AsyncClient, gw: str, s: int, args: argparse.Namespace, result: Result) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": f"You are agent {s}. " + words(f"sys{s}", args.system_words)},
        {"role": "user", "content": f"Task {s}: " + words(f"task{s}", 40)},
    ]
    headers = {"x-session-id": f"bench-{s}"}
    await asyncio.sleep(0.2 * (s % max(1, args.concurrency or args.sessions)))  # staggered arrivals
    for t in range(args.turns):
        if s % 2 == 1 and t in (8, 16):
            messages = _edit(messages, t // 8 - 1, f"edit{s}.{t}")
        body = {"model": MODEL, "messages": messages, "tools": TOOLS, "temperature": 0, "max_tokens": 64,
                "stream": True, "stream_options": {"include_usage": True}}
        try:
            answer, ttft, prompt_tokens = await _chat(client, gw, body, headers)
        except (RuntimeError, httpx.HTTPError) as exc:
            result.errors += 1
            print(f"  session {s} turn {t}: {exc!r}", file=sys.stderr)
            return
        result.turns.append(Turn(s, t, ttft * args.speed, prompt_tokens, False))
        # The oracle is asked after the timed phase, so its CPU load does not distort the TTFTs.
        result.checks.append((len(result.turns) - 1, body, answer))
        messages = [*messages, answer]
        calls = answer.get("tool_calls") or []
        for i, c in enumerate(calls):
            messages.append({"role": "tool", "tool_call_id": c.get("id") or f"c{i}",
                             "content": words(f"r{s}.{t}.{i}", args.result_words)})
        if not calls:
            messages.append({"role": "user", "content": f"Next ({t}): " + words(f"u{s}.{t}", args.result_words)})


async def run_policy(policy: str, args: argparse.Namespace) -> Result:
    # (a) is a P/D cluster without bidirectional_kv_xfer: its decode nodes retain nothing after a turn.
    # (With the flag on and handles never used, every turn pins D memory until the engine TTL.)
    spec = StackSpec(preset=args.preset, prefill=args.prefill, decode=args.decode, speed=args.speed,
                     # The published reverse-pull figures (PR #32553, the vLLM blog) ran prefill nodes with prefix
                     # caching off. With it on and a working set that fits P's KV cache, every policy mostly hits
                     # P's own cache and the reverse pull has little left to do.
                     prefill_prefix_caching=args.prefill_prefix_caching == "on",
                     cluster={"kv_lease_duration": 600.0, "bidirectional": policy != "no-pull"})
    oracle_spec = ClusterSpec(prefill=0, decode=0, aggregated=1, preset=args.preset, speed=args.oracle_speed)
    result = Result(policy)
    # The stack's gateway: its times and auto's estimator seeds (calibrated on the preset's cost model) at --speed.
    settings = {"metrics_poll_interval_s": 0.5, "bidirectional_prefill": policy != "no-pull"}
    async with sim_stack(spec, policy, gateway=settings) as stack, SimCluster(oracle_spec) as oracle:
        gw = stack.url
        async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(keepalive_expiry=2.0)) as client:
            # At most --concurrency sessions at a time: on a small shared CPU the simulator's own (real)
            # CPU time would otherwise swamp the simulated GPU time that TTFT is meant to show.
            limit = asyncio.Semaphore(args.concurrency or args.sessions)

            async def one(s: int) -> None:
                async with limit:
                    await _session(client, gw, s, args, result)

            await asyncio.gather(*(one(s) for s in range(args.sessions)))
            for idx, body, answer in result.checks:
                want, _, _ = await _chat(client, oracle.aggregated_urls[0], body, {})
                result.turns[idx].wrong = not _same(answer, want)
            for u in stack.urls["prefill"]:
                text = (await client.get(f"{u}/metrics")).text
                for line in text.splitlines():
                    if line.startswith("vllm:prompt_tokens_cached_by_source_total") and 'source="p2p"' in line:
                        result.p2p_tokens += float(line.rsplit(" ", 1)[1])
    return result


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = min(len(values) - 1, max(0, round(q * (len(values) - 1))))
    return values[k]


def table(results: dict[str, Result]) -> str:
    head = "| turns | " + " | ".join(f"({k}) {label} p50 / p95 s" for k, _, label in POLICIES) + " | prompt tokens |"
    lines = [head, "|" + "---|" * (len(POLICIES) + 2)]
    for lo, hi in BUCKETS:
        cells = []
        tokens: list[int] = []
        for _key, policy, _ in POLICIES:
            r = results[policy]
            v = [t.ttft_s for t in r.turns if lo <= t.turn <= hi]
            tokens += [t.prompt_tokens for t in r.turns if lo <= t.turn <= hi and policy == "pull"]
            cells.append(f"{_pct(v, 0.5):.3f} / {_pct(v, 0.95):.3f}" if v else "–")
        name = f"{lo}–{hi}" if hi < 10_000 else f"≥{lo}"
        tok = f"{min(tokens)}–{max(tokens)}" if tokens else "–"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {tok} |")
    ge10 = {p: _pct([t.ttft_s for t in results[p].turns if t.turn >= 10], 0.5) for _, p, _ in POLICIES}
    lines.append("| p50 turns ≥10 | " + " | ".join(f"{ge10[p]:.3f}" for _, p, _ in POLICIES) + " | |")
    lines.append("| wrong answers | " + " | ".join(str(sum(t.wrong for t in results[p].turns))
                                                  for _, p, _ in POLICIES) + " | |")
    lines.append("| turns / errors | " + " | ".join(f"{len(results[p].turns)} / {results[p].errors}"
                                                   for _, p, _ in POLICIES) + " | |")
    lines.append("| P tokens pulled from D | " + " | ".join(f"{results[p].p2p_tokens:,.0f}"
                                                           for _, p, _ in POLICIES) + " | |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="glm-5-fp8-h200-tp8")
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--turns", type=int, default=24)
    ap.add_argument("--concurrency", type=int, default=0, help="sessions at a time (0 = all)")
    ap.add_argument("--prefill", type=int, default=3)
    ap.add_argument("--decode", type=int, default=2)
    # Speed 1: the simulator's own tokenizer and HTTP handling run in real time and are multiplied by the
    # speed when TTFT is converted to simulated seconds, so higher speeds inflate every policy's TTFT.
    ap.add_argument("--speed", type=float, default=0.2, help="simulated seconds per real second (< 1: slower)")
    ap.add_argument("--oracle-speed", type=float, default=200.0)
    ap.add_argument("--system-words", type=int, default=1200)
    ap.add_argument("--result-words", type=int, default=340)
    ap.add_argument("--prefill-prefix-caching", choices=("off", "on"), default="off",
                    help="off (default) as in the published vLLM figures; on = the simulator's default")
    ap.add_argument("--json", action="store_true", help="also print per-turn results as JSON")
    args = ap.parse_args()
    results: dict[str, Result] = {}
    for key, policy, label in POLICIES:
        t0 = time.perf_counter()
        results[policy] = asyncio.run(run_policy(policy, args))
        r = results[policy]
        print(f"({key}) {label}: {len(r.turns)} turns, {r.errors} errors, {time.perf_counter() - t0:.0f} s",
              file=sys.stderr)
    print(f"preset {args.preset}, {args.prefill}P {args.decode}D, {args.sessions} sessions × {args.turns} turns, "
          f"prefill prefix caching {args.prefill_prefix_caching}, TTFT in simulated seconds (speed {args.speed})")
    print(table(results))
    ge10 = {p: _pct([t.ttft_s for t in results[p].turns if t.turn >= 10], 0.5) for _, p, _ in POLICIES}
    print(f"\nkvtether (pull) vs (a) on turns ≥10: {ge10['no-pull'] / ge10['pull']:.2f}× lower p50 TTFT; "
          f"auto vs (a): {ge10['no-pull'] / ge10['auto']:.2f}× (target ≥ 2)")
    if args.json:
        print(json.dumps({p: [t.__dict__ for t in r.turns] for p, r in results.items()}))


if __name__ == "__main__":
    main()
