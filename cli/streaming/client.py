"""The streaming client: one request, its SSE answer read event by event, each stamped on arrival."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
from kvtether.cli.streaming.answers import CHAT, AnswerReader, reader_for
from kvtether.cli.streaming.clock import TokenClock, now_ns
from kvtether.gateway.transport.upstream import Upstream, UpstreamResponse

# The path of each API under the server's base URL (…/v1).
PATHS = {"chat": "/chat/completions", "completions": "/completions", "responses": "/responses",
         "messages": "/messages"}


class StreamFailure(Exception):
    """A request that got no complete answer. ``kind``: ``timeout`` or ``connection`` (no answer), ``http_<status>``
    (an error status), ``server_error`` (an error event inside a 200 stream), ``stream`` (the stream broke)."""

    def __init__(self, kind: str, message: str, headers: httpx.Headers | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.headers = headers  # the response's, when one came


@dataclass(slots=True)
class StreamedAnswer:
    """A streamed answer as received: its clock, what its reader kept, and the response's headers."""

    api: str
    clock: TokenClock
    reader: AnswerReader
    headers: httpx.Headers

    def ttfc_ms(self, scale: float = 1.0) -> float | None:
        return self.clock.ttfc_ms(scale)

    def ttft_ms(self, scale: float = 1.0) -> float | None:
        return self.clock.ttft_ms(scale)

    def tpot_ms(self, scale: float = 1.0) -> float | None:
        return self.clock.tpot_ms(self.reader.completion_tokens, scale)

    def e2e_ms(self, scale: float = 1.0) -> float | None:
        return self.clock.e2e_ms(scale)

    def message(self) -> dict[str, Any]:
        return self.reader.message()


def _data(line: str) -> Any:
    """An SSE line's JSON payload; None for anything else (event names, comments, blank lines, [DONE])."""
    if not line.startswith("data:"):
        return None
    payload = line[5:].strip()
    if not payload or payload == "[DONE]":
        return None
    return orjson.loads(payload)


def _take(line: str, now: int, reader: AnswerReader, headers: httpx.Headers) -> None:
    """One line of the stream, arrived at `now`: its event read, an error event raised as the server's."""
    data = _data(line)
    if not isinstance(data, Mapping):
        return
    reader.clock.event(now)
    reader.read(data, now)
    if reader.error is not None:
        raise StreamFailure("server_error", reader.error[:300], headers)


async def _read(resp: httpx.Response, reader: AnswerReader, clock_ns: Callable[[], int]) -> None:
    async for line in resp.aiter_lines():
        _take(line, clock_ns(), reader, resp.headers)  # stamped first: nothing may sit between arrival and stamp


async def _read_pieces(resp: UpstreamResponse, reader: AnswerReader, clock_ns: Callable[[], int],
                       headers: httpx.Headers) -> None:
    """:func:`_read` over the pieces the network delivered: one arrival stamp per piece, its lines cut here (as
    bytes: a newline byte is never inside a UTF-8 character, a piece's end may be)."""
    rest = b""
    async for piece in resp.pieces():
        now = clock_ns()
        lines = (rest + piece).split(b"\n")
        rest = lines.pop()
        for line in lines:
            _take(line.decode(), now, reader, headers)
    if rest:  # a last line without its newline
        _take(rest.decode(), clock_ns(), reader, headers)


async def _stream_lean(client: Upstream, url: str, body: bytes, headers: dict[str, str], read_timeout_s: float | None,
                       clock: TokenClock, reader: AnswerReader, api: str,
                       clock_ns: Callable[[], int]) -> StreamedAnswer:
    resp = await client.send("POST", url, body, headers, read_timeout=read_timeout_s)
    try:
        resp_headers = httpx.Headers(resp.headers)
        if resp.status_code != 200:
            text = (await resp.read()).decode("utf-8", "replace")
            raise StreamFailure(f"http_{resp.status_code}", f"HTTP {resp.status_code}: {text}"[:300], resp_headers)
        answer = StreamedAnswer(api, clock, reader, resp_headers)
        try:
            await _read_pieces(resp, reader, clock_ns, resp_headers)
        except StreamFailure:
            raise
        except Exception as e:  # the stream broke after its head: never a connection failure
            raise StreamFailure("stream", f"{type(e).__name__}: {e}"[:300]) from e
        clock.end = clock_ns()
        return answer
    finally:
        await resp.aclose()


async def stream_answer(client: httpx.AsyncClient | Upstream, url: str, body: Mapping[str, Any],
                        headers: Mapping[str, str] | None = None, *, api: str = CHAT,
                        request_timeout_s: float | None = None,
                        clock_ns: Callable[[], int] = now_ns) -> StreamedAnswer:
    """POST `body` (a streamed request of `api`) to `url` and read its answer to the end of the stream.

    The clock starts just before the request is sent; `request_timeout_s` bounds each wait (the client's own
    timeout without it). `clock_ns`: the clock the times are read on (nanoseconds): ``perf_counter_ns`` live, a
    virtual loop's time (``loop_clock_ns``) in virtual time. Raises StreamFailure: never a retry, which would
    hide in the times; the caller counts the failure instead."""
    clock = TokenClock(t0=clock_ns())
    reader = reader_for(api, clock)
    if isinstance(client, Upstream):
        # The gateway's own lean HTTP/1.1 client (gateway/transport/upstream.py): a virtual-time run's client,
        # whose CPU is no part of any figure there, need not pay for httpx's layers on every streamed chunk.
        try:
            return await _stream_lean(client, url, orjson.dumps(dict(body)),
                                      {"content-type": "application/json", **dict(headers or {})},
                                      request_timeout_s, clock, reader, api, clock_ns)
        except StreamFailure:
            raise
        except httpx.TimeoutException as e:
            raise StreamFailure("timeout", f"request timed out ({type(e).__name__}: {e})") from e
        except httpx.TransportError as e:
            raise StreamFailure("connection", f"connection error ({type(e).__name__}: {e or 'no answer'})") from e
    timeout = httpx.USE_CLIENT_DEFAULT if request_timeout_s is None else request_timeout_s
    started = False  # whether the response's head came: a failure after it broke the stream
    try:
        # orjson: the same compact UTF-8 JSON httpx's `json=` sends, several times faster on a long history.
        request_headers = {"content-type": "application/json", **dict(headers or {})}
        async with client.stream("POST", url, content=orjson.dumps(dict(body)), headers=request_headers,
                                 timeout=timeout) as resp:
            started = True
            if resp.status_code != 200:
                text = (await resp.aread()).decode("utf-8", "replace")
                raise StreamFailure(f"http_{resp.status_code}", f"HTTP {resp.status_code}: {text}"[:300], resp.headers)
            answer = StreamedAnswer(api, clock, reader, resp.headers)
            await _read(resp, reader, clock_ns)
        clock.end = clock_ns()
        return answer
    except StreamFailure:
        raise
    except httpx.TimeoutException as e:
        if started:
            raise StreamFailure("stream", f"{type(e).__name__}: {e}"[:300]) from e
        raise StreamFailure("timeout", f"request timed out ({type(e).__name__}: {e})") from e
    except httpx.TransportError as e:
        if started:
            raise StreamFailure("stream", f"{type(e).__name__}: {e}"[:300]) from e
        raise StreamFailure("connection", f"connection error ({type(e).__name__}: {e or 'no answer'})") from e
    except Exception as e:  # a broken stream mid-way (bad JSON, …): recorded by the caller, never a crash
        raise StreamFailure("stream", f"{type(e).__name__}: {e}"[:300]) from e
