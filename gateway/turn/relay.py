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

from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

import anyio
import httpx
import orjson
from kvtether.gateway import telemetry as T
from kvtether.gateway.errors import sse_error
from kvtether.gateway.policy.placement import HandleAction
from kvtether.gateway.transport.streaming import LastChunk
from kvtether.gateway.turn import body as B
from kvtether.gateway.turn.context import FinalLeg, LegResult, Services, TurnContext, UpstreamFailure
from kvtether.gateway.turn.stream import DONE, Batch, Stream, loads

# Keys whose presence means a chunk must be parsed whatever its value ("token_ids" also matches
# "prompt_token_ids"): the handle and token ids are read and stripped, an error ends the turn as failed.
_ALWAYS = (b'"kv_transfer_params"', b'token_ids"', b'"error"')
# Keys that matter only with a value: vLLM sends `"finish_reason":null` on every chunk.
_IF_SET = (b'"finish_reason"', b'"usage"')

End = Callable[[LegResult], Awaitable[None]]  # the end of the turn (remember.finish), once per turn


async def relay(sv: Services, ctx: TurnContext, leg: FinalLeg, stream: Stream, end: End,
                ) -> AsyncGenerator[bytes, None]:
    """SSE passthrough; lines are parsed only for timing, the handle, token ids, usage and the answer. `end`
    runs once, whatever happens: before ``[DONE]`` goes out, or when the client left or the stream broke."""
    r = _Reader(sv, ctx, leg)
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
                await r.end(end)
            yield LastChunk(tail)
    except httpx.HTTPError as exc:
        failure = UpstreamFailure(leg.node, leg.name, f"{type(exc).__name__}: {exc}")
        sv.count_error(failure)
        sv.mark_failed(failure)  # a broken stream is soft: the node connected, so three in a row take it out
        leg.span.set_attribute(T.ERROR_TYPE, "stream_broken")
        r.result.ok = False
        yield sse_error(f"upstream stream failed: {failure}")
    finally:
        with anyio.CancelScope(shield=True):
            await stream.resp.aclose()
            if not finished:
                # The client left or the stream broke: keep the pin; keep the handle only if D finished.
                await r.end(end)


class _Reader:
    """What one stream told the gateway so far, read chunk by chunk."""

    def __init__(self, sv: Services, ctx: TurnContext, leg: FinalLeg) -> None:
        self.sv, self.ctx, self.leg, self.span = sv, ctx, leg, leg.span
        self.result = LegResult()
        self.answer = B.StreamAnswer()
        # The next turn's message-chain key needs the answer only for a session identified by hash.
        self.want_answer = ctx.kind == "chat" and ctx.session_source in ("new", "prefix")
        self.first_data = True
        # A chunk per decode step, so that its arrival marks the end of one (policy/steps.py): not when the node
        # or the request streams every few tokens (--stream-interval).
        self.chunk_per_step = sv.config.stream_interval == 1 and _stream_interval(ctx.body) == 1

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
            if payload == DONE:
                return (b"\n".join(batch[:i]) + b"\n" if i else b""), b"\n".join(batch[i:]) + b"\n"
            if payload:
                replaced = self.chunk(payload, now)
                if replaced is not None:
                    batch[i] = replaced
        return b"\n".join(batch) + b"\n", None

    async def end(self, end: End) -> None:
        """The turn's end, with what the stream told: D's hold-back released, the answer put together."""
        self.release_hold_back()
        self.result.answer = self.answer.message()
        await end(self.result)

    def release_hold_back(self) -> None:
        if self.result.holding_back:
            self.result.holding_back = False
            self.sv.cluster.hold_back(self.leg.node, -1)

    def batch_arrived(self) -> float:
        """A network read's lines are here: one timestamp for them all, and (past the stream's first chunk) one
        arrival on D's record of step boundaries (policy/steps.py): the chunks of one read are one arrival."""
        now = self.sv.clock()
        if self.result.first_chunk is not None and self.chunk_per_step:
            self.sv.learning.chunk_arrived(self.leg.node, now)
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
        chunk = loads(payload)
        if chunk is None:
            return None
        if not self.steady:
            self._timing(chunk, now)
        _read_chunk(chunk, result, self.answer if self.want_answer else None, now)
        if B.strip_internal(chunk, keep_token_ids=self.ctx.keep_token_ids):
            return b"data: " + _dumps(chunk)
        return None

    def _timing(self, chunk: dict[str, Any], now: float) -> None:
        result, ctx, node = self.result, self.ctx, self.leg.node
        if result.first_chunk is None and chunk.get("choices"):
            result.first_chunk = now - ctx.t0
            result.read_identity(chunk)
            # Only a decode-local turn's mixed step is learned from; read before this stream's own first chunk
            # joins the record, so only other streams' bursts are in it.
            sent_at = self.leg.sent_at
            if sent_at is not None and self.leg.plan.action is HandleAction.DECODE_LOCAL:
                result.arrivals_before_first = self.sv.learning.arrivals_since(node, sent_at)
            if self.chunk_per_step:
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
            self.release_hold_back()


def _stream_interval(body: Any) -> int:
    """The tokens per chunk a request asked for (vLLM's `stream_interval`; 1 when unset or unreadable)."""
    value = body.get("stream_interval") if isinstance(body, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 1 else 1


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
