"""The final leg's stream, relayed to the client as it comes (SSE).

The stream is read in the pieces the network delivers, cut into lines, and forwarded a piece at a time (one
write per piece rather than one per line). A ``data:`` line is parsed only when it can carry something the
gateway needs, decided first by a substring test on the raw bytes: when D produced the first token and the
client saw the first delta (timing, hold-back, TPOT quota), D's handle and token ids (the session's held
sequence), usage, the finish reason, and the answer when the next turn's message-chain key needs it (a session
found or started by hash). A chunk is re-serialized only when an internal field had to be stripped from it.
The turn is remembered before the client sees ``[DONE]``: an agent sends its next turn right after it, and
that turn must find the handle.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
import orjson
from kvtether.gateway import telemetry as T
from kvtether.gateway.policy.placement import HandleAction, Plan
from kvtether.gateway.shell.errors import sse_error
from kvtether.gateway.turn import body as B
from kvtether.gateway.turn.context import LegResult, Services, TurnContext, UpstreamFailure
from kvtether.gateway.turn.remember import finish, read_identity, release_hold_back
from kvtether.gateway.turn.streaming import LastChunk
from kvtether.gateway.turn.upstream import UpstreamResponse
from opentelemetry import trace

Batch = list[bytes]  # complete lines (without their line end) from one network read

_DONE = b"[DONE]"
# Keys whose presence means a chunk must be parsed whatever its value ("token_ids" also matches
# "prompt_token_ids"): the handle and token ids are read and stripped, an error ends the turn as failed.
_ALWAYS = (b'"kv_transfer_params"', b'token_ids"', b'"error"')
# Keys that matter only with a value: vLLM sends `"finish_reason":null` on every chunk.
_IF_SET = (b'"finish_reason"', b'"usage"')


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
        if payload == _DONE:
            return True
        chunk = _loads(payload)
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


async def relay(sv: Services, ctx: TurnContext, the_plan: Plan, stream: Stream, span: trace.Span,
                source: str) -> AsyncGenerator[bytes, None]:
    """SSE passthrough; lines are parsed only for timing, the handle, token ids, usage and the answer."""
    r = _Reader(sv, ctx, the_plan, span)
    finished = False
    try:
        batches = iter(stream.held)
        while True:
            batch = next(batches, None)
            if batch is None:
                piece = await anext(stream.pieces, None)
                batch = stream.lines.cut(piece) if piece is not None else stream.lines.rest()
                if piece is None and not batch:
                    break
            if not batch:
                continue
            head, tail = r.read(batch)
            if tail is None:
                yield head
                continue
            if head:
                yield head
            if not finished:
                # Record D's handle before the client sees the end of the stream: an agent sends its next
                # turn right after [DONE], and that turn must find the handle.
                finished = True
                r.result.answer = r.answer.message()
                await finish(sv, ctx, the_plan, r.result, span, source)
            yield LastChunk(tail)
    except httpx.HTTPError as exc:
        failure = UpstreamFailure(the_plan.decode, "aggregated" if sv.config.mode == "aggregated" else "decode",
                                  f"{type(exc).__name__}: {exc}")
        sv.count_error(failure)
        sv.mark_failed(failure)  # a broken stream is soft: the node connected, so three in a row take it out
        span.set_attribute(T.ERROR_TYPE, "stream_broken")
        r.result.ok = False
        yield sse_error(f"upstream stream failed: {failure}")
    finally:
        with anyio.CancelScope(shield=True):
            await stream.resp.aclose()
            if not finished:
                # The client left or the stream broke: keep the pin; keep the handle only if D finished.
                r.result.answer = r.answer.message()
                await finish(sv, ctx, the_plan, r.result, span, source)


class _Reader:
    """What one stream told the gateway so far, read chunk by chunk."""

    def __init__(self, sv: Services, ctx: TurnContext, the_plan: Plan, span: trace.Span) -> None:
        self.sv, self.ctx, self.the_plan, self.span = sv, ctx, the_plan, span
        self.result = LegResult()
        self.answer = B.StreamAnswer()
        # The next turn's message-chain key needs the answer only for a session identified by hash.
        self.want_answer = ctx.kind == "chat" and ctx.session_source in ("new", "prefix")
        self.first_data = True

    def read(self, batch: Batch) -> tuple[bytes, bytes | None]:
        """Reads a batch of lines (internal fields cut from them); returns the text to forward, split before
        ``data: [DONE]`` when the batch holds it: (all, None), or (before, from [DONE] on)."""
        now = self.batch_arrived()
        for i, line in enumerate(batch):
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if self.first_data:
                self.saw_data(now)
            if payload == _DONE:
                return (b"\n".join(batch[:i]) + b"\n" if i else b""), b"\n".join(batch[i:]) + b"\n"
            if payload:
                replaced = self.chunk(payload, now)
                if replaced is not None:
                    batch[i] = replaced
        return b"\n".join(batch) + b"\n", None

    def batch_arrived(self) -> float:
        """A network read's lines are here: one timestamp for them all, and (past the stream's first chunk) one
        arrival on D's record of step boundaries (policy/steps.py): the chunks of one read are one arrival."""
        now = time.perf_counter()
        if self.result.first_chunk is not None:
            self.sv.learning.chunk_arrived(self.the_plan.decode, now)
        return now

    @property
    def steady(self) -> bool:
        """Past the first chunk with choices and the first token: a chunk is parsed only if it can matter."""
        return self.result.first_chunk is not None and self.result.ttft is not None

    def saw_data(self, now: float) -> None:
        self.first_data = False
        self.span.add_event(T.EVENT_FIRST_CHUNK)
        self.span.set_attribute(T.GEN_AI_RESPONSE_TTFC, now - self.ctx.t0)

    def chunk(self, payload: bytes, now: float) -> bytes | None:
        """Reads one SSE data payload; returns a replacement line when internal fields had to go."""
        result = self.result
        if self.steady and not self.want_answer and not _must_parse(payload):
            return None
        chunk = _loads(payload)
        if chunk is None:
            return None
        if not self.steady:
            self._timing(chunk, now)
        _read_chunk(chunk, result, self.answer if self.want_answer else None, now)
        if B.strip_internal(chunk, keep_token_ids=self.ctx.keep_token_ids):
            return b"data: " + _dumps(chunk)
        return None

    def _timing(self, chunk: dict[str, Any], now: float) -> None:
        result, ctx, node = self.result, self.ctx, self.the_plan.decode
        if result.first_chunk is None and chunk.get("choices"):
            result.first_chunk = now - ctx.t0
            read_identity(chunk, result)
            # Only a decode-local turn's mixed step is learned from; read before this stream's own first chunk
            # joins the record, so only other streams' bursts are in it.
            if ctx.final_leg_at is not None and self.the_plan.action is HandleAction.DECODE_LOCAL:
                result.arrivals_before_first = self.sv.learning.arrivals_since(node, ctx.final_leg_at)
            self.sv.learning.chunk_arrived(node, now)
            if not B.has_first_token(chunk):
                # D produced the first token but the client sees nothing yet (a tool-call parser holds the name
                # back): a local prefill's stall now delays this turn's TTFT itself.
                result.holding_back = True
                self.sv.cluster.hold_back(node, 1)
        if result.ttft is None and B.has_first_token(chunk):
            result.ttft = now - ctx.t0
            self.span.add_event(T.EVENT_FIRST_TOKEN)
            ctx.span.add_event(T.EVENT_FIRST_TOKEN)
            release_hold_back(self.sv, node, result)


def _must_parse(payload: bytes) -> bool:
    """Whether a chunk (past the first token) can carry the handle, token ids, an error, a finish reason or
    usage. A substring test: in JSON these quoted keys cannot occur inside a string value, where quotes are
    escaped."""
    for key in _ALWAYS:
        if key in payload:
            return True
    for key in _IF_SET:
        at = payload.find(key)
        while at >= 0:
            at += len(key)
            if not payload[at:at + 16].lstrip(b" \t:").startswith(b"null"):
                return True
            at = payload.find(key, at)
    return False


def _loads(payload: bytes) -> dict[str, Any] | None:
    try:
        chunk = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None
    return chunk if isinstance(chunk, dict) else None


def _dumps(chunk: dict[str, Any]) -> bytes:
    try:
        return orjson.dumps(chunk)
    except TypeError:  # an integer beyond 64 bits, which orjson refuses and the stdlib writes
        import json

        return json.dumps(chunk, separators=(",", ":"), ensure_ascii=False).encode()


def _read_chunk(chunk: dict[str, Any], result: LegResult, answer: B.StreamAnswer | None, now: float) -> None:
    """What the session store needs from a chunk: token ids, the answer, finish reasons, handle, usage."""
    if result.prompt_ids is None:
        result.prompt_ids = B.prompt_ids_of(chunk)
    for choice in chunk.get("choices") or ():
        if not isinstance(choice, dict) or choice.get("index", 0) != 0:
            continue
        out = B.output_ids_of(choice)
        if out:
            result.output_ids.extend(out)
            result.time_output(len(out), now)
        if answer is not None:
            answer.add(choice)
        if choice.get("finish_reason"):
            result.finish_reasons.append(str(choice["finish_reason"]))
            result.ok = True
    params = chunk.get(B.KV_FIELD)
    if isinstance(params, dict):
        result.handle = params
    if "error" in chunk:
        result.ok = False
    if chunk.get("usage"):
        result.usage = chunk["usage"]
