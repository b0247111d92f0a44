"""The HTTP app: OpenAI-compatible routes, the caller's API key, request validation, error mapping, admin
and metrics.

Authentication (``auth.py``) and validation (``validate.py``) happen here, before anything reaches a node:
a request the gateway rejects never touches a session. Everything after validation is the orchestrator's
job.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import anyio
import httpx
from kvtether.gateway import telemetry as T
from kvtether.gateway.api import anthropic, hosted, responses_http
from kvtether.gateway.config import GatewayConfig
from kvtether.gateway.errors import GatewayError
from kvtether.gateway.nodes.cluster import Cluster
from kvtether.gateway.nodes.health import probe_forever
from kvtether.gateway.nodes.retention import Retention
from kvtether.gateway.policy.retention import ReleaseReason
from kvtether.gateway.shell import validate as V
from kvtether.gateway.shell.workers import merged_metrics, worker_exited
from kvtether.gateway.stores import open_store
from kvtether.gateway.stores.sessions import SessionStore
from kvtether.gateway.tenancy import Auth, scoped
from kvtether.gateway.transport.streaming import RelayResponse
from kvtether.gateway.transport.upstream import Upstream, UpstreamLimits
from kvtether.gateway.turn import body as B
from kvtether.gateway.turn.context import PATHS
from kvtether.gateway.turn.orchestrator import Orchestrator
from kvtether.gateway.turn.tokenize import start_local_tokenizer, tokenize_remote
from kvtether.sdk.apis.messages import MessagesError, count_tokens_body
from opentelemetry import propagate, trace
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

log = logging.getLogger(__name__)

MESSAGES_PATH = "/v1/messages"
RESPONSES_PATH = "/v1/responses"


class Gateway:
    """Everything one app instance owns; reachable as ``app.state.gateway`` (tests, admin)."""

    def __init__(self, config: GatewayConfig, store: SessionStore | None = None,
                 tracer_provider: trace.TracerProvider | None = None) -> None:
        self.config = config
        self.tracer = T.tracer(tracer_provider)
        self.metrics = T.Metrics()
        self.metrics.set_policy(config.policy)
        self.metrics.held_kv_budget.set(config.held_kv_budget)
        # An explicit provider (tests, the demo's in-memory capture) is used as is; else the OTEL_* variables
        # pick the global one at startup.
        self.own_tracing = tracer_provider is not None
        # One of several workers on a port (`kvtether serve --workers N`): the directory where every worker writes
        # its metrics, which /metrics merges (shell/workers.py); None: this process's registry alone.
        self.worker_metrics: str | None = None
        # The configured store (memory, or Redis/Valkey shared by replicas); closed at shutdown when built here.
        self.own_store = store is None
        self.store: SessionStore = store or open_store(config, metrics=self.metrics)
        self.auth = Auth(config)
        self.client = _upstream_client(config)
        # The guard's /tokenize calls get connections of their own. Sharing a keep-alive connection with the
        # prefill leg that follows them delayed P's answer by ~44 ms (measured on the simulator: the P→D hop
        # of every guarded turn 11.3 ms simulated at speed 0.25 against 1.6 ms without /tokenize, and ~1 ms
        # with its own pool; benchmarks/pd_hop.py). The process sat idle meanwhile, i.e. the wait was in the
        # connection, not in Python.
        self.tokenize_client = _upstream_client(config)
        # The completion legs: a client of their own that relays a stream in the pieces the network delivers.
        self.upstream = Upstream(UpstreamLimits(
            connect_timeout_s=config.connect_timeout_s, write_timeout_s=config.write_timeout_s,
            pool_timeout_s=config.pool_timeout_s, max_connections=config.max_connections,
            max_keepalive_connections=config.max_keepalive_connections, keepalive_expiry_s=config.keepalive_expiry_s))
        self.cluster = Cluster(config, self.client,
                               on_poll_failure=lambda url: self.metrics.upstream_errors.labels(url, "metrics").inc())
        for node in self.cluster.nodes.values():  # every series from the start, so a rate() sees the first error
            for phase in T.PHASES:
                self.metrics.upstream_errors.labels(node.url, phase)
        # Releases go out on the polls' client: a one-token prefill each, off the request path.
        self.retention = Retention(config, self.cluster, self.store, self.metrics, self.client)
        self.responses = responses_http.ResponsesState(self.store, config.responses_ttl_s,
                                                       responses_http.seal_for(config.reasoning_key))
        self.dropped_tools = hosted.DroppedTools(self.metrics.dropped_tools)
        self.orchestrator = Orchestrator(config, self.cluster, self.store, self.metrics, self.upstream,
                                         self.tokenize_client, tracer=self.tracer, retention=self.retention)

    async def sweep_forever(self) -> None:
        while True:
            await anyio.sleep(self.config.sweep_interval_s)
            dropped = await self.store.sweep()
            self.metrics.pinned_sessions.set(await self.store.count())
            if dropped:
                log.debug("swept %d expired sessions", dropped)

    def models(self) -> list[str]:
        names = self.cluster.served_models()
        if self.config.model and self.config.model not in names:
            names = [self.config.model, *names]
        return names


def _gateway(request: Request) -> Gateway:
    gw: Gateway = request.app.state.gateway
    return gw


async def _validate(gw: Gateway, kind: str, body: dict[str, Any], headers: Mapping[str, str]) -> None:
    V.check_headers(headers)
    V.check_body(kind, body, pd=gw.config.mode == "pd")
    model = body["model"]
    known = gw.models()
    if not known:
        await gw.cluster.refresh_all()
        known = gw.models()
    if not known:
        raise GatewayError(503, "no backend has reported its models yet", code="not_ready")
    if model not in known:
        raise GatewayError(404, f"the model `{model}` does not exist", param="model", code="model_not_found")
    upstream = gw.cluster.served_models()
    if model == gw.config.model and upstream and model not in upstream:
        # The configured public name is an alias of what the backends serve.
        body["model"] = upstream[0]
    V.check_length(kind, body, gw.cluster.max_model_len(body["model"]))


def _completion_route(kind: str, api: str | None = None) -> Callable[[Request], Awaitable[Response]]:
    """A route onto the chat (or completions) path; ``api`` = "messages": Anthropic Messages, lowered to a chat
    turn at the edge and its answer raised back (``gateway/api/anthropic.py``); "responses": OpenAI Responses,
    the same way, its state kept by the gateway (``gateway/api/responses_http.py``)."""
    route = api or kind

    async def endpoint(request: Request) -> Response:
        gw = _gateway(request)
        parent = propagate.extract(dict(request.headers))
        path = request.scope["path"]
        span = gw.tracer.start_span(T.server_span_name("POST", path), context=parent, kind=T.KIND_SERVER)
        T.set_attrs(span, {T.HTTP_METHOD: "POST", T.HTTP_ROUTE: path, T.ATTR_MODE: gw.config.mode,
                           T.ATTR_POLICY: gw.config.policy})
        response: Response | None = None
        model = ""
        pending: responses_http.Pending | None = None
        dropped: tuple[str, ...] = ()  # hosted tools the API's translation left out of the turn
        sessions: list[str] = []  # the session the turn was served in, once the chat path found it

        def identified(session_id: str) -> None:
            sessions.append(session_id)
            if pending is not None:
                pending.identified(session_id)

        try:
            try:
                headers = {k.lower(): v for k, v in request.headers.items()}
                tenant = gw.auth.tenant(headers)
                body = await V.read_json(request, gw.config.max_body_bytes)
                if api == "messages":
                    model = str(body.get("model") or "")
                    body, headers, dropped = anthropic.lower(body, headers, gw.config.hosted_tools)
                elif api == "responses":
                    body, headers, pending = await responses_http.lower(gw.responses, body, headers, tenant,
                                                                        gw.config.hosted_tools)
                    dropped = pending.dropped
                await _validate(gw, kind, body, headers)
                salt = gw.auth.cache_salt(tenant, body.get("cache_salt"))
                if salt is not None:
                    body["cache_salt"] = salt
                T.set_attrs(span, {T.GEN_AI_REQUEST_MODEL: body.get("model"),
                                   T.GEN_AI_REQUEST_STREAM: body.get("stream") is True or None})
                response = await gw.orchestrator.handle(
                    kind, body, headers, span, tenant=tenant, upstream_auth=gw.auth.upstream_authorization(headers),
                    on_identified=identified if api is not None else None)
            except GatewayError as err:
                response = err.response()
            except Exception as exc:  # a bug must still answer in the API's shape, and be logged
                log.exception("unhandled error")
                response = GatewayError(500, f"internal gateway error: {type(exc).__name__}",
                                        type_="internal_error").response()
            if dropped:
                gw.dropped_tools.note(dropped, sessions[0] if sessions else None, path)
                hosted.tell(response, dropped)
            if api == "messages":
                return anthropic.raise_(response, model)
            return responses_http.raise_(response, pending) if pending is not None else response
        finally:
            status = response.status_code if response is not None else 500
            span.set_attribute(T.HTTP_STATUS, status)
            gw.metrics.requests.labels(route, f"{status // 100}xx").inc()
            if isinstance(response, RelayResponse):
                response.on_close.append(span.end)
            else:
                if status >= 500:
                    span.set_status(trace.Status(trace.StatusCode.ERROR))
                span.end()

    return endpoint


async def stored_response(request: Request) -> Response:
    """GET or DELETE /v1/responses/{id}: a response the gateway stored (in the caller's tenant)."""
    gw = _gateway(request)
    try:
        tenant = gw.auth.tenant({k.lower(): v for k, v in request.headers.items()})
        rid = request.path_params["response_id"]
        if request.method == "DELETE":
            return await responses_http.delete(gw.responses, tenant, rid)
        return await responses_http.retrieve(gw.responses, tenant, rid)
    except GatewayError as err:
        return err.response()


async def response_input_items(request: Request) -> Response:
    gw = _gateway(request)
    try:
        tenant = gw.auth.tenant({k.lower(): v for k, v in request.headers.items()})
        order = request.query_params.get("order", "desc")
        return await responses_http.input_items(gw.responses, tenant, request.path_params["response_id"], order)
    except GatewayError as err:
        return err.response()


async def responses_websocket(request: Request) -> Response:
    """GET /v1/responses: Codex's WebSocket transport (an upgrade request). The gateway serves Responses over
    HTTP only; 426 is the answer that makes Codex fall back to HTTP at once (other statuses make it retry)."""
    return GatewayError(426, "the Responses API is served over HTTP (POST /v1/responses), not WebSocket",
                        code="upgrade_not_supported").response()


async def cancel_response(request: Request) -> Response:
    """Only background responses can be cancelled, and the gateway serves none."""
    return GatewayError(400, "only background responses can be cancelled; the gateway does not serve background "
                             "responses", param="response_id").response()


async def models(request: Request) -> Response:
    gw = _gateway(request)
    names = gw.models()
    now = int(time.time())
    return JSONResponse({"object": "list",
                         "data": [{"id": n, "object": "model", "created": now, "owned_by": "kvtether"} for n in names]})


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    gw = _gateway(request)
    c = gw.cluster
    if gw.config.mode == "aggregated":
        ok = any(n.healthy for n in c.role("aggregated"))
    else:
        ok = any(n.healthy for n in c.role("prefill")) and any(n.healthy for n in c.role("decode"))
    nodes = [{"url": n.url, "role": n.role, "healthy": n.healthy, "version": n.version, "block_size": n.block_size,
              "running": n.running, "waiting": n.waiting, "kv_usage": n.kv_usage, "last_error": n.last_error,
              "prefix_caching": n.prefix_caching, "kv_capacity_tokens": n.kv_capacity_tokens,
              **({"local_handles": n.local_handles, "held_kv_tokens": n.held_kv_tokens} if n.role == "decode" else {})}
             for n in c.nodes.values()]
    ok = ok and bool(gw.models())
    return JSONResponse({"ready": ok, "mode": gw.config.mode, "policy": gw.config.policy, "nodes": nodes},
                        status_code=200 if ok else 503)


async def metrics(request: Request) -> Response:
    gw = _gateway(request)
    for node in gw.cluster.nodes.values():
        gw.metrics.node_healthy.labels(node.url, node.role).set(1 if node.healthy else 0)
    text = merged_metrics(gw.worker_metrics) if gw.worker_metrics else generate_latest(gw.metrics.registry)
    return Response(text, media_type=CONTENT_TYPE_LATEST)


async def admin_sessions(request: Request) -> Response:
    gw = _gateway(request)
    try:
        gw.auth.check_admin({k.lower(): v for k, v in request.headers.items()})
    except GatewayError as err:
        return err.response()
    now = gw.orchestrator.sv.clock()
    out = []
    for s in await gw.store.list():
        out.append({
            "session_id": s.session_id,
            "decode": s.decode,
            "held_tokens": s.held.num_tokens if s.held else 0,
            "has_handle": s.handle is not None,
            "handle_age_s": round(now - s.handle_at, 3) if s.handle_at is not None else None,
            "turns": s.turns,
            "expires_in_s": round(s.expires_at - now, 3),
        })
    return JSONResponse(out)


async def end_session(request: Request) -> Response:
    """DELETE /v1/sessions/{id}: the client is done with a session (the SDK's AgentSession.close()). Its handle
    is released on its decode node and the session forgotten; 404 when the gateway holds no such session."""
    gw = _gateway(request)
    try:
        tenant = gw.auth.tenant({k.lower(): v for k, v in request.headers.items()})
        named = request.path_params["session_id"]
        V.check_session_id(named)
    except GatewayError as err:
        return err.response()
    sid = scoped(tenant, named)
    if await gw.store.get(sid) is None:
        return GatewayError(404, f"no session {named!r}", param="session_id", code="session_not_found").response()
    await gw.retention.release_session(sid, ReleaseReason.FINAL)
    await gw.store.delete(sid)
    gw.metrics.pinned_sessions.set(await gw.store.count())
    return Response(status_code=204)


async def count_tokens(request: Request) -> Response:
    """POST /v1/messages/count_tokens: the prompt's length as the served model renders it (P's /tokenize)."""
    gw = _gateway(request)
    try:
        headers = {k.lower(): v for k, v in request.headers.items()}
        gw.auth.tenant(headers)
        body = await V.read_json(request, gw.config.max_body_bytes)
        try:
            # The prompt the turn would render: without the hosted tools the turn would leave out.
            chat = count_tokens_body(body, hosted_tools=gw.config.hosted_tools)
        except MessagesError as err:
            raise GatewayError(err.status, err.message) from None
        payload = B.tokenize_body("chat", chat)
        ids = await tokenize_remote(gw.orchestrator.sv, payload) if payload is not None else None
        if ids is None:
            raise GatewayError(503, "no prefill node could count the tokens", code="not_ready")
        return JSONResponse({"input_tokens": len(ids)})
    except GatewayError as err:
        return anthropic.error(err)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return GatewayError(exc.status_code, str(exc.detail)).response()


def create_app(config: GatewayConfig, *, store: SessionStore | None = None,
               tracer_provider: trace.TracerProvider | None = None, worker_metrics: str | None = None) -> GatewayApp:
    """``worker_metrics``: this app is one of several workers, which write their metrics in that directory."""
    gw = Gateway(config, store, tracer_provider)
    gw.worker_metrics = worker_metrics

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if not gw.own_tracing:
            T.setup_tracing(config.otlp_endpoint)
        await gw.cluster.refresh_all()
        async with anyio.create_task_group() as tg:
            tg.start_soon(gw.cluster.poll_forever)
            tg.start_soon(probe_forever, gw.cluster)
            tg.start_soon(gw.sweep_forever)
            tg.start_soon(start_local_tokenizer, gw.orchestrator.sv)  # in the background: it imports transformers
            tg.start_soon(gw.retention.run)
            try:
                yield
            finally:
                with anyio.CancelScope(shield=True):
                    await gw.retention.shutdown()
                tg.cancel_scope.cancel()
        if gw.orchestrator.sv.tokenizer is not None:
            with anyio.move_on_after(5):  # background tokenizer warm-ups: threads cannot be cancelled
                await gw.orchestrator.sv.tokenizer.warmed()
        await gw.client.aclose()
        await gw.tokenize_client.aclose()
        await gw.upstream.aclose()
        if gw.own_store:
            await gw.store.aclose()
        if gw.worker_metrics:
            worker_exited(gw.worker_metrics)

    completions = {PATHS[kind]: _completion_route(kind) for kind in ("chat", "completions")}
    completions[MESSAGES_PATH] = _completion_route("chat", api="messages")
    completions[RESPONSES_PATH] = _completion_route("chat", api="responses")
    app = GatewayApp(
        completions,
        routes=[
            *(Route(path, endpoint, methods=["POST"]) for path, endpoint in completions.items()),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/ready", ready, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/admin/sessions", admin_sessions, methods=["GET"]),
            Route("/v1/sessions/{session_id:path}", end_session, methods=["DELETE"]),
            Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
            Route(RESPONSES_PATH, responses_websocket, methods=["GET"]),
            Route("/v1/responses/{response_id}", stored_response, methods=["GET", "DELETE"]),
            Route("/v1/responses/{response_id}/input_items", response_input_items, methods=["GET"]),
            Route("/v1/responses/{response_id}/cancel", cancel_response, methods=["POST"]),
        ],
        lifespan=lifespan,
        exception_handlers={HTTPException: _http_error},
    )
    app.state.gateway = gw
    return app


class GatewayApp(Starlette):
    """Starlette, with the completion routes called directly: their endpoint answers every error in the API's
    shape itself, so the router's matching and the exception middlewares around it (a layer of calls per
    request, and one per message sent) buy them nothing. Every other request, and lifespan, goes through the
    router as usual."""

    def __init__(self, completions: dict[str, Callable[[Request], Awaitable[Response]]], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._completions = completions

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            endpoint = self._completions.get(scope["path"])
            if endpoint is not None:
                scope["app"] = self
                response = await endpoint(Request(scope, receive))
                await response(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def _upstream_client(config: GatewayConfig) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        timeout=httpx.Timeout(connect=config.connect_timeout_s, read=config.read_timeout_s,
                              write=config.write_timeout_s, pool=config.pool_timeout_s),
        limits=httpx.Limits(max_connections=config.max_connections,
                            max_keepalive_connections=config.max_keepalive_connections,
                            keepalive_expiry=config.keepalive_expiry_s),
    )
