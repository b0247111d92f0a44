"""The upstream legs of a turn: ``/tokenize`` for the guard, the prefill leg, and the final leg whose answer
the client sees (decode in P/D mode, the replica in aggregated mode).

Each leg has its own CLIENT span, counts itself in its node's in-flight requests, and turns every upstream
problem into an :class:`~kvtether.gateway.turn.context.UpstreamFailure` that says whether the node or the request
is at fault, so the orchestrator can retry, re-place or answer the client cleanly.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import anyio
import httpx
from kvtether.gateway import telemetry as T
from kvtether.gateway.guard.readback import DECODE_PULL, Read, read_of, reported_cached_tokens
from kvtether.gateway.guard.tokencheck import Trust
from kvtether.gateway.guard.tokenizer import LocalTokenizer
from kvtether.gateway.guard.verify import handle_num_tokens
from kvtether.gateway.policy.placement import Plan, Turn
from kvtether.gateway.policy.retention import ReleaseReason
from kvtether.gateway.shell.errors import GatewayError
from kvtether.gateway.turn import body as B
from kvtether.gateway.turn.context import PATHS, LegResult, Prefilled, Services, TurnContext, UpstreamFailure
from kvtether.gateway.turn.relay import read_preamble, relay
from kvtether.gateway.turn.remember import finish, read_body
from kvtether.gateway.turn.streaming import RelayResponse
from kvtether.gateway.turn.upstream import UpstreamResponse
from opentelemetry import trace
from starlette.responses import JSONResponse, Response

log = logging.getLogger(__name__)
_JSON = {"content-type": "application/json"}


async def tokenize(sv: Services, ctx: TurnContext) -> list[int] | None:
    """The prompt's token ids (same messages, tools and template arguments as the completion): the local
    tokenizer's where the guard trusts it for this model (compared with /tokenize first while unchecked, and
    on a share of turns), else the least-loaded P's ``/tokenize``; None when that fails, and the turn goes on
    unverified."""
    payload = B.tokenize_body(ctx.kind, ctx.body)
    if payload is None:
        return None
    guard_tok = sv.tokenizer
    ours = None
    if guard_tok is not None and guard_tok.usable(ctx.model):
        with sv.tracer.start_as_current_span(T.SPAN_TOKENIZE, context=ctx.parent_ctx, kind=T.KIND_INTERNAL) as span:
            span.set_attribute(T.ATTR_TOKENIZE_SOURCE, "local")
            ours = await guard_tok.encode(payload)
            T.set_attrs(span, {T.ATTR_PROMPT_TOKENS: len(ours) if ours is not None else None})
    if guard_tok is None or ours is None:
        return await tokenize_remote(sv, payload, ctx)
    if not guard_tok.wants_check(ctx.model):
        sv.metrics.guard_tokenize.labels("local").inc()
        return ours
    theirs = await tokenize_remote(sv, payload, ctx)
    if theirs is None:  # P could not answer: no evidence either way
        return ours if guard_tok.trust(ctx.model) is Trust.VERIFIED else None
    guard_tok.compare(ctx.model, ours, theirs, "turn")
    return theirs


async def tokenize_remote(sv: Services, payload: dict[str, Any], ctx: TurnContext | None = None) -> list[int] | None:
    """The least-loaded P's ``/tokenize`` of a body; None when it fails (counted as an upstream error)."""
    view = sv.cluster.view()
    nodes = [n for n in view.prefill if n.healthy] or list(view.prefill)
    if not nodes:
        return None
    node = min(nodes, key=lambda n: (n.score, n.url)).url
    parent = ctx.parent_ctx if ctx is not None else None
    with sv.tracer.start_as_current_span(T.SPAN_TOKENIZE, context=parent, kind=T.KIND_INTERNAL) as span:
        T.set_attrs(span, {T.ATTR_PREFILL: node, T.ATTR_TOKENIZE_SOURCE: "remote"})
        started = time.perf_counter()
        try:
            try:
                timeout = httpx.Timeout(sv.config.tokenize_timeout_s, connect=sv.config.connect_timeout_s)
                resp = await sv.tokenize_client.post(f"{node}/tokenize", content=B.dumps(payload),
                                                     headers=_JSON, timeout=timeout)
            finally:
                if ctx is not None:
                    ctx.upstream_s += time.perf_counter() - started
            if resp.status_code != 200:
                raise UpstreamFailure(node, "tokenize", f"HTTP {resp.status_code}", resp.status_code)
            tokens = resp.json().get("tokens")
            if not isinstance(tokens, list):
                raise UpstreamFailure(node, "tokenize", "no tokens in /tokenize answer", resp.status_code)
            span.set_attribute(T.ATTR_PROMPT_TOKENS, len(tokens))
            sv.metrics.guard_tokenize.labels("remote").inc()
            return [int(t) for t in tokens]
        except (httpx.HTTPError, ValueError) as exc:
            sv.count_error(UpstreamFailure(node, "tokenize", str(exc)))
        except UpstreamFailure as failure:
            sv.count_error(failure)
        span.set_attribute(T.ERROR_TYPE, "tokenize_failed")
        return None


async def start_local_tokenizer(sv: Services) -> None:
    """Loads the guard's local tokenizer off the event loop, then checks it against each served model's
    /tokenize; until then (or if it cannot load) the guard asks /tokenize."""
    guard_tok = sv.tokenizer
    if guard_tok is None:
        return
    try:
        local = await anyio.to_thread.run_sync(LocalTokenizer.load, guard_tok.source)
    except Exception as exc:
        log.warning("cannot load the guard's tokenizer %s (%s): the guard uses /tokenize", guard_tok.source, exc)
        return
    guard_tok.loaded(local)
    with anyio.move_on_after(sv.config.tokenize_timeout_s):
        await guard_tok.startup_check(sv.cluster.served_models(), lambda model: lambda p: tokenize_remote(sv, dict(p)))


async def prefill_with_recovery(sv: Services, ctx: TurnContext, the_plan: Plan, kv: dict[str, Any] | None,
                                replan: Callable[[Turn], Plan]) -> tuple[Prefilled, Plan]:
    """The prefill leg, recovered: a failed pull is retried once without its handle (docs/protocol.md §2: an expired
    or failed pull errors the prefill), a failed P is replaced by another (`replan`) while one is left."""
    for _ in range(1 + len(sv.cluster.role("prefill"))):
        assert the_plan.prefill is not None
        try:
            return await prefill(sv, ctx, the_plan.prefill, kv), the_plan
        except UpstreamFailure as failure:
            sv.count_error(failure)
            if kv is not None:
                sv.metrics.handle_outcomes.labels("retried_cold").inc()
                ctx.span.set_attribute(T.ATTR_RETRIED, True)
                # P may or may not have told D it is done with the handle: a release makes sure (a notify
                # for a hold already freed is only a log line on D).
                sv.release(kv, ctx.state.decode if ctx.state is not None else None, ReleaseReason.UNUSED)
                kv = None
                continue
            if not failure.node_fault:
                raise
            sv.mark_failed(failure)
            ctx.exclude.add(failure.node)
            turn = Turn(policy=sv.config.policy, new_session=False, pinned_decode=the_plan.decode,
                        round_robin=0, exclude=frozenset(ctx.exclude))
            try:
                the_plan = replan(turn)
            except GatewayError:
                raise failure from None  # no other prefill node: report what went wrong upstream
    raise GatewayError(502, "every prefill node failed", type_="upstream_error", code="upstream_failed")


async def prefill(sv: Services, ctx: TurnContext, node: str, kv: dict[str, Any] | None) -> Prefilled:
    span = sv.leg_span(ctx, node, "prefill")
    started = time.perf_counter()
    sv.cluster.begin(node)
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
            ctx.upstream_s += time.perf_counter() - started
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
        T.set_attrs(span, {T.GEN_AI_RESPONSE_TTFC: time.perf_counter() - started,
                           T.GEN_AI_RESPONSE_ID: response_id, T.GEN_AI_RESPONSE_MODEL: response_model,
                           T.GEN_AI_USAGE_INPUT: prompt, T.GEN_AI_USAGE_CACHE_READ: read.cached_tokens,
                           T.ATTR_HANDLE_READ: read.source == DECODE_PULL if kv is not None else None})
        _prefill_learned(sv, ctx, node, prompt, read, time.perf_counter() - started, kv)
        return Prefilled(params if isinstance(params, dict) else None, read)
    except UpstreamFailure as failure:
        span.set_attribute(T.ERROR_TYPE, str(failure.status or "connection"))
        span.set_status(trace.Status(trace.StatusCode.ERROR, str(failure)))
        raise
    finally:
        sv.cluster.end(node)
        span.end()


def _prefill_learned(sv: Services, ctx: TurnContext, node: str, prompt: int | None, read: Read, seconds: float,
                     kv: dict[str, Any] | None) -> None:
    """What the policy learns from a prefill leg: P's speed, and the new KV its cache took in."""
    if prompt is None:
        return
    # P reads from D only what its own cache lacks of the handle (min(handle, prompt) − its own hit), and
    # nothing when it reported no read; its own hit is the plan's estimate (vLLM reports only the sum).
    pulled = 0
    if kv is not None and read.source == DECODE_PULL:
        pulled = max(0, min(handle_num_tokens(kv) or 0, prompt) - ctx.prefill_cached.get(node, 0))
    holder = ctx.state.decode if ctx.state is not None else None
    sv.learning.prefill_done(node, prompt, read.cached_tokens, seconds, now=sv.clock(),
                             load=ctx.load_at_plan(node), pulled_tokens=pulled, pulled_from=holder)
    # Without a read P's cached tokens are its own hit; with one they include what it read from D (which its
    # cache takes in too), so the plan's estimate of its own hit stands in.
    own = ctx.prefill_cached.get(node, 0) if pulled else read.cached_tokens
    sv.learning.wrote(node, prompt, own)


async def final_leg(sv: Services, ctx: TurnContext, the_plan: Plan, payload: dict[str, Any], leg: str,
                    source: str) -> Response:
    """The leg whose answer the client sees: D in P/D mode, the replica in aggregated mode."""
    node = the_plan.decode
    span = sv.leg_span(ctx, node, leg)
    sv.cluster.begin(node)  # ended by remember.finish, or below on failure
    ctx.final_leg_at = time.perf_counter()
    sresp: UpstreamResponse | None = None
    try:
        if not ctx.stream:
            data = await _send_whole(sv, ctx, node, leg, payload, span)
        else:
            sresp = await _send_stream(sv, ctx, node, leg, payload, span)
            stream = await read_preamble(sresp, node, leg)
    except BaseException as exc:  # a failure, or the client leaving (cancelled): nothing is left open
        if isinstance(exc, UpstreamFailure):
            span.set_attribute(T.ERROR_TYPE, str(exc.status or "connection"))
            span.set_status(trace.Status(trace.StatusCode.ERROR, str(exc)))
        span.end()
        sv.cluster.end(node)
        sv.leave_decoding(ctx)
        if sresp is not None and not isinstance(exc, UpstreamFailure):
            with anyio.CancelScope(shield=True):
                await sresp.aclose()
        raise
    sv.cluster.mark_ok(node)
    if sresp is None:
        result = LegResult(ok=True, usage=data.get("usage"), ttft=time.perf_counter() - ctx.t0)
        read_body(data, result)
        B.strip_internal(data, keep_token_ids=ctx.keep_token_ids)
        await finish(sv, ctx, the_plan, result, span, source)
        return JSONResponse(data, headers=ctx.response_headers)
    # The reuse decision is final before the decode leg starts, so it can go into the stream's headers.
    return RelayResponse(relay(sv, ctx, the_plan, stream, span, source),
                         headers={"cache-control": "no-cache", **ctx.response_headers})


async def _send_whole(sv: Services, ctx: TurnContext, node: str, leg: str, payload: dict[str, Any],
                      span: trace.Span) -> dict[str, Any]:
    # A non-streamed answer is the first thing its client sees: every stall on D delays it.
    sv.cluster.hold_back(node, 1)
    try:
        resp = await _post(sv, ctx, node, payload, span, sv.config.read_timeout_s)
        await resp.read()
    except httpx.HTTPError as exc:
        raise UpstreamFailure.from_http(node, leg, exc) from None
    finally:
        sv.cluster.hold_back(node, -1)
    data = _json_or_none(resp)
    if resp.status_code != 200 or not isinstance(data, dict):
        raise UpstreamFailure(node, leg, f"HTTP {resp.status_code}", resp.status_code, data)
    return data


async def _send_stream(sv: Services, ctx: TurnContext, node: str, leg: str, payload: dict[str, Any],
                       span: trace.Span) -> UpstreamResponse:
    try:
        sresp = await _post(sv, ctx, node, payload, span, sv.config.read_timeout_s)
    except httpx.HTTPError as exc:
        raise UpstreamFailure.from_http(node, leg, exc) from None
    if sresp.status_code != 200:
        with contextlib.suppress(httpx.HTTPError):
            await sresp.read()
        await sresp.aclose()
        raise UpstreamFailure(node, leg, f"HTTP {sresp.status_code}", sresp.status_code, _json_or_none(sresp))
    return sresp


async def _post(sv: Services, ctx: TurnContext, node: str, payload: dict[str, Any], span: trace.Span,
                read_timeout: float | None) -> UpstreamResponse:
    """A leg's request to `node`, up to its answer's head (`read_timeout` bounds each wait for the node's bytes)."""
    # Bodies are serialized by orjson (B.dumps), several times faster than the stdlib for long histories.
    headers = {**sv.upstream_headers(ctx, span), **_JSON}
    return await sv.upstream.send("POST", f"{node}{PATHS[ctx.kind]}", B.dumps(payload), headers,
                                  read_timeout=read_timeout)


def _json_or_none(resp: UpstreamResponse) -> Any:
    try:
        return resp.json()
    except ValueError:
        return None
