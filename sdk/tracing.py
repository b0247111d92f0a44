"""Optional OpenTelemetry hook: one CLIENT span per model call, and ``traceparent`` on the request.

Only ``opentelemetry-api`` is used, and only when it is importable. With no tracer provider
configured (the API's default proxy/no-op provider) nothing is created and nothing is injected, so
the cost is one ``isinstance`` per call. Attribute names follow the OTel GenAI conventions (chat
inference span); kvtether's own fields use the ``kvtether.`` namespace. The session id goes in
``gen_ai.conversation.id`` (a caller-meaningful id, as the conventions ask); prefix hashes never do.

It knows turns (``TurnMetrics``) but not sessions: the session passes what the span needs, so the
session depends on tracing and never the other way round.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .turns import TurnMetrics

try:
    from opentelemetry import propagate as _propagate
    from opentelemetry import trace as _trace
    from opentelemetry.trace import NoOpTracerProvider, ProxyTracerProvider, SpanKind, Status, StatusCode

    _HAVE_OTEL = True
except ImportError:  # pragma: no cover - opentelemetry-api is a declared dependency, but optional here
    _HAVE_OTEL = False

_SCOPE = "kvtether.sdk"
_tracer_cache: tuple[Any, Any] | None = None  # (provider, tracer): providers rarely change


@dataclass(frozen=True, slots=True)
class SpanContext:
    """What a span says about the session a call belongs to."""

    conversation_id: str
    tenant: str | None = None
    provider: Any = None  # a TracerProvider overriding the global one
    system: str = "openai"  # gen_ai.provider.name: the client library's vendor


@dataclass(slots=True)
class CallSpan:
    span: Any
    context: Any  # an OTel Context holding the span, for injection on every attempt


def _tracer(provider: Any) -> Any:
    global _tracer_cache
    cached = _tracer_cache
    if cached is not None and cached[0] is provider:
        return cached[1]
    from . import __version__

    tracer = provider.get_tracer(_SCOPE, __version__)
    _tracer_cache = (provider, tracer)
    return tracer


def start_span(
    where: SpanContext, metrics: TurnMetrics, body: Mapping[str, Any], server: tuple[str | None, int | None]
) -> CallSpan | None:
    if not _HAVE_OTEL:
        return None
    provider = where.provider or _trace.get_tracer_provider()
    if isinstance(provider, ProxyTracerProvider | NoOpTracerProvider):
        return None
    model = metrics.model or ""
    attrs: dict[str, Any] = {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": where.system,
        "gen_ai.conversation.id": where.conversation_id,
        "kvtether.turn.index": metrics.turn,
        "kvtether.call.seq": metrics.seq,
    }
    if model:
        attrs["gen_ai.request.model"] = model
    if metrics.stream:
        attrs["gen_ai.request.stream"] = True
    if metrics.prefix:
        attrs["kvtether.prefix"] = metrics.prefix
    if metrics.parent:
        attrs["kvtether.prefix_parent"] = metrics.parent
    if metrics.api != "chat":
        attrs["kvtether.api"] = metrics.api
    if where.tenant:
        attrs["kvtether.tenant"] = where.tenant
    for field, attr in (
        ("max_tokens", "gen_ai.request.max_tokens"),
        ("max_completion_tokens", "gen_ai.request.max_tokens"),
        ("max_output_tokens", "gen_ai.request.max_tokens"),
        ("temperature", "gen_ai.request.temperature"),
        ("top_p", "gen_ai.request.top_p"),
        ("seed", "gen_ai.request.seed"),
    ):
        value = body.get(field)
        if isinstance(value, int | float) and not isinstance(value, bool):
            attrs[attr] = value
    host, port = server
    if host:
        attrs["server.address"] = host
        if port:
            attrs["server.port"] = port
    span = _tracer(provider).start_span(f"chat {model}".strip(), kind=SpanKind.CLIENT, attributes=attrs)
    return CallSpan(span=span, context=_trace.set_span_in_context(span))


def inject(call_span: CallSpan, headers: MutableMapping[str, str]) -> None:
    """W3C ``traceparent`` (+ ``tracestate``/``baggage`` per the global propagator) for this call."""
    _propagate.inject(headers, context=call_span.context)


def end_span(call_span: CallSpan, m: TurnMetrics, error: BaseException | None) -> None:
    span = call_span.span
    if m.ttfc_ms is not None:
        span.set_attribute("gen_ai.response.time_to_first_chunk", m.ttfc_ms / 1000)
    if m.ttft_ms is not None:
        # No GenAI name for "first token incl. tool calls and reasoning" on the client: our namespace.
        span.set_attribute("kvtether.time_to_first_token", m.ttft_ms / 1000)
    if m.finish_reason:
        span.set_attribute("gen_ai.response.finish_reasons", [m.finish_reason])
    if m.prompt_tokens is not None:
        span.set_attribute("gen_ai.usage.input_tokens", m.prompt_tokens)
    if m.completion_tokens is not None:
        span.set_attribute("gen_ai.usage.output_tokens", m.completion_tokens)
    if m.cached_tokens is not None:
        span.set_attribute("gen_ai.usage.cache_read.input_tokens", m.cached_tokens)
    if m.request_id:
        span.set_attribute("kvtether.request_id", m.request_id)
    span.set_attribute("kvtether.attempts", m.attempts)
    if error is not None:
        span.set_attribute("error.type", type(error).__name__)
        span.set_status(Status(StatusCode.ERROR, str(error)[:200]))
    elif m.aborted:
        span.set_attribute("kvtether.aborted", True)
    span.end()
