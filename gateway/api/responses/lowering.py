"""``/v1/responses`` at the gateway's edge: a Responses request lowered to the chat path, and its answer raised
back and recorded (``kvtether.protocol.responses`` holds the pure translation, ``state.py`` the records).

**Sessions.** A Responses request belongs to the session named by (first that applies): a session header the
chat path reads itself (``x-session-id``, …); the session of the response it chains from or of its
conversation; Codex's ``thread-id`` / ``session-id`` headers (``x-codex-turn-metadata``'s ``thread_id`` /
``session_id``; older builds' ``conversation_id`` / ``session_id``); the ``prompt_cache_key`` body field. A
request naming none is found by its message-chain hash, as a chat client's is.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

from kvtether.gateway.api.edge import EdgeResponse
from kvtether.gateway.api.responses.state import Pending, ResponsesState
from kvtether.gateway.errors import GatewayError
from kvtether.protocol import responses as R
from kvtether.protocol.common import HostedTools
from kvtether.protocol.contract import SESSION_HEADER, session_id_from_headers
from kvtether.protocol.responses.items import BookkeepingItems
from kvtether.protocol.wire import openai_error_body
from starlette.responses import Response

# Codex's session headers, newest first: the thread (a conversation; a sub-agent's is its own) before the
# process-wide session; then what older builds sent.
CODEX_HEADERS = ("thread-id", "session-id", "conversation_id", "session_id")
CODEX_METADATA_HEADER = "x-codex-turn-metadata"
_MAX_SESSION_ID = 256


async def lower(state: ResponsesState, body: dict[str, Any], headers: dict[str, str], tenant: str | None,
                hosted_tools: HostedTools = "drop", bookkeeping_items: BookkeepingItems = "drop"
                ) -> tuple[dict[str, Any], dict[str, str], Pending]:
    """The chat body and headers for a Responses request, and what its answer needs (a GatewayError when the
    request is bad or names a response the gateway does not hold). ``hosted_tools``, ``bookkeeping_items``: the
    gateway's settings."""
    previous = body.get("previous_response_id")
    conversation = R.conversation_id(body.get("conversation"))
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise GatewayError(400, "previous_response_id must be a non-empty string", param="previous_response_id")
    if body.get("conversation") is not None and conversation is None:
        raise GatewayError(400, "conversation must be an id or {id}", param="conversation")
    if previous and conversation:
        raise GatewayError(400, "previous_response_id and conversation cannot both be set",
                           param="previous_response_id")
    history: list[dict[str, Any]] = []
    chain_session: str | None = None
    if previous:
        record = await state.get(tenant, "resp", previous)
        if record is None:
            raise GatewayError(404, f"Previous response with id '{previous}' not found.",
                               param="previous_response_id", code="previous_response_not_found")
        history, chain_session = list(record.get("messages") or []), record.get("session")
    elif conversation:
        record = await state.get(tenant, "conv", conversation)
        history = list(record.get("messages") or []) if record else []
        chain_session = (record or {}).get("session") or f"conv-{conversation}"
    try:
        lowered = R.translate(body, seal=state.seal, history=history, hosted_tools=hosted_tools,
                              bookkeeping=bookkeeping_items)
    except R.ResponsesError as err:
        raise GatewayError(err.status, err.message, param=err.param, code=err.code) from None
    chat = lowered.chat
    instructions = 1 if isinstance(body.get("instructions"), str) and body["instructions"] else 0
    out = dict(headers)
    named = session_for(body, headers, chain_session)
    if named is not None:
        out[SESSION_HEADER] = named
    base = R.skeleton(body, R.response_id(), time.time(), previous=previous or None)
    raw_input = body.get("input")
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": raw_input}]}] \
        if isinstance(raw_input, str) else list(raw_input or [])
    pending = Pending(body, tenant, state, base, chat["messages"][instructions:], conversation, input_items=items,
                      dropped=lowered.dropped, left_out=lowered.left_out)
    return chat, out, pending


def session_for(body: Mapping[str, Any], headers: Mapping[str, str], chain: str | None) -> str | None:
    """The session a Responses request names that the chat path would not find by itself (module docstring)."""
    if session_id_from_headers(headers) is not None:
        return None
    if isinstance(chain, str) and chain:
        return chain[:_MAX_SESSION_ID]
    for name in CODEX_HEADERS[:2]:
        value = (headers.get(name) or "").strip()
        if value:
            return value[:_MAX_SESSION_ID]
    meta = headers.get(CODEX_METADATA_HEADER)
    if meta:
        try:
            parsed = json.loads(meta)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            for key in ("thread_id", "session_id"):
                if isinstance(parsed.get(key), str) and parsed[key].strip():
                    return str(parsed[key]).strip()[:_MAX_SESSION_ID]
    for name in CODEX_HEADERS[2:]:
        value = (headers.get(name) or "").strip()
        if value:
            return value[:_MAX_SESSION_ID]
    cache_key = body.get("prompt_cache_key")
    if isinstance(cache_key, str) and cache_key.strip():
        return cache_key.strip()[:_MAX_SESSION_ID]
    return None


class _Stream:
    """A chat stream's chunks → Responses SSE events (edge.StreamConverter)."""

    def __init__(self, pending: Pending) -> None:
        self._pending = pending
        self._t = R.StreamTranslator(pending.base, tools=pending.body.get("tools"), seal=pending.seal)

    @property
    def ended(self) -> bool:
        return self._pending.final is not None

    def feed(self, chunk: dict[str, Any]) -> bytes:
        return b"".join(R.sse(e) for e in self._t.feed(chunk))

    def done(self) -> bytes:
        out = b"".join(R.sse(e) for e in self._t.close())
        self._pending.final = self._t.final
        return out

    def broken(self, message: str) -> bytes:
        return b"".join(R.sse(e) for e in self._t.fail(message))


def openai_error(status: int, payload: Any) -> dict[str, Any]:
    """An upstream or gateway error in OpenAI's shape (vLLM's older flat ``{"object": "error"…}`` too)."""
    if isinstance(payload, Mapping) and isinstance(payload.get("error"), Mapping):
        return dict(payload)
    message = payload.get("message") if isinstance(payload, Mapping) else None
    return openai_error_body(str(message or f"upstream error (HTTP {status})"),
                             "invalid_request_error" if status < 500 else "upstream_error")


def raise_(response: Response, pending: Pending) -> Response:
    """The chat path's answer (whole, streamed, or an error) in Responses' shape, recorded once whole."""

    def whole(status: int, payload: Any) -> tuple[int, Any]:
        if status >= 400 or not isinstance(payload, Mapping):
            return status, openai_error(status, payload)
        pending.final = R.from_chat(payload, pending.base, tools=pending.body.get("tools"), seal=pending.seal)
        return status, pending.final

    return EdgeResponse(response, whole=whole, stream=lambda: _Stream(pending), finished=pending.record)
