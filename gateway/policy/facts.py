"""What the cost model reads and returns (pure data): the turn's facts, the nodes' load, each option's
estimate and the decision.

The shell (``gather.py``, ``orchestrator.py``) fills :class:`TurnFacts` from the session and the guard, and
:class:`NodeLoad` from the cluster view; ``costmodel.choose`` returns a :class:`CostDecision`
whose ``reason`` goes on the turn's span.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from kvtether.gateway.policy.stallquota import RunningPrefill, pending_s

Option = Literal["decode_local", "pull", "cold"]
OPTIONS: tuple[Option, ...] = ("decode_local", "pull", "cold")  # also the tie-break order


@dataclass(frozen=True, slots=True)
class NodeLoad:
    """A node as a decision sees it: health, load from its ``/metrics`` (``vllm:num_requests_running``/
    ``_waiting``, ``kv_cache_usage_perc``) and the gateway's own counts (``cluster.Node.load``)."""

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
    # A pool instance (kv_both): it decodes its own sessions and prefills for others, in one scheduler, so a
    # prefill leg there shares engine steps with its own decodes (options.prefill_leg).
    both: bool = False
    # both only: of `running`, prefill legs this gateway has there (the rest are decoding or local turns).
    prefilling: float = 0.0

    @property
    def decoding(self) -> float:
        """Requests decoding here: on a pool instance, those running that are not prefill legs."""
        return max(0.0, self.running - self.prefilling) if self.both else self.running

    @property
    def score(self) -> tuple[float, float]:
        # The fixed policies' "least loaded": queued work first (it is what delays a new request), KV pressure
        # breaks ties.
        return (self.running + 2.0 * self.waiting, self.kv_usage)


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
    # prefilled an earlier turn of the session (the shell's estimate, eviction discounted: copies.py).
    # A pull there reads only the rest of the reuse from D; a cold prefill there computes only the rest.
    prefill_cached: tuple[tuple[str, int], ...] = ()
    next_suffix_tokens: int | None = None  # typical suffix of the session's next turn; None: this turn's
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
    # The same per pool instance a prefill leg may run on (url, credit, quota): its own decoding requests
    # absorb that leg's stall as they would a local prefill's.
    stall_credits: tuple[tuple[str, float, float], ...] = ()
    # Prefills admitted earlier and still running beside a node's decodes (url, seconds until each should end,
    # the time before that its stall comes in, its stall, the engine steps it comes in): an answer that starts
    # decoding there meanwhile takes the rest of their stall, which its TPOT objective must absorb
    # (stallquota.RunningPrefill).
    running_prefills: tuple[tuple[str, float, float, float, int], ...] = ()

    def pending_stall(self, url: str, after_s: float) -> float:
        """The stall an answer that starts decoding on `url` in `after_s` seconds takes from those prefills."""
        return pending_s((RunningPrefill(end, run, stall, steps) for u, end, run, stall, steps
                          in self.running_prefills if u == url), after_s)

    def prefill_queue_s(self, url: str) -> float:
        """Compute still ahead of a new prefill on `url`: what is left of each prefill running there (a leg or a
        local turn, of any session), until the gateway sees it end. vLLM's scheduler gives the running requests
        their chunks first and a new prefill what they leave of each step's budget, so the new one computes
        after them: however many they are, their remaining compute is its queue."""
        return sum(max(0.0, min(ends_in, run)) for u, ends_in, run, _, _ in self.running_prefills if u == url)

    def stall_credit(self, url: str, pinned: str | None) -> tuple[float, float]:
        """(credit, quota) of the requests decoding on `url`: the pinned D's, or a pool instance's."""
        if url == pinned:
            return self.request_stall_credit_s, self.request_stall_quota_s
        return next(((c, q) for u, c, q in self.stall_credits if u == url), (math.inf, math.inf))

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1:
            raise ValueError("prompt_tokens must be >= 1")
        for name in ("suffix_tokens", "reuse_tokens", "decode_cached_tokens", "expected_output_tokens",
                     "prefill_cached_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.next_suffix_tokens is not None and self.next_suffix_tokens < 0:
            raise ValueError("next_suffix_tokens must be >= 0")
        if any(n < 0 for _, n in self.decode_elsewhere) or any(n < 0 for _, n in self.prefill_cached):
            raise ValueError("decode_elsewhere and prefill_cached tokens must be >= 0")
        if math.isnan(self.ttft_tail_s):
            raise ValueError("ttft_tail_s must be a number")
        if math.isnan(self.request_stall_credit_s) or not self.request_stall_quota_s >= 0:
            raise ValueError("request_stall_credit_s must be a number and request_stall_quota_s >= 0")




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
    stall_s: float = 0.0  # decode_local: seconds the running batch on D loses (what its TPOT quotas absorb)
    # What a request decoding beside this option's prefill takes, on the node that runs it beside decodes (D for
    # decode_local, a pool instance for a prefill leg there), whether or not one decodes there now: what a
    # request placed there while it runs inherits (stallquota.RunningPrefill). 0 on a dedicated P.
    beside_stall_s: float = 0.0
    # P/D on another D than the pinned one: what its answer's decode adds to that D's batch less what it would
    # add to the pinned D's (negative when the other D is lighter; 0 on the pinned D). See _balance_s.
    balance_s: float = 0.0
    tail_s: float = 0.0  # tail_weight × the estimated TTFT above the tail threshold (see PolicyKnobs)
    # P/D: what decoding on a D short of memory risks (options.preemption_risk_s): the answer preempted and its
    # prompt recomputed there, times the likelihood.
    pressure_s: float = 0.0
    # P/D: seconds until D gets the request (P queue + read + prefill) and of D's read of what it lacks: where
    # the turn will need D (the shell records them as the turn's arrival on D). decode_local: how long its own
    # prefill step holds D up for turns arriving meanwhile (in interference_s, weighted by arrival_weight).
    arrive_s: float = 0.0
    d_read_s: float = 0.0
    blocks_s: float = 0.0
    # soft only: the limit is a fixed cap (max_local_suffix_tokens), which no wait clears; the others (TPOT
    # quotas, prefills running, KV pressure) clear as the requests running there finish (policy/deferral.py).
    fixed_limit: bool = False
    # soft only: the limit is the KV-pressure veto: over it, the prefill may preempt the requests decoding there,
    # whose recompute costs them far more than any stall (never run over it to save this turn's TTFT).
    kv_limit: bool = False

    @property
    def score_s(self) -> float:
        return self.ttft_s + self.interference_s + self.horizon_s + self.balance_s + self.tail_s + self.pressure_s


@dataclass(frozen=True, slots=True)
class CostDecision:
    option: Option
    reason: str  # short, human-readable, with the estimates: log it and put it on the turn's span
    estimates_s: dict[str, float]  # estimated TTFT of each feasible option
    prefill_url: str | None  # None for decode_local
    decode_url: str
    reuse_tokens: int = 0  # pull: send the handle truncated to this many tokens
    scores_s: dict[str, float] = field(default_factory=dict)  # TTFT + interference + horizon, feasible ones
    options: tuple[OptionEstimate, ...] = ()
    forced: bool = False  # chosen although over a limit: nothing else was possible
    # forced, over a pool instance's quota, because every option within the limits was past the TTFT objective and
    # this one was within it (PolicyKnobs.ttft_over_quota)
    rescued: bool = False
    greedy_option: Option | None = None  # what the choice would be without the look-ahead (auto only)
    # P/D: when the turn will need D (OptionEstimate.arrive_s, d_read_s), for the shell's arrival record.
    arrive_s: float = 0.0
    d_read_s: float = 0.0

    @property
    def chosen(self) -> OptionEstimate | None:
        """The estimate of the option chosen (None when the decision carries no estimates)."""
        return next((o for o in self.options if o.option == self.option), None)

    def trace_attributes(self) -> dict[str, str | float | int | bool]:
        """Flat attributes for a span or a JSONL trace record (names without the telemetry prefix)."""
        out: dict[str, str | float | int | bool] = {
            "option": self.option,
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

