"""What the Messages translation's request, answer and stream sides share: Anthropic's errors (a refused
request, an upstream error in Anthropic's shape) and the system-prompt mark vLLM strips."""

from __future__ import annotations

import json
from collections.abc import Mapping
from http import HTTPStatus
from typing import Any, Final

from kvtether.protocol.common import Refused

# Claude Code's per-request attribution block in ``system``: vLLM leaves it out of the prompt.
BILLING_HEADER_PREFIX: Final = "x-anthropic-billing-header"

# HTTP status → Anthropic error.type (vLLM 0.34's translate_error_type, plus 500 and Anthropic's own 529).
ERROR_TYPES: Final[Mapping[int, str]] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


class MessagesError(Refused):
    """A request the Messages API refuses, with the HTTP status and Anthropic ``error.type`` to answer it with."""

    def __init__(self, status: int, type: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.type = type
        self.message = message

    def body(self) -> dict[str, Any]:
        return {"type": "error", "error": {"type": self.type, "message": self.message}}


def invalid(message: str) -> MessagesError:
    return MessagesError(400, "invalid_request_error", message)


# ---------------------------------------------------------------------------------------------------------
# Errors


def error_type(status: int) -> str:
    """Anthropic's ``error.type`` for an HTTP status: other 4xx are invalid requests, other 5xx API errors."""
    known = ERROR_TYPES.get(status)
    if known is not None:
        return known
    return "api_error" if status >= 500 else "invalid_request_error"


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def from_openai_error(status: int, openai_error_body: Any) -> dict[str, Any]:
    """The gateway's (or vLLM's) OpenAI-shaped error — ``{"error": {"message", "type", …}}``, or the flat
    ``{"object": "error", "message", …}`` older vLLM answers with — in Anthropic's shape. The type follows the
    status, as vLLM 0.34 does, since OpenAI's type names (``service_unavailable``…) mean nothing to an
    Anthropic SDK, which dispatches on ``error.type``."""
    message: Any = None
    if isinstance(openai_error_body, Mapping):
        inner = openai_error_body.get("error")
        if isinstance(inner, Mapping):
            message = inner.get("message")
        elif isinstance(inner, str):
            message = inner
        if message is None:
            message = openai_error_body.get("message")
    elif isinstance(openai_error_body, str | bytes):
        text = openai_error_body.decode(errors="replace") if isinstance(openai_error_body, bytes) \
            else openai_error_body
        try:
            parsed = json.loads(text)
        except ValueError:
            parsed = None
        # An error body not parsed yet: read it as JSON; anything else is the message itself.
        return from_openai_error(status, parsed) if isinstance(parsed, Mapping) else error_body(status, text or
                                                                                               _phrase(status))
    if not isinstance(message, str) or not message:
        message = _phrase(status)
    return error_body(status, message)


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return f"upstream error (HTTP {status})"
