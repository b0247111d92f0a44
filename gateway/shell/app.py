"""The HTTP app: the API rooms' routes (``api/chat``, ``api/messages``, ``api/responses``), the models list,
health, readiness, metrics, the admin view, and ending a session.

``Gateway`` owns everything one app instance runs on — the session store, the node clients, the cluster view,
retention, the orchestrator, the Responses state — and the app's lifespan starts and stops it. What a turn's
route does (the caller's key, validation, the API's edge, the orchestrator) is ``api/endpoint.py``'s.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import httpx
from kvtether.gateway import telemetry as T
from kvtether.gateway.api import chat, messages, responses
from kvtether.gateway.api import validate as V
from kvtether.gateway.api.endpoint import turn_endpoint
from kvtether.gateway.api.hosted import DroppedTools
from kvtether.gateway.api.responses.state import ResponsesState, seal_for
from kvtether.gateway.api.serving import Serving, request_headers
from kvtether.gateway.clock import Clock, running_clock
from kvtether.gateway.config import GatewayConfig
from kvtether.gateway.errors import GatewayError
from kvtether.gateway.nodes.cluster import Cluster, poll_timeout_s
from kvtether.gateway.nodes.discovery import Change, Discovery, open_discovery
from kvtether.gateway.nodes.discovery.runner import discover_forever
from kvtether.gateway.nodes.health import probe_forever
from kvtether.gateway.nodes.retention import Retention
from kvtether.gateway.policy.retention import ReleaseReason
from kvtether.gateway.shell.workers import merged_metrics, worker_exited
from kvtether.gateway.stores import FailSafeStore, open_store
from kvtether.gateway.stores.sessions import SessionStore
from kvtether.gateway.tenancy import Auth, scoped
from kvtether.gateway.transport.upstream import Upstream, UpstreamLimits
from kvtether.gateway.turn.orchestrator import Orchestrator
from kvtether.gateway.turn.tokenize import start_local_tokenizer
from opentelemetry import trace
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

log = logging.getLogger(__name__)

# Every client-facing API, a room each: its turns' paths and its own other routes.
API_ROOMS = (chat, messages, responses)
# How long an idle poll connection is kept: above the default 2 s poll interval, below vLLM's 5 s idle close.
POLL_KEEPALIVE_S = 4.0


class Gateway:
    """Everything one app instance owns; reachable as ``app.state.gateway`` (tests, admin)."""

    def __init__(self, config: GatewayConfig, store: SessionStore | None = None,
                 tracer_provider: trace.TracerProvider | None = None, clock: Clock | None = None,
                 discovery: Discovery | None = None) -> None:
        self.config = config
        # The one clock every part below reads (gateway/clock.py): passed down, never read beside it.
        self.clock = clock = clock or running_clock()
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
        self.store: SessionStore = store or open_store(config, metrics=self.metrics, clock=clock)
        self.auth = Auth(config)
        self.client = _upstream_client(config)
        # The guard's /tokenize calls get connections of their own. Sharing a keep-alive connection with the
        # prefill leg that follows them delayed P's answer by ~44 ms (measured on the simulator: the P→D hop
        # of every guarded turn 11.3 ms simulated at speed 0.25 against 1.6 ms without /tokenize, and ~1 ms
        # with its own pool). The process sat idle meanwhile, i.e. the wait was in the connection, not in
        # Python. benchmarks/pd_hop.py measures the hop as it is now.
        self.tokenize_client = _upstream_client(config)
        # The completion legs: a client of their own that relays a stream in the pieces the network delivers.
        self.upstream = Upstream(UpstreamLimits(
            connect_timeout_s=config.connect_timeout_s, write_timeout_s=config.write_timeout_s,
            pool_timeout_s=config.pool_timeout_s, max_connections=config.max_connections,
            max_keepalive_connections=config.max_keepalive_connections,
            keepalive_expiry_s=config.keepalive_expiry_s), clock=clock, on_wait=self.metrics.connection_waited)
        # The /metrics polls: a lean client of their own, so that a poll never waits for a slot behind turns.
        # Its idle connections live longer than the legs' (one poll interval is 2 s by default), yet below
        # the 5 s after which vLLM's uvicorn closes an idle connection (VLLM_HTTP_TIMEOUT_KEEP_ALIVE).
        poll_s = poll_timeout_s(config)
        self.poller = Upstream(UpstreamLimits(
            connect_timeout_s=min(poll_s, config.connect_timeout_s), write_timeout_s=poll_s, pool_timeout_s=poll_s,
            max_connections=config.max_connections, max_keepalive_connections=config.max_keepalive_connections,
            keepalive_expiry_s=max(config.keepalive_expiry_s, POLL_KEEPALIVE_S)), clock=clock)
        self.cluster = Cluster(config, self.client,
                               on_poll_failure=lambda url: self.metrics.upstream_errors.labels(url, "metrics").inc(),
                               clock=clock, poller=self.poller)
        for node in self.cluster.nodes.values():  # every series from the start, so a rate() sees the first error
            for phase in T.PHASES:
                self.metrics.upstream_errors.labels(node.url, phase)
        # Where the nodes are (nodes/discovery/): the configured lists, DNS or the Kubernetes API.
        self.discovery = discovery or open_discovery(config.discovery)
        self.cluster.on_change = self.node_changed
        if self.own_store and isinstance(self.store, FailSafeStore):
            # While the shared store is down, sessions are pinned by hash among the nodes that take them now.
            self.store.pins = self.cluster.session_nodes
        self.count_nodes()
        # Releases go out on the polls' client: a one-token prefill each, off the request path.
        self.retention = Retention(config, self.cluster, self.store, self.metrics, self.client, clock=clock)
        self.responses = ResponsesState(self.store, config.responses_ttl_s, seal_for(config.reasoning_key))
        self.dropped_tools = DroppedTools(self.metrics.dropped_tools)
        self.orchestrator = Orchestrator(config, self.cluster, self.store, self.metrics, self.upstream,
                                         self.tokenize_client, clock=clock, tracer=self.tracer,
                                         retention=self.retention)

    def node_changed(self, change: Change) -> None:
        """A discovered node joined, became ready, started draining or left: counted, and a span of its own."""
        after = change.after or "removed"
        with self.tracer.start_as_current_span(T.SPAN_NODE_CHANGE, kind=T.KIND_INTERNAL) as span:
            T.set_attrs(span, {T.ATTR_NODE_URL: change.url, T.ATTR_NODE_ROLE: change.role,
                               T.ATTR_NODE_SOURCE: self.discovery.source,
                               T.ATTR_NODE_STATE_BEFORE: change.before or "none", T.ATTR_NODE_STATE_AFTER: after})
        if change.before is None:
            for phase in T.PHASES:
                self.metrics.upstream_errors.labels(change.url, phase)
            if change.role in ("decode", "both"):
                self.metrics.decode_stall.labels(change.url)  # at zero from its join, as a configured node's
        if change.after is None:
            for gauge, labels in ((self.metrics.node_healthy, (change.url, change.role)),
                                  (self.metrics.held_kv_tokens, (change.url,)),
                                  (self.metrics.held_kv_share, (change.url,))):
                with contextlib.suppress(KeyError):
                    gauge.remove(*labels)
        self.count_nodes()

    def count_nodes(self) -> None:
        """kvtether_nodes{role,state}: every role this mode has, every state, zero where none."""
        counts: dict[tuple[str, str], int] = {}
        for n in self.cluster.nodes.values():
            state = "out" if n.state == "ready" and not n.healthy else n.state
            counts[n.role, state] = counts.get((n.role, state), 0) + 1
        roles = ("aggregated",) if self.config.mode == "aggregated" else ("prefill", "decode", "both")
        for role in roles:
            for state in T.NODE_STATES:
                self.metrics.nodes.labels(role, state).set(counts.get((role, state), 0))

    async def sweep_forever(self) -> None:
        while True:
            await anyio.sleep(self.config.sweep_interval_s)
            dropped = await self.store.sweep()
            self.metrics.pinned_sessions.set(await self.store.count())
            if dropped:
                log.debug("swept %d expired sessions", dropped)

    def models(self) -> list[str]:
        """The names a request may use: the public name, what the backends serve, and each exact alias of one of
        those (a pattern names no model to list)."""
        names = self.cluster.served_models()
        if self.config.model and self.config.model not in names:
            names = [self.config.model, *names]
        aliases = self.config.listed_aliases()
        return [*names, *(a for a, served in aliases.items() if served in names and a not in names)]


def _gateway(request: Request) -> Gateway:
    gw: Gateway = request.app.state.gateway
    return gw


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
        ok = any(n.routable for n in c.role("aggregated"))
    else:
        ok = any(n.routable for n in c.role("prefill")) and any(n.routable for n in c.role("decode"))
    nodes = [{"url": n.url, "role": n.role, "healthy": n.healthy, "state": n.state, "version": n.version,
              "block_size": n.block_size,
              "running": n.running, "waiting": n.waiting, "kv_usage": n.kv_usage, "last_error": n.last_error,
              "prefix_caching": n.prefix_caching, "kv_capacity_tokens": n.kv_capacity_tokens,
              **({"local_handles": n.local_handles, "held_kv_tokens": n.held_kv_tokens}
                 if n.role in ("decode", "both") else {})}
             for n in c.nodes.values()]
    ok = ok and bool(gw.models())
    return JSONResponse({"ready": ok, "mode": gw.config.mode, "policy": gw.config.policy, "nodes": nodes},
                        status_code=200 if ok else 503)


async def metrics(request: Request) -> Response:
    gw = _gateway(request)
    for node in gw.cluster.nodes.values():
        gw.metrics.node_healthy.labels(node.url, node.role).set(1 if node.routable else 0)
    gw.count_nodes()
    text = merged_metrics(gw.worker_metrics) if gw.worker_metrics else generate_latest(gw.metrics.registry)
    return Response(text, media_type=CONTENT_TYPE_LATEST)


async def admin_sessions(request: Request) -> Response:
    gw = _gateway(request)
    try:
        gw.auth.check_admin(request_headers(request))
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
        tenant = gw.auth.tenant(request_headers(request))
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


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return GatewayError(exc.status_code, str(exc.detail)).response()


def create_app(config: GatewayConfig, *, store: SessionStore | None = None,
               tracer_provider: trace.TracerProvider | None = None, worker_metrics: str | None = None,
               clock: Clock | None = None, discovery: Discovery | None = None) -> GatewayApp:
    """``worker_metrics``: this app is one of several workers, which write their metrics in that directory.
    ``clock``: the one clock the gateway reads (gateway/clock.py); None: the running loop's when it runs on
    virtual time, else the OS's. ``discovery``: where the nodes are; None: the source ``config.discovery`` names."""
    gw = Gateway(config, store, tracer_provider, clock, discovery)
    gw.worker_metrics = worker_metrics

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if not gw.own_tracing:
            T.setup_tracing(config.otlp_endpoint)
        await gw.cluster.refresh_all()
        async with anyio.create_task_group() as tg:
            tg.start_soon(gw.cluster.poll_forever)
            tg.start_soon(discover_forever, gw.cluster, gw.discovery)
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
        await gw.poller.aclose()
        if gw.own_store:
            await gw.store.aclose()
        if gw.worker_metrics:
            worker_exited(gw.worker_metrics)

    turns = {route.path: turn_endpoint(route) for room in API_ROOMS for route in room.TURNS}
    app = GatewayApp(
        turns,
        routes=[
            *(Route(path, endpoint, methods=["POST"]) for path, endpoint in turns.items()),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/ready", ready, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/admin/sessions", admin_sessions, methods=["GET"]),
            Route("/v1/sessions/{session_id:path}", end_session, methods=["DELETE"]),
            *(route for room in API_ROOMS for route in room.ROUTES),
        ],
        lifespan=lifespan,
        exception_handlers={HTTPException: _http_error},
    )
    serving: Serving = gw  # what the rooms' routes read of it (checked here)
    app.state.gateway = serving
    return app


class GatewayApp(Starlette):
    """Starlette, with the turns' routes called directly: their endpoint answers every error in the API's shape
    itself, so the router's matching and the exception middlewares around it (a layer of calls per request, and
    one per message sent) buy them nothing. Every other request, and lifespan, goes through the router as
    usual."""

    def __init__(self, turns: dict[str, Callable[[Request], Awaitable[Response]]], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._turns = turns

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            endpoint = self._turns.get(scope["path"])
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
