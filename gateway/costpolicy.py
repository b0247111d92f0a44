"""Cost-based per-turn placement (pure): which of three ways to run a turn is cheapest, and why.

Options for a turn of a session pinned to decode node D (vLLM P/D with ``bidirectional_kv_xfer``):

- ``decode_local``: send the whole request to D. D's prefix cache already holds the history (the handle's
  blocks, or what an earlier local turn left), so D prefills only the uncached suffix — but it does so in
  the same engine steps as the decode batch already running there, stalling those requests (interference).
  On vLLM such a turn returns **no handle** (its KV stays in D's prefix cache, evictable) unless the shell
  marks it for retention (``TurnFacts.local_keeps_handle``): then a handle of its whole sequence.
- ``pull``: P receives D's (verified, possibly truncated) handle, reads the reused tokens' KV from D, computes
  the suffix, then D reads back only what its prefix cache lacks (≈ the suffix) and decodes. Leaves a fresh
  handle on D.
- ``cold``: P computes the whole prompt, D reads what it lacks. Leaves a fresh handle. The only option when
  the pinned D is dead (then on another D, which lacks everything).

Estimated TTFT of each (all terms from an :class:`EstimatorSnapshot`, learned online):

    local = queue_D(waiting_D) + max(prefill_D(n_local | cached), ceil(n_local/chunk)·tpot_D(running_D+1))
    pull  = queue_P(waiting_P+running_P) + transfer(D→P, reuse) + prefill_P(prompt−reuse | reuse)
            + transfer(P→D, prompt−cached_D) + queue_D(waiting_D) + tpot_D(running_D+1)
    cold  = queue_P(...) + prefill_P(prompt−cached_P | cached_P) + transfer(P→D, prompt−cached_D)
            + queue_D(waiting_D) + tpot_D(running_D+1)

Score = TTFT + interference + horizon + balance (the policy minimises the score, reports both):

- interference (local only) = ``interference_weight`` × running_D × stall, stall = max(0, local prefill
  time − steps·tpot_D(running_D)): every request decoding on D is delayed by the part of the local
  prefill that does not hide under its memory-bound decode steps. P's queue is FIFO, so work sent to P does
  not delay requests already there; that asymmetry is why only D's batch is charged.
- balance (auto, ``rebalance_decode``; P/D options only) = what decoding the answer on a D other than the
  pinned one saves, load for load (negative on a lighter D): see ``_balance_s``. The pull still reads the
  history from the pinned D, but the new D lacks the whole prompt (the TTFT counts that transfer).
- horizon = ``horizon_discount`` × E[best score of the next turn | what this option leaves behind], recursively
  for ``horizon_turns`` turns, with the same loads and a typical next suffix. After pull/cold D holds a fresh
  handle (next turn may pull all of it). So it does after a decode_local turn the shell marks for retention
  (``local_keeps_handle``: vLLM keeps a request with kv_transfer_params that is not a prefill leg). Unmarked,
  D holds no fresh one after decode_local: only the handle this turn did not use (the gateway puts it back,
  older by this turn), whose prefix the next turn may still pull, and the rest in D's prefix cache, which may
  be evicted (likely once D's KV usage passes ``evict_kv_usage_knee``). Without a live old handle the next
  turn can only go local or cold. This is what stops the policy from greedily running a turn locally when
  the session would then be stuck with large local prefills on a busy D or a cold prefill of the whole
  history.

Hard limits (an option over a limit is infeasible; "soft" ones can still be forced when nothing else is
possible, e.g. every P is dead): ``max_local_suffix_tokens``; the TPOT quotas (every request decoding on D
must be able to absorb the stall within its share of its decode time, stallquota.py) and the node's stall
budget if one is kept; the TPOT budget (running requests' mean inter-token time over their next
``tpot_window_tokens`` tokens, local prefill stall included); pull needs a
valid handle on a live pinned D, reuse ≥ vLLM's ``kv_recompute_threshold``, a bidirectional P, and enough
handle lifetime left to outlast P's queue.

No I/O, no clock: the shell gathers the facts and the snapshot, executes the decision, records ``reason``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol, get_args

from kvtether.gateway.estimates import EstimatorSnapshot
from kvtether.gateway.stallbudget import StallBudget

Option = Literal["decode_local", "pull", "cold"]
OPTIONS: tuple[Option, ...] = ("decode_local", "pull", "cold")  # also the tie-break order
PolicyMode = Literal["auto", "pull", "reference", "no-pull"]
POLICY_MODES: tuple[PolicyMode, ...] = get_args(PolicyMode)
MAX_HORIZON_TURNS = 3  # the look-ahead tree grows ~3^h; deeper adds cost, not insight (loads change anyway)


def parse_mode(text: str) -> PolicyMode:
    for m in POLICY_MODES:
        if text == m:
            return m
    raise ValueError(f"unknown placement policy {text!r}; known: {', '.join(POLICY_MODES)}")


class NodeLike(Protocol):
    """What the policy reads of a node; the shell's ``placement.NodeLoad`` fits as is."""

    @property
    def url(self) -> str: ...
    @property
    def healthy(self) -> bool: ...
    @property
    def running(self) -> float: ...
    @property
    def waiting(self) -> float: ...
    @property
    def kv_usage(self) -> float: ...
    @property
    def arriving(self) -> float: ...
    @property
    def bidirectional(self) -> bool: ...
    @property
    def prefix_caching(self) -> bool: ...
    @property
    def arrivals(self) -> tuple[tuple[float, float], ...]: ...
    @property
    def holding_back(self) -> float: ...


@dataclass(frozen=True, slots=True)
class NodeState:
    """A node's load from its ``/metrics`` (``vllm:num_requests_running``/``_waiting``, ``kv_cache_usage_perc``)."""

    url: str
    healthy: bool = True
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0  # 0..1
    bidirectional: bool = True  # prefill only: started with bidirectional_kv_xfer, may receive a handle
    # prefill only: keeps finished prompts' blocks for reuse (vLLM --enable-prefix-caching, known from its
    # cache_config_info); the look-ahead counts the copy a P/D turn leaves there only then.
    prefix_caching: bool = False
    # decode only: P/D turns whose prefill leg is under way, headed here (the shell's count; not yet in
    # `running`): load that is already on its way (rebalancing counts it).
    arriving: float = 0.0
    # decode only: of those, (seconds until its request reaches D, seconds of D's read of its KV) as estimated
    # when it was planned (negative: overdue). A local prefill's step delays what falls inside it.
    arrivals: tuple[tuple[float, float], ...] = ()
    # decode only: of `running`, requests whose client has seen nothing yet (first token out, first delta held
    # back by a tool-call parser; or not streamed): a stall delays their TTFT itself, not just their TPOT.
    holding_back: float = 0.0


@dataclass(frozen=True, slots=True)
class TurnFacts:
    """What the shell knows about this turn before placing it. Token counts are of the rendered prompt."""

    prompt_tokens: int
    suffix_tokens: int  # new tokens this turn adds to the session's history (prompt − previous prompt+output)
    reuse_tokens: int = 0  # verified by the guard against D's held sequence (already truncated); 0 if none
    handle_valid: bool = False  # a handle is held for the pinned D and not expired by the gateway's TTL
    handle_age_s: float = 0.0  # since D returned the handle (the engine frees it at decoder_kv_blocks_ttl)
    decode_cached_tokens: int = 0  # estimated prefix-cache hit on the pinned D without a handle
    expected_output_tokens: int = 256  # for the look-ahead: the next turn's history grows by this
    prefill_cached_tokens: int = 0  # every P's own prefix-cache hit (e.g. a shared system prompt); 0 if unknown
    # (prefill url, tokens): a prefix of the prompt that a P's prefix cache likely still holds, because it
    # prefilled an earlier turn of the session (the shell's estimate, eviction discounted: prefillcache.py).
    # A pull there reads only the rest of the reuse from D; a cold prefill there computes only the rest.
    prefill_cached: tuple[tuple[str, int], ...] = ()
    next_suffix_tokens: int | None = None  # typical suffix of the session's next turn; None: this turn's
    # Stall seconds the pinned D's running batch may still lose to local prefills (stallbudget.StallBudget's
    # credit); inf: no budget kept (the TPOT budget and the interference price still apply).
    decode_stall_credit_s: float = math.inf
    # (decode url, tokens): a prefix of the prompt that a decode node the session's pin left still holds in
    # its prefix cache (verified by the shell against the session's history; evictable). Moving the pin back
    # there (rebalancing) ships only the rest of the prompt.
    decode_elsewhere: tuple[tuple[str, int], ...] = ()
    # The estimated TTFT above which a turn is in the tail of recent turns (the shell's running quantile of
    # chosen options' estimates, `tail.TailTracker`); inf: unknown, no tail term.
    ttft_tail_s: float = math.inf
    # A decode-local turn comes back with a handle of its whole sequence (the shell marks it for retention
    # and the pinned D keeps such turns): the next turn may pull all of it, as after a P/D turn.
    local_keeps_handle: bool = False
    # Per-request TPOT quotas on the pinned D (stallquota.py): the least stall seconds a request decoding
    # there may still absorb, and that request's whole quota (the budget's size, for its shadow price);
    # inf: nobody decoding there, or no quotas kept.
    request_stall_credit_s: float = math.inf
    request_stall_quota_s: float = math.inf

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1:
            raise ValueError("prompt_tokens must be >= 1")
        for name in ("suffix_tokens", "reuse_tokens", "decode_cached_tokens", "expected_output_tokens",
                     "prefill_cached_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.next_suffix_tokens is not None and self.next_suffix_tokens < 0:
            raise ValueError("next_suffix_tokens must be >= 0")
        if math.isnan(self.decode_stall_credit_s):
            raise ValueError("decode_stall_credit_s must be a number")
        if any(n < 0 for _, n in self.decode_elsewhere) or any(n < 0 for _, n in self.prefill_cached):
            raise ValueError("decode_elsewhere and prefill_cached tokens must be >= 0")
        if math.isnan(self.ttft_tail_s):
            raise ValueError("ttft_tail_s must be a number")
        if math.isnan(self.request_stall_credit_s) or not self.request_stall_quota_s >= 0:
            raise ValueError("request_stall_credit_s must be a number and request_stall_quota_s >= 0")


@dataclass(frozen=True, slots=True)
class PolicyKnobs:
    mode: PolicyMode = "auto"
    # Decode-local never runs a suffix longer than this (Dynamo's conditional disaggregation has the same
    # knob). 8192 = one chunked-prefill step at vLLM's default token budget on large GPUs; whether a long
    # suffix may stall a busy D that long is the TPOT quotas' call (the shell's request_stall_share). 2048
    # until session 11: every 2–8k tool result then went through P, and those made the TTFT p95.
    max_local_suffix_tokens: int = 8192
    # Running requests on D must keep a mean inter-token time under this over their next window of tokens,
    # local prefill stall included; a typical interactive TPOT objective.
    tpot_budget_s: float = 0.100
    tpot_window_tokens: int = 16
    # Seconds of this turn's TTFT that one second of delay on *each* running request of D is worth. 1 would
    # count a token's delay like a first token's; lower, because users notice a mid-stream hiccup less.
    # Since the TPOT quotas (or the stall budget below) bound what local prefills may cost the batch (the stall
    # is learned from the stall itself, docs/placement.md "session 4"), this weight only orders turns within
    # them: 0.5 left a 7 % budget a third unused on GLM-5 (TPOT p95 +0.3 % over classic P/D, first token
    # 0.18 s late p50), 0.2 spends it (+4.3 %, 0.15 s; same run); with quotas of 0.2 (session 11) 0.5 ran
    # 80 late turns locally instead of ~100 and 1 ran 44.
    interference_weight: float = 0.2
    # The share of D's time local prefills may stall its running batch, i.e. about how much they may raise
    # the running requests' TPOT, kept as a token bucket with a burst of share × window (stallbudget.py).
    # 7 %: the "within 10 % of classic P/D" less noise; balancing the decode nodes (rebalance_decode)
    # lowers the TPOT it is measured against by about as much as pinned sessions' imbalance cost (GLM-5
    # paced: ~12 %), which is what leaves room for it. Over the window the stall stays
    # near the share, so a request decoding that long sees at most ~2 × share. Below the full burst the
    # policy prices the stall at burst/credit − 1 TTFT-seconds per stall-second (the budget's shadow price):
    # when it runs short, the turns with the most to gain per stall-second (long histories whose pull is
    # dear) keep running locally and the marginal ones go to P. share = 1 turns the budget off: the default
    # since session 11, where per-request TPOT quotas (stallquota.py) took its place, as they bound what a
    # TPOT p95 sees (each request's share) rather than the node's total (0.07 until then).
    decode_stall_share: float = 1.0
    decode_stall_window_s: float = 4.0
    # Look-ahead: turns considered after this one, and the weight of each (the session may end, loads change).
    horizon_turns: int = 1
    horizon_discount: float = 0.7
    # vLLM's kv_recompute_threshold: P recomputes rather than pulls fewer tokens, so "pull" would be cold.
    recompute_threshold_tokens: int = 64
    # The gateway's handle TTL (below the engine's decoder_kv_blocks_ttl, 480 s) and the margin within
    # which P declines a read near expiry (vLLM ≤ 0.28: 5 s): a pull must start before age + margin > ttl.
    handle_ttl_s: float = 450.0
    handle_margin_s: float = 5.0
    block_size: int = 16  # prefix caching hits whole blocks only
    chunk_tokens: int = 2048  # vLLM's max_num_batched_tokens: the local prefill is spread over these steps
    # Look-ahead: above this KV usage of D, a decode-local turn's history (no handle, only prefix cache)
    # may be evicted before the next turn; the probability rises linearly to 1 at full usage.
    evict_kv_usage_knee: float = 0.8
    # auto: a P/D turn (pull or cold) may decode on another D than the pinned one when that D is less loaded
    # enough to pay for moving the whole prompt's KV there (the session's pin moves with it). Without it a
    # pinned session keeps whatever imbalance its turns' timing gave its D, which every one of them pays in
    # TPOT; vLLM's reference proxy spreads turns round-robin and wins on balance alone.
    rebalance_decode: bool = True
    # Tail-aware objective: every second of an option's estimated TTFT above the tail threshold (the
    # `tail_quantile` of recent turns' estimates, kept by the shell) costs `tail_weight` seconds more. The p95
    # is made of such turns only (the long tool results), so for them TTFT outweighs what a move to a lighter
    # D saves in decode time; below the threshold the score is unchanged. 0 turns it off. 3 (session 7, GLM-5
    # paced, three runs on different sessions against 0): late p95 TTFT 11–54 ms lower and p50 1–10 ms lower in
    # each, decode TPOT p95 3–5 % higher (fewer moves to a lighter D).
    tail_weight: float = 3.0
    tail_quantile: float = 0.9
    # Seconds of this turn's TTFT one second of delay to a P/D turn arriving on D is worth. A local prefill's
    # engine step holds D up: a turn whose KV read should start, or whose first step should run, inside that
    # step waits for its end (GLM-5: up to ~80 ms, seen in the tail of long P/D turns). That delay lands on
    # another session's first token, so 1 would count it like this turn's. Off (0) by default: one GLM-5 paced
    # run against 0 (session 9, seed 0) was inconclusive (late p50 −11 ms, p95 +18 ms, TPOT p95 +1.3 points).
    arrival_weight: float = 0.0
    # Seconds of this turn's TTFT one second of stall on a running request whose client has seen nothing yet is
    # worth, when above interference_weight: its first delta waits for it too. A tool-call parser holds the
    # first delta back ~11 decode steps after the first token; under local prefills those steps ran 22–34 ms
    # longer at p50 than under `reference` (session 9, GLM-5 paced). 1 would count the stall like this turn's
    # TTFT. Off (0: no more than interference_weight) by default: one GLM-5 paced run of 1 against off
    # (session 9, seed 0) lost on late p50 (+17 ms) and TPOT p95 (+5.6 points), p95 within noise (+6 ms).
    holdback_weight: float = 0.0

    def __post_init__(self) -> None:
        if self.mode not in POLICY_MODES:
            raise ValueError(f"unknown mode {self.mode!r}")
        if not 0 <= self.horizon_turns <= MAX_HORIZON_TURNS:
            raise ValueError(f"horizon_turns must be in [0, {MAX_HORIZON_TURNS}]")
        if not 0.0 <= self.horizon_discount <= 1.0:
            raise ValueError("horizon_discount must be in [0, 1]")
        if self.interference_weight < 0 or self.tpot_budget_s <= 0 or self.tpot_window_tokens < 1:
            raise ValueError("interference_weight >= 0, tpot_budget_s > 0, tpot_window_tokens >= 1")
        if self.max_local_suffix_tokens < 0 or self.recompute_threshold_tokens < 0:
            raise ValueError("token limits must be >= 0")
        if not 0.0 <= self.evict_kv_usage_knee < 1.0:
            raise ValueError("evict_kv_usage_knee must be in [0, 1)")
        if self.block_size < 1 or self.chunk_tokens < 1:
            raise ValueError("block_size and chunk_tokens must be >= 1")
        if not 0.0 <= self.decode_stall_share <= 1.0 or self.decode_stall_window_s <= 0.0:
            raise ValueError("decode_stall_share must be in [0, 1] and decode_stall_window_s > 0")
        if self.tail_weight < 0.0 or not 0.0 < self.tail_quantile < 1.0:
            raise ValueError("tail_weight must be >= 0 and tail_quantile in (0, 1)")
        if self.arrival_weight < 0.0 or self.holdback_weight < 0.0:
            raise ValueError("arrival_weight and holdback_weight must be >= 0")

    @property
    def stall_burst_s(self) -> float:
        return self.decode_stall_share * self.decode_stall_window_s


@dataclass(frozen=True, slots=True)
class OptionEstimate:
    """One option as the policy saw it. Not feasible: ``why_not`` says why; a soft rejection (over a limit)
    keeps its estimates, a hard one (impossible) has an infinite ``ttft_s``."""

    option: Option
    feasible: bool
    why_not: str = ""
    soft: bool = False  # rejected by a limit only: may be forced when nothing else is possible
    ttft_s: float = math.inf
    interference_s: float = 0.0
    horizon_s: float = 0.0
    prefill_url: str | None = None
    decode_url: str | None = None
    reuse_tokens: int = 0  # the verified handle tokens sent (pull only); P reads those its own cache lacks
    computed_tokens: int = 0  # tokens prefilled
    moved_tokens: int = 0  # tokens whose KV crosses the network (both directions)
    stall_s: float = 0.0  # decode_local: seconds the running batch on D loses (what the stall budget spends)
    # P/D on another D than the pinned one: what its answer's decode adds to that D's batch less what it would
    # add to the pinned D's (negative when the other D is lighter; 0 on the pinned D). See _balance_s.
    balance_s: float = 0.0
    tail_s: float = 0.0  # tail_weight × the estimated TTFT above the tail threshold (see PolicyKnobs)
    # P/D: seconds until D gets the request (P queue + read + prefill) and of D's read of what it lacks: where
    # the turn will need D (the shell records them as the turn's arrival on D). decode_local: how long its own
    # prefill step holds D up for turns arriving meanwhile (in interference_s, weighted by arrival_weight).
    arrive_s: float = 0.0
    d_read_s: float = 0.0
    blocks_s: float = 0.0

    @property
    def score_s(self) -> float:
        return self.ttft_s + self.interference_s + self.horizon_s + self.balance_s + self.tail_s


@dataclass(frozen=True, slots=True)
class CostDecision:
    option: Option
    reason: str  # short, human-readable, with the estimates: log it and put it on the turn's span
    estimates_s: dict[str, float]  # estimated TTFT of each feasible option
    prefill_url: str | None  # None for decode_local
    decode_url: str
    reuse_tokens: int = 0  # pull: send the handle truncated to this many tokens
    policy: PolicyMode = "auto"
    scores_s: dict[str, float] = field(default_factory=dict)  # TTFT + interference + horizon, feasible ones
    options: tuple[OptionEstimate, ...] = ()
    forced: bool = False  # chosen although over a limit: nothing else was possible
    greedy_option: Option | None = None  # what the choice would be without the look-ahead (auto only)
    # P/D: when the turn will need D (OptionEstimate.arrive_s, d_read_s), for the shell's arrival record.
    arrive_s: float = 0.0
    d_read_s: float = 0.0

    def trace_attributes(self) -> dict[str, str | float | int | bool]:
        """Flat attributes for a span or a JSONL trace record (names without the telemetry prefix)."""
        out: dict[str, str | float | int | bool] = {
            "option": self.option,
            "policy": self.policy,
            "reason": self.reason,
            "decode_url": self.decode_url,
            "reuse_tokens": self.reuse_tokens,
            "forced": self.forced,
        }
        if self.prefill_url is not None:
            out["prefill_url"] = self.prefill_url
        if self.greedy_option is not None:
            out["greedy_option"] = self.greedy_option
        for o in self.options:
            if o.feasible:
                out[f"ttft_est_s.{o.option}"] = round(o.ttft_s, 6)
                out[f"score_s.{o.option}"] = round(o.score_s, 6)
            else:
                out[f"rejected.{o.option}"] = o.why_not
        return out


class NoFeasibleOption(Exception):
    """No option can run the turn (no healthy decode node, or neither a prefill node nor the pinned D)."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


# ---------------------------------------------------------------------------------------------------------
# Per-option estimates (no look-ahead).


@dataclass(frozen=True, slots=True)
class _Cluster:
    prefills: tuple[NodeLike, ...]  # healthy, not excluded
    decodes: tuple[NodeLike, ...]  # healthy, not excluded
    est: EstimatorSnapshot
    knobs: PolicyKnobs
    # Look-ahead memo, per call of choose: after pull and after cold the next turn is the same situation.
    memo: dict[tuple[TurnFacts, str | None, int], float] = field(default_factory=dict)

    def decode(self, url: str | None) -> NodeLike | None:
        return next((d for d in self.decodes if d.url == url), None) if url is not None else None


def _tail_s(ttft: float, turn: TurnFacts, c: _Cluster) -> float:
    if c.knobs.tail_weight == 0.0 or math.isinf(turn.ttft_tail_s):
        return 0.0
    return c.knobs.tail_weight * max(0.0, ttft - turn.ttft_tail_s)


def _floor_block(tokens: int, block: int) -> int:
    return max(0, tokens // block * block)


def _p_queue_s(c: _Cluster, p: NodeLike) -> float:
    # A P node's running requests are prefills still computing: a new one waits behind them as behind the
    # waiting ones (chunked prefill shares steps, which costs the same total time).
    return c.est.queue_s(p.url, p.waiting + p.running)


def _d_leg_s(c: _Cluster, d: NodeLike) -> float:
    """D's part of a P/D turn after the KV arrived: its queue, then one decode step produces the first token."""
    return c.est.queue_s(d.url, d.waiting) + c.est.tpot_s(d.url, d.running + 1)


def _d_cached(turn: TurnFacts, c: _Cluster) -> int:
    """Tokens of the prompt the pinned D's prefix cache holds: the handle's blocks (verified), or the estimate."""
    held = max(turn.decode_cached_tokens, turn.reuse_tokens if turn.handle_valid else 0)
    # vLLM recomputes at least the last prompt token, and hits whole blocks only.
    return _floor_block(min(held, turn.prompt_tokens - 1), c.knobs.block_size)


def _p_keep(d: NodeLike, c: _Cluster) -> float:
    """Probability that D's free (cached, unpinned) blocks survive until the next use: ~1 below the KV-usage
    knee, falling linearly to 0 at full usage (vLLM evicts free blocks LRU only when no free block is left)."""
    knee = c.knobs.evict_kv_usage_knee
    return 1.0 - min(1.0, max(0.0, (d.kv_usage - knee) / (1.0 - knee)))


def _cached_on(turn: TurnFacts, d: NodeLike, pinned: NodeLike | None, c: _Cluster) -> int:
    """Tokens of the prompt `d`'s prefix cache holds: the pinned D's (handle or estimate), or what another D
    kept of the session since the pin left it (expected, eviction discounted: a transfer's cost is linear
    in the tokens D lacks)."""
    if pinned is not None and d.url == pinned.url:
        return _d_cached(turn, c)
    left = max((n for url, n in turn.decode_elsewhere if url == d.url), default=0)
    return _floor_block(round(min(left, turn.prompt_tokens - 1) * _p_keep(d, c)), c.knobs.block_size)


def _local(turn: TurnFacts, pinned: str | None, c: _Cluster, now: bool = True) -> OptionEstimate:
    """`now`: this turn (False: a look-ahead turn, seconds later, when today's arrivals are long done)."""
    d = c.decode(pinned)
    if d is None:
        why = "no pinned decode node" if pinned is None else f"pinned decode {pinned} is down"
        return OptionEstimate("decode_local", False, why)
    cached = _d_cached(turn, c)
    n = turn.prompt_tokens - cached
    compute = c.est.prefill_s(d.url, n, cached)
    # Chunked prefill: each of its steps also decodes the running batch, so it cannot beat that step time.
    steps = math.ceil(n / c.knobs.chunk_tokens)
    ttft = c.est.queue_s(d.url, d.waiting) + max(compute, steps * c.est.tpot_s(d.url, d.running + 1))
    # What the running requests lose: a decode step is memory-bound (weights + KV read), so prefill work up
    # to one step time per step rides along for free (roofline: a step costs max(compute, memory)); the rest
    # stalls every one of them. The per-request constant counts too: on a MoE model it is mostly the expert
    # weights a prefill chunk touches and a small decode batch does not (GLM-5: ~70 ms against a ~10 ms
    # step); on a dense model it is about one step's weight read, which the decode step covers.
    marginal = c.est.prefill_s(d.url, n, cached)
    stall = max(0.0, marginal - steps * c.est.tpot_s(d.url, d.running)) if d.running > 0 else 0.0
    credit = turn.decode_stall_credit_s
    price = max(_stall_price(credit, c.knobs.stall_burst_s), _stall_price(turn.request_stall_credit_s,
                                                                        turn.request_stall_quota_s))
    interference = (c.knobs.interference_weight * d.running + price) * stall if stall else 0.0
    held = min(max(0.0, d.holding_back), d.running)
    interference += max(0.0, c.knobs.holdback_weight - c.knobs.interference_weight) * held * stall
    priced = now and c.knobs.arrival_weight > 0.0  # off: not computed, so no reason names it
    blocks = blocked_s(d.arrivals, c.est.queue_s(d.url, d.waiting), ttft) if priced else 0.0
    interference += c.knobs.arrival_weight * blocks
    base = OptionEstimate("decode_local", True, "", False, ttft, interference, 0.0, None, d.url, 0, n, 0, stall,
                          tail_s=_tail_s(ttft, turn, c), blocks_s=blocks)
    if n > c.knobs.max_local_suffix_tokens:
        return replace(base, feasible=False, soft=True,
                       why_not=f"local suffix {n} tok > max_local_suffix_tokens {c.knobs.max_local_suffix_tokens}")
    # A stall larger than the whole burst (a slow node's prefill) may still run from a full budget, which it
    # then overdraws: the long-run share holds, such turns are just spaced further apart.
    if stall > 0.0 and credit < min(stall, c.knobs.stall_burst_s):
        why = (f"stall budget: D's batch would lose {stall:.3f}s, {max(0.0, credit):.3f}s left "
               f"({c.knobs.decode_stall_share:.1%} of D's time)")
        return replace(base, feasible=False, soft=True, why_not=why)
    # Per-request quotas: no request decoding on D may lose more than its share of its own decode time.
    if stall > 0.0 and turn.request_stall_credit_s < stall:
        why = (f"TPOT quota: a request decoding on D may absorb {max(0.0, turn.request_stall_credit_s):.3f}s more "
               f"stall (of {turn.request_stall_quota_s:.3f}s), this one is {stall:.3f}s")
        return replace(base, feasible=False, soft=True, why_not=why)
    if d.running > 0:
        tpot = c.est.tpot_s(d.url, d.running) + stall / c.knobs.tpot_window_tokens
        if tpot > c.knobs.tpot_budget_s:
            why = f"TPOT of D's {d.running:g} running {tpot:.3f}s > budget {c.knobs.tpot_budget_s:.3f}s"
            return replace(base, feasible=False, soft=True, why_not=why)
    return base


def blocked_s(arrivals: Iterable[tuple[float, float]], start_s: float, end_s: float) -> float:
    """Seconds a local prefill holding D from `start_s` to `end_s` (from now) delays P/D turns arriving there.

    Each arrival needs D twice: when its request comes in (its KV read starts at the next step boundary)
    and when its read is done (its first step). vLLM runs one engine step at a time, so either instant inside
    the local prefill's step waits for the step's end."""
    total = 0.0
    if end_s <= start_s:
        return total
    for at, read in arrivals:
        for t in (at, at + max(0.0, read)):
            if start_s < t < end_s:
                total += end_s - t
    return total


def _stall_price(credit_s: float, burst: float) -> float:
    """TTFT-seconds one second of D's stall costs on top of the interference weight: 0 while the stall budget
    (a node's share, or the tightest request's quota) is full or not kept, rising as it drains (burst/credit −
    1: 1 at half, 3 at a quarter; at most 99, so a forced local turn on an overdrawn budget still has a finite
    score)."""
    if math.isinf(credit_s) or credit_s >= burst or burst <= 0.0:
        return 0.0
    return burst / max(credit_s, 0.01 * burst) - 1.0


def _pd(option: Option, turn: TurnFacts, p: NodeLike, d: NodeLike, holder: str | None, reuse: int,
        d_cached: int, c: _Cluster, pinned: NodeLike | None = None) -> OptionEstimate:
    """A P/D turn on the given nodes: P pulls `reuse` tokens from `holder` (0: cold), D lacks the rest.
    `pinned`: the session's D, when `d` may be another one (rebalancing)."""
    p_cached = _p_cached(turn, p.url, c)
    # vLLM's P reads only what its own cache lacks of the handle's tokens, and computes a read too short to
    # be worth it (count < kv_recompute_threshold) itself.
    pulled = max(0, reuse - p_cached) if holder is not None else 0
    if pulled < c.knobs.recompute_threshold_tokens:
        pulled = 0
    context = p_cached + pulled
    computed = turn.prompt_tokens - context
    read = c.est.transfer_s(holder, p.url, pulled) if holder is not None else 0.0
    back_tokens = turn.prompt_tokens - d_cached
    arrive = _p_queue_s(c, p) + read + c.est.prefill_s(p.url, computed, context)  # when D gets the request
    d_read = c.est.transfer_s(p.url, d.url, back_tokens)
    ttft = arrive + d_read + _d_leg_s(c, d)
    balance = _balance_s(turn, d, pinned, c) if pinned is not None else 0.0
    return OptionEstimate(option, True, "", False, ttft, 0.0, 0.0, p.url, d.url, reuse, computed,
                          pulled + back_tokens, balance_s=balance, tail_s=_tail_s(ttft, turn, c),
                          arrive_s=arrive, d_read_s=d_read)


def _p_cached(turn: TurnFacts, p_url: str, c: _Cluster) -> int:
    """Tokens of the prompt P's prefix cache holds: the session's copy there, or the shared floor."""
    mine = max((n for url, n in turn.prefill_cached if url == p_url), default=0)
    held = max(turn.prefill_cached_tokens, mine)
    return _floor_block(min(held, turn.prompt_tokens - 1), c.knobs.block_size)


def _best(cands: Iterable[OptionEstimate]) -> OptionEstimate | None:
    return min(cands, key=lambda o: (o.ttft_s + o.balance_s + o.tail_s, o.prefill_url or "", o.balance_s != 0.0),
               default=None)


def _decode_choices(pinned: NodeLike, c: _Cluster) -> tuple[NodeLike, ...]:
    """Where a P/D turn of a session pinned to `pinned` may decode: there, or (auto, rebalancing on) any D."""
    if c.knobs.mode != "auto" or not c.knobs.rebalance_decode:
        return (pinned,)
    return (pinned, *(d for d in c.decodes if d.url != pinned.url))


def _load(d: NodeLike) -> float:
    # Turns already headed to D count: without them, turns planned while another's prefill leg runs all
    # see the same light D and herd onto it.
    return d.running + d.waiting + d.arriving


def _balance_s(turn: TurnFacts, d: NodeLike, pinned: NodeLike, c: _Cluster) -> float:
    """Decoding this turn's answer on `d` instead of the pinned D, in TTFT-seconds.

    Each request a new one joins is delayed by one sequence's share of a decode step (tpot's per-sequence
    term) for about the answer's length: priced at `interference_weight`, like a local prefill's stall. The
    new answer itself decodes at its node's step time: this session's own latency (its agent waits for the
    whole answer before the next tool call), so a second of it counts as a second of TTFT. Both scale with
    the node's load (running + waiting).
    """
    if d.url == pinned.url:
        return 0.0
    out = turn.expected_output_tokens

    def cost(n: NodeLike) -> float:
        per_seq = max(0.0, c.est.tpot_s(n.url, 2.0) - c.est.tpot_s(n.url, 1.0))
        others = c.knobs.interference_weight * _load(n) * per_seq * out
        return others + out * c.est.tpot_s(n.url, _load(n) + 1.0)

    return cost(d) - cost(pinned)


def _pull(turn: TurnFacts, pinned: str | None, c: _Cluster) -> OptionEstimate:
    def no(why: str) -> OptionEstimate:
        return OptionEstimate("pull", False, why)

    if not turn.handle_valid:
        return no("no valid handle")
    d = c.decode(pinned)
    if d is None:
        return no("the handle's decode node is down")
    reuse = min(turn.reuse_tokens, turn.prompt_tokens - 1)  # P computes at least the last token
    if reuse < max(1, c.knobs.recompute_threshold_tokens):
        return no(f"verified reuse {reuse} tok < threshold {c.knobs.recompute_threshold_tokens}")
    ps = [p for p in c.prefills if p.bidirectional]
    if not ps:
        return no("no healthy bidirectional prefill node")
    best = _best(_pd("pull", turn, p, dd, d.url, reuse, _cached_on(turn, dd, d, c), c, d)
                 for p in ps for dd in _decode_choices(d, c))
    assert best is not None
    p_url = best.prefill_url or ""
    # P reads after its queue: the handle must still be alive (with the engine's decline margin) by then.
    reads_at = turn.handle_age_s + _p_queue_s(c, next(p for p in ps if p.url == p_url))
    if reads_at + c.knobs.handle_margin_s >= c.knobs.handle_ttl_s:
        return no(f"handle expires: age {turn.handle_age_s:.0f}s + queue, ttl {c.knobs.handle_ttl_s:.0f}s")
    return best


def _cold(turn: TurnFacts, pinned: str | None, c: _Cluster) -> OptionEstimate:
    if not c.prefills:
        return OptionEstimate("cold", False, "no healthy prefill node")
    home = c.decode(pinned)
    if home is not None:
        choices = _decode_choices(home, c)
    else:
        # Re-pin on the decode node that would serve a first token soonest.
        d = min(c.decodes, key=lambda n: (_d_leg_s(c, n), n.url), default=None)
        if d is None:
            return OptionEstimate("cold", False, "no healthy decode node")
        choices = (d,)
    best = _best(_pd("cold", turn, p, dd, None, 0, _cached_on(turn, dd, home, c), c, home)
                 for p in c.prefills for dd in choices)
    assert best is not None
    return best


def _immediate(turn: TurnFacts, pinned: str | None, c: _Cluster, now: bool = True) -> tuple[OptionEstimate, ...]:
    return (_local(turn, pinned, c, now), _pull(turn, pinned, c), _cold(turn, pinned, c))


# ---------------------------------------------------------------------------------------------------------
# Look-ahead.


def _after(turn: TurnFacts, o: OptionEstimate, pinned: str | None,
           c: _Cluster) -> list[tuple[float, TurnFacts, str | None]]:
    """The next turn(s) as this option leaves the session: (probability, facts, pinned decode)."""
    suffix = turn.suffix_tokens if turn.next_suffix_tokens is None else turn.next_suffix_tokens
    out_toks = turn.expected_output_tokens
    held = turn.prompt_tokens + out_toks - 1  # the last sampled token's KV is never computed
    # What other decode nodes keep of the session: the same prefixes (still prefixes of the next prompt),
    # plus, when this option moves the pin, the history on the D it leaves.
    elsewhere = tuple((url, n) for url, n in turn.decode_elsewhere if url != o.decode_url)
    home = c.decode(pinned)
    if home is not None and o.decode_url != home.url:
        elsewhere = (*(e for e in elsewhere if e[0] != home.url), (home.url, _d_cached(turn, c)))
    nxt = TurnFacts(
        prompt_tokens=turn.prompt_tokens + out_toks + suffix,
        suffix_tokens=suffix,
        reuse_tokens=held,
        handle_valid=True,
        handle_age_s=0.0,
        decode_cached_tokens=held,
        expected_output_tokens=out_toks,
        prefill_cached_tokens=turn.prefill_cached_tokens,
        prefill_cached=_p_copies_after(turn, o, c),
        next_suffix_tokens=suffix,
        decode_stall_credit_s=turn.decode_stall_credit_s,
        decode_elsewhere=elsewhere,
        ttft_tail_s=turn.ttft_tail_s,
        # The same loads: the next turn finds D's decoding requests as this one does (those running now are
        # done by then, an answer later; others have taken their place).
        request_stall_credit_s=turn.request_stall_credit_s,
        request_stall_quota_s=turn.request_stall_quota_s,
    )
    if o.option != "decode_local":
        return [(1.0, nxt, o.decode_url)]
    d = c.decode(o.decode_url)
    gap = o.ttft_s + out_toks * (c.est.tpot_s(d.url, d.running + 1) if d is not None else 0.0)
    # The stall budget after this turn spent its stall and refilled over the turn's answer.
    credit = turn.decode_stall_credit_s
    if not math.isinf(credit):
        budget = StallBudget(c.knobs.decode_stall_share, c.knobs.decode_stall_window_s, credit, 0.0)
        credit = budget.spend(o.stall_s, 0.0).credit(gap)
    if turn.local_keeps_handle:
        # Marked for retention, D returns a handle of the whole sequence as after a P/D turn: pinned, fresh.
        return [(1.0, replace(nxt, decode_stall_credit_s=credit), o.decode_url)]
    # Unmarked, vLLM returns no handle for a turn D prefilled itself. But the handle this turn did *not* use is
    # still held on D (the gateway puts it back), and its blocks still cover a prefix of the next prompt: the next
    # turn may pull that prefix and let P compute the rest (this turn's suffix and answer, then its own),
    # provided the handle is still alive by then (it is older by this turn and its answer). Without it, the
    # history sits only in D's prefix cache, which is evicted more likely the fuller D is: vLLM's KV usage
    # counts blocks of running requests; cached-but-free blocks are evicted (LRU) only when that usage leaves
    # no free block, so the risk is ~0 below a knee and rises to 1 as usage nears full. The handle's own
    # blocks are pinned (not evictable) for as long as it lives.
    p_keep = _p_keep(d, c) if d is not None else 0.0
    keeps = turn.handle_valid and turn.reuse_tokens > 0
    pinned_prefix = min(turn.reuse_tokens, held) if keeps else 0
    hit = replace(nxt, reuse_tokens=pinned_prefix, handle_valid=keeps,
                  handle_age_s=turn.handle_age_s + gap if keeps else 0.0, decode_stall_credit_s=credit)
    miss = replace(hit, decode_cached_tokens=pinned_prefix)
    return [(p, t, o.decode_url) for p, t in ((p_keep, hit), (1.0 - p_keep, miss)) if p > 0.0]


def _p_copies_after(turn: TurnFacts, o: OptionEstimate, c: _Cluster) -> tuple[tuple[str, int], ...]:
    # A P/D turn leaves its prompt in that P's cache (the next prompt extends it) if P caches prefixes; the
    # other copies stay prefixes of the next prompt.
    p = next((n for n in c.prefills if n.url == o.prefill_url), None)
    if p is None or not p.prefix_caching:
        return turn.prefill_cached
    return (*((u, n) for u, n in turn.prefill_cached if u != p.url), (p.url, turn.prompt_tokens))


def _scored(turn: TurnFacts, pinned: str | None, c: _Cluster, depth: int,
            now: bool = True) -> tuple[OptionEstimate, ...]:
    """Options with their horizon term: discount × E[value of the next turn], `depth` turns deep."""
    opts = _immediate(turn, pinned, c, now)
    if depth <= 0 or c.knobs.horizon_discount == 0.0:
        return opts
    out = []
    for o in opts:
        if not o.feasible:
            out.append(o)
            continue
        future = sum(p * _value(t, pin, c, depth - 1) for p, t, pin in _after(turn, o, pinned, c))
        out.append(replace(o, horizon_s=c.knobs.horizon_discount * future))
    return tuple(out)


def _value(turn: TurnFacts, pinned: str | None, c: _Cluster, depth: int) -> float:
    """The best score of a turn (auto policy), forcing a soft-rejected option if nothing else is possible."""
    key = (turn, pinned, depth)
    if key not in c.memo:
        opts = _scored(turn, pinned, c, depth, now=False)
        feasible = [o.score_s for o in opts if o.feasible]
        soft = [o.ttft_s + o.interference_s for o in opts if o.soft]
        c.memo[key] = min(feasible) if feasible else min(soft, default=math.inf)
    return c.memo[key]


# ---------------------------------------------------------------------------------------------------------
# The decision.


def choose(
    turn: TurnFacts,
    pinned_decode: str | None,
    prefills: Sequence[NodeLike],
    decodes: Sequence[NodeLike],
    estimates: EstimatorSnapshot,
    knobs: PolicyKnobs | None = None,
    *,
    exclude: frozenset[str] = frozenset(),
    round_robin: int = 0,
) -> CostDecision:
    """Place one turn. `pinned_decode` holds the session's history (and its handle, if `turn.handle_valid`).

    `exclude`: nodes that just failed this turn (retry). `round_robin`: the shell's counter, used only by
    the ``reference`` mode. Raises :class:`NoFeasibleOption` when no node can serve the turn.
    """
    knobs = knobs or PolicyKnobs()
    c = _Cluster(
        tuple(p for p in prefills if p.healthy and p.url not in exclude),
        tuple(d for d in decodes if d.healthy and d.url not in exclude),
        estimates,
        knobs,
    )
    if not c.decodes:
        raise NoFeasibleOption("no healthy decode node")
    if knobs.mode == "reference":
        return _reference(turn, pinned_decode, c, round_robin)

    opts = _scored(turn, pinned_decode, c, knobs.horizon_turns if knobs.mode == "auto" else 0)
    by = {o.option: o for o in opts}
    feasible = [o for o in opts if o.feasible]
    greedy: Option | None = None
    forced = False
    if knobs.mode == "auto":
        pick = min(feasible, key=lambda o: (o.score_s, OPTIONS.index(o.option)), default=None)
        if pick is not None and knobs.horizon_turns > 0:
            greedy = min(feasible, key=lambda o: (o.ttft_s + o.interference_s, OPTIONS.index(o.option))).option
    elif knobs.mode == "pull":
        pick = next((by[o] for o in ("pull", "cold") if by[o].feasible), None)
    else:  # no-pull: classic disaggregation
        pick = by["cold"] if by["cold"].feasible else None
    if pick is None:
        # Every P is down (or the only way left is over a limit): run it locally rather than fail the turn.
        local = by["decode_local"]
        if not (local.feasible or local.soft):
            raise NoFeasibleOption("; ".join(f"{o.option}: {o.why_not}" for o in opts))
        pick, forced = local, True
    assert pick.decode_url is not None
    return CostDecision(
        option=pick.option,
        reason=_reason(knobs.mode, pick, opts, turn, c, forced, greedy, pinned_decode),
        estimates_s={o.option: round(o.ttft_s, 6) for o in opts if o.feasible},
        prefill_url=pick.prefill_url,
        decode_url=pick.decode_url,
        reuse_tokens=pick.reuse_tokens if pick.option == "pull" else 0,
        policy=knobs.mode,
        scores_s={o.option: round(o.score_s, 6) for o in opts if o.feasible},
        options=opts,
        forced=forced,
        greedy_option=greedy,
        arrive_s=pick.arrive_s,
        d_read_s=pick.d_read_s,
    )


def _reference(turn: TurnFacts, pinned: str | None, c: _Cluster, rr: int) -> CostDecision:
    """vLLM's reference proxy: round-robin P and D, the conversation's handle attached whenever held."""
    if not c.prefills:
        raise NoFeasibleOption("no healthy prefill node")
    p, d = c.prefills[rr % len(c.prefills)], c.decodes[rr % len(c.decodes)]
    holder = c.decode(pinned)
    reuse = min(turn.reuse_tokens, turn.prompt_tokens - 1)
    d_cached = _d_cached(turn, c) if d.url == pinned else 0  # a different D lacks the whole history
    if turn.handle_valid and holder is not None and p.bidirectional and reuse > 0:
        pick = _pd("pull", turn, p, d, holder.url, reuse, d_cached, c)
        why = "round-robin, conversation handle attached"
    else:
        pick = _pd("cold", turn, p, d, None, 0, d_cached, c)
        why = "round-robin, no usable handle"
    return CostDecision(
        option=pick.option,
        reason=f"reference -> {pick.option}: {why}, est {pick.ttft_s:.3f}s (suffix {turn.suffix_tokens} tok, "
        f"reuse {pick.reuse_tokens} tok)",
        estimates_s={pick.option: round(pick.ttft_s, 6)},
        prefill_url=p.url,
        decode_url=d.url,
        reuse_tokens=pick.reuse_tokens,
        policy="reference",
        scores_s={pick.option: round(pick.score_s, 6)},
        options=(pick,),
        arrive_s=pick.arrive_s,
        d_read_s=pick.d_read_s,
    )


def _reason(mode: PolicyMode, pick: OptionEstimate, opts: Sequence[OptionEstimate], turn: TurnFacts,
            c: _Cluster, forced: bool, greedy: Option | None, pinned: str | None = None) -> str:
    """E.g. ``auto -> pull: pull 0.210s < decode_local 0.260s < cold 0.900s [ttft …] (suffix …; …)``."""
    feasible = sorted((o for o in opts if o.feasible), key=lambda o: (o.score_s, OPTIONS.index(o.option)))
    head = f"{mode} -> {pick.option}" + (" (forced)" if forced else "") + ": "
    head += " < ".join(f"{o.option} {o.score_s:.3f}s" for o in feasible) or "no option within limits"
    detail = []
    if any(o.interference_s or o.horizon_s or o.balance_s or o.tail_s for o in feasible):
        detail.append("ttft " + ", ".join(f"{o.option} {o.ttft_s:.3f}s" for o in feasible))
        detail += [f"{o.option} interference {o.interference_s:.3f}s" for o in feasible if o.interference_s]
        detail += [f"{o.option} holds up arriving turns {o.blocks_s:.3f}s" for o in feasible if o.blocks_s]
        detail += [f"{o.option} on {o.decode_url} balance {o.balance_s:.3f}s" for o in feasible if o.balance_s]
        detail += [f"{o.option} tail {o.tail_s:.3f}s (over {turn.ttft_tail_s:.3f}s)" for o in feasible if o.tail_s]
        detail.append("next turn " + ", ".join(f"{o.option} {o.horizon_s:.3f}s" for o in feasible))
    if greedy is not None and greedy != pick.option:
        detail.append(f"horizon: {pick.option} over greedy {greedy}")
    facts = [f"suffix {turn.suffix_tokens} tok", f"reuse {turn.reuse_tokens if turn.handle_valid else 0} tok"]
    d = c.decode(pick.decode_url)
    if d is not None:
        facts.append(f"D {d.running:g} running/{d.waiting:g} waiting"
                     + (f"/{d.arriving:g} arriving" if d.arriving else ""))
    home = c.decode(pinned)
    if home is not None and d is not None and d is not home:
        kept = _cached_on(turn, d, home, c)
        facts.append(f"moves the pin from {home.url} ({home.running:g} running/{home.waiting:g} waiting)"
                     + (f", D still holds {kept} tok of the history" if kept else ""))
    if not math.isinf(turn.decode_stall_credit_s):
        facts.append(f"D stall budget {turn.decode_stall_credit_s:.3f}s of {c.knobs.stall_burst_s:.3f}s")
    if not math.isinf(turn.request_stall_credit_s):
        facts.append(f"D's tightest TPOT quota {turn.request_stall_credit_s:.3f}s of {turn.request_stall_quota_s:.3f}s")
    # The P this turn uses, or (decode_local) the one the best P/D option would have used: its queue is
    # often why the turn stayed on D.
    p_url = pick.prefill_url or next((o.prefill_url for o in feasible if o.prefill_url), None)
    p = next((n for n in c.prefills if n.url == p_url), None)
    if p is not None:
        held = _p_cached(turn, p.url, c)
        facts.append(f"P {p.running:g} running/{p.waiting:g} waiting"
                     + (f", its cache holds {held} tok of the prompt" if held else ""))
    facts += [f"{o.option} n/a: {o.why_not}" for o in opts if not o.feasible]
    out = head
    if detail:
        out += " [" + "; ".join(detail) + "]"
    return out + " (" + "; ".join(facts) + ")"
