"""The shell that executes a turn: session lookup, tokenize + guard, plan, prefill leg, decode leg.

All decisions are made by the pure modules (``guard``, ``placement``, ``body``); this module only does
I/O in the order protocol §1–2 prescribes, recovers from upstream failures, records what D now holds
and keeps internal fields away from the client.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import anyio
import httpx
from kvtether.gateway import body as B
from kvtether.gateway import prefillcache as PC
from kvtether.gateway import stallquota as SQ
from kvtether.gateway import telemetry as T
from kvtether.gateway.cluster import Cluster, host_of
from kvtether.gateway.config import GatewayConfig
from kvtether.gateway.costpolicy import PolicyKnobs
from kvtether.gateway.errors import GatewayError, sse_error
from kvtether.gateway.estimates import Estimator, EstimatorSeeds, LearningParams
from kvtether.gateway.guard import HeldSequence, handle_groups, handle_num_tokens, truncate_handle, verified_reuse
from kvtether.gateway.placement import (
    ClusterView,
    HandleAction,
    HandleState,
    NoCapacity,
    Plan,
    Turn,
    plan,
    plan_aggregated,
)
from kvtether.gateway.prefillcache import PrefillCopy
from kvtether.gateway.sessions import SessionState, SessionStore, TakenHandle
from kvtether.gateway.stallbudget import StallBudget
from kvtether.gateway.steps import ChunkTimes, step_start
from kvtether.gateway.tail import TailTracker
from kvtether.sdk.contract import session_id_from_headers
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from starlette.responses import JSONResponse, Response, StreamingResponse

log = logging.getLogger(__name__)

PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
_FORWARD_HEADERS = ("authorization",)


class UpstreamFailure(Exception):
    def __init__(self, node: str, phase: str, message: str, status: int | None = None,
                 payload: Any = None, *, unreachable: bool = False) -> None:
        super().__init__(message)
        self.node, self.phase, self.status, self.payload = node, phase, status, payload
        # Could not connect at all: the node is down, not just this request.
        self.unreachable = unreachable

    @property
    def node_fault(self) -> bool:
        """A connection failure or 5xx says the node is in trouble; a 4xx says the request is."""
        return self.status is None or self.status >= 500

    def client_response(self) -> Response:
        if self.status is not None and self.status < 500 and isinstance(self.payload, dict) and "error" in self.payload:
            return JSONResponse(self.payload, status_code=self.status)
        if self.status is not None and self.status < 500:
            return GatewayError(self.status, f"upstream rejected the request: {self.payload}").response()
        return GatewayError(502, f"upstream {self.phase} failed: {self}", type_="upstream_error").response()


@dataclass
class TurnContext:
    kind: str  # chat | completions
    body: dict[str, Any]
    headers: dict[str, str]
    stream: bool
    keep_token_ids: bool
    session_id: str | None
    session_source: str  # header | prefix | new | none
    state: SessionState | None
    t0: float
    span: trace.Span
    exclude: set[str] = field(default_factory=set)
    # Cost-policy bookkeeping: the load view the plan saw (what each leg queued behind), the handle a
    # decode-local turn left unused (put back: its blocks still cover a prefix of the history), when the
    # final leg was sent, and the prefix D held verified for this prompt.
    plan_view: ClusterView | None = None
    unused_handle: TakenHandle | None = None
    final_leg_at: float | None = None
    decode_cached: int = 0
    # What the plan assumed each P's prefix cache holds of this prompt (prefillcache.py): the P leg's own
    # cache hit, when P's usage cannot tell it apart from tokens it pulled.
    prefill_cached: dict[str, int] = field(default_factory=dict)
    # Observability: seconds spent awaiting nodes before the final leg (tokenize, prefill), so that
    # final_leg_at - t0 - upstream_s is the gateway's own share of the TTFT; and the x-kvtether-* headers.
    upstream_s: float = 0.0
    response_headers: dict[str, str] = field(default_factory=dict)
    # The answer's expected length (the session's mean, capped by max_tokens): sizes its TPOT quota.
    expected_output_tokens: int = 256
    # (decode node, key) of the final leg's entry in the per-request stall quotas while D decodes it.
    exposure: tuple[str, int] | None = None

    @property
    def model(self) -> str:
        return str(self.body.get("model") or "")

    @property
    def parent_ctx(self) -> otel_context.Context:
        return trace.set_span_in_context(self.span)


@dataclass
class Prefilled:
    params: dict[str, Any] | None
    cached_tokens: int
    pulled: bool  # a handle was attached and accepted


@dataclass
class LegResult:
    """What the final (decode or aggregated) leg told us, for the session store."""

    ok: bool = False
    handle: dict[str, Any] | None = None
    prompt_ids: list[int] | None = None
    output_ids: list[int] = field(default_factory=list)
    answer: dict[str, Any] | None = None
    usage: Any = None
    finish_reasons: list[str] = field(default_factory=list)
    ttft: float | None = None
    # Since the turn's start, the stream's first chunk with choices: vLLM sends its role chunk with the first
    # engine output, so this is when D produced the first token. TTFT (above) may come several decode steps
    # later, once the tool-call parser releases the function name: not prefill time, so not learned from.
    first_chunk: float | None = None
    # Stream timing of output chunks (first, last, how many tokens between): the decode TPOT sample.
    out_first_at: float | None = None
    out_last_at: float | None = None
    out_tokens_timed: int = 0
    # Other streams' chunk arrivals on the same D between this leg's send and its first chunk (the last few):
    # the step boundaries a decode-local prefill's mixed step is read from (steps.step_start).
    arrivals_before_first: tuple[float, ...] = ()
    # Counted in its D's `holding_back` (first token out, first delta not yet): released once, by the first
    # delta or the end of the leg.
    holding_back: bool = False


class Orchestrator:
    def __init__(self, config: GatewayConfig, cluster: Cluster, store: SessionStore, metrics: T.Metrics,
                 client: httpx.AsyncClient, clock: Callable[[], float] = time.monotonic,
                 tracer: trace.Tracer | None = None, tokenize_client: httpx.AsyncClient | None = None) -> None:
        self.config = config
        self.cluster = cluster
        self.store = store
        self.metrics = metrics
        self.client = client
        # /tokenize on connections of its own (see app.py): default the same client.
        self.tokenize_client = tokenize_client or client
        self.clock = clock
        self._rr = 0
        self.tracer = tracer or T.tracer()
        # One estimator per gateway: node speeds learned from the turns it serves (cost policy, "auto").
        self.estimator = Estimator(_seeds(config), LearningParams(half_life_s=config.estimate_half_life_s))
        self.knobs = _knobs(config)
        # Per decode node: how much more its running batch may be stalled by decode-local prefills.
        self.stall_budgets: dict[str, StallBudget] = {}
        # Per decode node: the requests this gateway has decoding there, each with its TPOT quota of stall
        # (stallquota.py; only with request_stall_share < 1 under auto).
        self.exposures: dict[str, dict[int, SQ.Exposure]] = {}
        self._exposure_keys = itertools.count()
        # Per decode node: when its streamed chunks arrived (one burst per engine step).
        self.chunk_times = ChunkTimes()
        # Where recent turns' estimated TTFT tail starts (the tail-aware objective's threshold).
        self.tail = TailTracker(self.knobs.tail_quantile)
        # Per prefill node: tokens of new KV it took in (what evicts its older cached blocks; prefillcache.py).
        self.prefill_written: dict[str, int] = {}
        for node in config.decode:
            metrics.decode_stall.labels(node)  # every series shows zero before the first local turn

    # ---- entry -------------------------------------------------------------------------------

    async def handle(self, kind: str, body: dict[str, Any], headers: Mapping[str, str], span: trace.Span) -> Response:
        ctx = await self._identify(kind, body, headers, span)
        if self.config.mode == "aggregated":
            return await self._aggregated(ctx)
        return await self._pd(ctx)

    async def _identify(self, kind: str, body: dict[str, Any], headers: Mapping[str, str],
                        span: trace.Span) -> TurnContext:
        sid = session_id_from_headers(headers)
        source = "header" if sid else "none"
        if sid is None and kind == "chat":
            parent_key, _ = B.chat_keys(body)
            if parent_key is not None:
                sid = await self.store.find_by_prefix(parent_key)
                source = "prefix" if sid else source
            if sid is None:
                # A plain OpenAI client: a fresh session the next turn finds by its message-chain hash.
                sid, source = f"anon-{uuid.uuid4().hex}", "new"
        state = await self.store.get(sid) if sid else None
        T.set_attrs(span, {T.GEN_AI_CONVERSATION_ID: sid if source == "header" else None,
                           T.ATTR_SESSION_SOURCE: source})
        return TurnContext(kind, body, {k.lower(): v for k, v in headers.items()}, body.get("stream") is True,
                           body.get("return_token_ids") is True, sid, source, state, time.perf_counter(), span)

    # ---- P/D -----------------------------------------------------------------------------------

    async def _pd(self, ctx: TurnContext) -> Response:
        policy = self.config.effective_policy
        state = ctx.state
        taken: TakenHandle | None = None
        handle_state = HandleState.MISSING
        if state is not None and ctx.session_id is not None and policy in ("pull", "reference", "auto"):
            taken = await self.store.take_handle(ctx.session_id)
            if taken is None and state.handle is not None:
                # A concurrent turn of the same session took it first: this one goes cold.
                self.metrics.handle_outcomes.labels("lost_race").inc()
            if taken is not None:
                age = self.clock() - taken.handle_at
                handle_state = HandleState.EXPIRED if age >= self.config.session_ttl_s else HandleState.PRESENT
                ctx.span.set_attribute(T.ATTR_HANDLE_AGE, age)
        T.set_attrs(ctx.span, {T.ATTR_TURN: state.turns if state else 0,
                               T.ATTR_PINNED: state.decode if state else None})
        prompt_ids: list[int] | None = None
        reuse: int | None = None
        cached_held = state.cached if state is not None and policy == "auto" else None
        has_handle = taken is not None and handle_state is HandleState.PRESENT
        # Tokenize only when there is something to compare the prompt with (a handle's held sequence, or
        # what D's prefix cache holds after a decode-local turn): a first turn or a handle-less cold turn
        # needs no token ids, and /tokenize sits on the TTFT path.
        if policy in ("pull", "auto") and (has_handle or cached_held is not None):
            prompt_ids = B.literal_prompt_ids(ctx.kind, ctx.body) or await self._tokenize(ctx)
            if prompt_ids is not None and ((has_handle and taken is not None and taken.held is not None)
                                           or cached_held is not None):
                with self.tracer.start_as_current_span(T.SPAN_GUARD, context=ctx.parent_ctx,
                                                       kind=T.KIND_INTERNAL) as gspan:
                    if has_handle and taken is not None and taken.held is not None:
                        reuse = verified_reuse(taken.held, prompt_ids)
                        verdict = T.guard_verdict(reuse, taken.held.num_tokens, self.config.min_reuse_tokens)
                        T.set_attrs(gspan, {T.ATTR_HELD_TOKENS: taken.held.num_tokens, T.ATTR_REUSE_TOKENS: reuse,
                                            T.ATTR_GUARD_VERDICT: verdict})
                        ctx.span.set_attribute(T.ATTR_GUARD_VERDICT, verdict)
                    if cached_held is not None:
                        # Not a correctness check (a local turn hits D's prefix cache by content hash, never
                        # positionally): the cost policy's estimate of how much of the prompt D holds.
                        ctx.decode_cached = verified_reuse(cached_held, prompt_ids)
                        gspan.set_attribute(T.ATTR_DECODE_CACHED_TOKENS, ctx.decode_cached)
                    gspan.set_attribute(T.ATTR_PROMPT_TOKENS, len(prompt_ids))
        turn = Turn(
            policy=policy,
            new_session=state is None,
            pinned_decode=state.decode if state is not None else None,
            handle=handle_state,
            handle_tokens=handle_num_tokens(taken.handle) if taken else None,
            handle_groups=handle_groups(taken.handle) if taken else 1,
            prompt_tokens=len(prompt_ids) if prompt_ids is not None else None,
            reuse_tokens=reuse,
            min_reuse_tokens=self.config.min_reuse_tokens,
            partial_reuse=self.config.partial_reuse,
            round_robin=self._next_rr(),
            **self._auto_facts(ctx, taken, prompt_ids),
        )
        the_plan = self._plan(ctx, turn)
        if the_plan.action is HandleAction.DECODE_LOCAL and has_handle:
            ctx.unused_handle = taken  # D still holds it: restored after the turn, for a later pull
        if the_plan.handle_outcome:
            self.metrics.handle_outcomes.labels(the_plan.handle_outcome).inc()
        if prompt_ids is not None:
            self.metrics.prompt_tokens.inc(len(prompt_ids))
        kv: dict[str, Any] | None = None
        if taken is not None and the_plan.action is HandleAction.ATTACH:
            kv = taken.handle
        elif taken is not None and the_plan.action is HandleAction.TRUNCATE:
            kv = truncate_handle(taken.handle, the_plan.reuse_tokens, self.cluster.block_size(turn.pinned_decode or ""))
        if kv is not None:
            self.metrics.reused_tokens.inc(the_plan.reuse_tokens)

        # One re-placement after a failed node: the in-flight request may fail, the next turn must not.
        for attempt in range(2):
            if the_plan.action is HandleAction.DECODE_LOCAL:
                # The whole request to the pinned D: D prefills the suffix after its prefix-cache hit; marked
                # for retention, it returns a handle of the whole sequence (config.local_turn_handles); token
                # ids tell what its prefix cache now holds.
                source = "decode_local"
                mark = B.LOCAL_RETAIN_PARAMS if self.config.local_turn_handles else None
                d_body = B.decode_body(ctx.body, mark, want_token_ids=True)
            else:
                try:
                    with self.cluster.heading_to(the_plan.decode, self._arrival(the_plan), self.clock):
                        prefilled, the_plan = await self._prefill_with_recovery(ctx, the_plan, kv)
                except UpstreamFailure as failure:
                    return failure.client_response()
                except GatewayError as err:
                    return err.response()
                kv = None  # single use: never resend a handle, whatever happens next
                source = ("decode_pull" if prefilled.pulled else
                          ("prefill_cache" if prefilled.cached_tokens else "none"))
                d_kv = B.with_host(prefilled.params, host_of(the_plan.prefill or "")) if prefilled.params else None
                d_body = B.decode_body(ctx.body, d_kv, want_token_ids=self.config.guarded)
            reused = ctx.decode_cached if the_plan.action is HandleAction.DECODE_LOCAL else prefilled.cached_tokens
            ctx.response_headers = T.reuse_headers(source, reused, the_plan.action.value)
            T.set_attrs(ctx.span, {T.ATTR_REUSE_TOKENS: reused,
                                   T.ATTR_SUFFIX_TOKENS: len(prompt_ids) - reused if prompt_ids is not None else None})
            try:
                return await self._final_leg(ctx, the_plan, d_body, "decode", source)
            except UpstreamFailure as failure:
                self._count_error(failure)
                if not failure.node_fault or attempt == 1:
                    return failure.client_response()
                self.cluster.mark_failed(failure.node, str(failure), hard=failure.unreachable)
                ctx.exclude.add(failure.node)
                try:
                    the_plan = self._plan(ctx, self._cold_turn(turn, ctx))
                except GatewayError:
                    if failure.unreachable:
                        return failure.client_response()
                    # The only decode node answered with an error: it is alive, so try it once more.
                    ctx.exclude.discard(failure.node)
                    try:
                        the_plan = self._plan(ctx, self._cold_turn(turn, ctx))
                    except GatewayError as err:
                        return err.response()
        raise AssertionError("unreachable")  # pragma: no cover

    def _next_rr(self) -> int:
        self._rr += 1
        return self._rr - 1

    def _cold_turn(self, turn: Turn, ctx: TurnContext) -> Turn:
        # After a failed leg: no handle, and no second decode-local try (unless no P is left at all).
        return replace(turn, handle=HandleState.MISSING, handle_tokens=None, reuse_tokens=None,
                       round_robin=self._next_rr(), exclude=frozenset(ctx.exclude), allow_local=False)

    def _auto_facts(self, ctx: TurnContext, taken: TakenHandle | None, prompt_ids: list[int] | None) -> dict[str, Any]:
        """The session facts the cost policy weighs (docs/placement.md); harmless for the other policies."""
        state = ctx.state
        facts: dict[str, Any] = {"decode_cached_tokens": ctx.decode_cached}
        if taken is not None:
            facts["handle_age_s"] = max(0.0, self.clock() - taken.handle_at)
        max_tokens = ctx.body.get("max_completion_tokens") or ctx.body.get("max_tokens")
        if state is not None and state.avg_output_tokens is not None:
            out = round(state.avg_output_tokens)
            facts["expected_output_tokens"] = min(out, max_tokens) if isinstance(max_tokens, int) else out
        elif isinstance(max_tokens, int) and max_tokens > 0:
            facts["expected_output_tokens"] = max_tokens
        ctx.expected_output_tokens = facts.get("expected_output_tokens", ctx.expected_output_tokens)
        if state is None:
            return facts
        facts["last_prefill"] = state.last_prefill
        facts["local_keeps_handle"] = self._local_handle_due(ctx, state.decode)
        if prompt_ids is not None and state.last_tokens is not None:
            facts["suffix_tokens"] = max(0, len(prompt_ids) - state.last_tokens)
        if state.avg_suffix_tokens is not None:
            facts["next_suffix_tokens"] = round(state.avg_suffix_tokens)
        facts["decode_elsewhere"] = _elsewhere(state.elsewhere, ctx.decode_cached)
        ctx.prefill_cached = self._prefill_cached(state.prefill_copies, ctx.decode_cached)
        facts["prefill_cached"] = tuple(ctx.prefill_cached.items())
        return facts

    def _arrival(self, the_plan: Plan) -> tuple[float, float] | None:
        """When a P/D turn should reach its D (gateway clock) and D's read seconds, from its cost decision;
        None when nothing reads it (arrival_weight off)."""
        d = the_plan.decision
        if d is None or d.option == "decode_local" or self.knobs.arrival_weight <= 0.0:
            return None
        return self.clock() + d.arrive_s, d.d_read_s

    def _kept(self, result: LegResult, params: dict[str, Any], decode: str,
              block_size: int) -> tuple[dict[str, Any], HeldSequence | None]:
        """D's handle as the next prefill will send it (host rewritten), and the tokens it holds (guarded)."""
        handle = B.with_host(params, host_of(decode))
        n = handle_num_tokens(handle)
        if not (self.config.guarded and n and result.prompt_ids is not None):
            return handle, None
        return handle, HeldSequence.from_tokens(B.held_tokens(result.prompt_ids, result.output_ids, n), block_size)

    def _local_handle_due(self, ctx: TurnContext, decode: str | None) -> bool:
        """Whether a decode-local turn on `decode` would come back with a handle: marked (config), on a D not
        seen to drop marks, and not a stream on vLLM < 0.33 (whose streams carry no handle)."""
        node = self.cluster.nodes.get(decode) if decode is not None else None
        if not self.config.local_turn_handles or node is None or node.local_handles is False:
            return False
        return not ctx.stream or node.stream_handles

    def _prefill_cached(self, copies: tuple[PrefillCopy, ...], overlap: int) -> dict[str, int]:
        """Per P with prefix caching on: how much of this prompt its cache likely still holds (the session's
        copies there, cut to the prompt's verified overlap with the history, eviction discounted)."""
        out: dict[str, int] = {}
        for c in PC.cut(copies, overlap):
            node = self.cluster.nodes.get(c.url)
            if node is None or node.role != "prefill" or node.prefix_caching is not True:
                continue
            kept = PC.surviving(c, self.prefill_written.get(c.url, 0), node.kv_capacity_tokens, node.kv_usage)
            if kept > 0:
                out[c.url] = kept
        return out

    # ---- learning node speeds (the estimator behind "auto"; fed in every policy) --------------------

    def _load_at_plan(self, ctx: TurnContext, node: str) -> tuple[float, float]:
        """(running, waiting) of `node` as the plan saw it: what this leg queued behind."""
        view = ctx.plan_view
        for n in (*view.prefill, *view.decode) if view is not None else ():
            if n.url == node:
                return n.running, n.waiting
        return 0.0, 0.0

    def _learn_prefill(self, ctx: TurnContext, node: str, usage: Any, cached: int, seconds: float,
                       kv: dict[str, Any] | None) -> None:
        if not self.config.learn_estimates or not isinstance(usage, dict):
            return
        prompt = usage.get("prompt_tokens")
        if not isinstance(prompt, int) or prompt <= cached:
            return
        running, waiting = self._load_at_plan(ctx, node)
        pulled = (handle_num_tokens(kv) or 0) if kv is not None else 0
        holder = ctx.state.decode if ctx.state is not None else None
        self.estimator.observe_prefill_leg(node, prompt - cached, cached, seconds, now=self.clock(),
                                           ahead=running + waiting, pulled_tokens=pulled, pulled_from=holder)

    def _count_written(self, ctx: TurnContext, node: str, usage: Any, cached: int, *, pulled: bool) -> None:
        prompt = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        if not isinstance(prompt, int):
            return
        # Without a handle P's cached tokens are its own hit; with one they include what it read from D
        # (which its cache takes in too), so the plan's estimate of its own hit stands in.
        hit = ctx.prefill_cached.get(node, 0) if pulled else cached
        self.prefill_written[node] = self.prefill_written.get(node, 0) + PC.new_kv_tokens(prompt, hit)

    def _learn_decode(self, ctx: TurnContext, the_plan: Plan, result: LegResult, now: float) -> None:
        """D's side of a finished turn: a decode-local first-token time (local prefill) when nothing queued
        ahead of it, and its decode step time from the stream's inter-token gaps."""
        if not (self.config.learn_estimates and result.ok) or self.config.mode == "aggregated":
            return
        node = the_plan.decode
        running, waiting = self._load_at_plan(ctx, node)
        usage = result.usage if isinstance(result.usage, dict) else {}
        prompt = usage.get("prompt_tokens") if isinstance(usage.get("prompt_tokens"), int) else None
        if prompt is None and result.prompt_ids is not None:
            prompt = len(result.prompt_ids)  # a stream without usage: D's first chunk carries the prompt ids
        # Streams only: a non-streamed answer has no first-token time (its latency is the whole decode).
        if (result.first_chunk is not None and ctx.final_leg_at is not None and prompt is not None
                and waiting == 0):
            first_at = ctx.t0 + result.first_chunk
            if the_plan.action is HandleAction.DECODE_LOCAL:
                # D's own count when usage came back, else what the gateway verified it holds.
                cached = B.cached_tokens(usage) if usage else ctx.decode_cached
                seconds: float | None = first_at - ctx.final_leg_at
                if running > 0:
                    seconds = self._mixed_step_s(ctx, node, running, result, prompt - cached, first_at, now)
                log.debug("local prefill %s on %s: %d tok after %d, %g running: first chunk %.4fs after send, "
                          "learned %s", ctx.session_id, node, prompt - cached, cached, running,
                          first_at - ctx.final_leg_at, "-" if seconds is None else f"{seconds:.4f}s")
                if seconds is not None:
                    self.estimator.observe_prefill(node, prompt - cached, cached, seconds, now=now)
            # Not learned here: the P→D transfer from D's first token after a P leg. That time is mostly D's
            # request handling (template, tokenizing, admission) for a read of a few blocks, and the link's
            # fit is shared with the D→P pull: it taught the policy that every pull is slow.
        if result.out_first_at is not None and result.out_last_at is not None and result.out_tokens_timed >= 2:
            gap = (result.out_last_at - result.out_first_at) / result.out_tokens_timed
            self.estimator.observe_tpot(node, running + 1, gap, now=now)

    def _mixed_step_s(self, ctx: TurnContext, node: str, running: float, result: LegResult, tokens: int,
                      first_at: float, now: float) -> float | None:
        """How long the engine step that prefilled a local suffix took, read off the other streams on D.

        On a busy D this, not the turn's time to first token, is the local prefill's cost: the running
        requests waited exactly this step for their next token (the stall is it less a plain decode step),
        while the turn's own wait also holds D's request handling and the step in flight when it arrived
        (a stall learned from that overcharges every local turn on a busy D, where the budget matters).
        None when it cannot be read: a suffix over several chunked steps, or no other stream's chunk between
        this leg's send and its first chunk (nothing streaming there, or only non-streamed requests).
        """
        if tokens > self.knobs.chunk_tokens or ctx.final_leg_at is None:
            return None
        # Chunks of one step arrive within relay jitter of each other; a step apart, a decode step or more.
        same_step = 0.5 * self.estimator.snapshot(now).tpot_s(node, running)
        start = step_start(result.arrivals_before_first, ctx.final_leg_at, first_at, same_step)
        return None if start is None else first_at - start

    def _stall_budget(self, node: str, now: float) -> StallBudget:
        budget = self.stall_budgets.get(node)
        if budget is None:
            budget = StallBudget.full(self.knobs.decode_stall_share, self.knobs.decode_stall_window_s, now)
            self.stall_budgets[node] = budget
        return budget

    def _enter_decoding(self, ctx: TurnContext, node: str) -> None:
        """D has begun decoding this turn's answer: it gets its TPOT quota of stall (stallquota.py)."""
        share = self.config.request_stall_share
        if share >= 1.0 or self.config.policy != "auto":
            return
        self._leave_decoding(ctx)  # a leg retried after a failure: one entry per turn, on the node it runs on
        n = self.cluster.nodes.get(node)
        running = n.load().running if n is not None else 1.0  # polled gauge or this gateway's own, the fresher
        step = self.estimator.snapshot(self.clock()).tpot_s(node, max(1.0, running))
        key = next(self._exposure_keys)
        self.exposures.setdefault(node, {})[key] = SQ.Exposure(SQ.quota_s(share, ctx.expected_output_tokens, step))
        ctx.exposure = (node, key)

    def _leave_decoding(self, ctx: TurnContext) -> None:
        if ctx.exposure is not None:
            node, key = ctx.exposure
            ctx.exposure = None
            mine = self.exposures.get(node)
            if mine is not None:
                mine.pop(key, None)
                if not mine:
                    del self.exposures[node]

    def _plan(self, ctx: TurnContext, turn: Turn) -> Plan:
        now = self.clock()
        credit = self._stall_budget(turn.pinned_decode, now).credit(now) if turn.pinned_decode else math.inf
        quotas = SQ.credit(self.exposures.get(turn.pinned_decode or "", {}).values())
        turn = replace(turn, exclude=frozenset(ctx.exclude), decode_stall_credit_s=credit,
                       ttft_tail_s=self.tail.threshold(), request_stall_credit_s=quotas.credit_s,
                       request_stall_quota_s=quotas.quota_s)
        with self.tracer.start_as_current_span(T.SPAN_PLAN, context=ctx.parent_ctx, kind=T.KIND_INTERNAL) as span:
            view = self.cluster.view(now)
            ctx.plan_view = view
            try:
                p = plan(turn, view, self.estimator.snapshot(now), self.knobs)
            except NoCapacity as exc:
                span.set_attribute(T.ERROR_TYPE, "no_capacity")
                raise GatewayError(503, str(exc), code="no_capacity") from None
            if p.decision is not None and p.action is HandleAction.DECODE_LOCAL:
                # Planning and spending happen without an await between them, so two turns planned at once
                # on the same D cannot both take the last of its budget.
                stall = next((o.stall_s for o in p.decision.options if o.option == "decode_local"), 0.0)
                self.stall_budgets[p.decode] = self._stall_budget(p.decode, now).spend(stall, now)
                if p.decode in self.exposures:
                    self.exposures[p.decode] = SQ.absorb(self.exposures[p.decode], stall)
                self.metrics.decode_stall.labels(p.decode).inc(stall)
            if p.decision is not None:
                T.set_attrs(span, T.cost_attributes(p.decision.trace_attributes()))
                if p.decision.policy == "auto" and not p.decision.forced:
                    self.tail.observe(p.decision.estimates_s.get(p.decision.option, math.inf))
            T.set_attrs(span, {T.ATTR_POLICY: turn.policy, T.ATTR_PLAN_ACTION: p.action.value,
                               T.ATTR_PLAN_REASON: p.reason, T.ATTR_PREFILL: p.prefill, T.ATTR_DECODE: p.decode,
                               T.ATTR_HANDLE_OUTCOME: p.handle_outcome, T.ATTR_REUSE_TOKENS: p.reuse_tokens,
                               T.ATTR_RE_PLACED: p.re_placed})
        T.set_attrs(ctx.span, {T.ATTR_PLAN_ACTION: p.action.value, T.ATTR_PLAN_REASON: p.reason})
        log.debug("plan %s: %s", ctx.session_id, p.reason)
        return p

    async def _prefill_with_recovery(self, ctx: TurnContext, the_plan: Plan,
                                     kv: dict[str, Any] | None) -> tuple[Prefilled, Plan]:
        for _ in range(1 + len(self.cluster.role("prefill"))):
            assert the_plan.prefill is not None
            try:
                return await self._prefill(ctx, the_plan.prefill, kv), the_plan
            except UpstreamFailure as failure:
                self._count_error(failure)
                if kv is not None:
                    # Protocol §2: an expired or failed pull errors the prefill; retry once without the handle.
                    self.metrics.handle_outcomes.labels("retried_cold").inc()
                    ctx.span.set_attribute(T.ATTR_RETRIED, True)
                    kv = None
                    continue
                if not failure.node_fault:
                    raise
                self.cluster.mark_failed(failure.node, str(failure), hard=failure.unreachable)
                ctx.exclude.add(failure.node)
                turn = Turn(policy=self.config.effective_policy, new_session=False, pinned_decode=the_plan.decode,
                            round_robin=self._next_rr(), exclude=frozenset(ctx.exclude))
                try:
                    the_plan = self._plan(ctx, turn)
                except GatewayError:
                    raise failure from None  # no other prefill node: report what went wrong upstream
        raise GatewayError(502, "every prefill node failed", type_="upstream_error", code="upstream_failed")

    # ---- upstream legs -------------------------------------------------------------------------

    def _leg_span(self, ctx: TurnContext, node: str, leg: str) -> trace.Span:
        operation = "chat" if ctx.kind == "chat" else "text_completion"
        span = self.tracer.start_span(T.chat_span_name(operation, ctx.model), context=ctx.parent_ctx,
                                      kind=T.KIND_CLIENT)
        host = host_of(node)
        port = httpx.URL(node).port
        T.set_attrs(span, {T.GEN_AI_OPERATION: operation, T.GEN_AI_PROVIDER: T.PROVIDER,
                           T.GEN_AI_REQUEST_MODEL: ctx.model, T.SERVER_ADDRESS: host, T.SERVER_PORT: port,
                           T.ATTR_LEG: leg, T.ATTR_TURN: ctx.state.turns if ctx.state else 0,
                           T.GEN_AI_CONVERSATION_ID: ctx.session_id if ctx.session_source == "header" else None,
                           T.GEN_AI_REQUEST_STREAM: True if (ctx.stream and leg != "prefill") else None,
                           T.GEN_AI_REQUEST_MAX_TOKENS: ctx.body.get("max_tokens")})
        return span

    def _upstream_headers(self, ctx: TurnContext, span: trace.Span) -> dict[str, str]:
        out = {k: ctx.headers[k] for k in _FORWARD_HEADERS if k in ctx.headers}
        propagate.inject(out, context=trace.set_span_in_context(span))
        return out

    def _count_error(self, failure: UpstreamFailure) -> None:
        self.metrics.upstream_errors.labels(failure.node, failure.phase).inc()

    async def _tokenize(self, ctx: TurnContext) -> list[int] | None:
        view = self.cluster.view()
        nodes = [n for n in view.prefill if n.healthy] or list(view.prefill)
        if not nodes:
            return None
        node = min(nodes, key=lambda n: (n.score, n.url)).url
        payload = B.tokenize_body(ctx.kind, ctx.body)
        if payload is None:
            return None
        with self.tracer.start_as_current_span(T.SPAN_TOKENIZE, context=ctx.parent_ctx, kind=T.KIND_INTERNAL) as span:
            span.set_attribute(T.ATTR_PREFILL, node)
            started = time.perf_counter()
            try:
                try:
                    resp = await self.tokenize_client.post(f"{node}/tokenize", json=payload,
                                                  timeout=httpx.Timeout(self.config.tokenize_timeout_s,
                                                                        connect=self.config.connect_timeout_s))
                finally:
                    ctx.upstream_s += time.perf_counter() - started
                if resp.status_code != 200:
                    raise UpstreamFailure(node, "tokenize", f"HTTP {resp.status_code}", resp.status_code)
                tokens = resp.json().get("tokens")
                if not isinstance(tokens, list):
                    raise UpstreamFailure(node, "tokenize", "no tokens in /tokenize answer", resp.status_code)
                span.set_attribute(T.ATTR_PROMPT_TOKENS, len(tokens))
                return [int(t) for t in tokens]
            except (httpx.HTTPError, ValueError) as exc:
                self._count_error(UpstreamFailure(node, "tokenize", str(exc)))
            except UpstreamFailure as failure:
                self._count_error(failure)
            span.set_attribute(T.ERROR_TYPE, "tokenize_failed")
            return None

    async def _prefill(self, ctx: TurnContext, node: str, kv: dict[str, Any] | None) -> Prefilled:
        span = self._leg_span(ctx, node, "prefill")
        started = time.perf_counter()
        self.cluster.begin(node)
        try:
            payload = B.prefill_body(ctx.body, kv)
            # A leg with a handle gets a bound (pull_timeout_s): a stuck pull is retried without the handle.
            # A cold leg keeps the client's read timeout: it may legitimately compute for a long time.
            timeout = self.client.timeout
            if kv is not None:
                c = self.config
                timeout = httpx.Timeout(connect=c.connect_timeout_s, read=c.pull_timeout_s,
                                        write=c.write_timeout_s, pool=c.pool_timeout_s)
            try:
                resp = await self.client.post(f"{node}{PATHS[ctx.kind]}", json=payload,
                                              headers=self._upstream_headers(ctx, span), timeout=timeout)
            except httpx.ReadTimeout:
                raise UpstreamFailure(node, "prefill", f"prefill with a handle did not answer within "
                                      f"{self.config.pull_timeout_s:g} s") from None
            except httpx.HTTPError as exc:
                raise UpstreamFailure(node, "prefill", f"{type(exc).__name__}: {exc}",
                                     unreachable=_unreachable(exc)) from None
            finally:
                ctx.upstream_s += time.perf_counter() - started
            data = _json_or_none(resp)
            if resp.status_code != 200 or not isinstance(data, dict):
                raise UpstreamFailure(node, "prefill", f"HTTP {resp.status_code}", resp.status_code, data)
            self.cluster.mark_ok(node)
            params = data.get(B.KV_FIELD)
            usage = data.get("usage")
            cached = B.cached_tokens(usage)
            T.set_attrs(span, {T.GEN_AI_RESPONSE_TTFC: time.perf_counter() - started,
                               T.GEN_AI_USAGE_INPUT: usage.get("prompt_tokens") if isinstance(usage, dict) else None,
                               T.GEN_AI_USAGE_CACHE_READ: cached})
            self._learn_prefill(ctx, node, usage, cached, time.perf_counter() - started, kv)
            self._count_written(ctx, node, usage, cached, pulled=kv is not None)
            return Prefilled(params if isinstance(params, dict) else None, cached, kv is not None)
        except UpstreamFailure as failure:
            span.set_attribute(T.ERROR_TYPE, str(failure.status or "connection"))
            span.set_status(trace.Status(trace.StatusCode.ERROR, str(failure)))
            raise
        finally:
            self.cluster.end(node)
            span.end()

    async def _final_leg(self, ctx: TurnContext, the_plan: Plan, payload: dict[str, Any], leg: str,
                         source: str) -> Response:
        """The leg whose answer the client sees: D in P/D mode, the replica in aggregated mode."""
        node = the_plan.decode
        span = self._leg_span(ctx, node, leg)
        headers = self._upstream_headers(ctx, span)
        url = f"{node}{PATHS[ctx.kind]}"
        self.cluster.begin(node)  # ended by _finish, or below on failure
        ctx.final_leg_at = time.perf_counter()
        sresp: httpx.Response | None = None
        try:
            if not ctx.stream:
                # A non-streamed answer is the first thing its client sees: every stall on D delays it.
                self.cluster.hold_back(node, 1)
                self._enter_decoding(ctx, node)
                try:
                    resp = await self.client.post(url, json=payload, headers=headers)
                except httpx.HTTPError as exc:
                    raise UpstreamFailure(node, leg, f"{type(exc).__name__}: {exc}",
                                     unreachable=_unreachable(exc)) from None
                finally:
                    self.cluster.hold_back(node, -1)
                data = _json_or_none(resp)
                if resp.status_code != 200 or not isinstance(data, dict):
                    raise UpstreamFailure(node, leg, f"HTTP {resp.status_code}", resp.status_code, data)
            else:
                req = self.client.build_request("POST", url, json=payload, headers=headers)
                try:
                    sresp = await self.client.send(req, stream=True)
                except httpx.HTTPError as exc:
                    raise UpstreamFailure(node, leg, f"{type(exc).__name__}: {exc}",
                                     unreachable=_unreachable(exc)) from None
                if sresp.status_code != 200:
                    with contextlib.suppress(httpx.HTTPError):
                        await sresp.aread()
                    await sresp.aclose()
                    raise UpstreamFailure(node, leg, f"HTTP {sresp.status_code}", sresp.status_code,
                                          _json_or_none(sresp))
                lines = sresp.aiter_lines()
                preamble = await _read_preamble(sresp, lines, node, leg)
        except BaseException as exc:  # a failure, or the client leaving (cancelled): nothing is left open
            if isinstance(exc, UpstreamFailure):
                span.set_attribute(T.ERROR_TYPE, str(exc.status or "connection"))
                span.set_status(trace.Status(trace.StatusCode.ERROR, str(exc)))
            span.end()
            self.cluster.end(node)
            self._leave_decoding(ctx)
            if sresp is not None and not isinstance(exc, UpstreamFailure):
                with anyio.CancelScope(shield=True):
                    await sresp.aclose()
            raise
        self.cluster.mark_ok(node)
        if not ctx.stream:
            result = LegResult(ok=True, usage=data.get("usage"), ttft=time.perf_counter() - ctx.t0)
            _read_body(data, result)
            B.strip_internal(data, keep_token_ids=ctx.keep_token_ids)
            await self._finish(ctx, the_plan, result, span, source)
            return JSONResponse(data, headers=ctx.response_headers)
        assert sresp is not None
        # The reuse decision is final before the decode leg starts, so it can go into the stream's headers.
        return StreamingResponse(self._relay(ctx, the_plan, sresp, _chain(preamble, lines), span, source),
                                 media_type="text/event-stream",
                                 headers={"cache-control": "no-cache", **ctx.response_headers})

    async def _relay(self, ctx: TurnContext, the_plan: Plan, resp: httpx.Response, lines: AsyncIterator[str],
                     span: trace.Span, source: str) -> AsyncIterator[bytes]:
        """SSE passthrough, line by line; lines are parsed only for timing, the handle and token ids."""
        result = LegResult()
        answer = B.StreamAnswer()
        first_chunk = True
        finished = False
        try:
            async for line in lines:
                if line.startswith("data:"):
                    payload = line[5:].strip()
                    if first_chunk:
                        first_chunk = False
                        span.add_event(T.EVENT_FIRST_CHUNK)
                        span.set_attribute(T.GEN_AI_RESPONSE_TTFC, time.perf_counter() - ctx.t0)
                    if payload == "[DONE]" and not finished:
                        # Record D's handle before the client sees the end of the stream: an agent
                        # sends its next turn right after [DONE], and that turn must find the handle.
                        finished = True
                        result.answer = answer.message()
                        await self._finish(ctx, the_plan, result, span, source)
                    elif payload and payload != "[DONE]":
                        seen_first = result.first_chunk is not None
                        line = self._relay_chunk(ctx, the_plan.decode, payload, result, answer, span) or line
                        if result.first_chunk is not None:
                            self._time_chunk(ctx, the_plan, result, seen_first)
                yield (line + "\n").encode()
        except httpx.HTTPError as exc:
            failure = UpstreamFailure(the_plan.decode, "aggregated" if self.config.mode == "aggregated" else "decode",
                                      f"{type(exc).__name__}: {exc}")
            self._count_error(failure)
            self.cluster.mark_failed(the_plan.decode, str(failure), hard=False)
            span.set_attribute(T.ERROR_TYPE, "stream_broken")
            result.ok = False
            yield sse_error(f"upstream stream failed: {failure}")
        finally:
            with anyio.CancelScope(shield=True):
                await resp.aclose()
                if not finished:
                    # The client left or the stream broke: keep the pin; keep the handle only if D finished.
                    result.answer = answer.message()
                    await self._finish(ctx, the_plan, result, span, source)

    def _time_chunk(self, ctx: TurnContext, the_plan: Plan, result: LegResult, seen_first: bool) -> None:
        at = time.perf_counter()
        node = the_plan.decode
        # Only a decode-local turn's mixed step is learned from (_mixed_step_s); read before this stream's own
        # first chunk joins the record, so only other streams' bursts are in it.
        if not seen_first and ctx.final_leg_at is not None and the_plan.action is HandleAction.DECODE_LOCAL:
            result.arrivals_before_first = self.chunk_times.since(node, ctx.final_leg_at)[-_STEP_ARRIVALS:]
        self.chunk_times.record(node, at)

    def _relay_chunk(self, ctx: TurnContext, node: str, payload: str, result: LegResult, answer: B.StreamAnswer,
                     span: trace.Span) -> str | None:
        """Reads one SSE data payload; returns a replacement line when internal fields had to go."""
        try:
            chunk = json.loads(payload)
        except ValueError:
            return None
        if not isinstance(chunk, dict):
            return None
        if result.first_chunk is None and chunk.get("choices"):
            result.first_chunk = time.perf_counter() - ctx.t0
            self._enter_decoding(ctx, node)
            if not B.has_first_token(chunk):
                # D produced the first token but the client sees nothing yet (a tool-call parser holds the
                # name back): a local prefill's stall now delays this turn's TTFT itself.
                result.holding_back = True
                self.cluster.hold_back(node, 1)
        if result.ttft is None and B.has_first_token(chunk):
            result.ttft = time.perf_counter() - ctx.t0
            span.add_event(T.EVENT_FIRST_TOKEN)
            ctx.span.add_event(T.EVENT_FIRST_TOKEN)
            self._release_hold_back(node, result)
        ids = B.prompt_ids_of(chunk)
        if ids is not None and result.prompt_ids is None:
            result.prompt_ids = ids
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            out = B.output_ids_of(choice)
            if out:
                result.output_ids.extend(out)
                _time_output(result, len(out))
            answer.add(choice)
            if choice.get("finish_reason"):
                result.finish_reasons.append(str(choice["finish_reason"]))
                result.ok = True
        params = chunk.get(B.KV_FIELD)
        if isinstance(params, dict):
            result.handle = params
        if "error" in chunk:
            result.ok = False
        if chunk.get("usage"):
            result.usage = chunk["usage"]
        if B.strip_internal(chunk, keep_token_ids=ctx.keep_token_ids):
            return "data: " + json.dumps(chunk, separators=(",", ":"), ensure_ascii=False)
        return None

    # ---- end of a turn -----------------------------------------------------------------------

    def _release_hold_back(self, node: str, result: LegResult) -> None:
        if result.holding_back:
            result.holding_back = False
            self.cluster.hold_back(node, -1)

    async def _finish(self, ctx: TurnContext, the_plan: Plan, result: LegResult, span: trace.Span,
                      source: str) -> None:
        self._release_hold_back(the_plan.decode, result)
        try:
            usage = result.usage if isinstance(result.usage, dict) else {}
            if the_plan.prefill is None and source == "none" and B.cached_tokens(usage):
                source = "prefill_cache"
            T.set_attrs(span, {T.GEN_AI_RESPONSE_FINISH_REASONS: result.finish_reasons or None,
                               T.GEN_AI_USAGE_INPUT: usage.get("prompt_tokens"),
                               T.GEN_AI_USAGE_OUTPUT: usage.get("completion_tokens"),
                               T.GEN_AI_USAGE_CACHE_READ: B.cached_tokens(usage) if usage else None,
                               T.ATTR_REUSE_SOURCE: source, T.ATTR_TTFT: result.ttft})
            # The gateway's own share: until the final leg was sent, less the time awaiting tokenize/prefill
            # (from there on it only relays, and the first token's arrival is the TTFT's end).
            overhead = (max(0.0, ctx.final_leg_at - ctx.t0 - ctx.upstream_s)
                        if result.ttft is not None and ctx.final_leg_at is not None else None)
            T.set_attrs(ctx.span, {T.ATTR_REUSE_SOURCE: source, T.ATTR_TTFT: result.ttft,
                                   T.ATTR_GATEWAY_OVERHEAD: overhead,
                                   T.ATTR_PREFILL: the_plan.prefill, T.ATTR_DECODE: the_plan.decode})
            if result.ttft is not None:
                self.metrics.observe_ttft(source, self.config.mode, result.ttft, overhead)
            await self._remember(ctx, the_plan, result)
        except Exception:  # the client already has its answer; bookkeeping must not turn it into an error
            log.exception("failed to record the end of a turn")
        finally:
            self.cluster.end(the_plan.decode)
            self._leave_decoding(ctx)
            span.end()

    async def _remember(self, ctx: TurnContext, the_plan: Plan, result: LegResult) -> None:
        if ctx.session_id is None:
            return
        now = self.clock()
        prior = ctx.state
        policy = self.config.effective_policy
        handle: dict[str, Any] | None = None
        held: HeldSequence | None = None
        handle_at: float | None = now
        block_size = self.cluster.block_size(the_plan.decode)
        local = the_plan.action is HandleAction.DECODE_LOCAL
        if result.ok and the_plan.prefill is not None and policy in ("pull", "reference", "auto"):
            if result.handle is None:
                self.metrics.stream_handles_missing.inc()
            else:
                handle, held = self._kept(result, result.handle, the_plan.decode, block_size)
        elif local and result.ok and result.handle is not None and self.config.local_turn_handles:
            # D kept the marked local turn's blocks: a handle of the whole sequence, newer than the one this
            # turn did not use (that one is never pulled now; D frees it at its TTL).
            self.cluster.note_local_handles(the_plan.decode, True)
            self.metrics.local_handles.labels("kept").inc()
            if ctx.unused_handle is not None:
                self.metrics.local_handles.labels("superseded").inc()
            handle, held = self._kept(result, result.handle, the_plan.decode, block_size)
        elif local:
            if result.ok and self._local_handle_due(ctx, the_plan.decode):
                # Marked, due, and none came back: this D does not keep local turns (no bidirectional_kv_xfer).
                self.cluster.note_local_handles(the_plan.decode, False)
                self.metrics.local_handles.labels("missing").inc()
            if ctx.unused_handle is not None:
                # The handle this turn did not use still pins a prefix of the history on D, so a later turn
                # may pull it (and so free it) before it expires.
                handle, held, handle_at = ctx.unused_handle.handle, ctx.unused_handle.held, ctx.unused_handle.handle_at
        # What D's prefix cache holds now (prompt + output − 1: the last sampled token has no KV), handle or
        # not: the cost policy's decode_cached_tokens next turn. Learned from D's token ids.
        cached: HeldSequence | None = None
        total: int | None = None
        if result.ok and result.prompt_ids is not None and policy == "auto":
            total = len(result.prompt_ids) + len(result.output_ids)
            cached = HeldSequence.from_tokens(
                B.held_tokens(result.prompt_ids, result.output_ids, max(0, total - 1)), block_size)
        self._learn_decode(ctx, the_plan, result, now)
        prefix_key = None
        if ctx.kind == "chat" and ctx.session_source in ("new", "prefix") and result.answer is not None:
            _, prefix_key = B.chat_keys(ctx.body, result.answer)
        current = await self.store.get(ctx.session_id)
        base = current or prior
        avg_out, avg_suffix = _running_means(base, result, total)
        elsewhere: tuple[tuple[str, int], ...] = ()
        copies = self._copies_after(ctx, the_plan, result) if policy == "auto" else ()
        if prior is not None and policy == "auto":
            # What D's the pin leaves or left still hold of this prompt, for a later move back there.
            elsewhere = _elsewhere(prior.elsewhere, ctx.decode_cached, drop=the_plan.decode)
            if prior.decode is not None and prior.decode != the_plan.decode and ctx.decode_cached > 0:
                elsewhere = (*elsewhere, (prior.decode, ctx.decode_cached))[-_ELSEWHERE_MAX:]
        await self.store.put(SessionState(
            session_id=ctx.session_id,
            decode=the_plan.decode,
            handle=handle,
            held=held,
            handle_at=handle_at if handle is not None else None,
            expires_at=now + self.config.session_ttl_s,
            turns=(base.turns if base else 0) + 1,
            created_at=base.created_at if base else now,
            prefix_key=prefix_key,
            cached=cached,
            last_tokens=total,
            last_prefill=the_plan.prefill or (base.last_prefill if base else None),
            avg_output_tokens=avg_out,
            avg_suffix_tokens=avg_suffix,
            elsewhere=elsewhere,
            prefill_copies=copies,
        ))
        self.metrics.pinned_sessions.set(await self.store.count())

    def _copies_after(self, ctx: TurnContext, the_plan: Plan, result: LegResult) -> tuple[PrefillCopy, ...]:
        """The session's prefix-cache copies on P once this turn ran: its P (with prefix caching on) holds the
        prompt; the others are cut to the prompt's overlap with the history they were prefixes of."""
        prior = ctx.state.prefill_copies if ctx.state is not None else ()
        url = the_plan.prefill
        node = self.cluster.nodes.get(url) if url is not None else None
        if node is None or node.prefix_caching is not True or not result.ok or result.prompt_ids is None:
            return PC.cut(prior, ctx.decode_cached, drop=url)
        assert url is not None
        return PC.after_prefill(prior, ctx.decode_cached, url, len(result.prompt_ids), self.cluster.block_size(url),
                                self.prefill_written.get(url, 0))

    # ---- aggregated ----------------------------------------------------------------------------

    async def _aggregated(self, ctx: TurnContext) -> Response:
        pinned = ctx.state.decode if ctx.state else None
        for attempt in range(2):
            try:
                the_plan = plan_aggregated(pinned, self.cluster.aggregated_view(), frozenset(ctx.exclude))
            except NoCapacity as exc:
                return GatewayError(503, str(exc), code="no_capacity").response()
            T.set_attrs(ctx.span, {T.ATTR_PLAN_REASON: the_plan.reason, T.ATTR_DECODE: the_plan.decode})
            try:
                return await self._final_leg(ctx, the_plan, B.decode_body(ctx.body, None, want_token_ids=False),
                                             "aggregated", "none")
            except UpstreamFailure as failure:
                self._count_error(failure)
                if not failure.node_fault or attempt == 1:
                    return failure.client_response()
                self.cluster.mark_failed(failure.node, str(failure), hard=failure.unreachable)
                ctx.exclude.add(failure.node)
        raise AssertionError("unreachable")  # pragma: no cover


_ELSEWHERE_MAX = 8  # decode nodes a session remembers having left (a cluster rarely has more worth going back to)


def _elsewhere(left: tuple[tuple[str, int], ...], overlap: int, *,
               drop: str | None = None) -> tuple[tuple[str, int], ...]:
    """Other D's prefixes of the session's history, each cut to this prompt's verified overlap with that
    history (`overlap`: what the pinned D's prefix cache shares with the prompt). Each entry is a prefix of
    the history, so it shares min(tokens, overlap) with the prompt; `drop`: the D the pin moves to."""
    return tuple((url, min(n, overlap)) for url, n in left if url != drop and min(n, overlap) > 0)


async def _read_preamble(resp: httpx.Response, lines: AsyncIterator[str], node: str, leg: str) -> list[str]:
    """Hold back the stream's lines up to its first chunk with choices (or end): an error event there means
    the client has seen nothing yet, so the turn can still be retried as a whole (e.g. D failed to read
    P's KV). vLLM sends that chunk (the role chunk) with the first engine output, i.e. once D has the KV and
    the first token, so nothing retryable comes after it; from there lines are relayed as they come.

    Not up to the first content or tool-call delta: a tool-call parser holds that back for several decode
    steps, and holding the stream meanwhile delayed the client's first chunk and stamped the turn's first
    token (and every chunk held with it) that much late, which the estimator then learned as prefill."""
    held: list[str] = []
    try:
        async for line in lines:
            held.append(line)
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            try:
                chunk = json.loads(payload)
            except ValueError:
                break
            if not isinstance(chunk, dict):
                break
            if "error" in chunk:
                err = chunk["error"]
                code = err.get("code") if isinstance(err, dict) else None
                status = code if isinstance(code, int) and 400 <= code < 600 else 500
                raise UpstreamFailure(node, leg, f"error event before the first token: {err}", status, chunk)
            if chunk.get("choices") or B.has_first_token(chunk):
                break
    except httpx.HTTPError as exc:
        await resp.aclose()
        raise UpstreamFailure(node, leg, f"{type(exc).__name__}: {exc}",
                                     unreachable=_unreachable(exc)) from None
    except UpstreamFailure:
        await resp.aclose()
        raise
    return held


async def _chain(first: list[str], rest: AsyncIterator[str]) -> AsyncIterator[str]:
    for line in first:
        yield line
    async for line in rest:
        yield line


def _unreachable(exc: httpx.HTTPError) -> bool:
    return isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout)


def _json_or_none(resp: httpx.Response) -> Any:
    try:
        return resp.json()
    except (ValueError, httpx.ResponseNotRead):
        return None


def _read_body(data: dict[str, Any], result: LegResult) -> None:
    params = data.get(B.KV_FIELD)
    result.handle = params if isinstance(params, dict) else None
    result.prompt_ids = B.prompt_ids_of(data)
    choices = data.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        first = choices[0]
        result.output_ids = B.output_ids_of(first) or []
        result.answer = B.answer_message(first)
        if first.get("finish_reason"):
            result.finish_reasons = [str(c.get("finish_reason")) for c in choices if isinstance(c, dict)]
    result.ok = bool(result.finish_reasons)


def _seeds(config: GatewayConfig) -> EstimatorSeeds:
    return EstimatorSeeds(
        prefill_overhead_s=config.seed_prefill_overhead_s, prefill_s_per_token=config.seed_prefill_s_per_token,
        prefill_s_per_pair=config.seed_prefill_s_per_pair, transfer_latency_s=config.seed_transfer_latency_s,
        transfer_s_per_token=config.seed_transfer_s_per_token, tpot_base_s=config.seed_tpot_base_s,
        tpot_s_per_seq=config.seed_tpot_s_per_seq, queue_s_per_request=config.seed_queue_s_per_request)


def _knobs(config: GatewayConfig) -> PolicyKnobs:
    return PolicyKnobs(
        mode="auto", max_local_suffix_tokens=config.max_local_suffix_tokens, tpot_budget_s=config.tpot_budget_s,
        tpot_window_tokens=config.tpot_window_tokens, interference_weight=config.interference_weight,
        decode_stall_share=config.decode_stall_share, decode_stall_window_s=config.decode_stall_window_s,
        horizon_turns=config.horizon_turns, horizon_discount=config.horizon_discount,
        recompute_threshold_tokens=config.min_reuse_tokens, handle_ttl_s=config.session_ttl_s,
        block_size=config.block_size or 16, chunk_tokens=config.chunk_tokens,
        evict_kv_usage_knee=config.evict_kv_usage_knee, rebalance_decode=config.rebalance_decode,
        tail_weight=config.tail_weight, tail_quantile=config.tail_quantile, arrival_weight=config.arrival_weight,
        holdback_weight=config.holdback_weight)


_STEP_ARRIVALS = 16  # chunk arrivals kept per leg to find the step before its first chunk


def _time_output(result: LegResult, n: int) -> None:
    """Timestamps of streamed output: gaps after the first chunk are decode steps (TPOT samples)."""
    t = time.perf_counter()
    if result.out_first_at is None:
        result.out_first_at = t
        return
    result.out_last_at = t
    result.out_tokens_timed += n


def _running_means(base: SessionState | None, result: LegResult,
                   total: int | None) -> tuple[float | None, float | None]:
    """The session's mean answer length and mean suffix (what a turn adds to the last prompt + answer),
    exponentially weighted: what the policy's look-ahead expects of the next turn."""
    w = 0.3
    avg_out = base.avg_output_tokens if base is not None else None
    avg_suffix = base.avg_suffix_tokens if base is not None else None
    usage = result.usage if isinstance(result.usage, dict) else {}
    out = len(result.output_ids) or usage.get("completion_tokens")
    if isinstance(out, int) and out > 0:
        avg_out = float(out) if avg_out is None else (1 - w) * avg_out + w * out
    if total is not None and result.prompt_ids is not None and base is not None and base.last_tokens is not None:
        suffix = max(0, len(result.prompt_ids) - base.last_tokens)
        avg_suffix = float(suffix) if avg_suffix is None else (1 - w) * avg_suffix + w * suffix
    return avg_out, avg_suffix
