"""The final leg's stream, relayed to the client as it comes (SSE, line by line).

A line is parsed only for what the gateway needs from it: when D produced the first token and the client saw
the first delta (timing, hold-back, TPOT quota), D's handle and token ids (the session's held sequence),
usage, and the answer (the next turn's message-chain key). A chunk is re-serialized only when an internal
field had to be stripped from it. The turn is remembered before the client sees ``[DONE]``: an agent sends
its next turn right after it, and that turn must find the handle.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
from kvtether.gateway import body as B
from kvtether.gateway import telemetry as T
from kvtether.gateway.errors import sse_error
from kvtether.gateway.policy.placement import HandleAction, Plan
from kvtether.gateway.remember import finish, release_hold_back
from kvtether.gateway.turn import LegResult, Services, TurnContext, UpstreamFailure
from opentelemetry import trace


async def read_preamble(resp: httpx.Response, lines: AsyncIterator[str], node: str, leg: str) -> list[str]:
    """Hold back the stream's lines up to its first chunk with choices (or end): an error event there means
    the client has seen nothing yet, so the turn can still be retried as a whole (e.g. D failed to read
    P's KV). vLLM sends that chunk (the role chunk) with the first engine output, i.e. once D has the KV and
    the first token, so nothing retryable comes after it; from there lines are relayed as they come.

    Not up to the first content or tool-call delta: a tool-call parser holds that back for several decode
    steps, and holding the stream meanwhile delayed the client's first chunk and stamped the turn's first
    token (and every chunk held with it) that much late, which the estimator then learned as prefill."""
    held: list[str] = []
    try:
        async for line in lines:
            held.append(line)
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            try:
                chunk = json.loads(payload)
            except ValueError:
                break
            if not isinstance(chunk, dict):
                break
            if "error" in chunk:
                err = chunk["error"]
                code = err.get("code") if isinstance(err, dict) else None
                status = code if isinstance(code, int) and 400 <= code < 600 else 500
                raise UpstreamFailure(node, leg, f"error event before the first token: {err}", status, chunk)
            if chunk.get("choices") or B.has_first_token(chunk):
                break
    except httpx.HTTPError as exc:
        await resp.aclose()
        raise UpstreamFailure.from_http(node, leg, exc) from None
    except UpstreamFailure:
        await resp.aclose()
        raise
    return held


async def chain(first: list[str], rest: AsyncIterator[str]) -> AsyncIterator[str]:
    for line in first:
        yield line
    async for line in rest:
        yield line


async def relay(sv: Services, ctx: TurnContext, the_plan: Plan, resp: httpx.Response, lines: AsyncIterator[str],
                span: trace.Span, source: str) -> AsyncIterator[bytes]:
    """SSE passthrough, line by line; lines are parsed only for timing, the handle and token ids."""
    result = LegResult()
    answer = B.StreamAnswer()
    first_chunk = True
    finished = False
    try:
        async for line in lines:
            if line.startswith("data:"):
                payload = line[5:].strip()
                if first_chunk:
                    first_chunk = False
                    span.add_event(T.EVENT_FIRST_CHUNK)
                    span.set_attribute(T.GEN_AI_RESPONSE_TTFC, time.perf_counter() - ctx.t0)
                if payload == "[DONE]" and not finished:
                    # Record D's handle before the client sees the end of the stream: an agent sends its next
                    # turn right after [DONE], and that turn must find the handle.
                    finished = True
                    result.answer = answer.message()
                    await finish(sv, ctx, the_plan, result, span, source)
                elif payload and payload != "[DONE]":
                    seen_first = result.first_chunk is not None
                    line = _relay_chunk(sv, ctx, the_plan.decode, payload, result, answer, span) or line
                    if result.first_chunk is not None:
                        _time_chunk(sv, ctx, the_plan, result, seen_first)
            yield (line + "\n").encode()
    except httpx.HTTPError as exc:
        failure = UpstreamFailure(the_plan.decode, "aggregated" if sv.config.mode == "aggregated" else "decode",
                                  f"{type(exc).__name__}: {exc}")
        sv.count_error(failure)
        sv.cluster.mark_failed(the_plan.decode, str(failure), hard=False)
        span.set_attribute(T.ERROR_TYPE, "stream_broken")
        result.ok = False
        yield sse_error(f"upstream stream failed: {failure}")
    finally:
        with anyio.CancelScope(shield=True):
            await resp.aclose()
            if not finished:
                # The client left or the stream broke: keep the pin; keep the handle only if D finished.
                result.answer = answer.message()
                await finish(sv, ctx, the_plan, result, span, source)


def _time_chunk(sv: Services, ctx: TurnContext, the_plan: Plan, result: LegResult, seen_first: bool) -> None:
    at = time.perf_counter()
    node = the_plan.decode
    # Only a decode-local turn's mixed step is learned from; read before this stream's own first chunk joins
    # the record, so only other streams' bursts are in it.
    if not seen_first and ctx.final_leg_at is not None and the_plan.action is HandleAction.DECODE_LOCAL:
        result.arrivals_before_first = sv.learning.arrivals_since(node, ctx.final_leg_at)
    sv.learning.chunk_arrived(node, at)


def _relay_chunk(sv: Services, ctx: TurnContext, node: str, payload: str, result: LegResult,
                 answer: B.StreamAnswer, span: trace.Span) -> str | None:
    """Reads one SSE data payload; returns a replacement line when internal fields had to go."""
    try:
        chunk = json.loads(payload)
    except ValueError:
        return None
    if not isinstance(chunk, dict):
        return None
    if result.first_chunk is None and chunk.get("choices"):
        result.first_chunk = time.perf_counter() - ctx.t0
        sv.enter_decoding(ctx, node)
        if not B.has_first_token(chunk):
            # D produced the first token but the client sees nothing yet (a tool-call parser holds the name
            # back): a local prefill's stall now delays this turn's TTFT itself.
            result.holding_back = True
            sv.cluster.hold_back(node, 1)
    if result.ttft is None and B.has_first_token(chunk):
        result.ttft = time.perf_counter() - ctx.t0
        span.add_event(T.EVENT_FIRST_TOKEN)
        ctx.span.add_event(T.EVENT_FIRST_TOKEN)
        release_hold_back(sv, node, result)
    _read_chunk(chunk, result, answer)
    if B.strip_internal(chunk, keep_token_ids=ctx.keep_token_ids):
        return "data: " + json.dumps(chunk, separators=(",", ":"), ensure_ascii=False)
    return None


def _read_chunk(chunk: dict[str, Any], result: LegResult, answer: B.StreamAnswer) -> None:
    """What the session store needs from a chunk: token ids, the answer, finish reasons, handle, usage."""
    ids = B.prompt_ids_of(chunk)
    if ids is not None and result.prompt_ids is None:
        result.prompt_ids = ids
    for choice in chunk.get("choices") or []:
        if not isinstance(choice, dict) or choice.get("index", 0) != 0:
            continue
        out = B.output_ids_of(choice)
        if out:
            result.output_ids.extend(out)
            result.time_output(len(out))
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
