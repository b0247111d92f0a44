"""Placing a turn: ``policy.placement.plan`` (pure) with the live state it reads — the cluster's load view, the
learned estimates, the per-request TPOT quotas — its decision on the ``kvtether.plan`` span and in the metrics.

Also what a re-placement starts from (the turn gone cold after a failed leg), the round-robin counter the
reference policy reads, and the policy's parameters as configured.
"""

from __future__ import annotations

import math
from dataclasses import replace

from kvtether.gateway import telemetry as T
from kvtether.gateway.config import GatewayConfig
from kvtether.gateway.errors import GatewayError
from kvtether.gateway.policy.deferral import DeferralRecord, could_wait, deferral_s
from kvtether.gateway.policy.estimates import EstimatorSeeds, LearningParams
from kvtether.gateway.policy.knobs import PolicyKnobs
from kvtether.gateway.policy.peers import PeerKnobs
from kvtether.gateway.policy.placement import (
    ClusterView,
    HandleAction,
    HandleState,
    NoCapacity,
    Plan,
    Turn,
    plan,
    plan_aggregated,
)
from kvtether.gateway.turn.context import Placement, Services, TurnContext
from opentelemetry import trace


class Deferred(Exception):
    """The turn's placement is not run: every option is over a limit that may clear; place it again after
    `wait_s` (policy/deferral.py). Nothing was charged for it."""

    def __init__(self, wait_s: float) -> None:
        super().__init__(f"deferred {wait_s:.3f}s")
        self.wait_s = wait_s


class Placer:
    def __init__(self, sv: Services, knobs: PolicyKnobs, peers: PeerKnobs) -> None:
        self.sv, self.knobs, self.peer_knobs = sv, knobs, peers
        self._rr = 0
        self.deferrals = DeferralRecord()  # how this gateway's recent waits ended (policy/deferral.py)

    def next_rr(self) -> int:
        self._rr += 1
        return self._rr - 1

    def place(self, ctx: TurnContext, turn: Turn, exclude: set[str], replacing: Placement | None,
              waited_s: float | None = None) -> tuple[Plan, ClusterView, tuple[str, int] | None,
                                                      tuple[str, int] | None]:
        """The turn's plan, the load view it was made on, its entry in D's TPOT quotas (`replacing`'s left) and
        the prefill it leaves running beside a node's decodes until seen to end (Learning.admitted), with the
        nodes found failing (`exclude`) left out. `waited_s`: the turn may wait for a limit to clear,
        having waited that long already; raises Deferred (nothing charged) when it should wait more."""
        sv = self.sv
        now = sv.clock()
        quotas = sv.learning.quota_credit(turn.pinned_decode)
        # A pool instance's decoding requests take the stall of a prefill leg run there for another session.
        pool = tuple((url, q.credit_s, q.quota_s) for url in sv.cluster.pool_urls()
                     if url != turn.pinned_decode and (q := sv.learning.quota_credit(url)).credit_s != float("inf"))
        turn = replace(turn, exclude=frozenset(exclude), ttft_tail_s=sv.learning.tail_threshold(),
                       request_stall_credit_s=quotas.credit_s, request_stall_quota_s=quotas.quota_s,
                       stall_credits=pool, running_prefills=sv.learning.prefills_running(now))
        with sv.tracer.start_as_current_span(T.SPAN_PLAN, context=ctx.parent_ctx, kind=T.KIND_INTERNAL) as span:
            view = sv.cluster.view(now)
            try:
                # The peer rules match D's prefix cache in its own blocks, and the cost model floors its cached
                # prefix to them (known once D was polled: 16 on GPUs, 128 on vLLM's CPU backend).
                block = sv.cluster.block_size(turn.pinned_decode or "")
                peers = replace(self.peer_knobs, block_size=block)
                knobs = self.knobs if block == self.knobs.block_size else replace(self.knobs, block_size=block)
                p = plan(turn, view, sv.learning.snapshot(now), knobs, peers)
            except NoCapacity as exc:
                span.set_attribute(T.ERROR_TYPE, "no_capacity")
                raise self.no_capacity(exc) from None
            wait = self._wait_s(p, waited_s)
            if wait > 0.0:  # a wait is no error: the span ends as it is, then the turn is told to wait
                T.set_attrs(span, {T.ATTR_POLICY: turn.policy, T.ATTR_PLAN_DEFERS: True,
                                   T.ATTR_PLAN_DEFERRED_S: wait, T.ATTR_PLAN_REASON: p.reason})
            else:
                running = self._placed(span, turn, p, now, waited_s)
        if wait > 0.0:
            raise Deferred(wait)
        # From here the answer is headed for D: a local prefill admitted before its first token still runs on into
        # its decode steps (policy/stallquota.py), so its TPOT quota is kept from its placement on.
        exposure = sv.enter_decoding(p.decode, turn.expected_output_tokens, replacing, first_token_in(p))
        held = sv.cluster.nodes.get(p.decode)
        T.set_attrs(ctx.span, {T.ATTR_PLAN_ACTION: p.action.value, T.ATTR_PLAN_REASON: p.reason,
                               T.ATTR_DECODE_HELD_KV_TOKENS: held.held_kv_tokens if held is not None else None})
        return p, view, exposure, running

    def _wait_s(self, p: Plan, waited_s: float | None) -> float:
        """How long the turn waits before it is placed again (0: it runs now). A turn that has not waited yet
        waits only as the record of recent waits allows; one already waiting waits its time out."""
        if waited_s is None or not could_wait(p.decision, self.knobs):
            return 0.0
        if waited_s <= 0.0:
            waits, self.deferrals = self.deferrals.waits(self.knobs)
            if not waits:
                self.sv.metrics.deferred_turns.labels("skipped").inc()
                return 0.0
        return deferral_s(p.decision, waited_s, self.knobs)

    def _placed(self, span: trace.Span, turn: Turn, p: Plan, now: float,
                waited_s: float | None) -> tuple[str, int] | None:
        """The plan that runs: counted, told to the learning, on its span (with the wait before it, if any); the
        prefill it leaves running, if any."""
        if waited_s:
            self._deferred(p, waited_s)
            span.set_attribute(T.ATTR_PLAN_DEFERRED_S, waited_s)
        running = self._count(p, now)
        if p.re_placed:
            # The session leaves its node: counted by why (a draining or vanished node, a failed one, rebalancing).
            moved = self.sv.cluster.move_reason(turn.pinned_decode)
            self.sv.metrics.session_moves.labels(moved).inc()
            span.set_attribute(T.ATTR_MOVE_REASON, moved)
        if p.decision is not None:
            T.set_attrs(span, T.cost_attributes(p.decision.trace_attributes()))
        T.set_attrs(span, {T.ATTR_POLICY: turn.policy, T.ATTR_PLAN_ACTION: p.action.value,
                           T.ATTR_PLAN_REASON: p.reason, T.ATTR_PLAN_REASON_BUCKET: p.bucket,
                           T.ATTR_PREFILL: p.prefill, T.ATTR_DECODE: p.decode,
                           T.ATTR_HANDLE_OUTCOME: p.handle_outcome, T.ATTR_REUSE_TOKENS: p.reuse_tokens,
                           T.ATTR_RE_PLACED: p.re_placed})
        return running

    def _count(self, p: Plan, now: float) -> tuple[str, int] | None:
        """The decision told to the learning (the estimated stall of a decode-local turn, or of a prefill leg on a
        pool instance) as of `now`, the clock the plan was made on, and counted by its action and reason bucket."""
        sv = self.sv
        stall, running = sv.learning.admitted(p, now)
        sv.metrics.placement_decisions.labels(p.action.value, p.bucket).inc()
        if p.decision is not None and p.action is HandleAction.DECODE_LOCAL:
            sv.metrics.decode_stall.labels(p.decode).inc(stall)
        elif p.prefill is not None and stall > 0.0:
            sv.metrics.decode_stall.labels(p.prefill).inc(stall)
        return running

    def _deferred(self, p: Plan, waited_s: float) -> None:
        """A turn placed after waiting for a limit to clear: counted by whether it then ran within the limits."""
        forced = p.decision is not None and p.decision.forced
        self.deferrals = self.deferrals.ended(not forced, self.knobs)
        self.sv.metrics.deferred_turns.labels("forced" if forced else "cleared").inc()
        self.sv.metrics.deferred_seconds.inc(waited_s)

    def aggregated(self, ctx: TurnContext, exclude: set[str]) -> Plan:
        """Aggregated mode: the session's replica while it is healthy, else the least-loaded one (of those not
        found failing, `exclude`)."""
        sv = self.sv
        pinned = ctx.state.decode if ctx.state else None
        try:
            p = plan_aggregated(pinned, sv.cluster.aggregated_view(), frozenset(exclude))
        except NoCapacity as exc:
            raise self.no_capacity(exc) from None
        T.set_attrs(ctx.span, {T.ATTR_PLAN_REASON: p.reason, T.ATTR_DECODE: p.decode})
        return p

    def no_capacity(self, exc: NoCapacity) -> GatewayError:
        return GatewayError(503, str(exc), code="no_capacity", retry_after_s=self.sv.cluster.retry_after(exc.role))

    def cold(self, turn: Turn, exclude: set[str]) -> Turn:
        """The turn after a failed leg: no handle, no second decode-local try (unless no P is left at all), and
        none of the nodes found failing (`exclude`)."""
        return replace(turn, handle=HandleState.MISSING, handle_tokens=None, reuse_tokens=None,
                       round_robin=self.next_rr(), exclude=frozenset(exclude), allow_local=False)

    def arrival(self, the_plan: Plan) -> tuple[float, float] | None:
        """When a P/D turn should reach its D (gateway clock) and D's read seconds, from its cost decision;
        None when nothing reads it (arrival_weight off)."""
        d = the_plan.decision
        if d is None or d.option == "decode_local" or self.knobs.arrival_weight <= 0.0:
            return None
        return self.sv.clock() + d.arrive_s, d.d_read_s


def first_token_in(p: Plan) -> float:
    """Seconds until the plan's answer should start decoding (its estimated TTFT; 0 when unknown)."""
    d = p.decision
    chosen = d.chosen if d is not None else None
    return chosen.ttft_s if chosen is not None and math.isfinite(chosen.ttft_s) else 0.0


def estimator_seeds(config: GatewayConfig) -> EstimatorSeeds:
    return EstimatorSeeds(
        prefill_overhead_s=config.seed_prefill_overhead_s, prefill_s_per_token=config.seed_prefill_s_per_token,
        prefill_s_per_pair=config.seed_prefill_s_per_pair, transfer_latency_s=config.seed_transfer_latency_s,
        transfer_s_per_token=config.seed_transfer_s_per_token, tpot_base_s=config.seed_tpot_base_s,
        tpot_s_per_seq=config.seed_tpot_s_per_seq, queue_s_per_request=config.seed_queue_s_per_request)


def learning_params(config: GatewayConfig) -> LearningParams:
    return LearningParams(**config.learning_tuning())


def peer_knobs(config: GatewayConfig) -> PeerKnobs:
    """The peer gateways' rules as configured (policy/peers.py)."""
    return PeerKnobs(dynamo_rule=config.dynamo_rule, dynamo_decode_busy_share=config.dynamo_decode_busy_share,
                     llm_d_non_cached_tokens=config.llm_d_non_cached_tokens, block_size=config.block_size or 16)


def policy_knobs(config: GatewayConfig) -> PolicyKnobs:
    """The cost model's parameters: the operator's settings, then any [gateway.tuning] overrides."""
    return PolicyKnobs(
        max_local_suffix_tokens=config.max_local_suffix_tokens,
        pool_max_local_suffix_tokens=config.pool_max_local_suffix_tokens, tpot_budget_s=config.tpot_budget_s,
        ttft_objective_s=config.ttft_objective_s,
        recompute_threshold_tokens=config.min_reuse_tokens, handle_ttl_s=config.session_ttl_s,
        block_size=config.block_size or 16, chunk_tokens=config.chunk_tokens,
        rebalance_decode=config.rebalance_decode, local_kv_veto=config.decode_pressure_usage,
        pool_balance_abs=config.pool_balance_abs, pool_balance_rel=config.pool_balance_rel,
        defer_max_s=config.defer_max_s,
        **config.policy_tuning())
