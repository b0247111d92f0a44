"""The Responses room's routes: ``POST /v1/responses`` (a turn of the chat path, lowered and raised back at the
edge, recorded once whole), the stored responses (``GET``/``DELETE /v1/responses/{id}``, their
``input_items``, ``cancel``), and the 426 that turns Codex's WebSocket transport back to HTTP."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvtether.gateway.api.endpoint import TurnRoute
from kvtether.gateway.api.responses import lowering
from kvtether.gateway.api.responses.state import Pending, ResponsesState
from kvtether.gateway.api.serving import Serving, request_headers, serving
from kvtether.gateway.errors import GatewayError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

RESPONSES_PATH = "/v1/responses"


class ResponsesEdge:
    """One Responses request: lowered to a chat turn (its chain or conversation expanded), its answer raised
    back and recorded with the session it was served in."""

    def __init__(self, gw: Serving) -> None:
        self.state, self.hosted_tools = gw.responses, gw.config.hosted_tools
        self.bookkeeping_items = gw.config.bookkeeping_items
        self.pending: Pending | None = None
        self.dropped: tuple[str, ...] = ()
        self.left_out: tuple[str, ...] = ()

    async def lower(self, body: dict[str, Any], headers: dict[str, str],
                    tenant: str | None) -> tuple[dict[str, Any], dict[str, str]]:
        chat, out, self.pending = await lowering.lower(self.state, body, headers, tenant, self.hosted_tools,
                                                       self.bookkeeping_items)
        self.dropped, self.left_out = self.pending.dropped, self.pending.left_out
        return chat, out

    def identified(self, session_id: str) -> None:
        if self.pending is not None:
            self.pending.identified(session_id)

    def raise_(self, response: Response) -> Response:
        # Refused before it was lowered (a bad key, body or chain): the error as it is, in OpenAI's shape already.
        return lowering.raise_(response, self.pending) if self.pending is not None else response


async def stored_response(request: Request) -> Response:
    """GET or DELETE /v1/responses/{id}: a response the gateway stored (in the caller's tenant)."""
    gw = serving(request)
    try:
        tenant = gw.auth.tenant(request_headers(request))
        rid = request.path_params["response_id"]
        if request.method == "DELETE":
            return await _delete(gw.responses, tenant, rid)
        return await _retrieve(gw.responses, tenant, rid)
    except GatewayError as err:
        return err.response()


async def response_input_items(request: Request) -> Response:
    gw = serving(request)
    try:
        tenant = gw.auth.tenant(request_headers(request))
        order = request.query_params.get("order", "desc")
        return await _input_items(gw.responses, tenant, request.path_params["response_id"], order)
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


async def _retrieve(state: ResponsesState, tenant: str | None, response_id: str) -> Response:
    record = await state.get(tenant, "resp", response_id)
    if record is None:
        return _not_found(response_id)
    return JSONResponse(record["response"])


async def _delete(state: ResponsesState, tenant: str | None, response_id: str) -> Response:
    if not await state.delete(tenant, "resp", response_id):
        return _not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


async def _input_items(state: ResponsesState, tenant: str | None, response_id: str, order: str) -> Response:
    record = await state.get(tenant, "resp", response_id)
    if record is None:
        return _not_found(response_id)
    items = [_with_id(item, response_id, i) for i, item in enumerate(record.get("input") or [])]
    if order != "asc":
        items.reverse()
    return JSONResponse({"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
                         "last_id": items[-1]["id"] if items else None, "has_more": False})


def _with_id(item: Any, response_id: str, n: int) -> dict[str, Any]:
    out = dict(item) if isinstance(item, Mapping) else {"type": "message", "content": item}
    out.setdefault("id", f"item_{response_id.removeprefix('resp_')}_{n}")
    return out


def _not_found(response_id: str) -> Response:
    return GatewayError(404, f"Response with id '{response_id}' not found.", param="response_id",
                        code="not_found").response()


TURNS = (TurnRoute(RESPONSES_PATH, "chat", "responses", ResponsesEdge),)
ROUTES = (
    Route(RESPONSES_PATH, responses_websocket, methods=["GET"]),
    Route(f"{RESPONSES_PATH}/{{response_id}}", stored_response, methods=["GET", "DELETE"]),
    Route(f"{RESPONSES_PATH}/{{response_id}}/input_items", response_input_items, methods=["GET"]),
    Route(f"{RESPONSES_PATH}/{{response_id}}/cancel", cancel_response, methods=["POST"]),
)
