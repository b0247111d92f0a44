"""``/v1/responses`` at the gateway's edge: a Responses request lowered to the chat path, its answer raised
back, and the Responses state the gateway owns (``responses.py`` holds the pure translation).

**State.** vLLM keeps ``previous_response_id`` state in one API server's memory (off by default, never
evicted), and a P/D request's two legs run on two servers, so the gateway keeps it: each stored response
(``store``, true by default) is a record in the session store — memory, or Redis/Valkey shared by replicas —
under the caller's tenant, for ``responses_ttl_s``. A record holds the answer and the chat messages of its
whole history *with* the answer (reasoning and tool calls included, which vLLM's own replay drops), so a
chained request is expanded to exactly the messages a stateless client would have resent. A ``conversation``
is a record too: its messages, extended by each response made in it.

**Sessions.** A Responses request belongs to the session named by (first that applies): a session header the
chat path reads itself (``x-session-id``, …); the session of the response it chains from or of its
conversation; Codex's ``thread-id`` / ``session-id`` headers (``x-codex-turn-metadata``'s ``thread_id`` /
``session_id``; older builds' ``conversation_id`` / ``session_id``); the ``prompt_cache_key`` body field. A
request naming none is found by its message-chain hash, as a chat client's is.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson
from kvtether.gateway.api.edge import EdgeResponse
from kvtether.gateway.errors import GatewayError
from kvtether.gateway.stores.failsafe import StoreUnavailable
from kvtether.gateway.stores.sessions import SessionStore
from kvtether.gateway.tenancy import scoped
from kvtether.sdk.apis import responses as R
from kvtether.sdk.apis.common import HostedTools
from kvtether.sdk.contract import SESSION_HEADER, session_id_from_headers
from starlette.responses import JSONResponse, Response

log = logging.getLogger(__name__)

# Codex's session headers, newest first: the thread (a conversation; a sub-agent's is its own) before the
# process-wide session; then what older builds sent.
CODEX_HEADERS = ("thread-id", "session-id", "conversation_id", "session_id")
CODEX_METADATA_HEADER = "x-codex-turn-metadata"
_MAX_SESSION_ID = 256


class ResponsesState:
    """The stored responses and conversations, as records of the session store."""

    def __init__(self, store: SessionStore, ttl_s: float, seal: R.ReasoningSeal) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self.seal = seal

    async def get(self, tenant: str | None, kind: str, key: str) -> dict[str, Any] | None:
        try:
            raw = await self.store.get_record(scoped(tenant, f"{kind}:{key}"))
        except StoreUnavailable:
            raise GatewayError(503, "the Responses state store does not answer; retry shortly",
                               code="store_unavailable", retry_after_s=1.0) from None
        if raw is None:
            return None
        try:
            record = orjson.loads(raw)
        except orjson.JSONDecodeError:
            log.warning("responses state: an unreadable %s record was treated as absent", kind)
            return None
        return record if isinstance(record, dict) else None

    async def put(self, tenant: str | None, kind: str, key: str, record: Mapping[str, Any]) -> None:
        await self.store.put_record(scoped(tenant, f"{kind}:{key}"), orjson.dumps(record), self.ttl_s)

    async def delete(self, tenant: str | None, kind: str, key: str) -> bool:
        try:
            return await self.store.delete_record(scoped(tenant, f"{kind}:{key}"))
        except StoreUnavailable:
            raise GatewayError(503, "the Responses state store does not answer; retry shortly",
                               code="store_unavailable", retry_after_s=1.0) from None


def seal_for(key: str | None) -> R.ReasoningSeal:
    """The reasoning seal of the configured key, or of a random one (one gateway process)."""
    return R.ReasoningSeal(key.encode() if key else os.urandom(32))


@dataclass
class Pending:
    """One Responses request on its way: what its answer is built from and what gets stored after it."""

    body: dict[str, Any]
    tenant: str | None
    state: ResponsesState
    base: dict[str, Any]
    messages: list[dict[str, Any]]  # the chat messages sent, without the request's own instructions
    conversation: str | None
    session: str | None = None  # the session the chat path served it in (unscoped), once known
    final: dict[str, Any] | None = None
    input_items: list[Any] = field(default_factory=list)
    dropped: tuple[str, ...] = ()  # hosted tool types left out of the turn (hosted_tools = "drop")

    @property
    def seal(self) -> R.ReasoningSeal | None:
        include = self.body.get("include")
        return self.state.seal if isinstance(include, list) and R.ENCRYPTED_REASONING in include else None

    def identified(self, session_id: str) -> None:
        prefix = f"{self.tenant}/" if self.tenant is not None else ""
        self.session = session_id[len(prefix):] if prefix and session_id.startswith(prefix) else session_id

    async def record(self) -> None:
        """Store the finished answer (``store``) and extend its conversation."""
        if self.final is None:
            return
        answer = R.input_messages(self.final["output"], self.state.seal) if self.final["output"] else []
        history = self.messages + answer
        if self.body.get("store", True) is not False:
            await self.state.put(self.tenant, "resp", self.final["id"], {
                "response": self.final, "messages": history, "input": self.input_items, "session": self.session})
        if self.conversation is not None:
            await self.state.put(self.tenant, "conv", self.conversation,
                                 {"messages": history, "session": self.session})


async def lower(state: ResponsesState, body: dict[str, Any], headers: dict[str, str], tenant: str | None,
                hosted_tools: HostedTools = "drop") -> tuple[dict[str, Any], dict[str, str], Pending]:
    """The chat body and headers for a Responses request, and what its answer needs (a GatewayError when the
    request is bad or names a response the gateway does not hold). ``hosted_tools``: the gateway's setting."""
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
        lowered = R.translate(body, seal=state.seal, history=history, hosted_tools=hosted_tools)
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
                      dropped=lowered.dropped)
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
    return {"error": {"message": str(message or f"upstream error (HTTP {status})"),
                      "type": "invalid_request_error" if status < 500 else "upstream_error",
                      "param": None, "code": None}}


def raise_(response: Response, pending: Pending) -> Response:
    """The chat path's answer (whole, streamed, or an error) in Responses' shape, recorded once whole."""

    def whole(status: int, payload: Any) -> tuple[int, Any]:
        if status >= 400 or not isinstance(payload, Mapping):
            return status, openai_error(status, payload)
        pending.final = R.from_chat(payload, pending.base, tools=pending.body.get("tools"), seal=pending.seal)
        return status, pending.final

    return EdgeResponse(response, whole=whole, stream=lambda: _Stream(pending), finished=pending.record)


# ---- the stored responses' own routes ----------------------------------------------------------------------


async def retrieve(state: ResponsesState, tenant: str | None, response_id: str) -> Response:
    record = await state.get(tenant, "resp", response_id)
    if record is None:
        return _not_found(response_id)
    return JSONResponse(record["response"])


async def delete(state: ResponsesState, tenant: str | None, response_id: str) -> Response:
    if not await state.delete(tenant, "resp", response_id):
        return _not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


async def input_items(state: ResponsesState, tenant: str | None, response_id: str, order: str) -> Response:
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
