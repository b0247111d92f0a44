"""How much more each request decoding on a decode node may be stalled by decode-local prefills (pure).

A TPOT objective is over requests: the p95 of every request's time per output token. A request's TPOT rises
by the stall it absorbed over its answer's length, so what a TPOT p95 sees is how the stalls are *spread*
over requests, not only their total. A node-level share would bound the total and leave to chance where
stalls land: the unlucky requests that decode through a burst of local prefills make the p95. Here each
request decoding on D gets a quota of its own instead: ``share`` of its expected decode time (answer tokens
× D's step time when it began). A decode-local turn may run only if every request decoding on D can still
absorb its stall, and running it charges the stall to each of them. No request then loses more than
``share`` of its decode time, so the same TPOT p95 leaves room for more local turns than a node-level share
does (docs/placement.md). A quota is also capped at what keeps the request's TPOT within the objective
(``tpot_objective_s``): for short answers that, not the share, is the binding bound.

A request enters when it is placed on D (a decode-local turn, or a P/D turn whose prefill leg is still on P)
and leaves when its leg ends: a local prefill admitted while it is still prefilling on D or on its way there
runs on into its first decode steps, so it must fit that request's quota too. The other way round, a request
placed on D while a prefill admitted before it still runs there takes the rest of that prefill's stall
(:class:`RunningPrefill`): its placement must leave it within the objective, and its quota starts with that
much already absorbed. Counting the stall before its
first token as well is conservative by at most that part. A decode-local turn's own prefill is not charged
to it. Requests this gateway did not send are not seen: with several gateways in front of the same D, each
sees only its own.

No clock, no I/O: the shell keeps the exposures per node and passes plain values.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import TypeVar

K = TypeVar("K")


@dataclass(frozen=True, slots=True)
class Exposure:
    """One request decoding on D: the stall it may absorb in all (`quota_s`) and what it already has."""

    quota_s: float
    absorbed_s: float = 0.0
    # The most stall it can take and still meet the TPOT objective (objective_s); past it the answer is lost to
    # goodput whatever comes next, so its quota no longer holds other turns back (credit). inf: never lost (no
    # objective, or the rule off: PolicyKnobs.release_lost_answers).
    lost_after_s: float = math.inf

    @property
    def headroom_s(self) -> float:
        return self.quota_s - self.absorbed_s

    @property
    def lost(self) -> bool:
        return self.absorbed_s > self.lost_after_s


@dataclass(frozen=True, slots=True)
class Credit:
    """What D's decoding requests can still absorb: the least headroom among them (`credit_s`) and that
    request's whole quota (`quota_s`: the budget's size, for its shadow price). Both inf: nobody decoding."""

    credit_s: float = math.inf
    quota_s: float = math.inf


def quota_s(share: float, answer_tokens: int, step_s: float, tpot_objective_s: float = math.inf) -> float:
    """The stall a request of `answer_tokens` decoding at `step_s` per token may absorb: `share` of its decode
    time (tokens after the first; the first is the prefill's), and never more than keeps its TPOT (step time
    plus stall over those tokens) within `tpot_objective_s`. The second bound is what a short answer needs: six
    tokens at 7 ms share one 250 ms local prefill into a 57 ms TPOT."""
    if not 0.0 <= share <= 1.0:
        raise ValueError("share must be in [0, 1]")
    intervals = max(1, answer_tokens - 1)
    step = max(0.0, step_s)
    return min(share * intervals * step, max(0.0, tpot_objective_s - step) * intervals)


@dataclass(frozen=True, slots=True)
class RunningPrefill:
    """A prefill admitted on a node and still running there (a decode-local turn, or a pool instance's prefill
    leg), as placed: when it should end (the caller's clock), how long before that its stall comes (its compute,
    `duration_s`: the end of its run, after a leg's read or a local turn's admission, which stall nobody), and
    the stall it spreads over the requests decoding beside it in that time. A request that starts decoding
    before the window opens takes all of it: spread evenly over the whole run instead, a leg whose read took
    most of it showed an answer placed meanwhile a fraction of a stall it then took whole.

    It runs until the gateway sees it end (the local turn's first token, the prefill leg's answer), not until
    its estimate says so (:meth:`as_of`)."""

    ends_at: float
    duration_s: float
    stall_s: float
    # The engine steps it computes in (its tokens over the step budget): each stalls everyone decoding then by its
    # part of `stall_s`, whole, so an answer decoding through any part of a step takes all of it. 0: evenly, as
    # over very many steps.
    steps: int = 0

    def as_of(self, now: float) -> RunningPrefill:
        """Itself as known at `now`, still unseen: past its estimated end by `x`, it was underestimated by at least
        that, and with nothing else known as much again is the median of what remains (the Copernican estimate).
        So it is expected to end `x` after `now`, the time its stall comes in to last ``duration_s + 2x``, and its
        stall to keep its rate over that time, in as many steps."""
        x = now - self.ends_at
        if x <= 0.0:
            return self
        if self.duration_s <= 0.0:
            return replace(self, ends_at=now + x)
        run = self.duration_s + 2.0 * x
        return RunningPrefill(now + x, run, self.stall_s * run / self.duration_s, self.steps)

    def remaining_share(self, at: float) -> float:
        """The share of its stall still to come at `at`: its steps not yet over, the one in flight whole."""
        if self.duration_s <= 0.0:
            return 0.0 if at >= self.ends_at else 1.0
        left = min(1.0, max(0.0, (self.ends_at - at) / self.duration_s))
        if self.steps < 1:
            return left
        return math.ceil(left * self.steps - 1e-9) / self.steps

    def remaining_s(self, at: float) -> float:
        """The part of its stall still to come at `at` (spread evenly over its run)."""
        return self.stall_s * self.remaining_share(at)


def pending_s(prefills: Iterable[RunningPrefill], at: float) -> float:
    """The stall a request decoding on the node from `at` on takes from the prefills already running there: it
    was not there when they were admitted, so no quota of it was charged, yet it waits out their remaining
    chunks like everyone decoding there."""
    return sum(p.remaining_s(at) for p in prefills)


def objective_s(answer_tokens: int, step_s: float, tpot_objective_s: float) -> float:
    """The most stall an answer of `answer_tokens` decoding at `step_s` may take and keep its TPOT within
    `tpot_objective_s` (its quota's cap, :func:`quota_s`, at any share)."""
    return max(0.0, tpot_objective_s - max(0.0, step_s)) * max(1, answer_tokens - 1)


def credit(exposures: Iterable[Exposure]) -> Credit:
    """The tightest headroom among the answers that can still meet their TPOT objective. One already past it
    (charged more stall than its objective allows, :attr:`Exposure.lost`) is not protected any more: refusing a
    turn for its sake would save nothing and cost the turn (on the long documents at ×8, quotas seconds
    overspent held every turn of an instance off it)."""
    tightest = min((e for e in exposures if not e.lost), key=lambda e: e.headroom_s, default=None)
    return Credit() if tightest is None else Credit(tightest.headroom_s, tightest.quota_s)


def absorb(exposures: Mapping[K, Exposure], stall_s: float) -> dict[K, Exposure]:
    """Every request decoding on D after a local prefill that stalls them `stall_s` seconds."""
    stall = max(0.0, stall_s)
    return {k: replace(e, absorbed_s=e.absorbed_s + stall) for k, e in exposures.items()}
