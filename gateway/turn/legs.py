"""The upstream legs of a turn: the prefill leg, and the final leg whose answer the client sees (decode in P/D
mode, the replica in aggregated mode).

Each leg has its own CLIENT span, counts itself in its node's in-flight requests, and turns every upstream
problem into an :class:`~kvtether.gateway.turn.context.UpstreamFailure` that says whether the node or the request
is at fault, so the orchestrator can retry, re-place or answer the client cleanly. The final leg hands the
orchestrator a whole answer or a stream held back up to its first chunk with choices; relaying it and the end
of the turn are the orchestrator's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
from kvtether.gateway import telemetry as T
from kvtether.gateway.errors import GatewayError
from kvtether.gateway.guard.readback import DECODE_PULL, Read, read_of, reported_cached_tokens
from kvtether.gateway.guard.verify import handle_num_tokens
from kvtether.gateway.policy.placement import Turn
from kvtether.gateway.policy.retention import ReleaseReason
from kvtether.gateway.transport.upstream import UpstreamResponse
from kvtether.gateway.turn import body as B
from kvtether.gateway.turn.context import (
    PATHS,
    FinalLeg,
    LegResult,
    Placement,
    Prefilled,
    Progress,
    Services,
    TurnContext,
    UpstreamFailure,
)
from kvtether.gateway.turn.stream import Stream, read_preamble
from opentelemetry import trace

_JSON = {"content-type": "application/json"}
# Retry-After of a turn refused because every upstream connection of the process was taken: streams end within
# seconds, so a second is when one may well be free.
GATEWAY_BUSY_RETRY_S = 1.0


@dataclass
class Whole:
    """A non-streamed answer: the body the client gets (internal fields stripped), and what it told the turn."""

    data: dict[str, Any]
    result: LegResult


async def prefill_with_recovery(sv: Services, ctx: TurnContext, progress: Progress, placed: Placement,
                                kv: dict[str, Any] | None,
                                replan: Callable[[Turn], Placement]) -> tuple[Prefilled, Placement]:
    """The prefill leg, recovered: a failed pull is retried once without its handle (docs/protocol.md §2: an expired
    or failed pull errors the prefill), a failed P is replaced by another (`replan`) while one is left. Returns
    what P did and the placement it did it in (the re-placement, after a failed P); a failed P joins the nodes
    the turn's `progress` avoids."""
    holder = ctx.state.decode if ctx.state is not None else None  # the decode node that holds the handle, if any
    for _ in range(1 + len(sv.cluster.role("prefill"))):
        try:
            return await prefill(sv, ctx, progress, placed, kv), placed
        except GatewayError:
            if kv is not None:
                # Refused before P saw it (the gateway's connections all taken): the handle was taken from the
                # store for this leg alone, so D would hold its blocks for nothing until its TTL.
                sv.release(kv, holder, ReleaseReason.UNUSED)
            raise
        except UpstreamFailure as failure:
            sv.count_error(failure)
            if kv is not None:
                sv.metrics.handle_outcomes.labels("retried_cold").inc()
                ctx.span.set_attribute(T.ATTR_RETRIED, True)
                # P may or may not have told D it is done with the handle: a release makes sure (a notify
                # for a hold already freed is only a log line on D).
                sv.release(kv, holder, ReleaseReason.UNUSED)
                kv = None
                continue
            if not failure.node_fault:
                raise
            sv.mark_failed(failure)
            progress.exclude.add(failure.node)
            turn = Turn(policy=sv.config.policy, new_session=False, pinned_decode=placed.plan.decode,
                        round_robin=0, exclude=frozenset(progress.exclude))
            try:
                placed = replan(turn)
            except GatewayError:
                raise failure from None  # no other prefill node: report what went wrong upstream
    raise GatewayError(502, "every prefill node failed", type_="upstream_error", code="upstream_failed")


async def prefill(sv: Services, ctx: TurnContext, progress: Progress, placed: Placement,
                  kv: dict[str, Any] | None) -> Prefilled:
    """The placement's prefill leg (its wait added to the turn's `progress`), learned from."""
    node = placed.plan.prefill
    assert node is not None
    span = sv.leg_span(ctx, node, "prefill")
    started = sv.clock()
    sv.cluster.begin(node, prefill=True)
    try:
        payload = B.prefill_body(ctx.body, kv)
        # A leg with a handle gets a tight bound (pull_timeout_s): a stuck pull is retried without the handle.
        # A cold leg may legitimately compute for a long time: prefill_timeout_s only catches a stuck one,
        # which is then retried on another prefill node.
        c = sv.config
        bound = c.pull_timeout_s if kv is not None else c.prefill_timeout_s
        try:
            resp = await _post(sv, ctx, node, payload, span, bound)
            await resp.read()
        except httpx.ReadTimeout:
            what = "prefill with a handle" if kv is not None else "prefill"
            raise UpstreamFailure(node, "prefill", f"{what} did not answer within {bound:g} s") from None
        except httpx.HTTPError as exc:
            raise UpstreamFailure.from_http(node, "prefill", exc) from None
        finally:
            progress.upstream_s += sv.clock() - started
        data = _json_or_none(resp)
        if resp.status_code != 200 or not isinstance(data, dict):
            raise UpstreamFailure(node, "prefill", f"HTTP {resp.status_code}", resp.status_code, data)
        sv.cluster.mark_ok(node)
        params = data.get(B.KV_FIELD)
        usage = data.get("usage")
        prompt = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        prompt = prompt if isinstance(prompt, int) else None
        read = read_of(handle_num_tokens(kv) if kv is not None else None, prompt, reported_cached_tokens(usage))
        response_id, response_model = B.response_identity(data)
        T.set_attrs(span, {T.GEN_AI_RESPONSE_TTFC: sv.clock() - started,
                           T.GEN_AI_RESPONSE_ID: response_id, T.GEN_AI_RESPONSE_MODEL: response_model,
                           T.GEN_AI_USAGE_INPUT: prompt, T.GEN_AI_USAGE_CACHE_READ: read.cached_tokens,
                           T.ATTR_HANDLE_READ: read.source == DECODE_PULL if kv is not None else None})
        _prefill_learned(sv, ctx, placed, node, prompt, read, sv.clock() - started, kv)
        return Prefilled(params if isinstance(params, dict) else None, read)
    except UpstreamFailure as failure:
        span.set_attribute(T.ERROR_TYPE, str(failure.status or "connection"))
        span.set_status(trace.Status(trace.StatusCode.ERROR, str(failure)))
        raise
    finally:
        sv.cluster.end(node, prefill=True)
        if placed.running is not None and placed.running[0] == node:
            sv.learning.prefill_seen(placed.running)  # its KV is ready (or the leg failed): it runs no more
        span.end()


def _prefill_learned(sv: Services, ctx: TurnContext, placed: Placement, node: str, prompt: int | None, read: Read,
                     seconds: float, kv: dict[str, Any] | None) -> None:
    """What the policy learns from a prefill leg: P's speed, and the new KV its cache took in, against what its
    placement assumed (P's load, its own prefix-cache hit)."""
    if prompt is None:
        return
    # P reads from D only what its own cache lacks of the handle (min(handle, prompt) − its own hit), and
    # nothing when it reported no read; its own hit is the plan's estimate (vLLM reports only the sum).
    pulled = 0
    if kv is not None and read.source == DECODE_PULL:
        pulled = max(0, min(handle_num_tokens(kv) or 0, prompt) - placed.prefill_cached.get(node, 0))
    holder = ctx.state.decode if ctx.state is not None else None
    sv.learning.prefill_done(node, prompt, read.cached_tokens, seconds, now=sv.clock(),
                             load=placed.load_at_plan(node), pulled_tokens=pulled, pulled_from=holder)
    # Without a read P's cached tokens are its own hit; with one they include what it read from D (which its
    # cache takes in too), so the plan's estimate of its own hit stands in.
    own = placed.prefill_cached.get(node, 0) if pulled else read.cached_tokens
    sv.learning.wrote(node, prompt, own)


async def final_leg(sv: Services, ctx: TurnContext, progress: Progress, leg: FinalLeg,
                    payload: dict[str, Any]) -> Whole | Stream:
    """The leg whose answer the client sees: its whole answer, read, or its stream held back up to the first
    chunk with choices (until then a failure is the leg's: raised, and the turn may be retried). Its span and
    its count in D's in-flight requests stay open until the end of the turn (remember.finish); when it was
    sent and how long the turn had awaited nodes by then (the turn's `progress`) are the leg's."""
    node = leg.node
    leg.span = span = sv.leg_span(ctx, node, leg.name)
    sv.cluster.begin(node)  # ended by remember.finish, or below on failure
    leg.sent_at, leg.upstream_s = sv.clock(), progress.upstream_s
    sresp: UpstreamResponse | None = None
    try:
        if not ctx.stream:
            data = await _send_whole(sv, ctx, leg, payload)
        else:
            sresp = await _send_stream(sv, ctx, leg, payload)
            stream = await read_preamble(sresp, node, leg.name)
    except BaseException as exc:  # a failure, or the client leaving (cancelled): nothing is left open
        if isinstance(exc, UpstreamFailure):
            span.set_attribute(T.ERROR_TYPE, str(exc.status or "connection"))
            span.set_status(trace.Status(trace.StatusCode.ERROR, str(exc)))
        span.end()
        sv.cluster.end(node)
        sv.leave_decoding(leg.placed)
        if sresp is not None and not isinstance(exc, UpstreamFailure):
            with anyio.CancelScope(shield=True):
                await sresp.aclose()
        raise
    sv.cluster.mark_ok(node)
    if leg.placed.running is not None and leg.placed.running[0] == node:
        sv.learning.prefill_seen(leg.placed.running)  # a local prefill: its first token (or whole answer) is here
    if sresp is None:
        result = LegResult(ok=True, usage=data.get("usage"), ttft=sv.clock() - ctx.t0)
        _read_whole(data, result)
        B.strip_internal(data, keep_token_ids=ctx.keep_token_ids)
        return Whole(data, result)
    return stream


def _read_whole(data: dict[str, Any], result: LegResult) -> None:
    """What the session store needs from a non-streamed answer: handle, token ids, the answer, finish."""
    params = data.get(B.KV_FIELD)
    result.handle = params if isinstance(params, dict) else None
    result.prompt_ids = B.prompt_ids_of(data)
    result.read_identity(data)
    choices = data.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        first = choices[0]
        result.output_ids = B.output_ids_of(first) or []
        result.answer = B.answer_message(first)
        if first.get("finish_reason"):
            result.finish_reasons = [str(c.get("finish_reason")) for c in choices if isinstance(c, dict)]
    result.ok = bool(result.finish_reasons)


async def _send_whole(sv: Services, ctx: TurnContext, leg: FinalLeg, payload: dict[str, Any]) -> dict[str, Any]:
    # A non-streamed answer is the first thing its client sees: every stall on D delays it.
    node = leg.node
    sv.cluster.hold_back(node, 1)
    try:
        resp = await _post(sv, ctx, node, payload, leg.span, sv.config.read_timeout_s)
        await resp.read()
    except httpx.HTTPError as exc:
        raise UpstreamFailure.from_http(node, leg.name, exc) from None
    finally:
        sv.cluster.hold_back(node, -1)
    data = _json_or_none(resp)
    if resp.status_code != 200 or not isinstance(data, dict):
        raise UpstreamFailure(node, leg.name, f"HTTP {resp.status_code}", resp.status_code, data)
    return data


async def _send_stream(sv: Services, ctx: TurnContext, leg: FinalLeg, payload: dict[str, Any]) -> UpstreamResponse:
    node = leg.node
    try:
        sresp = await _post(sv, ctx, node, payload, leg.span, sv.config.read_timeout_s)
    except httpx.HTTPError as exc:
        raise UpstreamFailure.from_http(node, leg.name, exc) from None
    if sresp.status_code != 200:
        with contextlib.suppress(httpx.HTTPError):
            await sresp.read()
        await sresp.aclose()
        raise UpstreamFailure(node, leg.name, f"HTTP {sresp.status_code}", sresp.status_code, _json_or_none(sresp))
    return sresp


async def _post(sv: Services, ctx: TurnContext, node: str, payload: dict[str, Any], span: trace.Span,
                read_timeout: float | None) -> UpstreamResponse:
    """A leg's request to `node`, up to its answer's head (`read_timeout` bounds each wait for the node's bytes)."""
    # Bodies are serialized by orjson (B.dumps), several times faster than the stdlib for long histories.
    headers = {**sv.upstream_headers(ctx, span), **_JSON}
    try:
        return await sv.upstream.send("POST", f"{node}{PATHS[ctx.kind]}", B.dumps(payload), headers,
                                      read_timeout=read_timeout)
    except httpx.PoolTimeout:
        # Every upstream connection of this process stayed taken for pool_timeout_s: the gateway is full, not
        # the node, which never saw the request. A node failure would count it against the node (three in a row
        # take a healthy one out, and its turns then crowd the others) and retry the turn elsewhere, into the
        # same full pool; the client is told to come back instead.
        raise GatewayError(503, f"the gateway is relaying as many turns as it may (max_connections = "
                                f"{sv.upstream.limits.max_connections}); retry later", code="gateway_busy",
                           retry_after_s=GATEWAY_BUSY_RETRY_S) from None


def _json_or_none(resp: UpstreamResponse) -> Any:
    try:
        return resp.json()
    except ValueError:
        return None
