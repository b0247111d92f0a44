#!/usr/bin/env python3
"""TTFT with and without the decode -> prefill KV pull over a 2k -> 24k prompt sweep, beside the vLLM blog.

Run:  .venv/bin/python benchmarks/sim_pull_sweep.py [--mode analytic|sim] [--preset NAME ...]

What is compared
  The vLLM blog (2026-10-12; docs/protocol.md §4): 1P1D, each node 8 x H200 TP8, 16 x 200 Gb/s EFA,
  prefill prefix caching OFF, kv_recompute_threshold 64, decoder_kv_blocks_ttl 480, vLLM's multi-turn
  benchmark. Published: Qwen3-32B TTFT off 158 -> 778 ms, on 122 -> 460 ms over 2k -> 24k prompts;
  GLM-5-FP8 off 500 -> 2334 ms, on 358 -> 702 ms over 2k -> 20k; the D -> P transfer itself ~30-130 ms.
  Only those ENDPOINTS are published: in-between rows print "n/a" for the blog, nothing is interpolated.
  "2k" / "24k" are read as 2048 / 24576 tokens (ASSUMPTION).

Workload shape (ASSUMPTION, stated again in the output)
  vLLM's multi-turn benchmark (benchmarks/multi_turn/generate_multi_turn.json): conversations whose prompt
  grows turn by turn; each turn adds a user message of 120-160 tokens (mean 140) after the previous answer
  of 80-120 tokens (mean 100). A sweep point L is one warm turn whose prompt is L tokens:
    * the decode node D that served the previous turn holds prompt + answer - 1 = L - 140 - 1 tokens;
    * off (no bidirectional pull, P prefix caching off): P prefills all L tokens;
    * on: P pulls the L - 141 held tokens from D (>= threshold 64) and prefills the 141-token suffix;
    * both: D reads from P only the blocks its own prefix cache lacks (it still caches the previous
      turn's full blocks), then computes the first token. TTFT = P leg + D's read + D's first step.
  One request at a time (no concurrent clients): the blog's client count is not published.

Modes
  analytic  the cost model's formulas (kvtether.sim.cost, the ones the engine charges), one lone turn.
  sim       the same turns driven through the simulator (kvtether.sim.cluster, 1P1D) over HTTP as vLLM's
            reference proxy drives vLLM: P leg with max_tokens=1 and kv_transfer_params, D leg streamed,
            the next turn's P leg carrying D's handle. The engines decide what is pulled, cached, chunked
            and computed. TTFT is the simulated time the engines CHARGED for the turn (each engine step's
            cost-model price via Engine.on_step, plus the NIXL reads counted by /metrics), because client
            wall time x speed also contains the Python simulator's own CPU time (tokenizing, hashing,
            serializing ~1-2 s per 24k-token turn on a small machine), which would swamp the figures;
            wall x speed is printed too. Prefix caching is off on P (ClusterSpec.prefill_prefix_caching).

Cost terms beyond compute and bytes (sim/presets.py has the sources)
  * per-descriptor transfer cost: vLLM's NIXL connector posts one RDMA read per (KV region, block) on each GPU;
    ~2.4 us each (ai-dynamo/nixl #1514). Qwen3-32B on TP8 (4 KiB descriptors) is message-rate bound.
  * per-request serving overhead (API server, proxy hop, hand-over): NOT MODELLED in the shipped presets (0),
    because the only source would be the blog's own 2k point. Absolute TTFTs at short prompts therefore sit
    below the blog's by its fixed serving cost (~100 ms per turn); the long-prompt ratio is the comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvtether.sim.presets import Preset, get_preset

USER_TOKENS = 140  # mean of the multi-turn benchmark's uniform(120, 160) user message
ANSWER_TOKENS = 100  # mean of its uniform(80, 120) answer
THRESHOLD = 64  # kv_recompute_threshold of the blog's set-up


@dataclass(frozen=True)
class BlogCurve:
    """The blog's published endpoints, nothing in between."""

    model: str
    lengths: tuple[int, int]
    off_ms: tuple[float, float]
    on_ms: tuple[float, float]

    def at(self, length: int) -> tuple[float, float] | None:
        for i, published in enumerate(self.lengths):
            if published == length:
                return self.off_ms[i], self.on_ms[i]
        return None


BLOG: dict[str, BlogCurve] = {
    "qwen3-32b-h200-tp8": BlogCurve("Qwen3-32B", (2048, 24576), (158.0, 778.0), (122.0, 460.0)),
    "glm-5-fp8-h200-tp8": BlogCurve("GLM-5-FP8", (2048, 20480), (500.0, 2334.0), (358.0, 702.0)),
}
DEFAULT_LENGTHS: dict[str, tuple[int, ...]] = {
    "qwen3-32b-h200-tp8": (2048, 4096, 8192, 12288, 16384, 20480, 24576),
    "glm-5-fp8-h200-tp8": (2048, 4096, 8192, 12288, 16384, 20480),
}


@dataclass(frozen=True)
class Turn:
    """TTFT of one warm turn and where its time goes (simulated seconds)."""

    prompt: int
    pulled: int  # tokens P read from D (0: computed locally)
    computed: int  # tokens P prefilled
    pull: float  # D -> P transfer
    prefill: float  # P's chunked prefill
    to_decode: float  # D's read of the blocks it lacks from P
    first_token: float  # D's first step
    overhead: float = 0.0  # fixed per-request serving overhead of both legs (P's and D's request)

    @property
    def ttft(self) -> float:
        return self.pull + self.prefill + self.to_decode + self.first_token + self.overhead


def analytic_turn(
    preset: Preset,
    prompt: int,
    *,
    pull: bool,
    user_tokens: int = USER_TOKENS,
    answer_tokens: int = ANSWER_TOKENS,
    threshold: int = THRESHOLD,
) -> Turn:
    """One warm turn of `prompt` tokens through 1P1D, from the cost model alone (see the module docstring)."""
    if prompt <= user_tokens + answer_tokens:
        raise ValueError("the prompt must be longer than one turn's new part")
    c = preset.cost
    held = prompt - user_tokens - 1  # D's handle: previous prompt + answer - 1 (the last sampled token has no KV)
    # P's prefix cache is off, so nothing is cached locally: count = min(remote_num_tokens, prompt) - 0.
    pulled = held if pull and held >= threshold else 0
    computed = prompt - pulled
    prefill = c.lone_prefill_seconds(computed, pulled, preset.max_num_batched_tokens)
    d_cached = held // preset.block_size * preset.block_size  # D's prefix cache keeps full blocks only
    return Turn(
        prompt=prompt,
        pulled=pulled,
        computed=computed,
        pull=c.transfer_seconds(pulled),
        prefill=prefill,
        to_decode=c.transfer_seconds(prompt - d_cached),
        first_token=c.step_seconds([(1, prompt - 1)], []),
        overhead=2 * c.hardware.request_overhead,  # the P leg and the D leg are a request each
    )


# --- sim mode ------------------------------------------------------------------------------------------

FILLER = (
    "the model reads the data file and the agent checks the cache before each new request while the "
    "user waits for an answer about the state of the system and the time it takes to build the result "
)


def _words(n: int, salt: int) -> str:
    """About `n` tokens of ordinary words (the simulator's tokenizer: ~1 token per common word)."""
    words = FILLER.split()
    out = [f"turn{salt}"]
    while len(out) < n:
        out.extend(words)
    return " ".join(out[:n])


DEFAULT_P_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@dataclass
class SimLeg:
    """What one node charged, in simulated seconds, during one leg of the measured turn."""

    steps: list[float]  # the cost model's price of each engine step, in order
    xfer_tokens: int  # tokens this node read over NIXL during the leg
    overhead: float = 0.0  # per-request overhead the engine charged during the leg (Engine.overhead_charged)


@dataclass
class SimTurn:
    wall: float  # client-side TTFT, real seconds x speed: includes the host's own CPU time
    p_leg: SimLeg
    d_leg: SimLeg
    prompt: int

    def charged(self, preset: Preset) -> Turn:
        """The turn as the engines priced it: P's steps and pull, D's read and first step.

        This is the simulator's own account (what the engine slept for), free of the real time the Python
        simulator spends tokenizing, hashing and serializing, which wall x speed also contains.
        """
        c = preset.cost
        return Turn(
            prompt=self.prompt,
            pulled=self.p_leg.xfer_tokens,
            computed=self.prompt - self.p_leg.xfer_tokens,
            pull=c.transfer_seconds(self.p_leg.xfer_tokens),
            prefill=sum(self.p_leg.steps),
            to_decode=c.transfer_seconds(self.d_leg.xfer_tokens),
            first_token=self.d_leg.steps[0] if self.d_leg.steps else 0.0,
            overhead=self.p_leg.overhead + self.d_leg.overhead,
        )


async def _xfer_tokens(http: Any, url: str) -> int:
    """Prompt tokens this node read over NIXL, from its /metrics (Prometheus text): vLLM has no token counter
    for NIXL reads, but every token read lands in `vllm:prompt_tokens_cached_by_source_total{source="p2p"}`."""
    r = await http.get(f"{url}/metrics")
    r.raise_for_status()
    total = 0.0
    for line in r.text.splitlines():
        if line.startswith("vllm:prompt_tokens_cached_by_source_total{") and 'source="p2p"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


async def _sim_turn(
    http: Any,
    cluster: Any,
    body: dict[str, Any],
    handle: dict[str, Any] | None,
    speed: float,
) -> tuple[SimTurn, dict[str, Any] | None, str]:
    """One turn as vLLM's reference proxy runs it: P leg (max_tokens=1, kv_transfer_params = the previous
    turn's handle or the default dict), then D leg (streamed) with P's params. Returns the measured turn,
    D's new handle and the answer text."""
    import json

    p_url, d_url = cluster.prefill_urls[0], cluster.decode_urls[0]
    priced = {url: cluster.node(url).engine.preset.cost for url in (p_url, d_url)}
    log: dict[str, list[float]] = {p_url: [], d_url: []}
    for url in (p_url, d_url):
        cost = priced[url]
        cluster.node(url).engine.on_step = lambda step, cost=cost, out=log[url]: out.append(
            cost.step_seconds(step.prefill_chunks, step.decode_contexts)
        )
    p_xfer0, d_xfer0 = await _xfer_tokens(http, p_url), await _xfer_tokens(http, d_url)
    p_over0, d_over0 = (cluster.node(url).engine.overhead_charged for url in (p_url, d_url))

    p_body = dict(body, max_tokens=1, stream=False, kv_transfer_params=handle or dict(DEFAULT_P_PARAMS))
    start = time.perf_counter()
    r = await http.post(f"{p_url}/v1/chat/completions", json=p_body)
    r.raise_for_status()
    p_params = r.json()["kv_transfer_params"]
    p_steps = list(log[p_url])
    d_body = dict(body, stream=True, return_token_ids=True, kv_transfer_params=p_params)
    first: float | None = None
    text: list[str] = []
    new_handle: dict[str, Any] | None = None
    async with http.stream("POST", f"{d_url}/v1/chat/completions", json=d_body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                if choice.get("token_ids") and first is None:  # return_token_ids: a chunk per sampled token
                    first = time.perf_counter()
                text.append((choice.get("delta") or {}).get("content") or "")
            if chunk.get("kv_transfer_params"):
                new_handle = chunk["kv_transfer_params"]
    if first is None:
        first = time.perf_counter()
    for url in (p_url, d_url):
        cluster.node(url).engine.on_step = None
    turn = SimTurn(
        wall=(first - start) * speed,
        p_leg=SimLeg(
            p_steps, await _xfer_tokens(http, p_url) - p_xfer0, cluster.node(p_url).engine.overhead_charged - p_over0
        ),
        d_leg=SimLeg(
            list(log[d_url]),
            await _xfer_tokens(http, d_url) - d_xfer0,
            cluster.node(d_url).engine.overhead_charged - d_over0,
        ),
        prompt=int(p_params.get("remote_num_tokens") or 0),
    )
    return turn, new_handle, "".join(text)


async def _sim_point(preset: str, length: int, pull: bool, speed: float) -> SimTurn:
    """Two-turn conversation on a fresh 1P1D cluster: turn 1 builds a history of about `length` - 141 tokens
    on D, turn 2 (the measured one) adds a 140-token user message."""
    import httpx

    cluster_mod = importlib.import_module("kvtether.sim.cluster")
    spec = cluster_mod.ClusterSpec(
        prefill=1, decode=1, preset=preset, speed=speed, bidirectional=pull, prefill_prefix_caching=False
    )
    async with cluster_mod.SimCluster(spec) as c, httpx.AsyncClient(timeout=600) as http:
        p_url = c.prefill_urls[0]

        # Size turn 1 so that turn 2's prompt is about `length` tokens: measure the template's and the
        # filler's token counts with P's /tokenize, as the gateway would.
        async def count(msgs: list[dict[str, Any]]) -> int:
            r = await http.post(f"{p_url}/tokenize", json={"model": "kvtether-sim", "messages": msgs})
            r.raise_for_status()
            return int(r.json()["count"])

        probe = 1000
        small = await count([{"role": "user", "content": _words(probe, 1)}])
        per_word = (await count([{"role": "user", "content": _words(2 * probe, 1)}]) - small) / probe
        overhead = await count([{"role": "user", "content": "x"}, {"role": "assistant", "content": "x"}])
        target_first = length - USER_TOKENS - ANSWER_TOKENS - overhead
        first_user = _words(max(1, round(target_first / per_word)), 1)
        messages: list[dict[str, Any]] = [{"role": "user", "content": first_user}]
        body: dict[str, Any] = {"model": "kvtether-sim", "messages": messages, "max_tokens": ANSWER_TOKENS}
        _, handle, answer = await _sim_turn(http, c, body, None, speed)
        user = _words(USER_TOKENS, 2)
        messages = [*messages, {"role": "assistant", "content": answer}]
        # Pad the new user message so the measured prompt lands on `length` even when the answer was short.
        short = length - await count([*messages, {"role": "user", "content": user}])
        if short > 0:
            user = _words(USER_TOKENS + round(short / per_word), 2)
        messages = [*messages, {"role": "user", "content": user}]
        # Only the first token is measured: the measured turn's D leg stops after two.
        body = dict(body, messages=messages, max_tokens=2)
        turn, _, _ = await _sim_turn(http, c, body, handle if pull else None, speed)
        print(
            f"   [sim] {preset} target {length}: measured prompt {turn.prompt} tokens, pull={pull}: "
            f"P steps {len(turn.p_leg.steps)}, P read {turn.p_leg.xfer_tokens} tokens, "
            f"D read {turn.d_leg.xfer_tokens} tokens; wall x speed {turn.wall * 1e3:.0f} ms",
            file=sys.stderr,
        )
        return turn


def sim_available() -> bool:
    try:
        importlib.import_module("kvtether.sim.cluster")
    except ImportError:
        return False
    return True


# --- report --------------------------------------------------------------------------------------------


def _fmt(x: float | None, spec: str = "7.0f") -> str:
    return "n/a".rjust(int(spec.split(".")[0])) if x is None else format(x, spec)


def _message_bound(preset: Preset, tokens: int) -> bool:
    """Whether a read of `tokens` is limited by descriptors per second rather than bytes per second."""
    c = preset.cost
    hw = c.hardware
    if tokens <= 0:
        return False
    messages = c.transfer_descriptors(tokens) * hw.n_gpus / hw.link_message_rate
    return messages > tokens * c.model.kv_bytes_per_token / hw.link


def report(
    name: str,
    lengths: Sequence[int],
    off: Sequence[float],
    on: Sequence[float],
    turns: Sequence[tuple[Turn, Turn]] | None,
    mode: str,
) -> list[str]:
    preset = get_preset(name)
    blog = BLOG.get(name)
    c = preset.cost
    hw = c.hardware
    per_gpu_desc = c.model.kv_bytes_per_token / hw.n_gpus * c.block_size / max(1, c.model.kv_regions)
    rate = "none" if math.isinf(hw.link_message_rate) else f"{hw.link_message_rate / 1e6:.2f} M/s"
    lines = [
        f"== {name}: {preset.description}",
        f"   mode={mode}  efficiency={hw.efficiency}  kv={c.model.kv_bytes_per_token / 1024:.0f} KiB/token"
        f"  link={hw.link_bandwidth * 8 / 1e12:.1f} Tb/s",
        f"   NIXL: {c.model.kv_regions} regions/GPU x {c.block_size}-token blocks, ~{per_gpu_desc / 1024:.1f} KiB per"
        f" descriptor, node message rate {rate} (not scaled by efficiency)",
        f"   request overhead {hw.request_overhead * 1e3:.0f} ms per request, 2 per turn"
        " (0 = not modelled: the blog's fixed serving cost is absent from absolute short-prompt TTFTs)",
        "   prompt | off ms | on ms | ratio | blog off | blog on | blog ratio | ratio err | pull ms (bound)"
        " | P prefill off/on ms",
    ]
    for i, length in enumerate(lengths):
        ratio = off[i] / on[i]
        published = blog.at(length) if blog else None
        b_ratio = published[0] / published[1] if published else None
        err = (ratio / b_ratio - 1.0) * 100 if b_ratio else None
        pull = prefill = "n/a"
        if turns is not None:
            t_off, t_on = turns[i]
            bound = "msg" if _message_bound(preset, t_on.pulled) else "bw"
            pull = f"{t_on.pull * 1e3:.0f} ({bound})"
            prefill = f"{t_off.prefill * 1e3:.0f}/{t_on.prefill * 1e3:.0f}"
        lines.append(
            f"   {length:6d} | {off[i] * 1e3:6.0f} | {on[i] * 1e3:5.0f} | {ratio:5.2f} |"
            f" {_fmt(published[0] if published else None, '8.0f')} | {_fmt(published[1] if published else None)} |"
            f" {_fmt(b_ratio, '10.2f')} | {_fmt(err, '+8.0f')}{'%' if err is not None else ' '} |"
            f" {pull:>14} | {prefill}"
        )
    if blog:
        last = lengths[-1]
        published = blog.at(last)
        if published:
            ratio = off[-1] / on[-1]
            b_ratio = published[0] / published[1]
            ok = abs(ratio / b_ratio - 1.0) <= 0.25
            lines.append(
                f"   longest ({last}): ratio {ratio:.2f} vs blog {b_ratio:.2f} -> "
                f"{'WITHIN' if ok else 'OUTSIDE'} +-25 %;  off grows x{off[-1] / off[0]:.1f} (blog "
                f"x{blog.off_ms[1] / blog.off_ms[0]:.1f}), on grows x{on[-1] / on[0]:.1f} (blog "
                f"x{blog.on_ms[1] / blog.on_ms[0]:.1f})"
            )
            lines.append(
                f"   blog minus model at {last}: off {published[0] - off[-1] * 1e3:+.0f} ms, "
                f"on {published[1] - on[-1] * 1e3:+.0f} ms (time the blog's turn spends outside this model)"
            )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--mode",
        choices=("analytic", "sim"),
        default=None,
        help="default: sim when kvtether.sim.cluster is importable, else analytic",
    )
    parser.add_argument("--preset", action="append", help="repeatable; default: the two blog presets")
    parser.add_argument("--lengths", help="comma-separated prompt lengths (default: the blog's range)")
    parser.add_argument(
        "--speed",
        type=float,
        default=5.0,
        help="sim mode: simulated seconds per real second. TTFT is the engines' charged time, which does not"
        " depend on it; keep it modest so the 30 s P lease outlives the simulator's own CPU time x speed",
    )
    args = parser.parse_args(argv)
    mode = args.mode or ("sim" if sim_available() else "analytic")
    presets = args.preset or list(BLOG)
    print("TTFT sweep, decode -> prefill KV pull off vs on (1P1D, P prefix caching off, threshold 64, TTL 480)")
    print(
        f"workload (ASSUMPTION): vLLM multi-turn benchmark shape; a warm turn = {USER_TOKENS}-token user message "
        f"after a {ANSWER_TOKENS}-token answer; D holds prompt - {USER_TOKENS + 1}; one request at a time"
    )
    print(
        "blog: endpoints only (2k = 2048, 24k = 24576, 20k = 20480); 'n/a' = not published; "
        "ratio err = model ratio / blog ratio - 1"
    )
    sys.stdout.flush()
    for name in presets:
        lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else list(DEFAULT_LENGTHS.get(name, ()))
        preset = get_preset(name)
        if mode == "analytic":
            turns = [(analytic_turn(preset, n, pull=False), analytic_turn(preset, n, pull=True)) for n in lengths]
            off = [t[0].ttft for t in turns]
            on = [t[1].ttft for t in turns]
            lines = report(name, lengths, off, on, turns, mode)
        else:
            sim_turns = [
                (
                    asyncio.run(_sim_point(name, n, False, args.speed)),
                    asyncio.run(_sim_point(name, n, True, args.speed)),
                )
                for n in lengths
            ]
            turns = [(a.charged(preset), b.charged(preset)) for a, b in sim_turns]
            off = [t[0].ttft for t in turns]
            on = [t[1].ttft for t in turns]
            lines = report(name, lengths, off, on, turns, f"sim, engine-charged time (speed {args.speed})")
            lines.append(
                "   wall x speed (incl. the simulator's own CPU time): "
                + ", ".join(
                    f"{n}: {a.wall * 1e3:.0f}/{b.wall * 1e3:.0f} ms"
                    for n, (a, b) in zip(lengths, sim_turns, strict=True)
                )
            )
        print()
        print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
