"""An API at the gateway's edge: a chat answer raised back into another API's shape, as it leaves.

The request path speaks Chat Completions from end to end (identify → plan → legs → relay → remember); an API
module (``gateway/api/``) lowers its request to a chat body on the way in, and :class:`EdgeResponse` converts
whatever the chat path answered on the way out, without touching the relay: it wraps the ASGI ``send`` of the
answer the path produced.

- A stream (``text/event-stream``, status 200): the relay's network reads are cut into SSE events, each chat
  chunk is handed to the API's stream converter, and what it returns goes out at once (so the TTFT the client
  sees is the relay's, plus a parse).
- A whole answer or an error: the body is collected, converted once, and sent with its new length.

The client leaving, the relay's clean-up and the answer's span are the wrapped response's own business: it
still runs exactly as for a chat client.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import orjson
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

log = logging.getLogger(__name__)


class StreamConverter(Protocol):
    def feed(self, chunk: dict[str, Any]) -> bytes:
        """The client's bytes for one chat chunk (possibly none)."""
        ...

    def done(self) -> bytes:
        """The client's bytes at the chat stream's ``[DONE]``."""
        ...

    def broken(self, message: str) -> bytes:
        """The client's bytes for a chat stream that ended in an error event."""
        ...

    @property
    def ended(self) -> bool:
        """Whether the answer is whole: the bytes just converted end it."""
        ...


class EdgeResponse(Response):
    def __init__(self, inner: Response, *, whole: Callable[[int, Any], tuple[int, Any]],
                 stream: Callable[[], StreamConverter],
                 finished: Callable[[], Awaitable[None]] | None = None) -> None:
        """``whole(status, json)`` converts a whole answer or an error (its new status and JSON body);
        ``stream()`` makes the converter of one streamed answer; ``finished()`` runs once the answer is whole,
        *before* its last bytes go out (what it records is there when the client's next request comes)."""
        self.inner = inner
        self._finished = finished
        self._ran_finished = False
        self.status_code = inner.status_code
        self.background = None
        self._whole = whole
        self._stream = stream
        self.raw_headers = inner.raw_headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        start: Message | None = None
        streamed = False
        converter: StreamConverter | None = None
        pending = b""
        body: list[bytes] = []

        async def edge_send(message: Message) -> None:
            nonlocal start, streamed, converter, pending
            if message["type"] == "http.response.start":
                headers = list(message.get("headers") or [])
                streamed = message["status"] == 200 and any(
                    k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers)
                if streamed:
                    converter = self._stream()
                    await send({**message, "headers": [(k, v) for k, v in headers if k.lower() != b"content-length"]})
                else:
                    start = message
                return
            if message["type"] != "http.response.body":
                await send(message)
                return
            more = bool(message.get("more_body", False))
            if streamed:
                assert converter is not None
                pending += message.get("body", b"")
                out, pending = _convert_events(pending, converter, final=not more)
                if converter.ended:
                    await self._finish()
                if out or not more:
                    await send({"type": "http.response.body", "body": out, "more_body": more})
                return
            body.append(message.get("body", b""))
            if more:
                return
            assert start is not None
            status, payload = self._whole(start["status"], _json_or_text(b"".join(body)))
            await self._finish()
            data = orjson.dumps(payload)
            headers = [(k, v) for k, v in start.get("headers") or [] if k.lower() not in (b"content-length",
                                                                                           b"content-type")]
            headers += [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": data, "more_body": False})

        await self.inner(scope, receive, edge_send)

    async def _finish(self) -> None:
        if self._finished is None or self._ran_finished:
            return
        self._ran_finished = True
        try:
            await self._finished()
        except Exception:  # what it records is a convenience for later requests: never the answer's failure
            log.exception("recording a finished answer failed")


def _json_or_text(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return {"error": {"message": raw.decode("utf-8", "replace")[:2000], "type": "upstream_error"}}


def _convert_events(buffer: bytes, converter: StreamConverter, *, final: bool) -> tuple[bytes, bytes]:
    """Complete SSE events of `buffer` converted; what is left of it (an event cut by a network read)."""
    out: list[bytes] = []
    while True:
        cut = buffer.find(b"\n\n")
        if cut < 0:
            if not final or not buffer.strip():
                break
            cut = len(buffer)  # the stream's last event without its blank line
        event, buffer = buffer[:cut], buffer[cut + 2:]
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                out.append(converter.done())
                continue
            try:
                chunk = orjson.loads(data)
            except orjson.JSONDecodeError:
                continue
            if isinstance(chunk, dict) and "error" in chunk and "choices" not in chunk:
                err = chunk["error"]
                out.append(converter.broken(str(err.get("message") if isinstance(err, dict) else err)))
            elif isinstance(chunk, dict):
                out.append(converter.feed(chunk))
    return b"".join(out), buffer
