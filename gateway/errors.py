"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import json
import math
from typing import Any

from kvtether.protocol.wire import openai_error_body
from starlette.responses import JSONResponse

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
          429: "rate_limit_error", 503: "service_unavailable", 504: "timeout"}


class GatewayError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type_: str | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        # 503 when every node of a role is out: when the first may be back (clients and LBs honour it).
        self.retry_after_s = retry_after_s
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or _TYPES.get(status, "invalid_request_error" if status < 500 else "upstream_error")

    def payload(self) -> dict[str, Any]:
        return error_payload(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        headers = {"retry-after": str(max(1, math.ceil(self.retry_after_s)))} if self.retry_after_s else None
        return JSONResponse(self.payload(), status_code=self.status, headers=headers)


def error_payload(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return openai_error_body(message, type_, param, code)


def sse_error(message: str, type_: str = "upstream_error", code: str | None = None) -> bytes:
    """The event a stream that already started ends with when its upstream fails."""
    return f"data: {json.dumps(error_payload(message, type_, None, code))}\n\n".encode()
