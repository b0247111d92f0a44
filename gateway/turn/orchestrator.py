"""A turn, top to bottom: identify → gather → plan → legs → relay → remember.

Each step lives in a room of its own (``identify``, ``gather``, ``policy.placement``, ``legs``, ``relay``,
``remember``); this module runs them in the order docs/protocol.md §1–2 prescribes and owns what spans steps:
executing the plan (which handle to send, which legs to run) and one re-placement after a failed node, so a
dead node fails at most the request in flight, never the session's next turn.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import httpx
from kvtether.gateway import telemetry as T
from kvtether.gateway.config import GatewayConfig
from kvtether.gateway.guard.readback import readable_offer
from kvtether.gateway.guard.tokencheck import GuardTokenizer
from kvtether.gateway.guard.verify import handle_num_tokens, truncate_handle
from kvtether.gateway.nodes.cluster import Cluster, host_of
from kvtether.gateway.nodes.retention import Retention
from kvtether.gateway.policy.estimates import EstimatorSeeds, LearningParams
from kvtether.gateway.policy.knobs import PolicyKnobs
from kvtether.gateway.policy.learning import Learning
from kvtether.gateway.policy.peers import PeerKnobs
from kvtether.gateway.policy.placement import HandleAction, HandleState, NoCapacity, Plan, Turn, plan, plan_aggregated
from kvtether.gateway.policy.reasons import reason_bucket
from kvtether.gateway.policy.retention import ReleaseReason
from kvtether.gateway.shell.errors import GatewayError
from kvtether.gateway.stores.sessions import SessionStore
from kvtether.gateway.turn import body as B
from kvtether.gateway.turn.context import Services, TurnContext, UpstreamFailure
from kvtether.gateway.turn.gather import Gathered, gather
from kvtether.gateway.turn.identify import identify
from kvtether.gateway.turn.legs import final_leg, prefill_with_recovery
from kvtether.gateway.turn.streaming import RelayResponse
from kvtether.gateway.turn.upstream import Upstream
from kvtether.sdk.contract import session_final_from_headers
from opentelemetry import trace
from starlette.responses import Response

log = logging.getLogger(__name__)


class Orchestrator:
    def __init__(self, config: GatewayConfig, cluster: Cluster, store: SessionStore, metrics: T.Metrics,
                 upstream: Upstream, tokenize_client: httpx.AsyncClient, clock: Callable[[], float] = time.monotonic,
                 tracer: trace.Tracer | None = None, retention: Retention | None = None) -> None:
        self.knobs = policy_knobs(config)
        self.peer_knobs = peer_knobs(config)
        # TPOT quotas and step boundaries serve decode-local turns only: P/D mode under the auto policy.
        pd_auto = config.policy == "auto" and config.mode == "pd"
        learning = Learning(estimator_seeds(config), learning_params(config), self.knobs,
                            request_stall_share=config.request_stall_share if pd_auto else 1.0,
                            enabled=config.learn_estimates, steps=config.mode == "pd")
        # The guard's local tokenizer is loaded and checked at start-up (legs.start_local_tokenizer, from the app).
        guard_tok = (GuardTokenizer(config.tokenizer, metrics, config.tokenizer_check_share)
                     if config.tokenizer else None)
        self.sv = Services(config, cluster, store, metrics, upstream, tokenize_client,
                           tracer or T.tracer(), learning, clock, guard_tok, retention)
        self._rr = 0
        for node in config.decode:
            metrics.decode_stall.labels(node)  # every series shows zero before the first local turn
        if config.mode == "pd":
            metrics.expect_decisions(config.policy)

    @property
    def learning(self) -> Learning:
        return self.sv.learning

    async def handle(self, kind: str, body: dict[str, Any], headers: Mapping[str, str], span: trace.Span, *,
                     tenant: str | None = None, upstream_auth: str | None = None,
                     on_identified: Callable[[str], None] | None = None) -> Response:
        """The turn's answer. ``on_identified(session_id)``: told which session the turn is served in (an API
        edge that records state per session, e.g. Responses)."""
        ctx = await identify(self.sv.store, kind, body, headers, span, tenant)
        if on_identified is not None and ctx.session_id is not None:
            on_identified(ctx.session_id)
        ctx.upstream_auth = upstream_auth
        ctx.arrived_at = self.sv.clock()
        ctx.final = session_final_from_headers(headers)
        if ctx.final:
            ctx.span.set_attribute(T.ATTR_SESSION_FINAL, True)
        if self.sv.config.mode == "aggregated":
            return await self._aggregated(ctx)
        return await self._pd(ctx)

    # ---- P/D -----------------------------------------------------------------------------------

    async def _pd(self, ctx: TurnContext) -> Response:
        try:
            resp = await self._pd_turn(ctx)
        except BaseException:
            self.sv.leave_decoding(ctx)
            raise
        if not isinstance(resp, RelayResponse):
            # A whole answer's leg has ended, or an error ended the turn: nothing decodes for it any more (a
            # relayed stream leaves when it ends).
            self.sv.leave_decoding(ctx)
        return resp

    async def _pd_turn(self, ctx: TurnContext) -> Response:
        sv = self.sv
        g = await gather(sv, ctx, self._next_rr())
        the_plan = self.plan(ctx, g.turn)
        kv = self._handle_to_send(ctx, g, the_plan)

        def replan(turn: Turn) -> Plan:  # another P after a failed prefill leg
            return self.plan(ctx, replace(turn, round_robin=self._next_rr()))

        # One re-placement after a failed node: the in-flight request may fail, the next turn must not.
        for attempt in range(2):
            if the_plan.action is HandleAction.DECODE_LOCAL:
                # The whole request to the pinned D: D prefills the suffix after its prefix-cache hit; marked
                # for retention, it returns a handle of the whole sequence (config.local_turn_handles); token
                # ids tell what its prefix cache now holds.
                source = "decode_local"
                mark = B.LOCAL_RETAIN_PARAMS if sv.config.marks_local_turns else None
                d_body = B.decode_body(ctx.body, mark, want_token_ids=True)
                reused = ctx.decode_cached
            else:
                try:
                    with sv.cluster.heading_to(the_plan.decode, self._arrival(the_plan), sv.clock):
                        prefilled, the_plan = await prefill_with_recovery(sv, ctx, the_plan, kv, replan)
                except UpstreamFailure as failure:
                    return failure.client_response()
                except GatewayError as err:
                    return err.response()
                kv = None  # single use: never resend a handle, whatever happens next
                # What P reported, not what the plan meant: a handle P did not read is no pull.
                source, reused = prefilled.read.source, prefilled.read.cached_tokens
                if prefilled.read.handle_unread:
                    sv.metrics.handle_outcomes.labels("unread").inc()
                sv.metrics.reused_tokens.labels(source).inc(reused)
                d_kv = B.with_host(prefilled.params, host_of(the_plan.prefill or "")) if prefilled.params else None
                d_body = B.decode_body(ctx.body, d_kv, want_token_ids=sv.config.guarded or sv.config.cache_aware)
            ctx.response_headers = T.reuse_headers(source, reused, the_plan.action.value, reason_bucket(the_plan))
            T.set_attrs(ctx.span, {T.ATTR_REUSE_TOKENS: reused, T.ATTR_SUFFIX_TOKENS:
                                   len(g.prompt_ids) - reused if g.prompt_ids is not None else None})
            try:
                return await final_leg(sv, ctx, the_plan, d_body, "decode", source)
            except UpstreamFailure as failure:
                replaced = self._after_failed_decode(ctx, g.turn, failure, last=attempt == 1)
                if isinstance(replaced, Response):
                    return replaced
                the_plan = replaced
        raise AssertionError("unreachable")  # pragma: no cover

    def _handle_to_send(self, ctx: TurnContext, g: Gathered, the_plan: Plan) -> dict[str, Any] | None:
        """The handle the prefill leg sends (as is, or truncated to the verified prefix), counted."""
        sv = self.sv
        if the_plan.action is HandleAction.DECODE_LOCAL and g.has_handle:
            ctx.unused_handle = g.taken  # D still holds it: restored after the turn, for a later pull
        if the_plan.handle_outcome:
            sv.metrics.handle_outcomes.labels(the_plan.handle_outcome).inc()
        if g.has_handle and g.taken is not None and the_plan.action is HandleAction.NONE:
            # Out of the store and not sent: nothing will pull it now, so D need not hold it until its TTL.
            reason = ReleaseReason.REFUSED if the_plan.handle_outcome == "refused_by_guard" else ReleaseReason.UNUSED
            sv.release(g.taken.handle, g.turn.pinned_decode, reason)
        if g.prompt_ids is not None:
            sv.metrics.prompt_tokens.inc(len(g.prompt_ids))
        kv: dict[str, Any] | None = None
        if g.taken is not None and the_plan.action is HandleAction.ATTACH:
            kv = g.taken.handle
        elif g.taken is not None and the_plan.action is HandleAction.TRUNCATE:
            kv = truncate_handle(g.taken.handle, the_plan.reuse_tokens,
                                 sv.cluster.block_size(g.turn.pinned_decode or ""))
        if kv is not None:
            # Never a length P's own prefix-cache hit could equal, so P's cached count tells whether it read it.
            kv = readable_offer(kv, len(g.prompt_ids) if g.prompt_ids is not None else None,
                                sv.cluster.block_size(the_plan.prefill or ""))
            sv.metrics.offered_tokens.inc(handle_num_tokens(kv) or 0)
        return kv

    def _after_failed_decode(self, ctx: TurnContext, turn: Turn, failure: UpstreamFailure, *,
                             last: bool) -> Plan | Response:
        """A cold re-placement after a failed decode leg, or the answer the client gets when there is none."""
        sv = self.sv
        sv.count_error(failure)
        if not failure.node_fault or last:
            return failure.client_response()
        sv.mark_failed(failure)
        ctx.exclude.add(failure.node)
        try:
            return self.plan(ctx, self._cold_turn(turn, ctx))
        except GatewayError:
            if failure.unreachable:
                return failure.client_response()
            # The only decode node answered with an error: it is alive, so try it once more.
            ctx.exclude.discard(failure.node)
            try:
                return self.plan(ctx, self._cold_turn(turn, ctx))
            except GatewayError as err:
                return err.response()

    def _next_rr(self) -> int:
        self._rr += 1
        return self._rr - 1

    def _cold_turn(self, turn: Turn, ctx: TurnContext) -> Turn:
        # After a failed leg: no handle, and no second decode-local try (unless no P is left at all).
        return replace(turn, handle=HandleState.MISSING, handle_tokens=None, reuse_tokens=None,
                       round_robin=self._next_rr(), exclude=frozenset(ctx.exclude), allow_local=False)

    def _arrival(self, the_plan: Plan) -> tuple[float, float] | None:
        """When a P/D turn should reach its D (gateway clock) and D's read seconds, from its cost decision;
        None when nothing reads it (arrival_weight off)."""
        d = the_plan.decision
        if d is None or d.option == "decode_local" or self.knobs.arrival_weight <= 0.0:
            return None
        return self.sv.clock() + d.arrive_s, d.d_read_s

    def plan(self, ctx: TurnContext, turn: Turn) -> Plan:
        """Place the turn (pure: policy.placement.plan) with the live state the policy reads, on its span."""
        sv = self.sv
        now = sv.clock()
        quotas = sv.learning.quota_credit(turn.pinned_decode)
        turn = replace(turn, exclude=frozenset(ctx.exclude), ttft_tail_s=sv.learning.tail_threshold(),
                       request_stall_credit_s=quotas.credit_s, request_stall_quota_s=quotas.quota_s)
        with sv.tracer.start_as_current_span(T.SPAN_PLAN, context=ctx.parent_ctx, kind=T.KIND_INTERNAL) as span:
            view = sv.cluster.view(now)
            ctx.plan_view = view
            try:
                # The peer rules match D's prefix cache in its own blocks (known once D was polled).
                peers = replace(self.peer_knobs, block_size=sv.cluster.block_size(turn.pinned_decode or ""))
                p = plan(turn, view, sv.learning.snapshot(now), self.knobs, peers)
            except NoCapacity as exc:
                span.set_attribute(T.ERROR_TYPE, "no_capacity")
                raise GatewayError(503, str(exc), code="no_capacity",
                                   retry_after_s=sv.cluster.retry_after(exc.role)) from None
            stall = sv.learning.planned(p)
            # From here the answer is headed for D: a local prefill admitted before its first token still
            # runs into its decode steps (policy/stallquota.py), so its quota is kept from now on.
            sv.enter_decoding(ctx, p.decode)
            bucket = reason_bucket(p)
            sv.metrics.placement_decisions.labels(p.action.value, bucket).inc()
            if p.decision is not None and p.action is HandleAction.DECODE_LOCAL:
                sv.metrics.decode_stall.labels(p.decode).inc(stall)
            if p.decision is not None:
                T.set_attrs(span, T.cost_attributes(p.decision.trace_attributes()))
            T.set_attrs(span, {T.ATTR_POLICY: turn.policy, T.ATTR_PLAN_ACTION: p.action.value,
                               T.ATTR_PLAN_REASON: p.reason, T.ATTR_PLAN_REASON_BUCKET: bucket,
                               T.ATTR_PREFILL: p.prefill, T.ATTR_DECODE: p.decode,
                               T.ATTR_HANDLE_OUTCOME: p.handle_outcome, T.ATTR_REUSE_TOKENS: p.reuse_tokens,
                               T.ATTR_RE_PLACED: p.re_placed})
        held = sv.cluster.nodes.get(p.decode)
        T.set_attrs(ctx.span, {T.ATTR_PLAN_ACTION: p.action.value, T.ATTR_PLAN_REASON: p.reason,
                               T.ATTR_DECODE_HELD_KV_TOKENS: held.held_kv_tokens if held is not None else None})
        log.debug("plan %s: %s", ctx.session_id, p.reason)
        return p

    # ---- aggregated ----------------------------------------------------------------------------

    async def _aggregated(self, ctx: TurnContext) -> Response:
        sv = self.sv
        pinned = ctx.state.decode if ctx.state else None
        for attempt in range(2):
            try:
                the_plan = plan_aggregated(pinned, sv.cluster.aggregated_view(), frozenset(ctx.exclude))
            except NoCapacity as exc:
                return GatewayError(503, str(exc), code="no_capacity",
                                    retry_after_s=sv.cluster.retry_after(exc.role)).response()
            T.set_attrs(ctx.span, {T.ATTR_PLAN_REASON: the_plan.reason, T.ATTR_DECODE: the_plan.decode})
            try:
                return await final_leg(sv, ctx, the_plan, B.decode_body(ctx.body, None, want_token_ids=False),
                                       "aggregated", "none")
            except UpstreamFailure as failure:
                sv.count_error(failure)
                if not failure.node_fault or attempt == 1:
                    return failure.client_response()
                sv.mark_failed(failure)
                ctx.exclude.add(failure.node)
        raise AssertionError("unreachable")  # pragma: no cover


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
        max_local_suffix_tokens=config.max_local_suffix_tokens, tpot_budget_s=config.tpot_budget_s,
        recompute_threshold_tokens=config.min_reuse_tokens, handle_ttl_s=config.session_ttl_s,
        block_size=config.block_size or 16, chunk_tokens=config.chunk_tokens,
        rebalance_decode=config.rebalance_decode, local_kv_veto=config.decode_pressure_usage,
        **config.policy_tuning())
