"""The one endpoint every API's turn goes through: the caller's key, the body read and checked, the request
lowered to the chat path by its API's edge (Responses, Messages; none for chat and completions), the
orchestrator's turn, and its answer raised back into the API's shape.

Authentication (``tenancy.Auth``) and validation (``validate.py``) happen here, before anything reaches a node:
a request the gateway rejects never touches a session. Every error is answered in the API's shape, a bug's
too (and logged).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from kvtether.gateway import telemetry as T
from kvtether.gateway.api import hosted
from kvtether.gateway.api import validate as V
from kvtether.gateway.api.serving import Serving, request_headers, serving
from kvtether.gateway.errors import GatewayError
from kvtether.gateway.transport.streaming import RelayResponse
from opentelemetry import propagate, trace
from starlette.requests import Request
from starlette.responses import Response

log = logging.getLogger(__name__)

Endpoint = Callable[[Request], Awaitable[Response]]


class Edge(Protocol):
    """One request's passage through its API's edge: lowered to a chat body on the way in, the chat path's
    answer (whole, streamed, or an error) raised back on the way out."""

    dropped: tuple[str, ...]  # hosted tool types the translation left out of the turn (hosted_tools = "drop")
    left_out: tuple[str, ...]  # client bookkeeping item types it left out (bookkeeping_items = "drop")

    async def lower(self, body: dict[str, Any], headers: dict[str, str],
                    tenant: str | None) -> tuple[dict[str, Any], dict[str, str]]:
        """The chat body and headers for the request (a GatewayError when it is bad)."""
        ...

    def identified(self, session_id: str) -> None:
        """Told the session the turn is served in."""
        ...

    def raise_(self, response: Response) -> Response:
        """The chat path's answer in the API's shape (also an error from before the turn, even before lower)."""
        ...


@dataclass(frozen=True)
class TurnRoute:
    """A POST path served as a turn of the chat path."""

    path: str
    kind: str  # the chat path's kind: chat | completions
    name: str  # the route's label in kvtether_requests_total
    edge: Callable[[Serving], Edge] | None = None  # one per request; None: the chat path's own API


def turn_endpoint(route: TurnRoute) -> Endpoint:
    async def endpoint(request: Request) -> Response:
        gw = serving(request)
        path = request.scope["path"]
        span = gw.tracer.start_span(T.server_span_name("POST", path), context=propagate.extract(dict(request.headers)),
                                    kind=T.KIND_SERVER)
        T.set_attrs(span, {T.HTTP_METHOD: "POST", T.HTTP_ROUTE: path, T.ATTR_MODE: gw.config.mode,
                           T.ATTR_POLICY: gw.config.policy})
        edge = route.edge(gw) if route.edge is not None else None
        sessions: list[str] = []  # the session the turn was served in, once the chat path found it

        def identified(session_id: str) -> None:
            sessions.append(session_id)
            if edge is not None:
                edge.identified(session_id)

        response: Response | None = None
        try:
            response = await _turn(gw, route.kind, request, span, edge, identified if edge is not None else None)
            if edge is None:
                return response
            if edge.dropped:
                gw.dropped_tools.note(edge.dropped, sessions[0] if sessions else None, path)
                hosted.tell(response, edge.dropped)
            if edge.left_out:
                gw.dropped_tools.note_items(edge.left_out, sessions[0] if sessions else None, path,
                                            gw.metrics.dropped_items)
                hosted.tell(response, edge.left_out, T.HEADER_DROPPED_ITEMS)
            return edge.raise_(response)
        finally:
            _close(gw, route, span, response)

    return endpoint


async def _turn(gw: Serving, kind: str, request: Request, span: trace.Span, edge: Edge | None,
                on_identified: Callable[[str], None] | None) -> Response:
    """The chat path's answer to the request, or the error that stopped it."""
    try:
        headers = request_headers(request)
        tenant = gw.auth.tenant(headers)
        body = await V.read_json(request, gw.config.max_body_bytes)
        if edge is not None:
            body, headers = await edge.lower(body, headers, tenant)
        await _validate(gw, kind, body, headers)
        salt = gw.auth.cache_salt(tenant, body.get("cache_salt"))
        if salt is not None:
            body["cache_salt"] = salt
        T.set_attrs(span, {T.GEN_AI_REQUEST_MODEL: body.get("model"),
                           T.GEN_AI_REQUEST_STREAM: body.get("stream") is True or None})
        return await gw.orchestrator.handle(
            kind, body, headers, span, tenant=tenant, upstream_auth=gw.auth.upstream_authorization(headers),
            on_identified=on_identified)
    except GatewayError as err:
        return err.response()
    except Exception as exc:  # a bug must still answer in the API's shape, and be logged
        log.exception("unhandled error")
        return GatewayError(500, f"internal gateway error: {type(exc).__name__}", type_="internal_error").response()


async def served_model(gw: Serving, model: str) -> str:
    """The name the backends serve `model` under: itself, the model an alias names, or what they serve when it
    is the configured public name. A model nobody serves is refused 404 (the API's `model_not_found`)."""
    known = gw.models()
    if not known:
        await gw.cluster.refresh_all()
        known = gw.models()
    if not known:
        raise GatewayError(503, "no backend has reported its models yet", code="not_ready")
    target = gw.config.aliased(model)
    if target is not None:
        if target not in known:
            raise GatewayError(404, f"the model `{model}` is an alias of `{target}`, which no backend serves",
                               param="model", code="model_not_found")
        model = target
    if model not in known:
        raise GatewayError(404, f"the model `{model}` does not exist", param="model", code="model_not_found")
    upstream = gw.cluster.served_models()
    if model == gw.config.model and upstream and model not in upstream:
        # The configured public name is an alias of what the backends serve.
        return upstream[0]
    return model


async def _validate(gw: Serving, kind: str, body: dict[str, Any], headers: Mapping[str, str]) -> None:
    V.check_headers(headers)
    V.check_body(kind, body, pd=gw.config.mode == "pd")
    body["model"] = await served_model(gw, body["model"])
    V.check_length(kind, body, gw.cluster.max_model_len(body["model"]))


def _close(gw: Serving, route: TurnRoute, span: trace.Span, response: Response | None) -> None:
    """The request counted, and its span ended: now, or when a relayed stream is over."""
    status = response.status_code if response is not None else 500
    span.set_attribute(T.HTTP_STATUS, status)
    gw.metrics.requests.labels(route.name, f"{status // 100}xx").inc()
    if isinstance(response, RelayResponse):
        relayed = response

        def ended() -> None:
            gw.metrics.streams.labels(route.name, relayed.end).inc()
            span.set_attribute(T.ATTR_STREAM_END, relayed.end)
            if relayed.end == "broken":
                span.set_status(trace.Status(trace.StatusCode.ERROR))
            span.end()

        response.on_close.append(ended)
    else:
        if status >= 500:
            span.set_status(trace.Status(trace.StatusCode.ERROR))
        span.end()
