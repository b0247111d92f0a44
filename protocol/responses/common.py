"""What the Responses translation's request, answer and stream sides share: its refusal, the reasoning seal the
gateway hands out and reads back, and vLLM's names for namespaced and custom tool calls."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import zlib
from typing import Any

from kvtether.protocol.common import Refused

CUSTOM_TOOL_INPUT_KEY = "input"  # vLLM's CUSTOM_TOOL_INPUT_KEY
NAMESPACE_SEPARATOR = "__"  # vLLM's _NAMESPACE_TOOL_SEPARATOR
ENCRYPTED_REASONING = "reasoning.encrypted_content"


class ResponsesError(Refused):
    """A request the Responses API refuses: HTTP status, message, the offending parameter."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def invalid(message: str, param: str | None = None) -> ResponsesError:
    return ResponsesError(400, message, param, "invalid_request")


# ---------------------------------------------------------------------------------------------------------
# Reasoning the gateway hands out and reads back


class ReasoningSeal:
    """``encrypted_content`` of a reasoning item: the reasoning text, compressed and signed with the gateway's
    key (HMAC-SHA256). Opaque to the client and verifiable by any replica that shares the key; not secret —
    the same answer carries the text in the item's ``content`` anyway."""

    PREFIX = "kvt1."

    def __init__(self, key: bytes) -> None:
        self._key = key

    def seal(self, text: str) -> str:
        payload = base64.urlsafe_b64encode(zlib.compress(text.encode("utf-8", "surrogatepass"))).decode()
        return f"{self.PREFIX}{payload}.{self._sign(payload)}"

    def open(self, sealed: str) -> str | None:
        """The reasoning text, or None for content this gateway's key did not sign."""
        if not sealed.startswith(self.PREFIX):
            return None
        payload, _, signature = sealed[len(self.PREFIX):].rpartition(".")
        if not payload or not hmac.compare_digest(signature, self._sign(payload)):
            return None
        return self._text(payload)

    @classmethod
    def read(cls, sealed: Any) -> str | None:
        """The reasoning text of content in this seal's form, whoever signed it, or None: what a reader without
        the key (the SDK's recorder) needs to see the text the gateway will read from it."""
        if not isinstance(sealed, str) or not sealed.startswith(cls.PREFIX):
            return None
        payload = sealed[len(cls.PREFIX):].rpartition(".")[0]
        return cls._text(payload) if payload else None

    @staticmethod
    def _text(payload: str) -> str | None:
        try:
            return zlib.decompress(base64.urlsafe_b64decode(payload)).decode("utf-8", "surrogatepass")
        except (ValueError, zlib.error):
            return None

    def _sign(self, payload: str) -> str:
        digest = hmac.new(self._key, payload.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest[:24]).decode()


# ---------------------------------------------------------------------------------------------------------
# Tool names and custom tool payloads, as vLLM shows them to the model


def flat_name(namespace: str, name: str) -> str:
    return f"{namespace}{NAMESPACE_SEPARATOR}{name}"


def encode_custom_input(payload: str) -> str:
    """A custom tool call's arguments as vLLM shows them to the model (``encode_custom_tool_input``)."""
    return json.dumps({CUSTOM_TOOL_INPUT_KEY: payload}, ensure_ascii=False)


def decode_custom_input(arguments: str) -> str:
    """The payload of a custom tool call's arguments; bare text passes through (vLLM's rule)."""
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return arguments
    value = parsed.get(CUSTOM_TOOL_INPUT_KEY) if isinstance(parsed, dict) else None
    return value if isinstance(value, str) else arguments


