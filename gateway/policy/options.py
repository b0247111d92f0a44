"""Each option's estimate for one turn, without look-ahead (pure): TTFT, interference, balance, tail, and
the limits that make an option infeasible.

``Nodes`` is what one decision sees: the healthy nodes not excluded, the estimator's snapshot and the
knobs. ``local_option``, ``pull_option`` and ``cold_option`` each return an :class:`OptionEstimate`;
``immediate`` all three.
The formulas are in costmodel.py's docstring and docs/cost-model.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from kvtether.gateway.policy.estimates import EstimatorSnapshot
from kvtether.gateway.policy.facts import NodeLoad, Option, OptionEstimate, TurnFacts
from kvtether.gateway.policy.knobs import PolicyKnobs
from kvtether.gateway.policy.stallquota import objective_s


@dataclass(frozen=True, slots=True)
class Nodes:
    prefills: tuple[NodeLoad, ...]  # healthy, not excluded
    decodes: tuple[NodeLoad, ...]  # healthy, not excluded
    est: EstimatorSnapshot
    knobs: PolicyKnobs
    # Look-ahead memo, per call of choose: after pull and after cold the next turn is the same situation.
    memo: dict[tuple[TurnFacts, str | None, int], float] = field(default_factory=dict)

    def decode(self, url: str | None) -> NodeLoad | None:
        return next((d for d in self.decodes if d.url == url), None) if url is not None else None


def tail_term(ttft: float, turn: TurnFacts, c: Nodes) -> float:
    if c.knobs.tail_weight == 0.0 or math.isinf(turn.ttft_tail_s):
        return 0.0
    return c.knobs.tail_weight * max(0.0, ttft - turn.ttft_tail_s)


def floor_block(tokens: int, block: int) -> int:
    return max(0, tokens // block * block)


def p_queue_s(c: Nodes, p: NodeLoad, turn: TurnFacts) -> float:
    # A P node's running requests are prefills still computing: a new one waits behind them as behind the
    # waiting ones (chunked prefill shares steps, which costs the same total time). On a pool instance only its
    # prefills are: its decodes share each step with the new prefill instead (prefill_leg).
    counted = c.est.queue_s(p.url, p.waiting + (p.prefilling if p.both else p.running))
    return max(counted, pool_queue_s(c, p, turn))


def pool_queue_s(c: Nodes, p: NodeLoad, turn: TurnFacts) -> float:
    """The compute a new prefill on pool instance `p` waits for (``pool_queue_observed``; else 0): what is left of
    the prefills running there, local turns of its own sessions and other sessions' legs alike, until each is
    seen to end. A count of the gateway's legs there missed the local turns: on the long documents at ×8, legs
    estimated at 0.85-1.5 s took 2-3 s."""
    if not (p.both and c.knobs.pool_queue_observed):
        return 0.0
    return c.est.queue_s(p.url, p.waiting) + turn.prefill_queue_s(p.url)


def d_leg_s(c: Nodes, d: NodeLoad) -> float:
    """D's part of a P/D turn after the KV arrived: its queue, then one decode step produces the first token."""
    return c.est.queue_s(d.url, d.waiting) + c.est.tpot_s(d.url, d.running + 1)


def new_pin_order(c: Nodes, d: NodeLoad) -> tuple[float, float]:
    """Where a session without a decode node starts (or restarts): the node with the fewest requests, those headed
    there included, then the one that would serve a first token soonest. Sessions are pinned from then on, so
    without the turns already on their way, first turns planned together all see the same idle node and pin
    there for good (decode_load). Ties go to the first in the configuration's order."""
    return decode_load(d), d_leg_s(c, d)


def d_cached_tokens(turn: TurnFacts, c: Nodes) -> int:
    """Tokens of the prompt the pinned D's prefix cache holds: the handle's blocks (verified), or the estimate."""
    held = max(turn.decode_cached_tokens, turn.reuse_tokens if turn.handle_valid else 0)
    # vLLM recomputes at least the last prompt token, and hits whole blocks only.
    return floor_block(min(held, turn.prompt_tokens - 1), c.knobs.block_size)


def keep_probability(d: NodeLoad, c: Nodes) -> float:
    """Probability that D's free (cached, unpinned) blocks survive until the next use: ~1 below the KV-usage
    knee, falling linearly to 0 at full usage (vLLM evicts free blocks LRU only when no free block is left)."""
    knee = c.knobs.evict_kv_usage_knee
    return 1.0 - min(1.0, max(0.0, (d.kv_usage - knee) / (1.0 - knee)))


def cached_on(turn: TurnFacts, d: NodeLoad, pinned: NodeLoad | None, c: Nodes) -> int:
    """Tokens of the prompt `d`'s prefix cache holds: the pinned D's (handle or estimate), or what another D
    kept of the session since the pin left it (expected, eviction discounted: a transfer's cost is linear
    in the tokens D lacks)."""
    if pinned is not None and d.url == pinned.url:
        return d_cached_tokens(turn, c)
    left = max((n for url, n in turn.decode_elsewhere if url == d.url), default=0)
    return floor_block(round(min(left, turn.prompt_tokens - 1) * keep_probability(d, c)), c.knobs.block_size)


def local_option(turn: TurnFacts, pinned: str | None, c: Nodes, now: bool = True) -> OptionEstimate:
    """`now`: this turn (False: a look-ahead turn, seconds later, when today's arrivals are long done)."""
    d = c.decode(pinned)
    starts_on_decode = ""  # why a dedicated decode node would start the session only as a rescue
    if d is None:
        # A pool instance may start (or restart) a session itself: the least busy one prefills the whole prompt.
        d = min((n for n in c.decodes if n.both), key=lambda n: new_pin_order(c, n), default=None)
        why = "no pinned decode node" if pinned is None else f"pinned decode {pinned} is down"
        if d is None and c.knobs.decode_ttft_rescue and c.knobs.ttft_objective_s is not None:
            # On P/D a session starts on P; a decode node prefills it whole only when P's queue alone would lose
            # the turn to the TTFT objective (costmodel._within_objective_over_a_quota).
            d = min(c.decodes, key=lambda n: new_pin_order(c, n), default=None)
            starts_on_decode = f"{why}: a session starts on a prefill node"
        if d is None:
            return OptionEstimate("decode_local", False, why)
        cached = 0
    else:
        cached = d_cached_tokens(turn, c)
    n = turn.prompt_tokens - cached
    compute = c.est.prefill_s(d.url, n, cached)
    # Chunked prefill: each of its steps also decodes the running batch, so it cannot beat that step time.
    steps = math.ceil(n / c.knobs.chunk_tokens)
    own = max(compute, steps * c.est.tpot_s(d.url, d.decoding + 1))
    wait = c.est.queue_s(d.url, d.waiting)
    # vLLM's chunked prefill gives a new prefill what the prefills already running on D leave of each step's token
    # budget: its first token waits for their compute (on a pool instance, pool_queue_s), but it may start decoding
    # while their last chunks still run, and then decodes beside their rest. So its answer's stall is judged from
    # the soonest it could start (answer_stalled, below): judged from after them, short answers were admitted
    # that decoded beside them (TPOT 41-46 ms against 25 on the long documents, pool ×16).
    soonest = wait + own
    ttft = max(soonest, pool_queue_s(c, d, turn) + own)
    stall, interference, over = prefill_stall(d, n, cached, steps, turn.stall_credit(d.url, pinned), c)
    priced = now and c.knobs.arrival_weight > 0.0  # off: not computed, so no reason names it
    blocks = blocked_s(d.arrivals, wait, ttft) if priced else 0.0
    interference += c.knobs.arrival_weight * blocks
    base = OptionEstimate("decode_local", True, "", False, ttft, interference, 0.0, None, d.url, 0, n, 0, stall,
                          beside_stall_s=beside_stall(d, n, cached, steps, c), tail_s=tail_term(ttft, turn, c),
                          pressure_s=preemption_risk_s(turn, d, c), blocks_s=blocks)
    if kv_pressed(d, c):
        return replace(base, feasible=False, soft=True, kv_limit=True,
                       why_not=f"D's KV usage {d.kv_usage:.2f} >= {c.knobs.local_kv_veto:g}: a local prefill may "
                               "preempt its running requests")
    limit, knob = ((c.knobs.pool_max_local_suffix_tokens, "pool_max_local_suffix_tokens") if d.both
                   else (c.knobs.max_local_suffix_tokens, "max_local_suffix_tokens"))
    if limit is not None and n > limit:
        return replace(base, feasible=False, soft=True, fixed_limit=True,
                       why_not=f"local suffix {n} tok > {knob} {limit}")
    over = starts_on_decode or over or answer_stalled(turn, d, soonest, c)
    if over:
        return replace(base, feasible=False, soft=True, why_not=over)
    return base


def answer_stalled(turn: TurnFacts, d: NodeLoad, starts_in_s: float, c: Nodes) -> str:
    """Why this turn's answer, decoding on `d` from `starts_in_s` on, would break the TPOT objective on account of
    prefills already running there (admitted before it, so no quota of it was charged), or ""."""
    pending = turn.pending_stall(d.url, starts_in_s)
    if pending <= 0.0:
        return ""
    cap = objective_s(turn.expected_output_tokens, c.est.tpot_s(d.url, d.decoding + 1), c.knobs.tpot_budget_s)
    if pending <= cap:
        return ""
    where = "D" if not d.both else d.url
    return (f"prefills running on {where} would stall this answer {pending:.3f}s, over the {cap:.3f}s its "
            f"{turn.expected_output_tokens} tokens may take within the TPOT objective")


def beside_stall(node: NodeLoad, n: int, cached: int, steps: int, c: Nodes) -> float:
    """The stall a request decoding on `node` takes from a prefill of `n` tokens after `cached` run there in
    `steps` engine steps: what of its compute does not hide under those steps' decode work (prefill_stall), at
    the node's batch or, when nothing decodes there yet, at a batch of one (whoever comes next)."""
    return max(0.0, c.est.prefill_s(node.url, n, cached) - steps * c.est.tpot_s(node.url, max(1.0, node.decoding)))


def prefill_stall(node: NodeLoad, n: int, cached: int, steps: int, credit: tuple[float, float],
                  c: Nodes) -> tuple[float, float, str]:
    """A prefill of `n` tokens after `cached` in `steps` engine steps on `node`, beside the requests decoding
    there (a decode-local turn on D, or a prefill leg on a pool instance): (the stall each of them takes, what
    that is worth in TTFT-seconds, the TPOT limit it breaks or "").

    What the running requests lose: a decode step is memory-bound (weights + KV read), so prefill work up to one
    step time per step rides along for free (roofline: a step costs max(compute, memory)); the rest stalls every
    one of them. The per-request constant counts too: on a MoE model it is mostly the expert weights a prefill
    chunk touches and a small decode batch does not (GLM-5: ~70 ms against a ~10 ms step); on a dense model it
    is about one step's weight read, which the decode step covers. `credit`: the tightest TPOT quota among
    them and its size (stallquota.py)."""
    running = node.decoding
    if running <= 0:
        return 0.0, 0.0, ""
    where = "D" if not node.both else node.url
    stall = beside_stall(node, n, cached, steps, c)
    credit_s, quota_s = credit
    interference = 0.0
    if stall:
        interference = (c.knobs.interference_weight * running + stall_price(credit_s, quota_s)) * stall
        held = min(max(0.0, node.holding_back), running)
        interference += max(0.0, c.knobs.holdback_weight - c.knobs.interference_weight) * held * stall
    # Per-request quotas: no request decoding there may lose more than its share of its own decode time.
    if stall > 0.0 and credit_s < stall:
        return stall, interference, (f"TPOT quota: a request decoding on {where} may absorb "
                                     f"{max(0.0, credit_s):.3f}s more stall (of {quota_s:.3f}s), this one is "
                                     f"{stall:.3f}s")
    # A decode node also keeps its running requests' inter-token time within the budget over a short window (no
    # hiccup a reader would notice), the smoothness P/D is run for. A pool instance is held to the objective
    # itself, per request (its quotas, capped by the budget): the pool trades that smoothness for TTFT.
    tpot = c.est.tpot_s(node.url, running) + stall / c.knobs.tpot_window_tokens
    if not (node.both and math.isfinite(credit_s)) and tpot > c.knobs.tpot_budget_s:
        return stall, interference, (f"TPOT of {where}'s {running:g} running {tpot:.3f}s > budget "
                                     f"{c.knobs.tpot_budget_s:.3f}s")
    return stall, interference, ""


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


def stall_price(credit_s: float, burst: float) -> float:
    """TTFT-seconds one second of D's stall costs on top of the interference weight: 0 while the tightest
    request's TPOT quota on D (`burst`) is full or none is kept, rising as it drains (burst/credit − 1: 1 at
    half, 3 at a quarter; at most 99, so a forced local turn on an overdrawn quota still has a finite score)."""
    if math.isinf(credit_s) or credit_s >= burst or burst <= 0.0:
        return 0.0
    return burst / max(credit_s, 0.01 * burst) - 1.0


def pd_option(option: Option, turn: TurnFacts, p: NodeLoad, d: NodeLoad, holder: str | None, reuse: int,
        d_cached: int, c: Nodes, pinned: NodeLoad | None = None) -> OptionEstimate:
    """A P/D turn on the given nodes: P pulls `reuse` tokens from `holder` (0: cold), D lacks the rest.
    `pinned`: the session's D, when `d` may be another one (rebalancing)."""
    p_cached = p_cached_tokens(turn, p.url, c)
    # vLLM's P reads only what its own cache lacks of the handle's tokens, and computes a read too short to
    # be worth it (count < kv_recompute_threshold) itself.
    pulled = max(0, reuse - p_cached) if holder is not None else 0
    if pulled < c.knobs.recompute_threshold_tokens:
        pulled = 0
    context = p_cached + pulled
    computed = turn.prompt_tokens - context
    read = c.est.transfer_s(holder, p.url, pulled) if holder is not None else 0.0
    prefill, stall, interference, over = prefill_leg(turn, p, computed, context, pinned, c)
    beside = beside_stall(p, computed, context, math.ceil(computed / c.knobs.chunk_tokens), c) if p.both else 0.0
    back_tokens = turn.prompt_tokens - d_cached
    arrive = p_queue_s(c, p, turn) + read + prefill  # when D gets the request
    d_read = c.est.transfer_s(p.url, d.url, back_tokens)
    ttft = arrive + d_read + d_leg_s(c, d)
    balance = balance_term(turn, d, pinned, c) if pinned is not None else 0.0
    est = OptionEstimate(option, True, "", False, ttft, interference, 0.0, p.url, d.url, reuse, computed,
                         pulled + back_tokens, stall, beside_stall_s=beside, balance_s=balance,
                         tail_s=tail_term(ttft, turn, c), pressure_s=preemption_risk_s(turn, d, c),
                         arrive_s=arrive, d_read_s=d_read)
    over = over or answer_stalled(turn, d, ttft, c)
    if not over:
        return est
    # The leg's own instance short of memory is the KV-pressure veto (prefill_leg), whatever else is over.
    return replace(est, feasible=False, soft=True, why_not=over, kv_limit=leg_kv_vetoed(p, c))


def leg_kv_vetoed(p: NodeLoad, c: Nodes) -> bool:
    """Whether a prefill leg on `p` is under the KV-pressure veto: a pool instance with answers decoding and its
    memory short (a dedicated P, or an instance decoding nothing, has no answers to preempt)."""
    return p.both and p.decoding > 0 and kv_pressed(p, c)


def prefill_leg(turn: TurnFacts, p: NodeLoad, computed: int, context: int, pinned: NodeLoad | None,
                c: Nodes) -> tuple[float, float, float, str]:
    """P's compute for a prefill leg: (seconds, the stall its decoding requests take, what that is worth, the
    limit it breaks or ""). A dedicated P runs prefills only; a pool instance runs the leg in the steps that
    also decode its own sessions, which it slows (as a decode-local turn would) and which pace it."""
    seconds = c.est.prefill_s(p.url, computed, context)
    if leg_kv_vetoed(p, c):
        return seconds, 0.0, 0.0, (f"{p.url}'s KV usage {p.kv_usage:.2f} >= {c.knobs.local_kv_veto:g}: a prefill "
                                   "there may preempt its decoding requests")
    if not p.both or p.decoding <= 0:
        return seconds, 0.0, 0.0, ""
    steps = math.ceil(computed / c.knobs.chunk_tokens)
    seconds = max(seconds, steps * c.est.tpot_s(p.url, p.decoding + 1))
    credit = turn.stall_credit(p.url, pinned.url if pinned is not None else None)
    stall, interference, over = prefill_stall(p, computed, context, steps, credit, c)
    return seconds, stall, interference, over


def p_cached_tokens(turn: TurnFacts, p_url: str, c: Nodes) -> int:
    """Tokens of the prompt P's prefix cache holds: the session's copy there, or the shared floor."""
    mine = max((n for url, n in turn.prefill_cached if url == p_url), default=0)
    held = max(turn.prefill_cached_tokens, mine)
    return floor_block(min(held, turn.prompt_tokens - 1), c.knobs.block_size)


def cheapest(cands: Iterable[OptionEstimate]) -> OptionEstimate | None:
    """The best P/D pairing: the cheapest within limits, else (to force when nothing else can run the turn) the
    cheapest over a soft limit. A pairing's interference is a pool instance's prefill leg stalling its decodes."""
    pool = list(cands)
    within = [o for o in pool if o.feasible] or [o for o in pool if o.soft]
    # Ties: staying before moving, then the configuration's order (the candidates come in it; min keeps the first).
    return min(within, key=lambda o: (o.ttft_s + o.interference_s + o.balance_s + o.tail_s + o.pressure_s,
                                      o.balance_s != 0.0), default=None)


def decode_choices(pinned: NodeLoad, c: Nodes) -> tuple[NodeLoad, ...]:
    """Where a P/D turn of a session pinned to `pinned` may decode: there, or (rebalancing on) any D. A session
    on a pool instance stays there unless that instance is overloaded against the pool (`pool_overloaded`) or
    short of memory (`kv_pressed`); even then it moves only when the move is cheaper (the KV follows it: the
    prefill leg pulls the history, the new instance reads the prompt)."""
    if not c.knobs.rebalance_decode or (pinned.both and not pool_overloaded(pinned, c)
                                        and not kv_pressed(pinned, c)):
        return (pinned,)
    return (pinned, *(d for d in c.decodes if d.url != pinned.url))


def pool_overloaded(home: NodeLoad, c: Nodes) -> bool:
    """Whether the pool instance `home` is overloaded against the pool, in the manner of the SGLang / vLLM
    routers' cache-aware policy: its load exceeds the lightest instance's by more than ``pool_balance_abs``
    requests *and* by a factor of more than ``pool_balance_rel``. Session affinity is what keeps a history in
    one prefix cache: below both thresholds a session never moves."""
    lightest = min((decode_load(d) for d in c.decodes if d.both), default=decode_load(home))
    load = decode_load(home)
    return load - lightest > c.knobs.pool_balance_abs and load > c.knobs.pool_balance_rel * lightest


def kv_pressed(d: NodeLoad, c: Nodes) -> bool:
    """Whether D is short of memory: its KV usage at the mark where a local prefill there is vetoed."""
    return d.kv_usage >= c.knobs.local_kv_veto


def preemption_risk_s(turn: TurnFacts, d: NodeLoad, c: Nodes) -> float:
    """What decoding this turn's answer on `d` risks when `d`'s memory runs short, in TTFT-seconds.

    vLLM preempts a running request when a decode step cannot get a block, the most recently scheduled first
    (this answer, likely), and recomputes its whole sequence when it is scheduled again. So the expected cost is
    the prompt's prefill on `d` times the likelihood that its blocks run out: ~0 below the usage knee where
    cached-but-free blocks still cover new ones, rising linearly to 1 at full usage (:func:`keep_probability`'s
    complement). What moves a session off an instance short of memory, and keeps a move away from another."""
    risk = (1.0 - keep_probability(d, c)) * c.knobs.preemption_weight
    if risk <= 0.0:
        return 0.0
    return risk * c.est.prefill_s(d.url, turn.prompt_tokens + turn.expected_output_tokens)


def decode_load(d: NodeLoad) -> float:
    # Turns already headed to D count: without them, turns planned while another's prefill leg runs all
    # see the same light D and herd onto it.
    return d.running + d.waiting + d.arriving


def balance_term(turn: TurnFacts, d: NodeLoad, pinned: NodeLoad, c: Nodes) -> float:
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

    def cost(n: NodeLoad) -> float:
        per_seq = max(0.0, c.est.tpot_s(n.url, 2.0) - c.est.tpot_s(n.url, 1.0))
        others = c.knobs.interference_weight * decode_load(n) * per_seq * out
        return others + out * c.est.tpot_s(n.url, decode_load(n) + 1.0)

    return cost(d) - cost(pinned)


def pull_option(turn: TurnFacts, pinned: str | None, c: Nodes) -> OptionEstimate:
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
    # A pool instance never prefills for itself (that is decode_local) nor pulls from itself.
    best = cheapest(pd_option("pull", turn, p, dd, d.url, reuse, cached_on(turn, dd, d, c), c, d)
                    for p in ps for dd in decode_choices(d, c) if p.url not in (dd.url, d.url))
    if best is None:
        return no("no prefill node but the decode node itself")
    p_url = best.prefill_url or ""
    # P reads after its queue: the handle must still be alive (with the engine's decline margin) by then.
    reads_at = turn.handle_age_s + p_queue_s(c, next(p for p in ps if p.url == p_url), turn)
    if reads_at + c.knobs.handle_margin_s >= c.knobs.handle_ttl_s:
        return no(f"handle expires: age {turn.handle_age_s:.0f}s + queue, ttl {c.knobs.handle_ttl_s:.0f}s")
    return best


def cold_option(turn: TurnFacts, pinned: str | None, c: Nodes) -> OptionEstimate:
    if not c.prefills:
        return OptionEstimate("cold", False, "no healthy prefill node")
    home = c.decode(pinned)
    if home is not None:
        choices = decode_choices(home, c)
    else:
        d = min(c.decodes, key=lambda n: new_pin_order(c, n), default=None)
        if d is None:
            return OptionEstimate("cold", False, "no healthy decode node")
        choices = (d,)
    best = cheapest(pd_option("cold", turn, p, dd, None, 0, cached_on(turn, dd, home, c), c, home)
                    for p in c.prefills for dd in choices if p.url != dd.url)
    if best is None:
        return OptionEstimate("cold", False, "no prefill node but the decode node itself")
    return best


def immediate(turn: TurnFacts, pinned: str | None, c: Nodes, now: bool = True) -> tuple[OptionEstimate, ...]:
    return (local_option(turn, pinned, c, now), pull_option(turn, pinned, c), cold_option(turn, pinned, c))

