"""The four answers of `kvtether assess`, as pure functions over plain data (no I/O, no clock).

1. :func:`prefix_share`: what share of each turn's prompt repeats what the decode node holds from the previous
   turn, by turn index, its growth, and its spread over sessions.
2. :func:`pull_economics`: the KV bytes a pull would move per turn, the link bandwidth at which pulling them
   beats recomputing them on P (the simulator's cost model of prefill compute and of a NIXL read), beside the
   configured link; the share of turns where the pull pays.
3. :func:`retention`: the gaps between turns against the handle lifetime, and a replay of the sessions'
   timeline through the gateway's retention model (``gateway/policy/retention.py``): the share of turns whose
   KV is gone before they arrive, by cause, and the decode nodes' held KV over time against their capacity.
4. :func:`compare_topologies`: TTFT percentiles per turn index and on late turns, TPOT p95, the share of turns
   meeting the objectives, for each serving option run on the simulator, and the options ranked by what the user
   asked for (``verdict.py``).

Every answer carries its numbers and a one-line ``verdict``.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtether.cli.assess.verdict import decide
from kvtether.cli.common.stats import percentile
from kvtether.gateway.policy.retention import (
    DecodeMemory,
    HeldHandle,
    ReleaseReason,
    RetentionKnobs,
    held_blocks_tokens,
    review,
)
from kvtether.sim.cost import CostModel

GBIT = 1e9 / 8


@dataclass(frozen=True, slots=True)
class TurnFacts:
    """One turn of one session, as the analyses need it (tokens of the served model's rendering)."""

    session_id: str
    index: int
    prompt_tokens: int
    reused_tokens: int  # leading prompt tokens equal to what D holds after the previous turn (0 on turn 0)
    held_after: int  # tokens D holds after this turn: its prompt and its answer
    output_tokens: int
    gap_s: float  # think/tool time before this turn (after the previous answer)
    recorded_e2e_s: float | None = None
    recorded_ttft_s: float | None = None


def _r(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(x, digits)


def _spread(xs: Sequence[float]) -> dict[str, float | None]:
    return {"n": len(xs), "mean": _r(sum(xs) / len(xs)) if xs else None, "p10": _r(percentile(xs, 10)),
            "p50": _r(percentile(xs, 50)), "p90": _r(percentile(xs, 90)), "min": _r(min(xs, default=None)),
            "max": _r(max(xs, default=None))}


def _slope(points: Sequence[tuple[float, float]]) -> float | None:
    """Least-squares slope of y over x (None below two distinct x)."""
    if len({x for x, _ in points}) < 2:
        return None
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / sxx


def late_from(sessions: Sequence[Sequence[TurnFacts]]) -> int:
    """The first "late" turn index: the second half of a typical session, once its history has grown."""
    lengths = sorted(len(s) for s in sessions if s)
    if not lengths:
        return 1
    return max(1, lengths[len(lengths) // 2] // 2)


# --- 1. prefix share ---------------------------------------------------------------------------------------


def prefix_share(sessions: Sequence[Sequence[TurnFacts]]) -> dict[str, Any]:
    """Share of each turn's prompt that repeats the previous turn's hold (turns after the first)."""
    by_turn: dict[int, list[float]] = defaultdict(list)
    prompt_by_turn: dict[int, list[int]] = defaultdict(list)
    per_session: list[float] = []
    reused_sum = prompt_sum = 0
    for s in sessions:
        shares = []
        for t in s:
            prompt_by_turn[t.index].append(t.prompt_tokens)
            if t.index == 0 or t.prompt_tokens <= 0:
                continue
            share = t.reused_tokens / t.prompt_tokens
            by_turn[t.index].append(share)
            shares.append(share)
            reused_sum += t.reused_tokens
            prompt_sum += t.prompt_tokens
        if shares:
            per_session.append(sum(shares) / len(shares))
    per_turn = []
    for i in sorted(prompt_by_turn):
        prompts = prompt_by_turn[i]
        row: dict[str, Any] = {"turn": i, "n": len(prompts), "prompt_tokens_mean": _r(sum(prompts) / len(prompts), 1)}
        row.update({f"share_{k}": v for k, v in _spread(by_turn.get(i, [])).items() if k != "n"})
        per_turn.append(row)
    late = late_from(sessions)
    late_shares = [x for i, xs in by_turn.items() if i >= late for x in xs]
    growth = _slope([(float(i), float(p)) for i, ps in prompt_by_turn.items() for p in ps])
    share_growth = _slope([(float(i), x) for i, xs in by_turn.items() for x in xs])
    weighted = reused_sum / prompt_sum if prompt_sum else None
    late_p50 = percentile(late_shares, 50)
    late_p10 = percentile(late_shares, 10)
    if late_p50 is None:
        verdict = "no turn after the first: nothing is ever reused (single-turn traffic)"
    elif late_p50 >= 0.8:
        verdict = (f"late turns repeat {late_p50:.0%} of their prompt (p10 {late_p10:.0%}), growing by "
                   f"{growth or 0:,.0f} tokens a turn: the history dominates, reuse is worth pursuing")
    elif late_p50 >= 0.5:
        verdict = (f"late turns repeat {late_p50:.0%} of their prompt (p10 {late_p10:.0%}): reuse saves about "
                   "half of the prefill at best")
    else:
        verdict = (f"late turns repeat only {late_p50:.0%} of their prompt (p10 {late_p10:.0%}): new text dominates, "
                   "little for any reuse to save")
    return {
        "per_turn": per_turn,
        "late_from_turn": late,
        "late_share": _spread(late_shares),
        "token_weighted_share": _r(weighted),
        "prompt_growth_tokens_per_turn": _r(growth, 1),
        "share_growth_per_turn": _r(share_growth),
        "per_session_share": _spread(per_session),
        "verdict": verdict,
    }


# --- 2. pull economics -------------------------------------------------------------------------------------


def recompute_seconds(cost: CostModel, prompt: int, reused: int, max_batched: int) -> float:
    """What recomputing the reusable prefix costs P on top of the suffix: a cold prefill of the whole prompt
    less the suffix computed after the prefix (both chunked as vLLM's scheduler does)."""
    return (cost.lone_prefill_seconds(prompt, 0, max_batched)
            - cost.lone_prefill_seconds(prompt - reused, reused, max_batched))


def breakeven_gbps(cost: CostModel, reused: int, saving_s: float) -> float:
    """The link line rate (Gb/s) at which reading `reused` tokens of KV takes exactly `saving_s` (inf when no
    bandwidth is enough: the transfer's fixed latency or its per-descriptor posting time alone exceeds it)."""
    hw = cost.hardware
    messages_s = cost.transfer_descriptors(reused) * hw.n_gpus / hw.link_message_rate
    budget = saving_s - hw.link_latency
    if reused <= 0 or budget <= 0 or messages_s >= budget:
        return math.inf
    return reused * cost.model.kv_bytes_per_token / (budget * hw.efficiency) / GBIT


def pull_economics(sessions: Sequence[Sequence[TurnFacts]], cost: CostModel, max_batched: int,
                   min_reuse_tokens: int) -> dict[str, Any]:
    """Per turn after the first: KV bytes a pull moves, the time it takes on the configured link, the compute it
    saves on P, the break-even link bandwidth; the share of turns where the pull pays."""
    link_gbps = cost.hardware.link_bandwidth / GBIT
    rows: dict[int, list[dict[str, float]]] = defaultdict(list)
    turns = pays = too_short = 0
    saved_s = spent_s = 0.0
    breakevens: list[float] = []
    for s in sessions:
        for t in s:
            if t.index == 0:
                continue
            turns += 1
            if t.reused_tokens < min_reuse_tokens:
                too_short += 1  # vLLM computes a read this short instead of pulling it
                continue
            saving = recompute_seconds(cost, t.prompt_tokens, t.reused_tokens, max_batched)
            transfer = cost.transfer_seconds(t.reused_tokens)
            be = breakeven_gbps(cost, t.reused_tokens, saving)
            breakevens.append(be)
            if transfer < saving:
                pays += 1
                saved_s += saving - transfer
            else:
                spent_s += transfer - saving
            rows[t.index].append({"kv_bytes": t.reused_tokens * cost.model.kv_bytes_per_token, "transfer_s": transfer,
                                  "recompute_s": saving, "breakeven_gbps": be})
    per_turn = []
    for i in sorted(rows):
        rs = rows[i]
        finite = [r["breakeven_gbps"] for r in rs if math.isfinite(r["breakeven_gbps"])]
        per_turn.append({
            "turn": i, "n": len(rs),
            "kv_mb_mean": _r(sum(r["kv_bytes"] for r in rs) / len(rs) / 1e6, 3),
            "transfer_ms_mean": _r(sum(r["transfer_s"] for r in rs) / len(rs) * 1e3, 3),
            "recompute_ms_mean": _r(sum(r["recompute_s"] for r in rs) / len(rs) * 1e3, 3),
            "breakeven_gbps_p50": _r(percentile(finite, 50), 2) if len(finite) == len(rs) else None,
            "breakeven_gbps_max": _r(max(finite), 2) if len(finite) == len(rs) else None,
            "pays_share": _r(sum(1 for r in rs if r["transfer_s"] < r["recompute_s"]) / len(rs)),
        })
    finite_all = [b for b in breakevens if math.isfinite(b)]
    never = len(breakevens) - len(finite_all)
    share = pays / turns if turns else None
    be95 = percentile(finite_all, 95) if not never else None
    if share is None:
        verdict = "no turn after the first: there is nothing to pull"
    elif share >= 0.9:
        verdict = (f"the pull pays on {share:.0%} of turns: on the {link_gbps:,.0f} Gb/s link it saves "
                   f"{saved_s * 1e3 / max(pays, 1):,.1f} ms of P compute a turn on average"
                   + (f"; it would still pay down to {be95:,.0f} Gb/s for 95 % of them" if be95 else ""))
    elif share >= 0.5:
        verdict = (f"the pull pays on {share:.0%} of turns on the {link_gbps:,.0f} Gb/s link; the rest are too "
                   f"short ({too_short}) or the link is too slow for them: pull selectively (auto)")
    else:
        verdict = (f"the pull pays on only {share:.0%} of turns on the {link_gbps:,.0f} Gb/s link ({too_short} "
                   "reuse too little to pull): recomputing on P is as cheap; the pull is not worth it here")
    return {
        "link_gbps": round(link_gbps, 3),
        "kv_bytes_per_token": cost.model.kv_bytes_per_token,
        "per_turn": per_turn,
        "turns": turns,
        "pays": pays,
        "pays_share": _r(share),
        "below_min_reuse": too_short,
        "never_pays": never,
        "breakeven_gbps": {k: (_r(v, 2) if isinstance(v, float) else v) for k, v in _spread(finite_all).items()},
        "saved_ms_total": _r(saved_s * 1e3, 1),
        "lost_ms_total": _r(spent_s * 1e3, 1),
        "points": [{"turn": i, "kv_mb": r["kv_bytes"] / 1e6,
                    "breakeven_gbps": r["breakeven_gbps"] if math.isfinite(r["breakeven_gbps"]) else None}
                   for i, rs in sorted(rows.items()) for r in rs],
        "verdict": verdict,
    }


# --- 3. retention ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RetentionSetup:
    decode_nodes: int
    kv_capacity_tokens: int  # per decode node
    block_size: int
    decoder_ttl_s: float  # the engine frees a hold after this
    session_ttl_s: float  # the gateway stops sending a handle after this
    concurrency: int  # sessions in flight (closed loop: a session keeps its slot through its gaps)
    knobs: RetentionKnobs = field(default_factory=RetentionKnobs)
    review_interval_s: float = 1.0  # the gateway's retention_interval_s


LOSS_CAUSES = ("expired", "released_pressure", "released_budget", "evicted")
_CAUSE = {ReleaseReason.EXPIRED: "expired", ReleaseReason.PRESSURE: "released_pressure",
          ReleaseReason.BUDGET: "released_budget"}


def turn_duration_s(t: TurnFacts, cost: CostModel, max_batched: int) -> float:
    """The recorded end-to-end time, else an estimate: the suffix's prefill plus one decode step per output token
    at the turn's context, alone on the node (the retention timeline needs when holds start, not exact TTFTs)."""
    if t.recorded_e2e_s is not None:
        return t.recorded_e2e_s
    prefill = cost.lone_prefill_seconds(t.prompt_tokens - t.reused_tokens, t.reused_tokens, max_batched)
    step = cost.hardware.step_overhead + cost.decode_seconds([t.prompt_tokens])
    return prefill + t.output_tokens * step


class _RetentionTimeline:
    """The sessions' timeline through the retention model (see :func:`retention`): holds per session, the
    decode nodes' memory, and what became of each hold a later turn came back for."""

    def __init__(self, sessions: Sequence[Sequence[TurnFacts]], setup: RetentionSetup,
                 durations: Mapping[tuple[str, int], float]) -> None:
        self.setup, self.durations = setup, durations
        self.nodes = [f"D{i}" for i in range(setup.decode_nodes)]
        self.held: dict[str, HeldHandle] = {}  # session -> its live hold
        self.running: dict[str, int] = dict.fromkeys(self.nodes, 0)  # tokens of turns in flight per node
        self.pin: dict[str, str] = {}
        self.gap_sum: dict[str, tuple[float, int]] = {}
        self.lost: dict[str, str] = {}  # session -> why its hold went (until its next turn reads it)
        self.outcomes = dict.fromkeys(("available", *LOSS_CAUSES), 0)
        self.by_turn: dict[int, dict[str, int]] = defaultdict(lambda: dict.fromkeys(("available", *LOSS_CAUSES), 0))
        self.series: list[dict[str, Any]] = []
        # Events: (time, order, kind, session index, turn position). Arrivals sort after ends at the same instant.
        self.events: list[tuple[float, int, str, int, int]] = []
        self.order = 0
        self.sessions = [list(s) for s in sessions if s]
        self.waiting = list(range(len(self.sessions)))
        self.waiting.reverse()
        self.now = 0.0

    def total_held(self, node: str) -> int:
        bs = self.setup.block_size
        return sum(held_blocks_tokens(h.tokens, bs) for h in self.held.values() if h.node == node)

    def sample(self, now: float) -> None:
        self.series.append({"t": round(now, 3), **{n: self.total_held(n) for n in self.nodes}})

    def expire(self, now: float) -> None:
        for sid, h in list(self.held.items()):
            if now >= h.expires_at or now >= h.stored_at + self.setup.decoder_ttl_s:
                del self.held[sid]
                self.lost[sid] = "expired"

    def memory(self, node: str) -> DecodeMemory:
        """The node as its poll would show it: held KV and running turns' KV against its capacity, a turn
        waiting when they do not fit (its usage then full)."""
        cap = self.setup.kv_capacity_tokens
        used = self.total_held(node) + self.running[node]
        usage = min(1.0, used / cap) if cap else 0.0
        return DecodeMemory(capacity=cap, block_size=self.setup.block_size, usage=usage, waiting=float(used > cap))

    def review(self, now: float) -> None:
        self.expire(now)
        for rel in review(list(self.held.values()), {n: self.memory(n) for n in self.nodes}, now, self.setup.knobs):
            if rel.session_id in self.held:
                del self.held[rel.session_id]
                self.lost[rel.session_id] = _CAUSE.get(rel.reason, "released_budget")
        for n in self.nodes:
            over = self.total_held(n) + self.running[n] - self.setup.kv_capacity_tokens
            for h in sorted((h for h in self.held.values() if h.node == n), key=lambda h: h.stored_at):
                if over <= 0:
                    break
                del self.held[h.session_id]
                self.lost[h.session_id] = "evicted"
                over -= held_blocks_tokens(h.tokens, self.setup.block_size)

    def push(self, t: float, kind: str, si: int, pos: int) -> None:
        self.order += 1
        heapq.heappush(self.events, (t, self.order, kind, si, pos))

    def start(self, si: int, pos: int) -> None:
        """A turn arrives: it finds its session's hold (reads or replaces it) or learns why it is gone."""
        t = self.sessions[si][pos]
        sid = t.session_id
        self.review(self.now)
        if sid not in self.pin:
            self.pin[sid] = min(self.nodes, key=lambda n: (self.total_held(n) + self.running[n], n))
        if pos > 0:
            if sid in self.held:
                outcome = "available"
                del self.held[sid]  # the turn reads it (pull) or replaces it: either way D's hold ends
            else:
                outcome = self.lost.pop(sid, "expired")
            self.outcomes[outcome] += 1
            self.by_turn[t.index][outcome] += 1
        self.running[self.pin[sid]] += t.prompt_tokens
        self.push(self.now + self.durations[(sid, t.index)], "end", si, pos)

    def end(self, si: int, pos: int) -> None:
        """A turn ends: its KV is held until the session's next turn (none after its last; a new session starts)."""
        turns = self.sessions[si]
        t = turns[pos]
        sid = t.session_id
        node = self.pin[sid]
        self.running[node] -= t.prompt_tokens
        if pos < len(turns) - 1:
            g_sum, g_n = self.gap_sum.get(sid, (0.0, 0))
            nxt = turns[pos + 1]
            mean_gap = g_sum / g_n if g_n else None
            self.held[sid] = HeldHandle(sid, node, t.held_after, f"{sid}/{t.index}", self.now,
                                        self.now + self.setup.session_ttl_s, self.now, mean_gap)
            self.lost.pop(sid, None)
            self.gap_sum[sid] = (g_sum + nxt.gap_s, g_n + 1)
            self.push(self.now + nxt.gap_s, "start", si, pos + 1)
        elif self.waiting:
            nsi = self.waiting.pop()
            self.push(self.now + self.sessions[nsi][0].gap_s, "start", nsi, 0)
        self.review(self.now)
        self.sample(self.now)

    def run(self) -> None:
        for _ in range(min(self.setup.concurrency, len(self.sessions))):
            si = self.waiting.pop()
            self.push(self.sessions[si][0].gap_s, "start", si, 0)
        interval = self.setup.review_interval_s
        next_review = interval
        while self.events:
            t_ev = self.events[0][0]
            while next_review <= t_ev:
                self.review(next_review)
                self.sample(next_review)
                next_review += interval
                # A long quiet stretch: jump ahead instead of reviewing every interval in it (nothing changes but
                # expiries and idleness, which the review at the next event catches).
                if t_ev - next_review > 50 * interval:
                    next_review = t_ev
            self.now, _, kind, si, pos = heapq.heappop(self.events)
            if kind == "start":
                self.start(si, pos)
            else:
                self.end(si, pos)


def _retention_verdict(outcomes: Mapping[str, int], later: int, gone: int, peak_share: float | None) -> str:
    if not later:
        return "no turn after the first: nothing is held between turns"
    if gone / later <= 0.05:
        return (f"{outcomes['available'] / later:.0%} of turns find their KV still held; D's held KV peaks at "
                f"{peak_share:.0%} of its capacity: retention is no obstacle")
    worst = max(LOSS_CAUSES, key=lambda c: outcomes[c])
    return (f"{gone / later:.0%} of turns arrive after their KV is gone, mostly {worst.replace('_', ' ')} "
            f"({outcomes[worst]} turns); held KV peaks at {peak_share:.0%} of D's capacity"
            + (": raise decoder_kv_blocks_ttl / session_ttl_s" if worst == "expired" else
               ": raise held_kv_budget or add decode memory" if worst in ("released_budget", "evicted") else
               ": the running turns need D's memory: add decode memory"))


def retention(sessions: Sequence[Sequence[TurnFacts]], setup: RetentionSetup,
              durations: Mapping[tuple[str, int], float]) -> dict[str, Any]:
    """Replay the sessions' timeline (closed loop at ``setup.concurrency``, the recorded gaps, ``durations`` per
    (session, turn)) through the retention model and count, per turn after the first, whether its previous
    hold is still there when it arrives, and if not why. Each session is pinned to the decode node holding the
    least when it starts. Holds: from a turn's end to the next turn's start (then replaced), released at the
    session's last turn; expired at the gateway's or the engine's TTL; released by ``review`` (run every
    ``review_interval_s`` and at every arrival) at their expiry, over budget, or for pressure when a node's held
    KV plus the KV of the turns running on it exceeds its capacity (a turn would wait for memory); evicted
    when the releases left it over (oldest holds first)."""
    # Gaps against the TTLs.
    gaps = [t.gap_s for s in sessions for t in s if t.index > 0]
    timeline = _RetentionTimeline(sessions, setup, durations)
    timeline.run()
    outcomes = timeline.outcomes
    later = sum(outcomes.values())
    gone = later - outcomes["available"]
    peak = {n: max((row[n] for row in timeline.series), default=0) for n in timeline.nodes}
    peak_share = max(peak.values(), default=0) / setup.kv_capacity_tokens if setup.kv_capacity_tokens else None
    return {
        "gaps_s": _spread(gaps),
        "gaps": [round(g, 3) for g in gaps],
        "session_ttl_s": setup.session_ttl_s,
        "decoder_ttl_s": setup.decoder_ttl_s,
        "gaps_over_session_ttl": sum(1 for g in gaps if g >= setup.session_ttl_s),
        "gaps_over_decoder_ttl": sum(1 for g in gaps if g >= setup.decoder_ttl_s),
        "concurrency": setup.concurrency,
        "turns": later,
        "outcomes": outcomes,
        "outcome_share": {c: _r(outcomes[c] / later) if later else None for c in ("available", *LOSS_CAUSES)},
        "gone_share": _r(gone / later) if later else None,
        "per_turn": [{"turn": i, **c} for i, c in sorted(timeline.by_turn.items())],
        "capacity_tokens": setup.kv_capacity_tokens,
        "budget_tokens": (setup.knobs.budget_share * setup.kv_capacity_tokens
                          if setup.knobs.budget_share is not None else None),
        "peak_held_tokens": peak,
        "peak_held_share": _r(peak_share),
        "held_series": _thin(timeline.series, 600),
        "duration_s": round(timeline.now, 3),
        "verdict": _retention_verdict(outcomes, later, gone, peak_share),
    }


def _thin(series: list[dict[str, Any]], limit: int) -> list[dict[str, Any]]:
    if len(series) <= limit:
        return series
    step = len(series) / limit
    return [series[int(i * step)] for i in range(limit)] + [series[-1]]


# --- 4. topologies -----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TurnTiming:
    turn: int
    ttft_ms: float | None
    tpot_ms: float | None
    ok: bool = True


def _pcts(xs: Sequence[float]) -> dict[str, float | None]:
    return {"n": len(xs), "p50": _r(percentile(xs, 50), 1), "p95": _r(percentile(xs, 95), 1),
            "p99": _r(percentile(xs, 99), 1)}


def compare_topologies(runs: Mapping[str, Sequence[TurnTiming]], late: int, tpot_slo_ms: float | None,
                       descriptions: Mapping[str, str] | None = None,
                       engine_tpots: Mapping[str, Sequence[float]] | None = None,
                       attained: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """TTFT per turn index and on late turns (index ≥ ``late``), TPOT p95, per option; the options ranked by the
    share of turns meeting the objectives, then by their late-turn TTFT p95 and TPOT p95 (``verdict.py``), with
    the best, the runner-up, the rule that decided and the verdict.

    ``engine_tpots``: per option, the TPOT of every decoding request as the simulator's engine timed it (in its
    cost model's time, see ``topology.DecodeTimes``); where given, it is the option's ``tpot_ms`` (and
    the client's measurement moves to ``client_tpot_ms``). ``attained``: per option, the share of its turns that
    met both objectives (replay.report.attainment), reported as its ``attainment`` and ranked first; without it
    the ranking starts at the TTFT tail."""
    options: dict[str, Any] = {}
    for label, timings in runs.items():
        ok = [t for t in timings if t.ok]
        per_turn: dict[int, list[float]] = defaultdict(list)
        for t in ok:
            if t.ttft_ms is not None:
                per_turn[t.turn].append(t.ttft_ms)
        late_ttft = [t.ttft_ms for t in ok if t.ttft_ms is not None and t.turn >= late]
        tpots = [t.tpot_ms for t in ok if t.tpot_ms is not None]
        engine = (engine_tpots or {}).get(label)
        options[label] = {
            "description": (descriptions or {}).get(label, ""),
            "requests": len(timings), "errors": len(timings) - len(ok),
            "ttft_ms": _pcts([t.ttft_ms for t in ok if t.ttft_ms is not None]),
            "late_ttft_ms": _pcts(late_ttft),
            "tpot_ms": _pcts(tpots if engine is None else list(engine)),
            "tpot_source": "client" if engine is None else "engine",
            "per_turn_ttft_ms": [{"turn": i, **_pcts(xs)} for i, xs in sorted(per_turn.items())],
        }
        if engine is not None:
            options[label]["client_tpot_ms"] = _pcts(tpots)
        if attained is not None and label in attained:
            a = attained[label]
            options[label]["attainment"] = {k: a[k] for k in ("attainment", "met", "turns", "objectives")}
    q4: dict[str, Any] = {"late_from_turn": late, "tpot_slo_ms": tpot_slo_ms, "options": options}
    q4.update(decide(q4))
    return q4
