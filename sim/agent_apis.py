"""``/v1/responses`` and ``/v1/messages`` on a simulated node, as vLLM serves them: each request lowered to a
chat completion by vLLM's rules (``kvtether.protocol``, the translation the gateway uses too), run as one, and
its answer or stream raised back.

What vLLM's own endpoints do and the simulator copies (0.32–0.34):

- Responses: no state — vLLM's store is off by default, so ``previous_response_id`` is a 404 and ``store`` is
  ignored; reasoning items with ``encrypted_content`` are refused (400); ``kv_transfer_params`` is accepted
  (P/D legs) and the answer carries D's (whole answers, and the terminal event of a stream).
- Messages: ``kv_transfer_params`` is accepted; a whole answer carries the handle, a stream never does.
- Errors: vLLM's OpenAI-shaped error body on ``/v1/responses``, Anthropic's on ``/v1/messages``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from kvtether.protocol import messages as M
from kvtether.protocol import responses as R
from kvtether.protocol.wire import KV_FIELD, openai_error_body
from kvtether.sim.requests import BadRequest, chat_prompt_ids
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

if TYPE_CHECKING:
    from kvtether.sim.node import SimNode

Complete = Callable[[Any, Request], Awaitable[Response]]
# vLLM reads no encrypted reasoning at all: a seal of a key nobody holds refuses every one.
_NO_SEAL = R.ReasoningSeal(os.urandom(32))


def agent_api_routes(node: SimNode, complete: Complete) -> list[Route]:
    async def responses(request: Request) -> Response:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return _openai_error(400, f"invalid JSON body: {e}", None)
        if not isinstance(body, dict):
            return _openai_error(400, "the request body must be a JSON object", None)
        previous = body.get("previous_response_id")
        if previous:
            return _openai_error(404, f"Response with id '{previous}' not found.", "previous_response_id")
        kv = body.pop(KV_FIELD, None)
        try:
            # vLLM 0.32 renders only a request's function tools (tool_parsers/utils.py
            # iter_response_function_tool_dicts): a hosted tool such as Codex's web_search is left out of the
            # prompt without an error.
            chat = R.translate(body, seal=_NO_SEAL, hosted_tools="drop").chat
        except R.ResponsesError as e:
            return _openai_error(e.status, e.message, e.param)
        if kv is not None:
            chat[KV_FIELD] = kv
        base = R.skeleton(body, R.response_id(), time.time())
        answer = await complete(chat, request)
        if isinstance(answer, StreamingResponse):
            return StreamingResponse(_responses_stream(answer, base, body.get("tools")),
                                     media_type="text/event-stream")
        data = json.loads(bytes(answer.body))
        if answer.status_code != 200:
            return JSONResponse(data, status_code=answer.status_code)
        out = R.from_chat(data, base, tools=body.get("tools"), seal=None)
        if data.get(KV_FIELD) is not None:
            out[KV_FIELD] = data[KV_FIELD]
        return JSONResponse(out)

    async def messages(request: Request) -> Response:
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise M.MessagesError(400, "invalid_request_error", "the request body must be a JSON object")
            kv = body.pop(KV_FIELD, None)
            chat = M.to_chat(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return JSONResponse(M.error_body(400, f"invalid JSON body: {e}"), status_code=400)
        except M.MessagesError as e:
            return JSONResponse(e.body(), status_code=e.status)
        if kv is not None:
            chat[KV_FIELD] = kv
        model = str(body.get("model") or "")
        answer = await complete(chat, request)
        if isinstance(answer, StreamingResponse):
            return StreamingResponse(_messages_stream(answer, model), media_type="text/event-stream")
        data = json.loads(bytes(answer.body))
        if answer.status_code != 200:
            return JSONResponse(M.from_openai_error(answer.status_code, data), status_code=answer.status_code)
        out = M.from_chat(data, model)
        if data.get(KV_FIELD) is not None:
            out[KV_FIELD] = data[KV_FIELD]
        return JSONResponse(out)

    async def count_tokens(request: Request) -> Response:
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise M.MessagesError(400, "invalid_request_error", "the request body must be a JSON object")
            chat = M.count_tokens_body(body)
            ids = chat_prompt_ids(node.tokenizer, chat, tool_format=node.tool_format)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return JSONResponse(M.error_body(400, f"invalid JSON body: {e}"), status_code=400)
        except M.MessagesError as e:
            return JSONResponse(e.body(), status_code=e.status)
        except BadRequest as e:
            return JSONResponse(M.error_body(400, str(e)), status_code=400)
        return JSONResponse({"input_tokens": len(ids)})

    return [Route("/v1/responses", responses, methods=["POST"]),
            Route("/v1/messages", messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", count_tokens, methods=["POST"])]


def _openai_error(status: int, message: str, param: str | None) -> JSONResponse:
    kind = {400: "BadRequestError", 404: "NotFoundError"}.get(status, "InternalServerError")
    return JSONResponse(openai_error_body(message, kind, param, status), status_code=status)


async def _chunks(answer: StreamingResponse) -> AsyncIterator[dict[str, Any] | None]:
    """The chat stream's chunks as parsed JSON; None at ``[DONE]`` (the node writes whole events)."""
    async for raw in answer.body_iterator:
        data = raw if isinstance(raw, bytes) else str(raw).encode()
        for event in data.split(b"\n\n"):
            if not event.startswith(b"data: "):
                continue
            payload = event[6:]
            yield None if payload == b"[DONE]" else json.loads(payload)


async def _responses_stream(answer: StreamingResponse, base: dict[str, Any], tools: Any) -> AsyncIterator[bytes]:
    t = R.StreamTranslator(base, tools=tools, seal=None)
    handle: Any = None
    async for chunk in _chunks(answer):
        if chunk is None:
            events = t.close()
            if handle is not None and events and events[-1].get("response") is not None:
                # vLLM's terminal event carries the whole response, D's handle included.
                events[-1]["response"][KV_FIELD] = handle
            for e in events:
                yield R.sse(e)
        elif "error" in chunk and "choices" not in chunk:
            for e in t.fail(str(chunk["error"].get("message"))):
                yield R.sse(e)
        else:
            handle = chunk.get(KV_FIELD) or handle
            for e in t.feed(chunk):
                yield R.sse(e)


async def _messages_stream(answer: StreamingResponse, model: str) -> AsyncIterator[bytes]:
    # vLLM's Messages stream converter drops the chat chunks' kv_transfer_params: so does this one.
    t = M.StreamTranslator(model)
    async for chunk in _chunks(answer):
        if chunk is None:
            events = t.close()
        elif "error" in chunk and "choices" not in chunk:
            events = t.fail(str(chunk["error"].get("message")))
        else:
            events = t.feed(chunk)
        for name, data in events:
            yield M.sse(name, data)
