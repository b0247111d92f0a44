"""The final leg's stream as the turn takes it over: cut into lines, a batch per network read, and held back up
to its first chunk with choices.

Until that chunk the client has seen nothing, so an error event there is the leg's failure and the turn can
still be retried as a whole (``legs.final_leg`` raises it); from there on the relay forwards the lines as they
come.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
from kvtether.gateway.transport.upstream import UpstreamResponse
from kvtether.gateway.turn import body as B
from kvtether.gateway.turn.context import UpstreamFailure

Batch = list[bytes]  # complete lines (without their line end) from one network read

DONE = b"[DONE]"


class Lines:
    """The response body cut into complete lines, a batch per network read (SSE lines end in LF or CRLF; a
    partial line waits for the rest). The legs ask for no content encoding, so the body is the text."""

    def __init__(self) -> None:
        self.pending = b""

    def cut(self, piece: bytes) -> Batch:
        if self.pending:
            piece = self.pending + piece
        lines = piece.split(b"\n")
        self.pending = lines.pop()
        return [line[:-1] if line.endswith(b"\r") else line for line in lines]

    def rest(self) -> Batch:
        last, self.pending = self.pending, b""
        return [last[:-1] if last.endswith(b"\r") else last] if last else []


@dataclass
class Stream:
    """The final leg's answer as the relay takes it over: the batches held back so far, then the rest."""

    resp: UpstreamResponse
    pieces: AsyncIterator[bytes]
    lines: Lines
    held: list[Batch]


async def read_preamble(resp: UpstreamResponse, node: str, leg: str) -> Stream:
    """Hold back the stream's lines up to its first chunk with choices (or end): an error event there means
    the client has seen nothing yet, so the turn can still be retried as a whole (e.g. D failed to read
    P's KV). vLLM sends that chunk (the role chunk) with the first engine output, i.e. once D has the KV and
    the first token, so nothing retryable comes after it; from there lines are relayed as they come.

    Not up to the first content or tool-call delta: a tool-call parser holds that back for several decode
    steps, and holding the stream meanwhile delayed the client's first chunk and stamped the turn's first
    token (and every chunk held with it) that much late, which the estimator then learned as prefill."""
    stream = Stream(resp, resp.pieces(), Lines(), [])
    try:
        async for piece in stream.pieces:
            batch = stream.lines.cut(piece)
            stream.held.append(batch)
            if _ends_preamble(batch, node, leg):
                return stream
        stream.held.append(stream.lines.rest())
        _ends_preamble(stream.held[-1], node, leg)
    except httpx.HTTPError as exc:
        await resp.aclose()
        raise UpstreamFailure.from_http(node, leg, exc) from None
    except UpstreamFailure:
        await resp.aclose()
        raise
    return stream


def _ends_preamble(batch: Batch, node: str, leg: str) -> bool:
    """Whether `batch` holds the stream's first chunk with choices (or its end); raises on an error event
    before it."""
    for line in batch:
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == DONE:
            return True
        chunk = loads(payload)
        if chunk is None:
            return True
        if "error" in chunk:
            err = chunk["error"]
            code = err.get("code") if isinstance(err, dict) else None
            status = code if isinstance(code, int) and 400 <= code < 600 else 500
            raise UpstreamFailure(node, leg, f"error event before the first token: {err}", status, chunk)
        if chunk.get("choices") or B.has_first_token(chunk):
            return True
    return False


def loads(payload: bytes) -> dict[str, Any] | None:
    try:
        chunk = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None
    return chunk if isinstance(chunk, dict) else None
