"""Per-turn placement policies side by side: TTFT by turn bucket and decode TPOT, on the simulator.

Policies (same generated sessions, a fresh simulated cluster each):

  no-pull    classic P/D: every turn a cold prefill on P (P/D without bidirectional_kv_xfer)
  reference  vLLM's reference multi-turn proxy: round-robin P and D, the last handle attached unchecked
  pull       kvtether pinned + token guard, pull from D whenever verified
  auto       kvtether's cost-based choice per turn: decode-local, pull or cold (the default)

Sessions: agent loops with a shared system prompt; each turn appends a tool result whose size is drawn from
``--suffix-mix`` (default mostly 50–500 tokens, some 2–8k) and the model's answer (``--output`` tokens, pinned
with min_tokens + ignore_eos so every policy decodes the same amount). All sessions run at once, so both
decode nodes carry a running batch while new turns arrive (what makes a local prefill cost the batch TPOT).

Time: the simulator runs at ``--speed`` simulated seconds per real second (default 0.25, slower than real
time) and every reported time is *simulated* (= client-measured real × speed). The gateway's and the
simulator's own Python CPU time is then a quarter of what it would be at speed 1 relative to the simulated
GPU time; what is left of it is still in every number (it is overhead a real deployment also pays, scaled).
TTFT, TTFC and TPOT are measured at the client by the CLI's streaming client (kvtether.cli.streaming, the
project's definitions): TTFT is the first token of any kind (content, reasoning, refusal, tool call), TTFC the
first chunk of any kind (the simulator, like vLLM, sends its role chunk with the first engine output, so this
is the first *token*; TTFT also waits for the tool-call parser to release the function name, a few decode steps
later); TPOT is each request's time per output token after its first token (its first token to its last, over
completion_tokens − 1), p95 over requests.
The model writes tool calls in its own format (``--tool-call-parser``, default the preset's): GLM-5's glm47
releases the name after it and one tag (~4 tokens here), Qwen3's hermes after ~12 tokens.

Arrivals: paced by default (``--pace-s``: each session sends a turn every PACE seconds, or when its previous
answer is done if that is later): every policy then offers the same load, and decode TPOT compares at equal
decode concurrency (what "without hurting the other sessions" is about). ``--pace-s 0`` is a closed loop (each
session thinks ``--think-s`` after an answer, so a faster policy also raises the load it offers).

The cost policy's estimator seeds are set from the preset's cost model (a calibration an operator would
take from a short benchmark of the cluster), converted to real seconds at ``--speed``; it learns from there.

    .venv/bin/python benchmarks/placement_policies.py [--preset glm-5-fp8-h200-tp8|qwen3-32b-h200-tp8|both]
        [--sessions 16] [--turns 20] [--output 128] [--pace-s 4] [--speed 0.25] [--policies no-pull,reference,pull,auto]
        [--json]
    # a closed-loop workload: --pace-s 0 --sessions 8 --output 32 --speed 0.2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
from kvtether.cli.gen.generate import WORDS, parse_mix
from kvtether.cli.simstack import StackSpec, sim_stack
from kvtether.cli.streaming import StreamFailure, now_ns, stream_answer
from kvtether.gateway.config import load_config
from kvtether.gateway.policy import TUNING_FIELDS, PolicyKnobs
from kvtether.sim.presets import get_preset
from kvtether.sim.template import TOOL_FORMATS

MODEL = "kvtether-sim"
POLICIES = ("no-pull", "reference", "pull", "auto")
BUCKETS = ((0, 4), (5, 9), (10, 19), (20, 10_000))
SIM_SECONDS_KNOBS = ("tpot_budget_s",)  # converted to real seconds at --speed
TOKENS_PER_WORD = 1.37  # the simulator's tokenizer on the generator's vocabulary (measured)
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
]


@dataclass(frozen=True)
class SessionPlan:
    system: str
    task: str
    results: list[str]  # the tool result appended after each turn's answer
    think_s: list[float]  # simulated think/tool time after each turn (paced: gap from this send to the next)


@dataclass
class TurnResult:
    session: int
    turn: int
    ttft_s: float  # simulated
    tpot_s: float | None  # simulated seconds per output token after the first (first token → last token)
    prompt_tokens: int
    source: str = ""  # x-kvtether-reuse-source: decode_local | decode_pull | none | prefill_cache
    # Simulated seconds since the policy's run started: request sent, first token, last token (diagnostics:
    # how many requests decode at once, and whose decode a decode-local prefill overlapped).
    sent_s: float = 0.0
    first_s: float = 0.0
    last_s: float = 0.0
    repeat: int = 0
    # Simulated time to the first chunk of any kind (TTFC). The simulator, like vLLM's serving_chat, sends
    # its role chunk with the first engine output, so this is the first *token*; TTFT above also waits for
    # the tool-call parser to release the first delta (the function name: several decode steps).
    ttfc_s: float = 0.0


@dataclass
class Result:
    policy: str
    turns: list[TurnResult] = field(default_factory=list)
    errors: int = 0
    wall_s: float = 0.0
    options: dict[str, int] = field(default_factory=dict)
    overhead_s: float = 0.0  # simulated seconds of TTFT spent in the gateway itself, all turns together
    late_sends: int = 0  # paced runs: turns sent after their slot because the previous answer was not done
    # --engine-trace: every engine event of the run(s), as dicts (EngineEvent's fields + node, role, repeat)
    engine_events: list[dict[str, Any]] = field(default_factory=list)


def _words(rng: random.Random, tokens: int) -> str:
    return " ".join(rng.choices(WORDS, k=max(1, round(tokens / TOKENS_PER_WORD))))


def make_plans(args: argparse.Namespace, seed: int | None = None) -> list[SessionPlan]:
    """The same sessions for every policy (seeded)."""
    rng = random.Random(args.seed if seed is None else seed)
    mix = parse_mix(args.suffix_mix)
    system = "You are a coding agent. " + _words(rng, args.system_tokens)
    plans = []
    for s in range(args.sessions):
        results = []
        for _ in range(args.turns):
            r = rng.choices(mix, weights=[m.weight for m in mix])[0]
            results.append(_words(rng, rng.randint(r.lo, r.hi)))
        think = [rng.uniform(0.5, 1.5) * args.think_s for _ in range(args.turns)]
        if args.pace_s > 0:  # paced: the gap between two sends, not the time after an answer
            think = [rng.uniform(0.75, 1.25) * args.pace_s for _ in range(args.turns)]
        plans.append(SessionPlan(system, f"Task {s}: " + _words(rng, 60), results, think))
    return plans


@dataclass
class Chat:
    answer: dict[str, Any]
    ttft_s: float  # simulated
    tpot_s: float | None  # simulated
    prompt_tokens: int
    source: str
    t0: float  # perf_counter (real) at send, first token, last token
    first: float
    last: float
    ttfc_s: float  # simulated


async def _chat(client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str],
                speed: float) -> Chat:
    """Streamed call, read by the CLI's streaming client (kvtether.cli.streaming, which defines TTFT and TPOT):
    the answer, TTFT and mean TPOT (simulated s), prompt tokens, the gateway's reuse source."""
    try:
        got = await stream_answer(client, f"{url}/v1/chat/completions", body, headers)
    except StreamFailure as e:
        raise RuntimeError(e.message) from e
    r, clock = got.reader, got.clock
    answer: dict[str, Any] = {"role": "assistant", "content": r.text or None}
    if r.reasoning:
        answer["reasoning_content"] = "".join(r.reasoning)
    if r.calls:
        answer["tool_calls"] = r.tool_calls
    end = clock.end if clock.end is not None else now_ns()
    first = clock.first_token if clock.first_token is not None else end
    last = clock.last_token if clock.last_token is not None else first
    first_chunk = clock.first_event if clock.first_event is not None else first
    tpot_ms = got.tpot_ms(speed)
    return Chat(answer, (first - clock.t0) / 1e9 * speed, None if tpot_ms is None else tpot_ms / 1000,
                r.prompt_tokens or 0, got.headers.get("x-kvtether-reuse-source", ""), clock.t0 / 1e9, first / 1e9,
                last / 1e9, (first_chunk - clock.t0) / 1e9 * speed)


async def _session(client: httpx.AsyncClient, gw: str, s: int, plan: SessionPlan, args: argparse.Namespace,
                   result: Result, start: float, repeat: int) -> None:
    messages: list[dict[str, Any]] = [{"role": "system", "content": plan.system},
                                      {"role": "user", "content": plan.task}]
    headers = {"x-session-id": f"bench-{s}"}
    await asyncio.sleep(s * args.stagger_s / args.speed)  # staggered starts (simulated seconds)
    slot = time.perf_counter()  # paced: when this turn is due (real clock)
    for t in range(args.turns):
        if args.pace_s > 0:
            wait = slot - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            elif t > 0 and -wait * args.speed > 0.05:  # more than 50 simulated ms behind its slot
                result.late_sends += 1
            slot += plan.think_s[t] / args.speed
        body = {"model": MODEL, "messages": messages, "tools": TOOLS, "temperature": 0,
                "max_tokens": args.output, "min_tokens": args.output, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        if args.thinking:
            body["chat_template_kwargs"] = {"enable_thinking": True}
        try:
            c = await _chat(client, gw, body, headers, args.speed)
        except (RuntimeError, httpx.HTTPError) as exc:
            result.errors += 1
            print(f"  {result.policy} session {s} turn {t}: {exc!r}", file=sys.stderr)
            return
        sim = args.speed
        result.turns.append(TurnResult(s, t, c.ttft_s, c.tpot_s, c.prompt_tokens, c.source, (c.t0 - start) * sim,
                                       (c.first - start) * sim, (c.last - start) * sim, repeat, c.ttfc_s))
        answer = c.answer
        # The history goes on with a tool result whatever the model said (live answers, same sizes).
        # With --thinking the reasoning goes back too: within a tool loop (after the last user message)
        # the chat template keeps it, as agents running GLM-5 / Qwen3 with interleaved thinking send it.
        answer = {"role": "assistant", "content": answer.get("content") or "",
                  **({"reasoning_content": answer["reasoning_content"]} if "reasoning_content" in answer else {}),
                  "tool_calls": [{"id": f"call_{s}_{t}", "type": "function",
                                  "function": {"name": "read_file", "arguments": json.dumps({"path": f"f{t}"})}}]}
        messages = [*messages, answer, {"role": "tool", "tool_call_id": f"call_{s}_{t}", "content": plan.results[t]}]
        if args.pace_s <= 0:
            await asyncio.sleep(plan.think_s[t] / args.speed)


def parse_policy(name: str) -> tuple[str, dict[str, Any]]:
    """``auto`` or a variant ``auto@interference_weight=2+horizon_turns=2``: the policy and gateway config
    overrides (JSON values; the cost model's tuning constants go into the config's ``tuning`` table). Variants
    run side by side with the others, on the same sessions."""
    policy, _, rest = name.partition("@")
    knobs: dict[str, Any] = {}
    tuning: dict[str, Any] = {}
    for kv in rest.split("+") if rest else ():
        key, _, value = kv.partition("=")
        parsed = json.loads(value)
        integral = ("horizon_turns", "max_local_suffix_tokens", "tpot_window_tokens", "chunk_tokens")
        if isinstance(parsed, int) and not isinstance(parsed, bool) and key not in integral:
            parsed = float(parsed)
        (tuning if key in TUNING_FIELDS or key == "estimate_half_life_s" else knobs)[key] = parsed
    if tuning:
        knobs["tuning"] = tuning
    return policy, knobs


def _prefill_blocks(preset: str, tokens: int | None) -> int | None:
    # --prefill-kv-tokens in the preset's blocks (vLLM --num-gpu-blocks-override on P).
    return None if tokens is None else max(1, tokens // get_preset(preset).block_size)


async def run_policy(name: str, preset: str, plans: list[SessionPlan], args: argparse.Namespace,
                     repeat: int = 0) -> Result:
    policy, knobs = parse_policy(name)
    # Variants give times in simulated seconds like everything else here; the gateway measures real ones.
    knobs = {k: v / args.speed if k in SIM_SECONDS_KNOBS else v for k, v in knobs.items()}
    spec = StackSpec(preset=preset, prefill=args.prefill, decode=args.decode, speed=args.speed,
                     prefill_prefix_caching=args.prefill_prefix_caching == "on",
                     cluster={"kv_lease_duration": 600.0, "bidirectional": policy != "no-pull",
                              "prefill_num_gpu_blocks": _prefill_blocks(preset, args.prefill_kv_tokens),
                              "tool_call_parser": args.tool_call_parser})
    # Over the stack's gateway settings (its times ÷ speed, the seeds calibrated on the preset): the TPOT
    # objective and the stall window are in simulated seconds like every other time here; the gateway measures
    # real ones, `1/speed` times longer.
    settings = {"metrics_poll_interval_s": 1.0, "bidirectional_prefill": policy != "no-pull",
                "chunk_tokens": get_preset(preset).max_num_batched_tokens,
                **{k: getattr(PolicyKnobs(), k) / args.speed for k in SIM_SECONDS_KNOBS}, **knobs}
    result = Result(name)
    t0 = time.perf_counter()
    async with sim_stack(spec, policy, gateway=settings, separate_process=args.sim_process) as stack:
        if args.engine_trace and stack.cluster is not None:
            for node in stack.cluster.nodes:
                node.engine.on_event = lambda e, url=node.url, role=node.cfg.role: result.engine_events.append(
                    {**asdict(e), "node": url, "role": role, "repeat": repeat})
        gw = stack.url
        async with httpx.AsyncClient(timeout=3600,
                                     limits=httpx.Limits(keepalive_expiry=2.0, max_connections=200)) as client:
            start = time.perf_counter()
            await asyncio.gather(*(_session(client, gw, s, p, args, result, start, repeat)
                                   for s, p in enumerate(plans)))
            text = (await client.get(f"{gw}/metrics")).text
            for line in text.splitlines():
                if line.startswith("kvtether_ttft_seconds_count{"):
                    src = line.split('reuse_source="', 1)[1].split('"', 1)[0]
                    result.options[src] = result.options.get(src, 0) + int(float(line.rsplit(" ", 1)[1]))
                elif line.startswith("kvtether_gateway_overhead_seconds_sum"):
                    result.overhead_s += float(line.rsplit(" ", 1)[1]) * args.speed  # real → simulated
    result.wall_s = time.perf_counter() - t0
    return result


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


def table(results: dict[str, Result], paced: bool = False, counts: bool = True) -> str:
    """`counts`: the run's own tallies (errors, gateway overhead, late sends, wall time) are known; pooled
    --json output carries only the turns."""
    pols = list(results)
    lines = ["| turns | " + " | ".join(f"{p} TTFT p50 / p95 / p99 s" for p in pols) + " | prompt tokens |",
             "|" + "---|" * (len(pols) + 2)]
    for lo, hi in (*BUCKETS, (10, 10_000)):
        cells = []
        toks = [t.prompt_tokens for r in results.values() for t in r.turns if lo <= t.turn <= hi]
        for p in pols:
            v = [t.ttft_s for t in results[p].turns if lo <= t.turn <= hi]
            cells.append(f"{_pct(v, .5):.3f} / {_pct(v, .95):.3f} / {_pct(v, .99):.3f}" if v else "–")
        name = f"{lo}–{hi}" if hi < 10_000 else f"≥{lo}"
        if (lo, hi) == (10, 10_000):
            name = "**≥10 (all late)**"
        lines.append(f"| {name} | " + " | ".join(cells) + (f" | {min(toks)}–{max(toks)} |" if toks else " | – |"))
    late_fc = {p: [t.ttfc_s for t in results[p].turns if t.turn >= 10] for p in pols}
    lines.append("| ≥10: TTFC (first chunk = first token) p50 / p95 / p99 s | " + " | ".join(
        f"{_pct(late_fc[p], .5):.3f} / {_pct(late_fc[p], .95):.3f} / {_pct(late_fc[p], .99):.3f}" for p in pols)
        + " | |")
    tp = {p: [t.tpot_s for t in results[p].turns if t.tpot_s is not None] for p in pols}
    lines.append("| decode TPOT p50 / p95 s | " + " | ".join(f"{_pct(tp[p], .5):.4f} / {_pct(tp[p], .95):.4f}"
                                                          for p in pols) + " | |")
    if counts:
        lines.append("| turns / errors | " + " | ".join(f"{len(results[p].turns)} / {results[p].errors}"
                                                       for p in pols) + " | |")
    lines.append("| turns by reuse source | " + " | ".join(
        ", ".join(f"{k} {v}" for k, v in sorted(results[p].options.items()) if v) for p in pols) + " | |")
    if not counts:
        return "\n".join(lines)
    lines.append("| gateway's own TTFT share, mean s | " + " | ".join(
        f"{results[p].overhead_s / max(1, len(results[p].turns)):.3f}" for p in pols) + " | |")
    if paced:
        lines.append("| paced turns sent late (> 50 ms) | " + " | ".join(
            f"{results[p].late_sends}" for p in pols) + " | |")
    lines.append("| wall s | " + " | ".join(f"{results[p].wall_s:.0f}" for p in pols) + " | |")
    return "\n".join(lines)


def verdict(results: dict[str, Result], cand: str = "auto", first_chunk: bool = False) -> str:
    """The issue's four targets for `cand`; `first_chunk`: on TTFC instead of TTFT (the TPOT line is the same)."""
    if not all(p in results for p in ("no-pull", "reference", cand)):
        return ""

    def late(p: str, q: float) -> float:
        return _pct([t.ttfc_s if first_chunk else t.ttft_s for t in results[p].turns if t.turn >= 10], q)

    def tpot95(p: str) -> float:
        return _pct([t.tpot_s for t in results[p].turns if t.tpot_s is not None], 0.95)

    a50, n50, r50 = late(cand, .5), late("no-pull", .5), late("reference", .5)
    what = "TTFC" if first_chunk else "TTFT"
    out = [f"{cand} late-turn p50 {what}: {n50 / a50:.2f}× lower than no-pull (target ≥ 5), "
           f"{r50 / a50:.2f}× lower than reference (target ≥ 1.5)",
           f"{cand} late-turn p95 {what} {late(cand, .95):.3f} s vs no-pull {late('no-pull', .95):.3f} s, "
           f"reference {late('reference', .95):.3f} s (target: lower than both)",
           f"{cand} decode TPOT p95 {tpot95(cand):.4f} s vs no-pull {tpot95('no-pull'):.4f} s: "
           f"{(tpot95(cand) / tpot95('no-pull') - 1) * 100:+.1f} % (target within 10 %)"]
    # The decode-local turn is the fastest way to serve a late turn (no P leg, no transfer), so no-pull's p50
    # over the local turns' p50 is about the most any placement reaches against no-pull on these sessions:
    # every late turn local, each as fast as the local turns were here.
    local = [t.ttfc_s if first_chunk else t.ttft_s for t in results[cand].turns
             if t.turn >= 10 and t.source == "decode_local"]
    if local:
        out.append(f"{cand} late decode-local turns' {what} p50 {_pct(local, .5):.3f} s: no-pull's late p50 is "
                   f"{n50 / _pct(local, .5):.2f}× that (about the ceiling of the first ratio: every late turn "
                   f"local, {len(local)} of {sum(1 for t in results[cand].turns if t.turn >= 10)} were)")
    return "\n".join(out)


def _overlap(t: TurnResult, others: list[TurnResult]) -> tuple[float, int]:
    """During `t`'s decode (first → last token): the mean number of other requests decoding (cluster-wide),
    and how many decode-local first tokens (each the end of a local prefill step) fell inside it."""
    span = t.last_s - t.first_s
    if span <= 0:
        return 0.0, 0
    busy = sum(max(0.0, min(t.last_s, o.last_s) - max(t.first_s, o.first_s)) for o in others if o is not t)
    local = sum(1 for o in others if o is not t and o.source == "decode_local" and t.first_s < o.first_s <= t.last_s)
    return busy / span, local


def _fit(rows: list[tuple[float, ...]], ys: list[float]) -> list[float] | None:
    """Ordinary least squares by normal equations (tiny systems); None when singular."""
    d = len(rows[0]) if rows else 0
    if len(rows) <= d:
        return None
    a = [[sum(r[i] * r[j] for r in rows) for j in range(d)] for i in range(d)]
    b = [sum(r[i] * y for r, y in zip(rows, ys, strict=True)) for i in range(d)]
    m = [[*a[i], b[i]] for i in range(d)]
    for col in range(d):
        piv = max(range(col, d), key=lambda r: abs(m[r][col]))
        m[col], m[piv] = m[piv], m[col]
        if abs(m[col][col]) < 1e-12:
            return None
        for r in range(col + 1, d):
            f = m[r][col] / m[col][col]
            for k in range(col, d + 1):
                m[r][k] -= f * m[col][k]
    x = [0.0] * d
    for r in range(d - 1, -1, -1):
        x[r] = (m[r][d] - sum(m[r][k] * x[k] for k in range(r + 1, d))) / m[r][r]
    return x


def diagnostics(results: dict[str, Result], n_decode: int) -> str:
    """Where the time goes: late-turn TTFT by reuse source, and what decode TPOT is made of (batch size vs
    decode-local prefills overlapping a request's decode)."""
    lines = ["| policy | late TTFT p50 by source (n) | decode concurrency per D | local prefills per request's "
             "decode | TPOT p95, no local overlap (n) | TPOT p95, ≥1 local overlap (n) | "
             "TPOT fit: s + s/decoding req + s/local overlap |",
             "|---|---|---|---|---|---|---|"]
    for p, r in results.items():
        late = [t for t in r.turns if t.turn >= 10]
        srcs = sorted({t.source for t in late})
        by_src = ", ".join(f"{src or '?'} {_pct([t.ttft_s for t in late if t.source == src], .5):.3f} "
                           f"({sum(1 for t in late if t.source == src)})" for src in srcs)
        rows: list[tuple[float, ...]] = []
        ys: list[float] = []
        conc: list[float] = []
        overlaps: list[int] = []
        quiet: list[float] = []
        hit: list[float] = []
        for rep in sorted({t.repeat for t in r.turns}):
            same = [t for t in r.turns if t.repeat == rep]
            for t in same:
                if t.tpot_s is None:
                    continue
                c, k = _overlap(t, same)
                conc.append(c)
                overlaps.append(k)
                rows.append((1.0, c, float(k)))
                ys.append(t.tpot_s)
                (hit if k else quiet).append(t.tpot_s)
        fit = _fit(rows, ys) if any(row[2] for row in rows) else _fit([row[:2] for row in rows], ys)
        fit_s = " + ".join(f"{v * 1e3:.2f} ms" for v in fit) if fit else "–"
        mean_c = (1.0 + sum(conc) / len(conc)) / n_decode if conc else float("nan")
        mean_k = sum(overlaps) / len(overlaps) if overlaps else float("nan")
        lines.append(f"| {p} | {by_src} | {mean_c:.2f} | {mean_k:.2f} | {_pct(quiet, .95):.4f} ({len(quiet)}) | "
                     f"{_pct(hit, .95):.4f} ({len(hit)}) | {fit_s} |")
    return "\n".join(lines)


# Late turns whose prompt grew by more than this beyond the last answer: the long tool results (the suffix
# mix's 2–8k), which always go through P and set the tail; the rest are the short ones.
LONG_SUFFIX_TOKENS = 1500
_TIMELINE = (
    ("P wait", "P request in → its KV read began (overhead + queue)"),
    ("P read", "P's KV read from D (pull)"),
    ("P compute", "P's read done (or arrival) → prompt computed: queue + prefill steps"),
    ("hop", "P's prompt computed → D request in (P's answer through the gateway)"),
    ("D wait", "D request in → its KV read began (overhead + queue)"),
    ("D read", "D's KV read from P"),
    ("D first", "D's read done → its prompt done (the step that yields the first token)"),
    ("local", "decode-local: D request in → prompt done (queue + local prefill steps)"),
)


def _requests(events: list[dict[str, Any]]) -> dict[tuple[int, str, int], list[dict[str, dict[str, Any]]]]:
    """(repeat, role, prompt tokens) → the requests with that prompt, each as {event kind: event}."""
    by_id: dict[tuple[int, str, str], tuple[str, dict[str, dict[str, Any]]]] = {}
    for e in events:
        _, kinds = by_id.setdefault((e["repeat"], e["node"], e["request_id"]), (e["role"], {}))
        kinds.setdefault(e["kind"], e)
    out: dict[tuple[int, str, int], list[dict[str, dict[str, Any]]]] = {}
    for (rep, _, _), (role, req) in by_id.items():
        if "submit" in req and "prompt_done" in req:
            out.setdefault((rep, role, int(req["submit"]["prompt_tokens"])), []).append(req)
    return out


def _node_legs(r: dict[str, dict[str, Any]]) -> tuple[float, float, float]:
    """One engine request's (arrival → KV read start, the read, read end or arrival → prompt done)."""
    arrived, done = r["submit"]["at"], r["prompt_done"]["at"]
    read = r.get("kv_read")
    if read is None:
        return 0.0, 0.0, done - arrived
    return read["at"] - arrived, read["seconds"], done - (read["at"] + read["seconds"])


def _legs(p: dict[str, dict[str, Any]] | None, d: dict[str, dict[str, Any]]) -> dict[str, float]:
    if p is None:
        return {"local": d["prompt_done"]["at"] - d["submit"]["at"]}
    p_wait, p_read, p_compute = _node_legs(p)
    d_wait, d_read, d_first = _node_legs(d)
    return {"P wait": p_wait, "P read": p_read, "P compute": p_compute,
            "hop": d["submit"]["at"] - p["prompt_done"]["at"],
            "D wait": d_wait, "D read": d_read, "D first": d_first}


def timeline(results: dict[str, Result], output_tokens: int) -> str:
    """Where late turns' time to first token went, engine side (--engine-trace), p50 / p90 per leg, by suffix
    length and path. Turns are matched to engine requests by prompt length within a run (skipped when two
    requests of a role share it)."""
    lines = ["| policy | turns (n) | " + " | ".join(name for name, _ in _TIMELINE) + " | TTFC |",
             "|" + "---|" * (len(_TIMELINE) + 3)]
    skipped = 0
    for pol, r in results.items():
        reqs = _requests(r.engine_events)
        prev = {(t.repeat, t.session, t.turn): t.prompt_tokens for t in r.turns}
        groups: dict[str, list[tuple[dict[str, float], float]]] = {}
        for t in r.turns:
            before = prev.get((t.repeat, t.session, t.turn - 1))
            if t.turn < 10 or before is None:
                continue
            ds = reqs.get((t.repeat, "decode", t.prompt_tokens), [])
            ps = reqs.get((t.repeat, "prefill", t.prompt_tokens), [])
            if len(ds) != 1 or len(ps) > 1:
                skipped += 1
                continue
            size = "long" if t.prompt_tokens - before - output_tokens > LONG_SUFFIX_TOKENS else "short"
            path = "P/D" if ps else "local"
            groups.setdefault(f"{size} suffix, {path}", []).append((_legs(ps[0] if ps else None, ds[0]), t.ttfc_s))
        for key in sorted(groups):
            rows = groups[key]
            cells = []
            for name, _ in _TIMELINE:
                v = [legs[name] for legs, _ in rows if name in legs]
                cells.append(f"{_pct(v, .5):.3f} / {_pct(v, .9):.3f}" if v else "–")
            ttfc = [x for _, x in rows]
            lines.append(f"| {pol} | {key} ({len(rows)}) | " + " | ".join(cells)
                         + f" | {_pct(ttfc, .5):.3f} / {_pct(ttfc, .9):.3f} |")
    legend = "; ".join(f"{name}: {what}" for name, what in _TIMELINE)
    return "\n".join(lines) + f"\n\nEngine-side, simulated s, p50 / p90. {legend}. Unmatched turns: {skipped}."


def per_repeat(results: dict[str, Result], cand: str = "auto") -> str:
    """The verdict's lines for each repeat on its own: how far run-to-run noise moves them."""
    reps = sorted({t.repeat for r in results.values() for t in r.turns})
    if len(reps) < 2 or not all(p in results for p in ("no-pull", "reference", cand)):
        return ""
    out = []
    for rep in reps:
        sub = {p: Result(p, [t for t in r.turns if t.repeat == rep]) for p, r in results.items()}
        out.append(f"- repeat {rep}: " + " | ".join(verdict(sub, cand).splitlines()))
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="both", help="glm-5-fp8-h200-tp8, qwen3-32b-h200-tp8 or both")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--prefill", type=int, default=2)
    ap.add_argument("--decode", type=int, default=2)
    ap.add_argument("--speed", type=float, default=0.25, help="simulated seconds per real second (< 1: slower)")
    ap.add_argument("--system-tokens", type=int, default=2000)
    ap.add_argument("--suffix-mix", default="50-500:0.9,2000-8000:0.1", help="tool-result tokens per turn")
    ap.add_argument("--output", type=int, default=128, help="answer tokens per turn (pinned)")
    ap.add_argument("--thinking", action="store_true",
                    help="answers open with reasoning (chat_template_kwargs enable_thinking, GLM-5's and Qwen3's "
                         "default), sent back in the history; the first delta is then reasoning, not the tool "
                         "call the parser holds back until its name is complete")
    ap.add_argument("--tool-call-parser", choices=TOOL_FORMATS, default=None,
                    help="how the simulated model writes tool calls (default: the preset's model's: glm47 for "
                         "GLM-5, whose parser releases the name after it and one tag; hermes for Qwen3, ~12 tokens)")
    ap.add_argument("--think-s", type=float, default=0.3, help="mean simulated think/tool time between turns")
    ap.add_argument("--pace-s", type=float, default=4.0,
                    help="paced (open-loop) turns: each session sends a turn every PACE simulated s (± 25 %%), "
                         "or as soon as its previous answer is done if that is later; every policy then offers "
                         "the same load, so decode TPOT compares at equal concurrency. 0: closed loop "
                         "(--think-s after each answer)")
    ap.add_argument("--stagger-s", type=float, default=0.2, help="simulated seconds between session starts")
    ap.add_argument("--prefill-prefix-caching", choices=("off", "on"), default="off")
    ap.add_argument("--prefill-kv-tokens", type=int, default=None, metavar="N",
                    help="KV cache of each prefill node, in tokens (vLLM --num-gpu-blocks-override): with prefix "
                         "caching on, a cache smaller than the sessions' histories stands for a P that the rest of "
                         "a large cluster's sessions share (default: the preset's memory budget)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs of all policies, each on its own sessions (seed, seed+1, ...); turns are pooled and "
                         "each run's ratios printed; the policies' order rotates so machine load drift is shared")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--pool", nargs="+", metavar="FILE",
                    help="run nothing: pool the turns of earlier runs' --json output (one file per run, e.g. seeds "
                         "run as separate processes at the same time) and print the tables and verdict over them, "
                         "with each run's verdict; pass the runs' --preset and workload flags for the header")
    ap.add_argument("--plan-log", default=None, help="append every turn's placement reason (debug log) to this file")
    ap.add_argument("--engine-trace", default=None, metavar="FILE",
                    help="record every simulated engine's events (request in, KV read, prompt done) as JSON lines "
                         "in FILE and print where late turns' time to first token went, leg by leg")
    ap.add_argument("--sim-process", action="store_true",
                    help="run the simulated cluster in a child process (its own GIL and core) instead of in the "
                         "benchmark's process; not with --engine-trace, which reads the engines in process")
    args = ap.parse_args()
    if args.engine_trace and args.sim_process:
        ap.error("--engine-trace reads the engines in process: not with --sim-process")
    if args.plan_log:
        handler = logging.FileHandler(args.plan_log)
        handler.setFormatter(logging.Formatter("%(message)s"))
        plan_log = logging.getLogger("kvtether.gateway.turn.orchestrator")
        plan_log.setLevel(logging.DEBUG)
        plan_log.addHandler(handler)
    presets = ["glm-5-fp8-h200-tp8", "qwen3-32b-h200-tp8"] if args.preset == "both" else [args.preset]
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for name in policies:  # a misspelt variant fails now, not after the policies before it have run
        policy, knobs = parse_policy(name)
        load_config(None, prefill=["http://p:1"], decode=["http://d:1"], policy=policy, **knobs)
    if args.pool:
        if len(presets) != 1:
            ap.error("--pool: name the runs' one --preset")
        results = pooled(args.pool)
        report(presets[0], results, args, f", {len(args.pool)} runs pooled from --json output ({', '.join(args.pool)})",
               counts=False)
        return
    for preset in presets:
        results = {p: Result(p) for p in policies}
        for rep in range(args.repeat):
            plans = make_plans(args, args.seed + rep)
            for i in range(len(policies)):
                policy = policies[(i + rep) % len(policies)]
                r = asyncio.run(run_policy(policy, preset, plans, args, rep))
                print(f"  {preset} {policy} (repeat {rep}): {len(r.turns)} turns, {r.errors} errors, {r.wall_s:.0f} s",
                      file=sys.stderr)
                acc = results[policy]
                acc.turns += r.turns
                acc.errors += r.errors
                acc.wall_s += r.wall_s
                acc.overhead_s += r.overhead_s
                acc.late_sends += r.late_sends
                acc.engine_events += r.engine_events
                for k, n in r.options.items():
                    acc.options[k] = acc.options.get(k, 0) + n
        runs = ""
        if args.repeat > 1:
            runs = f", {args.repeat} runs pooled (seeds {args.seed}–{args.seed + args.repeat - 1})"
        report(preset, results, args, runs)


def pooled(paths: list[str]) -> dict[str, Result]:
    """The turns of several runs' ``--json`` output (each file's last JSON line: policy → turns), one repeat
    per file, pooled per policy. Runs meant to be pooled go in separate processes (each its own seed, or the
    same seed again), started together: paced runs take minutes of wall time each and use ~15 % of a core.
    The turns by reuse source are counted from the turns; what the JSON does not carry (errors, the gateway's
    overhead, late sends, wall time) is left out of the pooled table."""
    results: dict[str, Result] = {}
    for rep, path in enumerate(paths):
        with open(path) as f:
            lines = [line for line in f if line.startswith("{")]
        if not lines:
            raise SystemExit(f"{path}: no --json line (policy -> turns)")
        for policy, turns in json.loads(lines[-1]).items():
            acc = results.setdefault(policy, Result(policy))
            acc.turns += [TurnResult(**{**t, "repeat": rep}) for t in turns]
            for t in turns:  # by the source each client saw (a run's own count is the gateway's metric)
                source = t["source"] or "?"
                acc.options[source] = acc.options.get(source, 0) + 1
    return results


def report(preset: str, results: dict[str, Result], args: argparse.Namespace, runs: str,
           counts: bool = True) -> None:
    """The tables, the issue's verdict for every auto variant (pooled and per run) and the diagnostics."""
    policies = list(results)
    arrivals = (f"paced: a turn every {args.pace_s} s ± 25 %" if args.pace_s > 0
                else f"think {args.think_s} s after each answer")
    print(f"\n### {preset}: {args.prefill}P {args.decode}D, {args.sessions} concurrent sessions × {args.turns} "
          f"turns, suffix mix {args.suffix_mix} tok, {args.output} output tok/turn, {arrivals}, "
          f"prefill prefix caching {args.prefill_prefix_caching}"
          f"{'' if args.prefill_kv_tokens is None else f' (P cache {args.prefill_kv_tokens} tok)'}"
          f"{', thinking' if args.thinking else ''}, tool calls "
          f"{args.tool_call_parser or get_preset(preset).tool_call_parser}{runs}; "
          f"times in SIMULATED seconds "
          f"(speed {args.speed}: client real × {args.speed})\n")
    print(table(results, paced=args.pace_s > 0, counts=counts))
    for cand in [p for p in policies if parse_policy(p)[0] == "auto"]:
        v = verdict(results, cand)
        if v:
            print("\n" + v)
            print("on the first chunk (= first token): " + " | ".join(
                verdict(results, cand, first_chunk=True).splitlines()[:2]))
        rv = per_repeat(results, cand)
        if rv:
            print("\n" + rv)
    print("\n" + diagnostics(results, args.decode))
    if args.engine_trace:
        print("\n" + timeline(results, args.output))
        with open(args.engine_trace, "a") as f:
            for pol, res in results.items():
                for e in res.engine_events:
                    f.write(json.dumps({"preset": preset, "policy": pol, **e}) + "\n")
    if args.json:
        print(json.dumps({p: [t.__dict__ for t in r.turns] for p, r in results.items()}))

if __name__ == "__main__":
    main()
