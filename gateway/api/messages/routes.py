"""The Messages room's routes: ``POST /v1/messages`` (a turn of the chat path, lowered and raised back at the
edge) and ``POST /v1/messages/count_tokens``."""

from __future__ import annotations

from typing import Any

from kvtether.gateway.api import validate as V
from kvtether.gateway.api.endpoint import TurnRoute, served_model
from kvtether.gateway.api.messages import lowering
from kvtether.gateway.api.serving import Serving, request_headers, serving
from kvtether.gateway.errors import GatewayError
from kvtether.gateway.turn import body as B
from kvtether.gateway.turn.tokenize import tokenize_remote
from kvtether.protocol.messages import MessagesError, count_tokens_body
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

MESSAGES_PATH = "/v1/messages"


class MessagesEdge:
    """One Messages request: lowered to a chat turn, its answer raised back for the model the client named."""

    def __init__(self, gw: Serving) -> None:
        self.hosted_tools = gw.config.hosted_tools
        self.unreadable_results = gw.config.bookkeeping_items
        self.model = ""
        self.dropped: tuple[str, ...] = ()
        # Tool results' blocks no model behind vLLM reads (a document, …), left out (bookkeeping_items = "drop").
        self.left_out: tuple[str, ...] = ()

    async def lower(self, body: dict[str, Any], headers: dict[str, str],
                    tenant: str | None) -> tuple[dict[str, Any], dict[str, str]]:
        self.model = str(body.get("model") or "")
        chat, out, self.dropped, self.left_out = lowering.lower(body, headers, self.hosted_tools,
                                                                self.unreadable_results)
        return chat, out

    def identified(self, session_id: str) -> None:
        pass  # a Messages answer records nothing per session

    def raise_(self, response: Response) -> Response:
        return lowering.raise_(response, self.model)


async def count_tokens(request: Request) -> Response:
    """POST /v1/messages/count_tokens: the prompt's length as the served model renders it (P's /tokenize)."""
    gw = serving(request)
    try:
        gw.auth.tenant(request_headers(request))
        body = await V.read_json(request, gw.config.max_body_bytes)
        try:
            # The prompt the turn would render: without the hosted tools the turn would leave out.
            chat = count_tokens_body(body, hosted_tools=gw.config.hosted_tools)
        except MessagesError as err:
            raise GatewayError(err.status, err.message) from None
        chat["model"] = await served_model(gw, str(chat.get("model") or ""))
        payload = B.tokenize_body("chat", chat)
        ids = await tokenize_remote(gw.orchestrator.sv, payload) if payload is not None else None
        if ids is None:
            raise GatewayError(503, "no prefill node could count the tokens", code="not_ready")
        return JSONResponse({"input_tokens": len(ids)})
    except GatewayError as err:
        return lowering.error(err)


TURNS = (TurnRoute(MESSAGES_PATH, "chat", "messages", MessagesEdge),)
ROUTES = (Route(f"{MESSAGES_PATH}/count_tokens", count_tokens, methods=["POST"]),)
