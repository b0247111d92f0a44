"""A turn in flight: its context (identity and request), its placement, how it is going, its final leg, what its
legs returned, and the gateway parts every step uses.

Plain records plus :class:`Services`, the one object the request path's steps (identify, gather, place, legs,
relay, remember) share: configuration, the cluster view, the session store, metrics, tracing, the upstream
HTTP clients and the policy's :class:`~kvtether.gateway.policy.learning.Learning`.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
from kvtether.gateway import telemetry as T
from kvtether.gateway.clock import DEFAULT_CLOCK, Clock
from kvtether.gateway.config import GatewayConfig
from kvtether.gateway.errors import GatewayError
from kvtether.gateway.guard.readback import Read
from kvtether.gateway.guard.tokencheck import GuardTokenizer
from kvtether.gateway.nodes.cluster import Cluster, host_of, port_of
from kvtether.gateway.nodes.retention import Retention
from kvtether.gateway.policy.learning import Learning
from kvtether.gateway.policy.placement import ClusterView, Plan
from kvtether.gateway.policy.retention import ReleaseReason
from kvtether.gateway.stores.sessions import SessionState, SessionStore, TakenHandle
from kvtether.gateway.transport.upstream import Upstream
from kvtether.gateway.turn.body import ChatChain, response_identity
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from starlette.responses import JSONResponse, Response

PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
VLLM_SESSION_HEADER = "x-session-id"


@dataclass(frozen=True)
class TurnContext:
    """One turn's identity and request, as identify found them; nothing writes it later. What the other steps
    find is what they return: the placement (:class:`Placement`), its legs (:class:`FinalLeg`, :class:`LegResult`),
    and how the turn is going (:class:`Progress`)."""

    # The request and its session (identify).
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
    # The caller's tenant (API keys) and the session id as the client sent it (session_id is namespaced);
    # the Authorization header the legs send vLLM (tenancy's Auth.upstream_authorization).
    tenant: str | None = None
    named_session: str | None = None
    upstream_auth: str | None = None
    # A chat prompt's message-chain hash when the session is found or started by it: the answer extends it
    # into the key the next turn finds the session by (remember).
    chain: ChatChain | None = None
    # The client marked this turn as its session's last (contract.FINAL_HEADER): its handle is released once
    # the answer is out, and the session forgotten. When the turn reached the gateway (the gateway's clock):
    # the session's gap since its last turn ended, for retention's idle estimate.
    final: bool = False
    arrived_at: float = 0.0

    @property
    def model(self) -> str:
        return str(self.body.get("model") or "")

    @property
    def parent_ctx(self) -> otel_context.Context:
        return trace.set_span_in_context(self.span)


@dataclass(frozen=True)
class Placement:
    """What the plan step returns: the plan, and what it assumed of the nodes — the legs' learning and the end of
    the turn compare what happened with it. A re-placement (after a failed node) returns a new one that replaces
    it, and leaves its TPOT-quota entry."""

    plan: Plan
    # The load view the plan saw: what each leg queued behind (None: aggregated mode, which learns nothing).
    view: ClusterView | None = None
    # From gather, for every placement of the turn: the prefix of the prompt D's prefix cache holds (verified),
    # and what each P's may hold (policy/copies.py).
    decode_cached: int = 0
    prefill_cached: Mapping[str, int] = field(default_factory=dict)
    # (decode node, key) of the turn's entry in D's per-request TPOT quotas, held from this placement to the
    # answer's end (Services.enter_decoding / leave_decoding); None: no quotas kept.
    exposure: tuple[str, int] | None = None
    # The prefill it left running beside a node's decodes (a decode-local turn's, or a prefill leg's on a pool
    # instance), which the policy counts until the leg is seen to end (Learning.prefill_seen); None: none.
    running: tuple[str, int] | None = None

    def load_at_plan(self, node: str) -> tuple[float, float]:
        """(running, waiting) of `node` as the plan saw it: what this leg queued behind."""
        view = self.view
        for n in (*view.prefill, *view.decode) if view is not None else ():
            if n.url == node:
                return n.running, n.waiting
        return 0.0, 0.0


@dataclass
class Progress:
    """How the turn is going, kept by the orchestrator (one per turn) and added to by the steps that find out: the
    nodes found failing (every later placement avoids them), the seconds spent awaiting nodes before the final
    leg (tokenize, prefill legs), and the placement in force — the one whose TPOT-quota entry the turn holds,
    left if the turn fails."""

    exclude: set[str] = field(default_factory=set)
    upstream_s: float = 0.0
    placed: Placement | None = None


@dataclass
class FinalLeg:
    """The leg whose answer the client sees (D in P/D mode, the replica in aggregated mode), as the legs, the
    relay and the end of the turn read it."""

    placed: Placement  # the placement it executes: its plan, and what it assumed of the nodes
    name: str  # decode | aggregated: its phase in errors and metrics
    source: str  # where the prompt's reused KV came from (x-kvtether-reuse-source)
    headers: dict[str, str] = field(default_factory=dict)  # the x-kvtether-* headers its answer carries
    # The answer's expected length (the session's mean, capped by max_tokens; gather): sizes its TPOT quota.
    expected_output_tokens: int = 256
    # The handle a decode-local turn did not use: D still holds it, so it is put back after the turn.
    unused: TakenHandle | None = None
    # From its sending on (legs.final_leg): its CLIENT span, when it was sent (perf_counter), and the seconds
    # the turn had spent awaiting nodes by then (tokenize, prefill legs), so that sent_at - t0 - upstream_s is
    # the gateway's own share of the TTFT.
    span: trace.Span = trace.INVALID_SPAN
    sent_at: float | None = None
    upstream_s: float = 0.0

    @property
    def plan(self) -> Plan:
        return self.placed.plan

    @property
    def node(self) -> str:
        return self.plan.decode


@dataclass
class Prefilled:
    params: dict[str, Any] | None
    read: Read  # what P reported of its cached tokens and whether it read the handle


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
    # The answer's id and model as the node reported them (gen_ai.response.id / .model on the leg's span).
    response_id: str | None = None
    response_model: str | None = None
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
    # the step boundaries a decode-local prefill's mixed step is read from (policy/steps.py).
    arrivals_before_first: tuple[float, ...] = ()
    # Counted in its D's `holding_back` (first token out, first delta not yet): released once, by the first
    # delta or the end of the leg.
    holding_back: bool = False
    _sequence: array[int] | None = field(default=None, init=False, repr=False)  # sequence(), once the stream is over

    def sequence(self) -> array[int]:
        """Prompt + output ids as one int64 array (the guard's form), built once per turn: the held sequences
        remembered after it are slices of it (converting a 16k-element list of ints costs ~0.5 ms; a slice of an
        array is a copy of bytes)."""
        if self._sequence is None:
            seq = array("q", self.prompt_ids or ())
            seq.extend(self.output_ids)
            self._sequence = seq
        return self._sequence

    def read_identity(self, data: dict[str, Any]) -> None:
        """The answer's id and model, from a whole answer or a stream's first chunk."""
        self.response_id, self.response_model = response_identity(data)

    def time_output(self, n: int, t: float) -> None:
        """Timestamps of streamed output: gaps after the first chunk are decode steps (TPOT samples)."""
        if self.out_first_at is None:
            self.out_first_at = t
            return
        self.out_last_at = t
        self.out_tokens_timed += n


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

    @classmethod
    def from_http(cls, node: str, phase: str, exc: httpx.HTTPError) -> UpstreamFailure:
        # Refused: nothing listens there, the node is down. A connect timeout is not proof of that: a busy
        # node's accept queue can be full for a moment, so it counts like a 5xx (three in a row take it out),
        # and the turn is retried — on the same node when it is the only one.
        unreachable = isinstance(exc, httpx.ConnectError)
        return cls(node, phase, f"{type(exc).__name__}: {exc}", unreachable=unreachable)


@dataclass
class Services:
    config: GatewayConfig
    cluster: Cluster
    store: SessionStore
    metrics: T.Metrics
    upstream: Upstream  # the completion legs (prefill, decode, aggregated)
    tokenize_client: httpx.AsyncClient  # /tokenize on connections of its own (see shell/app.py)
    tracer: trace.Tracer
    learning: Learning
    clock: Clock = DEFAULT_CLOCK
    tokenizer: GuardTokenizer | None = None  # the guard's local tokenizer (None: /tokenize for every turn)
    retention: Retention | None = None  # releases the handles the gateway will not pull (None: none released)

    def release(self, handle: dict[str, Any] | None, node: str | None, reason: ReleaseReason) -> None:
        if self.retention is not None:
            self.retention.release(handle, node, reason)

    def count_error(self, failure: UpstreamFailure) -> None:
        self.metrics.upstream_errors.labels(failure.node, failure.phase).inc()

    def mark_failed(self, failure: UpstreamFailure) -> None:
        self.cluster.mark_failed(failure.node, str(failure), hard=failure.unreachable)

    def leg_span(self, ctx: TurnContext, node: str, leg: str) -> trace.Span:
        operation = "chat" if ctx.kind == "chat" else "text_completion"
        span = self.tracer.start_span(T.chat_span_name(operation, ctx.model), context=ctx.parent_ctx,
                                      kind=T.KIND_CLIENT)
        T.set_attrs(span, {T.GEN_AI_OPERATION: operation, T.GEN_AI_PROVIDER: T.PROVIDER,
                           T.GEN_AI_REQUEST_MODEL: ctx.model, T.SERVER_ADDRESS: host_of(node),
                           T.SERVER_PORT: port_of(node),
                           T.ATTR_LEG: leg, T.ATTR_TURN: ctx.state.turns if ctx.state else 0,
                           T.GEN_AI_CONVERSATION_ID: ctx.named_session if ctx.session_source == "header" else None,
                           T.GEN_AI_REQUEST_STREAM: True if (ctx.stream and leg != "prefill") else None,
                           T.GEN_AI_REQUEST_MAX_TOKENS: ctx.body.get("max_tokens")})
        return span

    def upstream_headers(self, ctx: TurnContext, span: trace.Span) -> dict[str, str]:
        out = {"authorization": ctx.upstream_auth} if ctx.upstream_auth else {}
        if ctx.session_id is not None:
            # vLLM ≥ 0.33 labels the KV events of the session's blocks with it (older versions ignore it).
            out[VLLM_SESSION_HEADER] = ctx.session_id
        propagate.inject(out, context=trace.set_span_in_context(span))
        return out

    def local_handle_due(self, ctx: TurnContext, decode: str | None) -> bool:
        """Whether a decode-local turn on `decode` would come back with a handle: marked (config), on a D not
        seen to drop marks, and not a stream on vLLM < 0.33 (whose streams carry no handle)."""
        node = self.cluster.nodes.get(decode) if decode is not None else None
        if not self.config.marks_local_turns or node is None or node.local_handles is False:
            return False
        return not ctx.stream or node.stream_handles

    def enter_decoding(self, node: str, expected_output_tokens: int, replacing: Placement | None,
                       starts_in_s: float = 0.0) -> tuple[str, int] | None:
        """A turn's answer was placed to decode on `node`, its first token expected in `starts_in_s`: its entry
        in the TPOT quotas of stall there (policy/stallquota.py), in place of the one its placement being
        replaced made (left here)."""
        share = self.quota_share(node)
        if share is None:
            return None  # no quotas kept
        self.leave_decoding(replacing)
        n = self.cluster.nodes.get(node)
        running = n.load().running if n is not None else 1.0  # polled gauge or this gateway's own, the fresher
        key = self.learning.decoding(node, expected_output_tokens, running, self.clock(), share=share,
                                     starts_in_s=starts_in_s)
        return (node, key) if key is not None else None

    def quota_share(self, node: str) -> float | None:
        """The share of its decode time a request decoding on `node` may lose to prefills there (its TPOT quota,
        policy/stallquota.py), always capped by the TPOT objective; None: no quotas are kept (a fixed policy, or
        request_stall_share 1 on a decode node)."""
        c = self.config
        if not c.placement_policy.uses_stall_quotas or c.mode != "pd":
            return None
        if node in c.nodes:
            return c.pool_stall_share
        return c.request_stall_share if c.request_stall_share < 1.0 else None

    def leave_decoding(self, placed: Placement | None) -> None:
        """Nothing decodes for the placement's turn any more: its answer ended, or the turn failed (or was placed
        anew). Leaving an entry again is harmless: its key is never reused."""
        if placed is not None and placed.exposure is not None:
            self.learning.done_decoding(*placed.exposure)
        if placed is not None:
            self.learning.prefill_seen(placed.running)
