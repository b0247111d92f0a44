"""The prompt's token ids for the guard: the local tokenizer's where the guard trusts it, else a prefill node's
``/tokenize``.

Here, in the turn, rather than in ``guard/``: the guard compares token sequences and keeps the local
tokenizer's trust (pure but for the tokenizer itself); asking a node is a turn's business — the least-loaded
P, the ``/tokenize`` connections of its own, the turn's span and its time awaiting nodes, an upstream error
counted. ``gather`` tokenizes a turn's prompt; ``count_tokens`` (Messages) and the app's start-up (the local
tokenizer checked against each served model) use the same calls.
"""

from __future__ import annotations

import logging
from typing import Any

import anyio
import httpx
import orjson
from kvtether.gateway import telemetry as T
from kvtether.gateway.guard.tokencheck import Trust
from kvtether.gateway.guard.tokenizer import LocalTokenizer
from kvtether.gateway.turn import body as B
from kvtether.gateway.turn.context import Progress, Services, TurnContext, UpstreamFailure

log = logging.getLogger(__name__)
_JSON = {"content-type": "application/json"}


async def tokenize(sv: Services, ctx: TurnContext, progress: Progress) -> list[int] | None:
    """The prompt's token ids (same messages, tools and template arguments as the completion): the local
    tokenizer's where the guard trusts it for this model (compared with /tokenize first while unchecked, and
    on a share of turns), else the least-loaded P's ``/tokenize`` (its wait added to the turn's `progress`);
    None when that fails, and the turn goes on unverified."""
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
        return await tokenize_remote(sv, payload, ctx, progress)
    if not guard_tok.wants_check(ctx.model):
        sv.metrics.guard_tokenize.labels("local").inc()
        return ours
    theirs = await tokenize_remote(sv, payload, ctx, progress)
    if theirs is None:  # P could not answer: no evidence either way
        return ours if guard_tok.trust(ctx.model) is Trust.VERIFIED else None
    guard_tok.compare(ctx.model, ours, theirs, "turn")
    return theirs


async def tokenize_remote(sv: Services, payload: dict[str, Any], ctx: TurnContext | None = None,
                          progress: Progress | None = None) -> list[int] | None:
    """The least-loaded P's ``/tokenize`` of a body; None when it fails (counted as an upstream error). For a
    turn (`ctx`), its span is the turn's child and its wait is added to the turn's `progress`."""
    view = sv.cluster.view()
    nodes = [n for n in view.prefill if n.healthy] or list(view.prefill)
    if not nodes:
        return None
    node = min(nodes, key=lambda n: n.score).url  # ties: the configuration's order
    parent = ctx.parent_ctx if ctx is not None else None
    with sv.tracer.start_as_current_span(T.SPAN_TOKENIZE, context=parent, kind=T.KIND_INTERNAL) as span:
        T.set_attrs(span, {T.ATTR_PREFILL: node, T.ATTR_TOKENIZE_SOURCE: "remote"})
        started = sv.clock()
        try:
            try:
                timeout = httpx.Timeout(sv.config.tokenize_timeout_s, connect=sv.config.connect_timeout_s)
                resp = await sv.tokenize_client.post(f"{node}/tokenize", content=B.dumps(payload),
                                                     headers=_JSON, timeout=timeout)
            finally:
                if progress is not None:
                    progress.upstream_s += sv.clock() - started
            if resp.status_code != 200:
                raise UpstreamFailure(node, "tokenize", f"HTTP {resp.status_code}", resp.status_code)
            tokens = orjson.loads(resp.content).get("tokens")  # tens of thousands of ids: the fast parser
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
