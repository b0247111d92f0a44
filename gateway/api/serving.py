"""What the API rooms read of the gateway: the parts the shell builds once per app (``shell/app.py``'s
``Gateway``, reachable from a request as ``app.state.gateway``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from kvtether.gateway import telemetry as T
from kvtether.gateway.config import GatewayConfig
from kvtether.gateway.nodes.cluster import Cluster
from kvtether.gateway.tenancy import Auth
from kvtether.gateway.turn.orchestrator import Orchestrator
from opentelemetry import trace
from starlette.requests import Request

if TYPE_CHECKING:  # the rooms import this module, so theirs are imported for the type checker only
    from kvtether.gateway.api.hosted import DroppedTools
    from kvtether.gateway.api.responses.state import ResponsesState


class Serving(Protocol):
    config: GatewayConfig
    tracer: trace.Tracer
    metrics: T.Metrics
    auth: Auth
    cluster: Cluster
    orchestrator: Orchestrator
    dropped_tools: DroppedTools  # hosted tools the turns dropped (api/hosted.py)
    responses: ResponsesState  # the stored responses and conversations (api/responses/state.py)

    def models(self) -> list[str]:
        """The model names the gateway serves: the configured public name first, then what the nodes serve, then
        the exact aliases of those (``model_aliases``)."""
        ...


def serving(request: Request) -> Serving:
    gw: Serving = request.app.state.gateway
    return gw


def request_headers(request: Request) -> dict[str, str]:
    """The request's headers, names lower-cased."""
    return {k.lower(): v for k, v in request.headers.items()}
