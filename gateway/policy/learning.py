"""What the cost policy learns from the turns the gateway serves, and the live state it plans with.

One :class:`Learning` per gateway. The shell reports what happened in plain values (a prefill leg's time, a
finished decode leg's timing, when chunks arrived, which requests are decoding where); the policy reads back
an :class:`EstimatorSnapshot`, the pinned D's tightest TPOT quota and the TTFT tail threshold. No I/O; every
time is passed in from the caller's clock (the gateway's one clock, gateway/clock.py).
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from kvtether.gateway.policy import copies as PC
from kvtether.gateway.policy import stallquota as SQ
from kvtether.gateway.policy.estimates import Estimator, EstimatorSeeds, EstimatorSnapshot, LearningParams
from kvtether.gateway.policy.knobs import PolicyKnobs
from kvtether.gateway.policy.placement import HandleAction, Plan
from kvtether.gateway.policy.steps import ChunkTimes, mixed_step_s
from kvtether.gateway.policy.tail import TailTracker

log = logging.getLogger(__name__)

STEP_ARRIVALS = 16  # chunk arrivals kept per leg to find the step before its first chunk
# A prefill the gateway has not seen end this long after it was admitted was abandoned without a word (its turn's
# end forgets it in any case): the gateway's own bound on a prefill leg (prefill_timeout_s) by default.
UNSEEN_PREFILL_FORGOTTEN_S = 600.0


class NodeFacts(Protocol):
    """What learning reads of a node (the shell's ``cluster.Node`` fits as is)."""

    @property
    def role(self) -> str: ...
    @property
    def prefix_caching(self) -> bool | None: ...
    @property
    def kv_capacity_tokens(self) -> int | None: ...
    @property
    def kv_usage(self) -> float: ...


@dataclass(frozen=True, slots=True)
class DecodeSample:
    """A finished final leg on a decode node, as the relay timed it (the gateway's clock, seconds)."""

    node: str
    local: bool  # a decode-local turn: D prefilled the suffix itself
    load: tuple[float, float]  # (running, waiting) on D as the plan saw it
    prompt_tokens: int | None
    cached_tokens: int  # of the prompt, what D's prefix cache held (its usage's count, else the guard's)
    sent_at: float | None  # the leg was sent
    first_chunk_at: float | None  # its first chunk with choices (D's first token)
    arrivals_before_first: tuple[float, ...] = ()  # other streams' chunks on D in between
    out_first_at: float | None = None  # first and last output chunk, and the tokens between them
    out_last_at: float | None = None
    out_tokens_timed: int = 0


class Learning:
    def __init__(self, seeds: EstimatorSeeds, params: LearningParams, knobs: PolicyKnobs, *,
                 request_stall_share: float = 1.0, enabled: bool = True, steps: bool = True) -> None:
        """`request_stall_share`: each decoding request's TPOT quota (1: none kept, as under fixed policies);
        `enabled`: whether finished turns update the estimates (off: the seeds stay); `steps`: whether chunk
        arrivals are recorded (only decode-local turns read them: off in aggregated mode)."""
        # Node speeds learned from served turns (prefill, transfer, decode step, queue).
        self.estimator = Estimator(seeds, params)
        self.knobs = knobs
        self.enabled = enabled
        self.request_stall_share = request_stall_share
        # Per decode node: the requests this gateway has decoding there, each with its TPOT quota of stall.
        self.exposures: dict[str, dict[int, SQ.Exposure]] = {}
        self._exposure_keys = itertools.count()
        # Per decode node: when its streamed chunks arrived (one burst per engine step).
        self.chunk_times = ChunkTimes()
        self.steps = steps
        # Where recent turns' estimated TTFT tail starts (the tail-aware objective's threshold).
        self.tail = TailTracker(knobs.tail_quantile)
        # Per prefill node: tokens of new KV it took in (what evicts its older cached blocks; copies.py).
        self.prefill_written: dict[str, int] = {}
        # Per node: the prefills admitted there that still run beside its decodes (stallquota.RunningPrefill), by
        # key, until the shell sees each end (prefill_seen), and when each was admitted.
        self.running_prefills: dict[str, dict[int, tuple[float, SQ.RunningPrefill]]] = {}
        self._running_keys = itertools.count()

    # ---- what planning reads ---------------------------------------------------------------------

    def snapshot(self, now: float) -> EstimatorSnapshot:
        return self.estimator.snapshot(now)

    def quota_credit(self, decode: str | None) -> SQ.Credit:
        """The tightest TPOT quota among the requests decoding on `decode` (inf: none)."""
        return SQ.credit(self.exposures.get(decode or "", {}).values())

    def tail_threshold(self) -> float:
        return self.tail.threshold()

    def prefill_cached(self, copies: Iterable[PC.PrefillCopy], overlap: int,
                       nodes: Mapping[str, NodeFacts]) -> dict[str, int]:
        """Per P with prefix caching on: how much of this prompt its cache likely still holds (the session's
        copies there, cut to the prompt's verified overlap with the history, eviction discounted)."""
        out: dict[str, int] = {}
        for c in PC.cut(copies, overlap):
            node = nodes.get(c.url)
            if node is None or node.role not in ("prefill", "both") or node.prefix_caching is not True:
                continue
            kept = PC.surviving(c, self.prefill_written.get(c.url, 0), node.kv_capacity_tokens, node.kv_usage)
            if kept > 0:
                out[c.url] = kept
        return out

    # ---- what the shell reports ------------------------------------------------------------------

    def prefills_running(self, now: float) -> tuple[tuple[str, float, float, float, int], ...]:
        """The prefills still running beside decodes, per node: (url, seconds until each should end, the window
        its stall comes in, its stall, its steps), for the policy (TurnFacts.running_prefills). One runs until the shell
        sees it end, even past its estimated end (stallquota.RunningPrefill.as_of)."""
        out = []
        for url, runs in list(self.running_prefills.items()):
            for key, (admitted, r) in list(runs.items()):
                if now - admitted > UNSEEN_PREFILL_FORGOTTEN_S:
                    del runs[key]
                else:
                    r = r.as_of(now)  # unseen past its estimated end: it is still running
                    out.append((url, r.ends_at - now, r.duration_s, r.stall_s, r.steps))
            if not runs:
                del self.running_prefills[url]
        return tuple(out)

    def prefill_seen(self, running: tuple[str, int] | None) -> None:
        """The shell saw a prefill :meth:`admitted` end (the local turn's first token, the prefill leg's answer),
        or its turn failed or was placed anew: it stalls nobody any more. Seeing one again is harmless."""
        if running is None:
            return
        url, key = running
        runs = self.running_prefills.get(url)
        if runs is not None:
            runs.pop(key, None)
            if not runs:
                del self.running_prefills[url]

    def planned(self, p: Plan, now: float | None = None) -> float:
        """:meth:`admitted`'s stall, for a caller that will not see the prefill end (it is then forgotten only
        after ``UNSEEN_PREFILL_FORGOTTEN_S``)."""
        return self.admitted(p, now)[0]

    def admitted(self, p: Plan, now: float | None = None) -> tuple[float, tuple[str, int] | None]:
        """A plan about to run; returns the stall seconds it charges the requests decoding where it prefills
        (a decode-local turn's D, a pool instance running its prefill leg), and the key of the prefill it leaves
        running there for answers placed beside it (None: none), which the shell reports ended
        (:meth:`prefill_seen`) when it sees it end.

        Called without an await between planning and this, so two turns planned at once on the same D cannot
        both take the last of its quotas."""
        d = p.decision
        stall = 0.0
        running: tuple[str, int] | None = None
        if d is not None:
            # A decode-local turn stalls its D; a P/D turn whose prefill leg runs on a pool instance stalls
            # that instance's decodes.
            chosen = d.chosen
            stall = chosen.stall_s if chosen is not None else 0.0
            where = p.decode if p.action is HandleAction.DECODE_LOCAL else p.prefill
            if where in self.exposures:
                self.exposures[where] = SQ.absorb(self.exposures[where], stall)
            beside = chosen.beside_stall_s if chosen is not None else 0.0
            if where is not None and chosen is not None and beside > 0.0 and now is not None:
                # Requests placed there while it runs take the rest of its stall (SQ.pending_s): until its first
                # token for a local turn, until its KV is ready for a prefill leg. Kept whether or not anything
                # decodes there now: on an idle instance, the next request placed there is the one it stalls.
                run = chosen.ttft_s if p.action is HandleAction.DECODE_LOCAL else chosen.arrive_s
                if run > 0.0 and math.isfinite(run):
                    key = next(self._running_keys)
                    # Its stall comes with its compute, the end of its run: not while a leg's history is read in,
                    # nor while a local turn waits to be admitted. One answer beside it is stalled about as long
                    # as it computes, so that is the window its stall comes in.
                    window = min(run, beside)
                    steps = max(1, math.ceil(chosen.computed_tokens / self.knobs.chunk_tokens))
                    self.running_prefills.setdefault(where, {})[key] = (
                        now, SQ.RunningPrefill(now + run, window, beside, steps))
                    running = (where, key)
        if d is not None and not d.forced:
            self.tail.observe(d.estimates_s.get(d.option, math.inf))
        return stall, running

    def prefill_done(self, node: str, prompt_tokens: int, cached: int, seconds: float, *, now: float,
                     load: tuple[float, float], pulled_tokens: int, pulled_from: str | None) -> None:
        """A prefill leg answered after `seconds`: `cached` of its prompt came from P's cache or D's KV."""
        if not self.enabled or prompt_tokens <= cached:
            return
        running, waiting = load
        self.estimator.observe_prefill_leg(node, prompt_tokens - cached, cached, seconds, now=now,
                                           ahead=running + waiting, pulled_tokens=pulled_tokens,
                                           pulled_from=pulled_from)

    def wrote(self, node: str, prompt_tokens: int, hit: int) -> None:
        """P `node` took in the KV of a prompt less its own cache hit (what may evict older blocks)."""
        self.prefill_written[node] = self.prefill_written.get(node, 0) + PC.new_kv_tokens(prompt_tokens, hit)

    def chunk_arrived(self, node: str, at: float) -> None:
        if self.steps:
            self.chunk_times.record(node, at)

    def arrivals_since(self, node: str, after: float) -> tuple[float, ...]:
        """The last few chunk arrivals on `node` after `after`: the step boundaries a decode-local turn's
        mixed step is read from (read before that turn's own first chunk is recorded)."""
        return self.chunk_times.since(node, after)[-STEP_ARRIVALS:]

    def decoding(self, node: str, expected_output_tokens: int, running: float, now: float,
                 share: float | None = None, starts_in_s: float = 0.0) -> int | None:
        """A request was placed to decode on `node`: it gets its TPOT quota of stall (`share` of its decode
        time, capped by the TPOT objective, ``knobs.tpot_budget_s``); returns its key. Without `share`, the
        gateway's request_stall_share, where 1 means no quotas are kept (None: off, or the policy is not auto).
        `starts_in_s`: when its first token is expected; what runs there only until then (a decode-local
        turn's own prefill above all) does not stall its answer."""
        if share is None:
            share = self.request_stall_share
            if share >= 1.0:
                return None
        step = self.estimator.snapshot(now).tpot_s(node, max(1.0, running))
        key = next(self._exposure_keys)
        # What the prefills already running there will still stall it counts against its quota from the start.
        pending = SQ.pending_s((r.as_of(now) for _, r in self.running_prefills.get(node, {}).values()),
                               now + max(0.0, starts_in_s))
        lost_after = (SQ.objective_s(expected_output_tokens, step, self.knobs.tpot_budget_s)
                      if self.knobs.release_lost_answers else math.inf)
        self.exposures.setdefault(node, {})[key] = SQ.Exposure(
            SQ.quota_s(share, expected_output_tokens, step, self.knobs.tpot_budget_s), pending, lost_after)
        return key

    def done_decoding(self, node: str, key: int) -> None:
        mine = self.exposures.get(node)
        if mine is not None:
            mine.pop(key, None)
            if not mine:
                del self.exposures[node]

    def decode_done(self, s: DecodeSample, now: float) -> None:
        """D's side of a finished turn: a decode-local first-token time (local prefill) when nothing queued
        ahead of it, and its decode step time from the stream's inter-token gaps."""
        if not self.enabled:
            return
        running, waiting = s.load
        # Streams only: a non-streamed answer has no first-token time (its latency is the whole decode).
        if (s.local and s.first_chunk_at is not None and s.sent_at is not None and s.prompt_tokens is not None
                and waiting == 0):
            tokens = s.prompt_tokens - s.cached_tokens
            seconds: float | None = s.first_chunk_at - s.sent_at
            if running > 0:
                seconds = self._mixed_step_s(s, running, tokens, now)
            log.debug("local prefill on %s: %d tok after %d, %g running: first chunk %.4fs after send, learned %s",
                      s.node, tokens, s.cached_tokens, running, s.first_chunk_at - s.sent_at,
                      "-" if seconds is None else f"{seconds:.4f}s")
            if seconds is not None:
                self.estimator.observe_prefill(s.node, tokens, s.cached_tokens, seconds, now=now)
        # Not learned here: the P→D transfer from D's first token after a P leg. That time is mostly D's request
        # handling (template, tokenizing, admission) for a read of a few blocks, and the link's fit is shared
        # with the D→P pull: it taught the policy that every pull is slow.
        if s.out_first_at is not None and s.out_last_at is not None and s.out_tokens_timed >= 2:
            gap = (s.out_last_at - s.out_first_at) / s.out_tokens_timed
            self.estimator.observe_tpot(s.node, running + 1, gap, now=now)

    def _mixed_step_s(self, s: DecodeSample, running: float, tokens: int, now: float) -> float | None:
        """How long the engine step that prefilled a local suffix took, read off the other streams on D.

        On a busy D this, not the turn's time to first token, is the local prefill's cost: the running
        requests waited exactly this step for their next token (the stall is it less a plain decode step),
        while the turn's own wait also holds D's request handling and the step in flight when it arrived
        (a stall learned from that overcharges every local turn on a busy D).
        None when it cannot be read: a suffix over several chunked steps, or no other stream's chunk between
        this leg's send and its first chunk (nothing streaming there, or only non-streamed requests).
        """
        if tokens > self.knobs.chunk_tokens or s.sent_at is None or s.first_chunk_at is None:
            return None
        # Chunks of one step arrive within relay jitter of each other; a step apart, a decode step or more.
        same_step = 0.5 * self.estimator.snapshot(now).tpot_s(s.node, running)
        return mixed_step_s(s.arrivals_before_first, s.sent_at, s.first_chunk_at, same_step)
