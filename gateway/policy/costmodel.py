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
    pull  = queue_P(waiting_P+running_P) + transfer(D→P, reuse−cached_P) + prefill_P(prompt−context | context)
            + transfer(P→D, prompt−cached_D) + queue_D(waiting_D) + tpot_D(running_D+1),
            context = cached_P + what P read (a read under kv_recompute_threshold is computed instead)
    cold  = queue_P(...) + prefill_P(prompt−cached_P | cached_P) + transfer(P→D, prompt−cached_D)
            + queue_D(waiting_D) + tpot_D(running_D+1)

Score = TTFT + interference + horizon + balance + tail (the policy minimises the score, reports both):

- interference (local only) = ``interference_weight`` × running_D × stall, stall = max(0, local prefill
  time − steps·tpot_D(running_D)): every request decoding on D is delayed by the part of the local
  prefill that does not hide under its memory-bound decode steps. P's queue is FIFO, so work sent to P does
  not delay requests already there; that asymmetry is why only D's batch is charged.
- balance (auto, ``rebalance_decode``; P/D options only) = what decoding the answer on a D other than the
  pinned one saves, load for load (negative on a lighter D): see ``options.balance_term``. The pull still reads the
  history from the pinned D, but the new D lacks the whole prompt (the TTFT counts that transfer).
- tail = ``tail_weight`` × the estimated TTFT above the tail threshold (recent turns' quantile), so a turn
  already in the tail is not moved to a lighter D that lacks its history.
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
must be able to absorb the stall within its share of its decode time, stallquota.py); the TPOT budget
(running requests' mean inter-token time over their next ``tpot_window_tokens`` tokens, local prefill stall
included); pull needs a valid handle on a live pinned D, reuse ≥ vLLM's ``kv_recompute_threshold``, a
bidirectional P, and enough handle lifetime left to outlast P's queue.

Modules: ``facts`` (what goes in and out), ``knobs`` (parameters), ``options`` (each option's estimate),
``lookahead`` (the horizon term), this one (the choice and its reason).

No I/O, no clock: the shell gathers the facts and the snapshot, executes the decision, records ``reason``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvtether.gateway.policy.estimates import EstimatorSnapshot
from kvtether.gateway.policy.facts import (
    OPTIONS,
    CostDecision,
    NodeLoad,
    NoFeasibleOption,
    Option,
    OptionEstimate,
    TurnFacts,
)
from kvtether.gateway.policy.knobs import PolicyKnobs
from kvtether.gateway.policy.lookahead import scored
from kvtether.gateway.policy.options import Nodes, cached_on, p_cached_tokens


def choose(
    turn: TurnFacts,
    pinned_decode: str | None,
    prefills: Sequence[NodeLoad],
    decodes: Sequence[NodeLoad],
    estimates: EstimatorSnapshot,
    knobs: PolicyKnobs | None = None,
    *,
    exclude: frozenset[str] = frozenset(),
) -> CostDecision:
    """Place one turn. `pinned_decode` holds the session's history (and its handle, if `turn.handle_valid`).

    `exclude`: nodes that just failed this turn (retry). Raises :class:`NoFeasibleOption` when no node can
    serve the turn.
    """
    knobs = knobs or PolicyKnobs()
    c = Nodes(
        tuple(p for p in prefills if p.healthy and p.url not in exclude),
        tuple(d for d in decodes if d.healthy and d.url not in exclude),
        estimates,
        knobs,
    )
    if not c.decodes:
        raise NoFeasibleOption("no healthy decode node")
    opts = scored(turn, pinned_decode, c, knobs.horizon_turns)
    pool = frozenset(n.url for n in (*c.prefills, *c.decodes) if n.both)
    rescue = _rescue(opts, knobs, pool)
    pick, greedy, forced = (rescue, None, True) if rescue is not None else _pick(opts, knobs)
    assert pick.decode_url is not None
    return CostDecision(
        option=pick.option,
        reason=_reason(pick, opts, turn, c, forced, greedy, pinned_decode),
        estimates_s={o.option: round(o.ttft_s, 6) for o in opts if o.feasible},
        prefill_url=pick.prefill_url,
        decode_url=pick.decode_url,
        reuse_tokens=pick.reuse_tokens if pick.option == "pull" else 0,
        scores_s={o.option: round(o.score_s, 6) for o in opts if o.feasible},
        options=opts,
        forced=forced,
        rescued=rescue is not None,
        greedy_option=greedy,
        arrive_s=pick.arrive_s,
        d_read_s=pick.d_read_s,
    )


def _rescue(opts: Sequence[OptionEstimate], knobs: PolicyKnobs, pool: frozenset[str]) -> OptionEstimate | None:
    """The option run over a quota to keep the TTFT objective, if any: only when every option within the limits
    is past the objective; over a pool instance's quota with ``ttft_over_quota``, a local turn over a decode node's
    with ``decode_ttft_rescue``. `pool`: the pool instances' urls."""
    objective = knobs.ttft_objective_s
    if objective is None or not (knobs.ttft_over_quota or knobs.decode_ttft_rescue) \
            or any(o.feasible and o.ttft_s <= objective for o in opts):
        return None
    return _within_objective_over_a_quota(opts, objective, pool, knobs)


def _pick(opts: Sequence[OptionEstimate], knobs: PolicyKnobs) -> tuple[OptionEstimate, Option | None, bool]:
    """The cheapest feasible option, what it would be without the look-ahead, and whether it was forced (over
    a limit, because nothing else could run the turn)."""
    feasible = [o for o in opts if o.feasible]
    objective = knobs.ttft_objective_s
    if objective is not None and any(o.ttft_s <= objective for o in feasible):
        # The look-ahead's trade stops at the TTFT objective: options over it go only when none is within it.
        feasible = [o for o in feasible if o.ttft_s <= objective]
    pick = min(feasible, key=lambda o: (o.score_s, OPTIONS.index(o.option)), default=None)
    greedy: Option | None = None
    if pick is not None and knobs.horizon_turns > 0:
        greedy = min(feasible, key=lambda o: (o.ttft_s + o.interference_s, OPTIONS.index(o.option))).option
    if pick is not None:
        return pick, greedy, False
    # Every P is down (or the only way left is over a limit): run it locally rather than fail the turn.
    local = next(o for o in opts if o.option == "decode_local")
    if not (local.feasible or local.soft):
        raise NoFeasibleOption("; ".join(f"{o.option}: {o.why_not}" for o in opts))
    return local, greedy, True


def _within_objective_over_a_quota(opts: Sequence[OptionEstimate], objective: float,
                                   pool: frozenset[str], knobs: PolicyKnobs) -> OptionEstimate | None:
    """When every option within the limits is estimated over the TTFT objective, the cheapest option whose prefill
    runs on a pool instance (in `pool`) that is within it and over a TPOT quota (or beside a running prefill)
    only, if any (``PolicyKnobs.ttft_over_quota``).

    Such a turn is lost to goodput whichever option within the limits runs it, and under load it is lost twice:
    its prefill joins a queue that every turn placed after it waits behind, so one turn over the objective makes
    the next ones over it too (the long documents at ×8 in the pool: legs estimated at 8 s, then taking 11 s).
    Run within the objective, it keeps its own turn at the price of a stall over the quota of the answers
    decoding beside it. A quota is a share of each answer's decode time capped at the TPOT objective, so going
    over it costs those answers TPOT, not necessarily their objective. Never over a fixed cap (the operator's)
    or the KV-pressure veto (a preempted answer is recomputed whole).

    On a pool instance (``ttft_over_quota``): there an answer's quota is the most stall its TPOT objective allows
    (``pool_stall_share`` 1), the rule's premise. A decode node's quota is a share of the answer's decode time
    kept for smoothness (``request_stall_share``): a local turn goes over it only with ``decode_ttft_rescue``,
    which also lets a session without a decode node start on one (P/D sends it to P otherwise)."""
    def eligible(o: OptionEstimate) -> bool:
        where = o.decode_url if o.option == "decode_local" else o.prefill_url
        if where in pool:
            return knobs.ttft_over_quota
        return knobs.decode_ttft_rescue and o.option == "decode_local"

    within = [o for o in opts if not o.feasible and o.soft and not o.fixed_limit and not o.kv_limit
              and o.ttft_s <= objective and eligible(o)]
    return min(within, key=lambda o: (o.score_s, OPTIONS.index(o.option)), default=None)


def _reason(pick: OptionEstimate, opts: Sequence[OptionEstimate], turn: TurnFacts, c: Nodes, forced: bool,
            greedy: Option | None, pinned: str | None = None) -> str:
    """E.g. ``auto -> pull: pull 0.210s < decode_local 0.260s < cold 0.900s [ttft …] (suffix …; …)``."""
    feasible = sorted((o for o in opts if o.feasible), key=lambda o: (o.score_s, OPTIONS.index(o.option)))
    head = f"auto -> {pick.option}" + (" (forced)" if forced else "") + ": "
    head += " < ".join(f"{o.option} {o.score_s:.3f}s" for o in feasible) or "no option within limits"
    detail = []
    if any(o.interference_s or o.horizon_s or o.balance_s or o.tail_s or o.pressure_s for o in feasible):
        detail.append("ttft " + ", ".join(f"{o.option} {o.ttft_s:.3f}s" for o in feasible))
        detail += [f"{o.option} interference {o.interference_s:.3f}s" for o in feasible if o.interference_s]
        detail += [f"{o.option} holds up arriving turns {o.blocks_s:.3f}s" for o in feasible if o.blocks_s]
        detail += [f"{o.option} on {o.decode_url} balance {o.balance_s:.3f}s" for o in feasible if o.balance_s]
        detail += [f"{o.option} tail {o.tail_s:.3f}s (over {turn.ttft_tail_s:.3f}s)" for o in feasible if o.tail_s]
        detail += [f"{o.option} on {o.decode_url} preemption risk {o.pressure_s:.3f}s" for o in feasible
                   if o.pressure_s]
        detail.append("next turn " + ", ".join(f"{o.option} {o.horizon_s:.3f}s" for o in feasible))
    if greedy is not None and greedy != pick.option:
        detail.append(f"horizon: {pick.option} over greedy {greedy}")
    objective = c.knobs.ttft_objective_s
    over = [o.option for o in feasible if objective is not None and o.ttft_s > objective]
    if objective is not None and over and pick.ttft_s <= objective:
        if pick.feasible:
            detail.append(f"held to the TTFT objective {objective:.3f}s: {', '.join(over)} over it")
        else:
            detail.append(f"over its limit to keep the TTFT objective {objective:.3f}s: {', '.join(over)} "
                          "within the limits but over it")
    facts = [f"suffix {turn.suffix_tokens} tok", f"reuse {turn.reuse_tokens if turn.handle_valid else 0} tok"]
    d = c.decode(pick.decode_url)
    if d is not None:
        facts.append(f"D {d.running:g} running/{d.waiting:g} waiting"
                     + (f"/{d.arriving:g} arriving" if d.arriving else ""))
    home = c.decode(pinned)
    if home is not None and d is not None and d is not home:
        kept = cached_on(turn, d, home, c)
        facts.append(f"moves the pin from {home.url} ({home.running:g} running/{home.waiting:g} waiting)"
                     + (f", D still holds {kept} tok of the history" if kept else ""))
    if not math.isinf(turn.request_stall_credit_s):
        facts.append(f"D's tightest TPOT quota {turn.request_stall_credit_s:.3f}s of {turn.request_stall_quota_s:.3f}s")
    # The P this turn uses, or (decode_local) the one the best P/D option would have used: its queue is
    # often why the turn stayed on D.
    p_url = pick.prefill_url or next((o.prefill_url for o in feasible if o.prefill_url), None)
    p = next((n for n in c.prefills if n.url == p_url), None)
    if p is not None:
        held = p_cached_tokens(turn, p.url, c)
        facts.append(f"P {p.running:g} running/{p.waiting:g} waiting"
                     + (f", its cache holds {held} tok of the prompt" if held else ""))
    facts += [f"{o.option} n/a: {o.why_not}" for o in opts if not o.feasible]
    out = head
    if detail:
        out += " [" + "; ".join(detail) + "]"
    return out + " (" + "; ".join(facts) + ")"
