"""A turn, top to bottom: identify → gather → plan → legs → relay → remember.

Each step lives in a module of its own (``identify``, ``gather``, ``place``, ``legs``, ``relay``, ``remember``)
and returns what it found; this module runs them in the order docs/protocol.md §1–2 prescribes and owns what
spans steps: executing the plan (which handle to send, which legs to run), one re-placement after a failed
node (so a dead node fails at most the request in flight, never the session's next turn), how the turn is
going (its ``Progress``: the nodes found failing, the time awaiting nodes, the placement in force, whose
TPOT-quota entry a failed turn leaves), and the end of the turn — the client's response, with the turn
remembered before it is whole.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import anyio
import httpx
from kvtether.gateway import telemetry as T
from kvtether.gateway.clock import DEFAULT_CLOCK, Clock
from kvtether.gateway.config import GatewayConfig
from kvtether.gateway.errors import GatewayError
from kvtether.gateway.guard.readback import readable_offer
from kvtether.gateway.guard.tokencheck import GuardTokenizer
from kvtether.gateway.guard.verify import handle_num_tokens, truncate_handle
from kvtether.gateway.nodes.cluster import Cluster, host_of
from kvtether.gateway.nodes.retention import Retention
from kvtether.gateway.policy.learning import Learning
from kvtether.gateway.policy.placement import HandleAction, Plan, Turn
from kvtether.gateway.policy.retention import ReleaseReason
from kvtether.gateway.stores.sessions import SessionStore, TakenHandle
from kvtether.gateway.transport.streaming import RelayResponse
from kvtether.gateway.transport.upstream import Upstream
from kvtether.gateway.turn import body as B
from kvtether.gateway.turn.context import (
    FinalLeg,
    Placement,
    Prefilled,
    Progress,
    Services,
    TurnContext,
    UpstreamFailure,
)
from kvtether.gateway.turn.gather import Gathered, gather
from kvtether.gateway.turn.identify import identify
from kvtether.gateway.turn.legs import Whole, final_leg, prefill_with_recovery
from kvtether.gateway.turn.place import Deferred, Placer, estimator_seeds, learning_params, peer_knobs, policy_knobs
from kvtether.gateway.turn.relay import relay
from kvtether.gateway.turn.remember import finish
from kvtether.gateway.turn.stream import Stream
from kvtether.protocol.wire import LOCAL_RETAIN_PARAMS
from opentelemetry import trace
from starlette.responses import JSONResponse, Response

log = logging.getLogger(__name__)

Answer = Whole | Stream  # what the final leg hands over: a whole answer, or a stream held back


class Orchestrator:
    def __init__(self, config: GatewayConfig, cluster: Cluster, store: SessionStore, metrics: T.Metrics,
                 upstream: Upstream, tokenize_client: httpx.AsyncClient, clock: Clock = DEFAULT_CLOCK,
                 tracer: trace.Tracer | None = None, retention: Retention | None = None) -> None:
        knobs = policy_knobs(config)
        # TPOT quotas and step boundaries serve decode-local turns only: P/D mode under a policy that keeps quotas.
        quotas = config.placement_policy.uses_stall_quotas and config.mode == "pd"
        learning = Learning(estimator_seeds(config), learning_params(config), knobs,
                            request_stall_share=config.request_stall_share if quotas else 1.0,
                            enabled=config.learn_estimates, steps=config.mode == "pd")
        # The guard's local tokenizer is loaded and checked at start-up (tokenize.start_local_tokenizer, the app).
        guard_tok = (GuardTokenizer(config.tokenizer, metrics, config.tokenizer_check_share)
                     if config.tokenizer else None)
        self.sv = Services(config, cluster, store, metrics, upstream, tokenize_client,
                           tracer or T.tracer(), learning, clock, guard_tok, retention)
        self.placer = Placer(self.sv, knobs, peer_knobs(config))
        for node in (*config.decode, *config.nodes):
            metrics.decode_stall.labels(node)  # every series shows zero before the first local turn
        if config.mode == "pd":
            metrics.expect_decisions(config.placement_policy.series)

    @property
    def learning(self) -> Learning:
        return self.sv.learning

    async def handle(self, kind: str, body: dict[str, Any], headers: Mapping[str, str], span: trace.Span, *,
                     tenant: str | None = None, upstream_auth: str | None = None,
                     on_identified: Callable[[str], None] | None = None) -> Response:
        """The turn's answer. ``on_identified(session_id)``: told which session the turn is served in (an API
        edge that records state per session, e.g. Responses)."""
        sv = self.sv
        ctx = await identify(sv.store, kind, body, headers, span, tenant,  # 1. identify
                             upstream_auth=upstream_auth, clock=sv.clock)
        if on_identified is not None and ctx.session_id is not None:
            on_identified(ctx.session_id)
        progress = Progress()
        try:
            leg, answer = await (self._aggregated if sv.config.mode == "aggregated" else self._pd)(ctx, progress)
        except BaseException as exc:  # the turn failed, or its client left: nothing decodes for it any more
            sv.leave_decoding(progress.placed)
            if isinstance(exc, UpstreamFailure):
                return exc.client_response()
            if isinstance(exc, GatewayError):
                return exc.response()
            raise
        end = functools.partial(finish, sv, ctx, leg)  # 6. remember: once the answer is whole
        if isinstance(answer, Whole):
            await end(answer.result)
            return JSONResponse(answer.data, headers=leg.headers)
        # 5. relay. The reuse decision is final before the decode leg starts, so it can go into the headers.
        return RelayResponse(relay(sv, ctx, leg, answer, end), headers={"cache-control": "no-cache", **leg.headers})

    async def _pd(self, ctx: TurnContext, progress: Progress) -> tuple[FinalLeg, Answer]:
        found = await gather(self.sv, ctx, self.placer.next_rr(), progress)  # 2. gather
        placed = await self._first_plan(ctx, progress, found)  # 3. plan
        kv, unused = self._offer(found, placed.plan)
        # 4. legs. One re-placement after a failed node: the in-flight request may fail, the next turn must not.
        for attempt in range(2):
            if placed.plan.action is HandleAction.DECODE_LOCAL:
                leg, d_body = self._local(ctx, found, placed, unused)
            else:
                prefilled, placed = await self._prefill(ctx, progress, found, placed, kv)
                kv = None  # single use: never resend a handle, whatever happens next
                leg, d_body = self._after_prefill(ctx, found, placed, prefilled)
            try:
                return leg, await final_leg(self.sv, ctx, progress, leg, d_body)
            except UpstreamFailure as failure:
                placed = self._after_failed_decode(ctx, progress, found, failure, last=attempt == 1)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _aggregated(self, ctx: TurnContext, progress: Progress) -> tuple[FinalLeg, Answer]:
        """The same session logic without P/D: the session's replica answers, re-placed once if it fails."""
        sv = self.sv
        for attempt in range(2):
            leg = FinalLeg(Placement(self.placer.aggregated(ctx, progress.exclude)), "aggregated", "none")
            try:
                return leg, await final_leg(sv, ctx, progress, leg, B.decode_body(ctx.body, None, want_token_ids=False))
            except UpstreamFailure as failure:
                sv.count_error(failure)
                if not failure.node_fault or attempt == 1:
                    raise
                sv.mark_failed(failure)
                progress.exclude.add(failure.node)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _first_plan(self, ctx: TurnContext, progress: Progress, found: Gathered) -> Placement:
        """The turn's placement; while every option is over a limit that may clear, it waits and is placed
        again (policy/deferral.py), up to defer_max_s in all."""
        started, deferred = self.sv.clock(), False
        while True:
            waited = self.sv.clock() - started if deferred else 0.0
            try:
                return self.plan(ctx, progress, found, found.turn, waited_s=waited)
            except Deferred as wait:
                deferred = True
                await anyio.sleep(wait.wait_s)

    def plan(self, ctx: TurnContext, progress: Progress, found: Gathered, turn: Turn,
             waited_s: float | None = None) -> Placement:
        """Place the turn (pure: policy.placement.plan) with the live state the policy reads, on its span, avoiding
        the nodes found failing. The placement returned is the one in force: it replaces any earlier one of the
        turn (whose TPOT-quota entry it leaves), and assumes what gather found of the prefix caches and the load
        view the plan saw (what the legs queued behind). `waited_s`: see Placer.place (a first placement only;
        a re-placement after a failed node never waits)."""
        the_plan, view, exposure, running = self.placer.place(ctx, turn, progress.exclude, progress.placed,
                                                              waited_s)
        if progress.placed is not None:  # the placement replaced runs no prefill any more
            self.sv.learning.prefill_seen(progress.placed.running)
        placed = Placement(the_plan, view, found.decode_cached, found.prefill_cached, exposure, running)
        progress.placed = placed
        log.debug("plan %s: %s", ctx.session_id, the_plan.reason)
        return placed

    # ---- executing the plan ----------------------------------------------------------------------

    def _offer(self, found: Gathered, the_plan: Plan) -> tuple[dict[str, Any] | None, TakenHandle | None]:
        """The handle the prefill leg sends (as is, or truncated to the verified prefix), counted; and the one a
        decode-local turn leaves unused (D still holds it: put back after the turn, for a later pull)."""
        sv = self.sv
        unused = found.taken if the_plan.action is HandleAction.DECODE_LOCAL and found.has_handle else None
        if the_plan.handle_outcome:
            sv.metrics.handle_outcomes.labels(the_plan.handle_outcome).inc()
        if found.has_handle and found.taken is not None and the_plan.action is HandleAction.NONE:
            # Out of the store and not sent: nothing will pull it now, so D need not hold it until its TTL.
            reason = ReleaseReason.REFUSED if the_plan.handle_outcome == "refused_by_guard" else ReleaseReason.UNUSED
            sv.release(found.taken.handle, found.turn.pinned_decode, reason)
        if found.prompt_ids is not None:
            sv.metrics.prompt_tokens.inc(len(found.prompt_ids))
        kv: dict[str, Any] | None = None
        if found.taken is not None and the_plan.action is HandleAction.ATTACH:
            kv = found.taken.handle
        elif found.taken is not None and the_plan.action is HandleAction.TRUNCATE:
            kv = truncate_handle(found.taken.handle, the_plan.reuse_tokens,
                                 sv.cluster.block_size(found.turn.pinned_decode or ""))
        if kv is not None:
            # Never a length P's own prefix-cache hit could equal, so P's cached count tells whether it read it.
            prompt = len(found.prompt_ids) if found.prompt_ids is not None else None
            kv = readable_offer(kv, prompt, sv.cluster.block_size(the_plan.prefill or ""))
            sv.metrics.offered_tokens.inc(handle_num_tokens(kv) or 0)
        return kv, unused

    def _local(self, ctx: TurnContext, found: Gathered, placed: Placement,
               unused: TakenHandle | None) -> tuple[FinalLeg, dict[str, Any]]:
        """The whole request to the pinned D: D prefills the suffix after its prefix-cache hit; marked for
        retention, it returns a handle of the whole sequence (config.local_turn_handles); token ids tell what
        its prefix cache now holds."""
        mark = LOCAL_RETAIN_PARAMS if self.sv.config.marks_local_turns else None
        leg = _decode_leg(ctx, found, placed, "decode_local", found.decode_cached, unused)
        return leg, B.decode_body(ctx.body, mark, want_token_ids=True)

    async def _prefill(self, ctx: TurnContext, progress: Progress, found: Gathered, placed: Placement,
                       kv: dict[str, Any] | None) -> tuple[Prefilled, Placement]:
        """The prefill leg (another P after a failed one, in its re-placement), while D counts the turn as
        arriving."""
        sv = self.sv

        def replan(turn: Turn) -> Placement:  # another P after a failed prefill leg
            return self.plan(ctx, progress, found, replace(turn, round_robin=self.placer.next_rr()))

        with sv.cluster.heading_to(placed.plan.decode, self.placer.arrival(placed.plan), sv.clock):
            return await prefill_with_recovery(sv, ctx, progress, placed, kv, replan)

    def _after_prefill(self, ctx: TurnContext, found: Gathered, placed: Placement,
                       prefilled: Prefilled) -> tuple[FinalLeg, dict[str, Any]]:
        """The decode leg after P's: what P reported, not what the plan meant (a handle P did not read is no
        pull), and P's handle for D to read."""
        sv = self.sv
        source, reused = prefilled.read.source, prefilled.read.cached_tokens
        if prefilled.read.handle_unread:
            sv.metrics.handle_outcomes.labels("unread").inc()
        sv.metrics.reused_tokens.labels(source).inc(reused)
        d_kv = B.with_host(prefilled.params, host_of(placed.plan.prefill or "")) if prefilled.params else None
        d_body = B.decode_body(ctx.body, d_kv, want_token_ids=sv.config.guarded or sv.config.cache_aware)
        return _decode_leg(ctx, found, placed, source, reused, None), d_body

    def _after_failed_decode(self, ctx: TurnContext, progress: Progress, found: Gathered, failure: UpstreamFailure,
                             *, last: bool) -> Placement:
        """A cold re-placement after a failed decode leg; raises what the client gets when there is none."""
        sv = self.sv
        sv.count_error(failure)
        if not failure.node_fault or last:
            raise failure
        sv.mark_failed(failure)
        progress.exclude.add(failure.node)
        try:
            return self.plan(ctx, progress, found, self.placer.cold(found.turn, progress.exclude))
        except GatewayError:
            if failure.unreachable:
                raise failure from None
            # The only decode node answered with an error: it is alive, so try it once more.
            progress.exclude.discard(failure.node)
            return self.plan(ctx, progress, found, self.placer.cold(found.turn, progress.exclude))


def _decode_leg(ctx: TurnContext, found: Gathered, placed: Placement, source: str, reused: int,
                unused: TakenHandle | None) -> FinalLeg:
    """A P/D turn's final leg, with where its reused KV came from in the answer's headers and on the turn's span."""
    T.set_attrs(ctx.span, {T.ATTR_REUSE_TOKENS: reused, T.ATTR_SUFFIX_TOKENS:
                           len(found.prompt_ids) - reused if found.prompt_ids is not None else None})
    the_plan = placed.plan
    headers = T.reuse_headers(source, reused, the_plan.action.value, the_plan.bucket)
    return FinalLeg(placed, "decode", source, headers,
                    expected_output_tokens=found.turn.expected_output_tokens, unused=unused)
