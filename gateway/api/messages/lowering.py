"""``POST /v1/messages`` at the gateway's edge: an Anthropic Messages request lowered to the chat path, and the
chat answer raised back (``kvtether.protocol.messages`` holds the pure translation; this module its HTTP side).

What the chat path gets: the translated body, and the request's headers with its session named the way the
path knows (``x-session-id``), from what Anthropic clients send — Claude Code's ``x-claude-code-session-id``
(a subagent, ``x-claude-code-agent-id``, is a session of its own: its own history, its own handle), else the
``session_id`` inside ``metadata.user_id`` (a JSON string Claude Code fills). A request that names none is
found by its message-chain hash, as a chat client's is.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from kvtether.gateway.api.edge import EdgeResponse
from kvtether.gateway.errors import GatewayError
from kvtether.protocol import messages as M
from kvtether.protocol.common import HostedTools
from kvtether.protocol.contract import SESSION_HEADER, session_id_from_headers
from starlette.responses import Response

CLAUDE_SESSION_HEADER = "x-claude-code-session-id"
CLAUDE_AGENT_HEADER = "x-claude-code-agent-id"
_MAX_SESSION_ID = 256


def lower(body: dict[str, Any], headers: dict[str, str], hosted_tools: HostedTools = "drop",
          unreadable_results: HostedTools = "drop") -> tuple[dict[str, Any], dict[str, str], tuple[str, ...],
                                                              tuple[str, ...]]:
    """The chat body and headers for a Messages request (a 400 in the gateway's error type when it is bad), the
    Anthropic-defined tool types left out of it (``hosted_tools``: the gateway's setting), and the tool results'
    block types no model behind vLLM reads that were left out of it (``unreadable_results``: the gateway's
    ``bookkeeping_items`` setting: they carry nothing the served model can use)."""
    try:
        lowered = M.translate(body, hosted_tools=hosted_tools, unreadable_results=unreadable_results)
    except M.MessagesError as err:
        raise GatewayError(err.status, str(err)) from None
    out = dict(headers)
    named = session_for(body, headers)
    if named is not None:
        out[SESSION_HEADER] = named
    return lowered.chat, out, lowered.dropped, lowered.left_out


def session_for(body: Mapping[str, Any], headers: Mapping[str, str]) -> str | None:
    """The session a Messages request belongs to, when it names one the chat path would not find by itself."""
    agent = (headers.get(CLAUDE_AGENT_HEADER) or "").strip()
    claude = (headers.get(CLAUDE_SESSION_HEADER) or "").strip()
    if claude and agent:
        return f"{claude}:agent:{agent}"[:_MAX_SESSION_ID]
    if session_id_from_headers(headers) is not None:
        return None  # a session header the chat path reads already
    user = body.get("metadata", {}).get("user_id") if isinstance(body.get("metadata"), Mapping) else None
    if isinstance(user, str) and user.startswith("{"):
        try:
            sid = json.loads(user).get("session_id")
        except (ValueError, AttributeError):
            sid = None
        if isinstance(sid, str) and sid.strip():
            return sid.strip()[:_MAX_SESSION_ID]
    return None


class _Stream:
    """A chat stream's chunks → Anthropic SSE events (edge.StreamConverter)."""

    def __init__(self, model: str) -> None:
        self._t = M.StreamTranslator(model)
        self.ended = False  # nothing to record when a Messages answer ends

    def feed(self, chunk: dict[str, Any]) -> bytes:
        return b"".join(M.sse(e, d) for e, d in self._t.feed(chunk))

    def done(self) -> bytes:
        return b"".join(M.sse(e, d) for e, d in self._t.close())

    def broken(self, message: str) -> bytes:
        return b"".join(M.sse(e, d) for e, d in self._t.fail(message))


def raise_(response: Response, model: str) -> Response:
    """The chat path's answer (whole, streamed, or an error) in Messages' shape."""

    def whole(status: int, payload: Any) -> tuple[int, Any]:
        if status >= 400:
            return status, M.from_openai_error(status, payload)
        return status, M.from_chat(payload, model)

    return EdgeResponse(response, whole=whole, stream=lambda: _Stream(model))


def error(err: GatewayError) -> Response:
    return raise_(err.response(), "")
