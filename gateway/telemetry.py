"""Every span, attribute and metric name of the gateway, in one module.

GenAI semantic-convention names move (notes §2.3); keeping them here means one edit when they do.
Metrics never carry session ids or prefix hashes as labels (unbounded cardinality); spans do.
"""

from __future__ import annotations

from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

TRACER_NAME = "kvtether.gateway"

# Spans (notes §2.7): SERVER per client request, INTERNAL steps, CLIENT per upstream leg.
SPAN_PLAN = "kvtether.plan"
SPAN_GUARD = "kvtether.guard"
SPAN_TOKENIZE = "kvtether.tokenize"
KIND_SERVER = SpanKind.SERVER
KIND_INTERNAL = SpanKind.INTERNAL
KIND_CLIENT = SpanKind.CLIENT


def server_span_name(method: str, path: str) -> str:
    return f"{method} {path}"


def chat_span_name(operation: str, model: str) -> str:
    return f"{operation} {model}"


# GenAI attributes.
GEN_AI_OPERATION = "gen_ai.operation.name"
GEN_AI_PROVIDER = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_STREAM = "gen_ai.request.stream"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_CONVERSATION_ID = "gen_ai.conversation.id"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_RESPONSE_TTFC = "gen_ai.response.time_to_first_chunk"
GEN_AI_USAGE_INPUT = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT = "gen_ai.usage.output_tokens"
GEN_AI_USAGE_CACHE_READ = "gen_ai.usage.cache_read.input_tokens"
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"
ERROR_TYPE = "error.type"
HTTP_METHOD = "http.request.method"
HTTP_ROUTE = "http.route"
HTTP_STATUS = "http.response.status_code"

# Our own attributes.
ATTR_LEG = "kvtether.leg"  # prefill | decode | aggregated
ATTR_TURN = "kvtether.turn.index"
ATTR_PREFIX = "kvtether.prefix.hash"
ATTR_SESSION_SOURCE = "kvtether.session.source"  # header | prefix | new
ATTR_POLICY = "kvtether.policy"
ATTR_PLAN_ACTION = "kvtether.plan.action"
ATTR_PLAN_REASON = "kvtether.plan.reason"
ATTR_PREFILL = "kvtether.prefill.node"
ATTR_DECODE = "kvtether.decode.node"
ATTR_RE_PLACED = "kvtether.plan.re_placed"
ATTR_HANDLE_OUTCOME = "kvtether.handle.outcome"
ATTR_HELD_TOKENS = "kvtether.held.tokens"
ATTR_PROMPT_TOKENS = "kvtether.prompt.tokens"
ATTR_REUSE_TOKENS = "kvtether.reuse.tokens"
ATTR_REUSE_SOURCE = "kvtether.reuse.source"
ATTR_TTFT = "kvtether.ttft_s"
ATTR_RETRIED = "kvtether.retried"
EVENT_FIRST_CHUNK = "first_chunk"
EVENT_FIRST_TOKEN = "first_token"

PROVIDER = "openai"

# Reuse sources (TTFT histogram label) and handle outcomes (counter label): closed sets.
REUSE_SOURCES = ("decode_pull", "prefill_cache", "decode_local", "none")
HANDLE_OUTCOMES = ("attached", "truncated", "refused_by_guard", "expired", "missing", "lost_race", "retried_cold")
PHASES = ("tokenize", "prefill", "decode", "aggregated", "metrics")

M_TTFT = "kvtether_ttft_seconds"
M_REQUESTS = "kvtether_requests_total"
M_HANDLE_OUTCOMES = "kvtether_handle_outcomes_total"
M_PINNED_SESSIONS = "kvtether_pinned_sessions"
M_UPSTREAM_ERRORS = "kvtether_upstream_errors_total"
M_REUSED_TOKENS = "kvtether_reused_tokens_total"
M_PROMPT_TOKENS = "kvtether_prompt_tokens_total"
M_STREAM_HANDLE_MISSING = "kvtether_stream_handles_missing_total"

# Server TTFT buckets of the GenAI conventions, stretched to long-context prefills.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80)


class Metrics:
    """Prometheus metrics in a per-app registry (several gateways can live in one test process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft = Histogram(M_TTFT, "Gateway-measured time to first token, by where the reused KV came from",
                              ["reuse_source"], buckets=TTFT_BUCKETS, registry=r)
        self.requests = Counter(M_REQUESTS, "Client requests by route and status class", ["route", "status"],
                                registry=r)
        self.handle_outcomes = Counter(M_HANDLE_OUTCOMES, "What happened to a session's handle on a turn",
                                       ["outcome"], registry=r)
        self.pinned_sessions = Gauge(M_PINNED_SESSIONS, "Sessions currently pinned to a node", registry=r)
        self.upstream_errors = Counter(M_UPSTREAM_ERRORS, "Upstream failures by node and phase", ["node", "phase"],
                                       registry=r)
        self.reused_tokens = Counter(M_REUSED_TOKENS, "Prompt tokens offered to prefill by a decode handle",
                                     registry=r)
        self.prompt_tokens = Counter(M_PROMPT_TOKENS, "Prompt tokens of P/D turns with a verified prompt", registry=r)
        self.stream_handles_missing = Counter(
            M_STREAM_HANDLE_MISSING, "Finished turns whose decode node returned no handle (e.g. streams before 0.33)",
            registry=r)
        for outcome in HANDLE_OUTCOMES:
            self.handle_outcomes.labels(outcome)
        for source in REUSE_SOURCES:
            self.ttft.labels(source)


def tracer(provider: trace.TracerProvider | None = None) -> trace.Tracer:
    """The gateway's tracer: from ``provider`` when given (tests, embedding apps), else the global one."""
    if provider is not None:
        return provider.get_tracer(TRACER_NAME)
    return trace.get_tracer(TRACER_NAME)


def set_attrs(span: trace.Span, attrs: dict[str, Any]) -> None:
    for key, value in attrs.items():
        if value is not None:
            span.set_attribute(key, value)


def setup_otlp(endpoint: str, service_name: str = "kvtether-gateway") -> None:
    """Install an OTLP/HTTP exporter as the global tracer provider (used by `kvtether serve`)."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    trace.set_tracer_provider(provider)
