"""The end of a turn: its span and metrics closed, what the policy learns fed to it, and the session's new
state (pin, handle and held sequence, what D's prefix cache holds, running means) put into the store.

Runs once per turn, whatever happened: after a non-streamed answer, before a stream's ``[DONE]`` reaches the
client, or when the client left or the stream broke. Bookkeeping never turns an answer the client already
has into an error.
"""

from __future__ import annotations

import logging
from typing import Any

from kvtether.gateway import telemetry as T
from kvtether.gateway.guard.readback import reported_cached_tokens
from kvtether.gateway.guard.verify import HeldSequence, handle_num_tokens, handle_request_id
from kvtether.gateway.nodes.cluster import host_of
from kvtether.gateway.policy import copies as PC
from kvtether.gateway.policy.learning import DecodeSample
from kvtether.gateway.policy.placement import HandleAction
from kvtether.gateway.policy.retention import ReleaseReason, block_scope
from kvtether.gateway.stores.sessions import SessionState
from kvtether.gateway.tenancy import scoped
from kvtether.gateway.turn import body as B
from kvtether.gateway.turn.context import FinalLeg, LegResult, Placement, Services, TurnContext

log = logging.getLogger(__name__)

_MEAN_WEIGHT = 0.3  # of the latest turn in the session's running means (≈ the last three turns count)


async def finish(sv: Services, ctx: TurnContext, leg: FinalLeg, result: LegResult) -> None:
    """The end of the turn, once its final leg's answer is whole (or the client left, or the stream broke)."""
    the_plan, span, source = leg.plan, leg.span, leg.source
    try:
        usage = result.usage if isinstance(result.usage, dict) else {}
        if the_plan.prefill is None:
            # The node that prefilled is the one that answered: its usage says what it did not compute (a P/D
            # turn's prefill leg was counted when P answered).
            cached = reported_cached_tokens(usage)
            if source == "none" and cached:
                source = "prefill_cache"
            if cached is not None:
                sv.metrics.reused_tokens.labels(source).inc(cached)
        T.set_attrs(span, {T.GEN_AI_RESPONSE_FINISH_REASONS: result.finish_reasons or None,
                           T.GEN_AI_RESPONSE_ID: result.response_id, T.GEN_AI_RESPONSE_MODEL: result.response_model,
                           T.GEN_AI_USAGE_INPUT: usage.get("prompt_tokens"),
                           T.GEN_AI_USAGE_OUTPUT: usage.get("completion_tokens"),
                           T.GEN_AI_USAGE_CACHE_READ: B.cached_tokens(usage) if usage else None,
                           T.ATTR_REUSE_SOURCE: source, T.ATTR_TTFT: result.ttft})
        # The gateway's own share: until the final leg was sent, less the time awaiting tokenize/prefill
        # (from there on it only relays, and the first token's arrival is the TTFT's end).
        overhead = (max(0.0, leg.sent_at - ctx.t0 - leg.upstream_s)
                    if result.ttft is not None and leg.sent_at is not None else None)
        T.set_attrs(ctx.span, {T.ATTR_REUSE_SOURCE: source, T.ATTR_TTFT: result.ttft,
                               T.ATTR_GATEWAY_OVERHEAD: overhead,
                               T.ATTR_PREFILL: the_plan.prefill, T.ATTR_DECODE: the_plan.decode})
        if result.ttft is not None:
            sv.metrics.observe_ttft(source, sv.config.mode, result.ttft, overhead)
        if log.isEnabledFor(logging.INFO):
            log.info("turn %s of %s: %s on %s, TTFT %s, %s%s", ctx.state.turns if ctx.state else 0,
                     ctx.named_session or ctx.session_source, the_plan.action.value, the_plan.decode,
                     f"{result.ttft:.3f} s" if result.ttft is not None else "-", source,
                     "" if result.ok else " (failed)")
        await remember(sv, ctx, leg, result)
    except Exception:  # the client already has its answer; bookkeeping must not turn it into an error
        log.exception("failed to record the end of a turn")
    finally:
        sv.cluster.end(the_plan.decode)
        sv.leave_decoding(leg.placed)
        span.end()


async def remember(sv: Services, ctx: TurnContext, leg: FinalLeg, result: LegResult) -> None:
    the_plan = leg.plan
    if ctx.session_id is None:
        if result.ok and result.handle is not None and the_plan.prefill is not None:
            # No session to keep it for: D would hold it until its TTL for nothing.
            sv.release(B.with_host(result.handle, host_of(the_plan.decode)), the_plan.decode, ReleaseReason.UNUSED)
        return
    now = sv.clock()
    prior = ctx.state
    block_size = sv.cluster.block_size(the_plan.decode)
    handle, held, handle_at = _handle_after(sv, ctx, leg, result, block_size)
    if handle_at is None:
        handle_at = now
    total, cached = _cached_after(sv, ctx, result, block_size, held)
    if result.ok and sv.config.mode != "aggregated":
        sv.learning.decode_done(_decode_sample(ctx, leg, result), now)
    current = await sv.store.get(ctx.session_id)
    await _release_replaced(sv, ctx, current, handle)
    if ctx.final:
        # The session's last turn: nothing will pull its handle, and nothing of it is worth remembering.
        sv.release(handle, the_plan.decode, ReleaseReason.FINAL)
        await sv.store.delete(ctx.session_id)
        sv.metrics.pinned_sessions.set(await sv.store.count())
        return
    prefix_key = None
    if ctx.chain is not None and ctx.session_source in ("new", "prefix") and result.answer is not None:
        prefix_key = scoped(ctx.tenant, ctx.chain.after(result.answer))
    base = current or prior
    avg_out, avg_suffix = _running_means(base, result, total)
    tracks = sv.config.placement_policy.tracks_cache_copies
    copies = _prefill_copies_after(sv, ctx, leg.placed, result) if tracks else ()
    elsewhere = _decode_elsewhere(ctx, leg.placed) if tracks else ()
    await sv.store.put(SessionState(
        session_id=ctx.session_id,
        decode=the_plan.decode,
        handle=handle,
        held=held,
        handle_at=handle_at if handle is not None else None,
        expires_at=now + sv.config.session_ttl_s,
        turns=(base.turns if base else 0) + 1,
        created_at=base.created_at if base else now,
        prefix_key=prefix_key,
        cached=cached,
        last_tokens=total,
        last_prefill=the_plan.prefill or (base.last_prefill if base else None),
        avg_output_tokens=avg_out,
        avg_suffix_tokens=avg_suffix,
        elsewhere=elsewhere,
        prefill_copies=copies,
        last_turn_at=now,
        mean_gap_s=_mean_gap(base, prior, ctx),
        cache_scope=block_scope(ctx.model, ctx.body.get("cache_salt")),
    ))
    sv.metrics.pinned_sessions.set(await sv.store.count())


def _cached_after(sv: Services, ctx: TurnContext, result: LegResult, block_size: int,
                  held: HeldSequence | None) -> tuple[int | None, HeldSequence | None]:
    """The turn's whole sequence (prompt + output) in tokens, and what D's prefix cache holds now (all of it
    but the last sampled token, which has no KV), handle or not: the cost policy's decode_cached_tokens next
    turn. Learned from D's token ids (None, None: not learned)."""
    if not (result.ok and result.prompt_ids is not None and sv.config.cache_aware):
        return None, None
    total = len(result.prompt_ids) + len(result.output_ids)
    cached = HeldSequence.from_tokens(result.sequence()[:max(0, total - 1)], block_size, prefix=held or _previous(ctx))
    return total, cached


def _decode_elsewhere(ctx: TurnContext, placed: Placement) -> tuple[PC.DecodeCopy, ...]:
    """What D's the pin leaves or left still hold of this prompt, for a later move back there."""
    prior = ctx.state
    if prior is None:
        return ()
    decode, held = placed.plan.decode, placed.decode_cached
    elsewhere = PC.cut(prior.elsewhere, held, drop=decode)
    if prior.decode is not None and prior.decode != decode and held > 0:
        elsewhere = (*elsewhere, PC.DecodeCopy(prior.decode, held))[-PC.MAX_DECODE_COPIES:]
    return elsewhere


async def _release_replaced(sv: Services, ctx: TurnContext, current: SessionState | None,
                            handle: dict[str, Any] | None) -> None:
    """A handle the store holds that this turn's put would overwrite (a concurrent turn of the session stored
    it meanwhile) would never be pulled: taken, only while it is still that one, and released."""
    if current is None or current.handle is None:
        return
    rid = handle_request_id(current.handle)
    if rid is None or rid == handle_request_id(handle):
        return
    taken = await sv.store.take_handle(current.session_id, rid)
    if taken is not None:
        sv.release(taken.handle, current.decode, ReleaseReason.SUPERSEDED)


def _mean_gap(base: SessionState | None, prior: SessionState | None, ctx: TurnContext) -> float | None:
    """The session's mean wait between a turn's end and the next one's start (exponentially weighted)."""
    mean = base.mean_gap_s if base is not None else None
    if prior is None or prior.last_turn_at is None:
        return mean
    gap = max(0.0, ctx.arrived_at - prior.last_turn_at)
    return gap if mean is None else (1 - _MEAN_WEIGHT) * mean + _MEAN_WEIGHT * gap


def _handle_after(sv: Services, ctx: TurnContext, leg: FinalLeg, result: LegResult, block_size: int,
                  ) -> tuple[dict[str, Any] | None, HeldSequence | None, float | None]:
    """The handle the session keeps after this turn, the tokens it holds, and when it was returned (None:
    now): D's new handle after a P/D turn or a marked decode-local one, else the handle a local turn did not
    use."""
    the_plan, unused = leg.plan, leg.unused
    local = the_plan.action is HandleAction.DECODE_LOCAL
    keeps = sv.config.placement_policy.keeps_handles
    if result.ok and the_plan.prefill is not None and result.handle is not None and not keeps:
        # D keeps every finished P/D turn's blocks when bidirectional_kv_xfer is on; this policy never pulls.
        sv.release(B.with_host(result.handle, host_of(the_plan.decode)), the_plan.decode, ReleaseReason.UNUSED)
        return None, None, None
    if result.ok and the_plan.prefill is not None and keeps:
        if result.handle is None:
            sv.metrics.stream_handles_missing.inc()
            return None, None, None
        return (*_kept(sv, result, result.handle, the_plan.decode, block_size, _previous(ctx)), None)
    if local and result.ok and result.handle is not None and sv.config.marks_local_turns:
        # D kept the marked local turn's blocks: a handle of the whole sequence, newer than the one this turn
        # did not use (that one is never pulled now; D frees it at its TTL).
        sv.cluster.note_local_handles(the_plan.decode, True)
        sv.metrics.local_handles.labels("kept").inc()
        if unused is not None:
            sv.metrics.local_handles.labels("superseded").inc()
            sv.release(unused.handle, ctx.state.decode if ctx.state else None, ReleaseReason.SUPERSEDED)
        return (*_kept(sv, result, result.handle, the_plan.decode, block_size, _previous(ctx)), None)
    if local:
        if result.ok and sv.local_handle_due(ctx, the_plan.decode):
            # Marked, due, and none came back: this D does not keep local turns (no bidirectional_kv_xfer).
            sv.cluster.note_local_handles(the_plan.decode, False)
            sv.metrics.local_handles.labels("missing").inc()
        if unused is not None:
            # The handle this turn did not use still pins a prefix of the history on D, so a later turn may
            # pull it (and so free it) before it expires.
            return unused.handle, unused.held, unused.handle_at
    return None, None, None


def _kept(sv: Services, result: LegResult, params: dict[str, Any], decode: str, block_size: int,
          prefix: HeldSequence | None = None) -> tuple[dict[str, Any], HeldSequence | None]:
    """D's handle as the next prefill will send it (host rewritten), and the tokens it holds (guarded)."""
    handle = B.with_host(params, host_of(decode))
    n = handle_num_tokens(handle)
    if not (sv.config.guarded and n and result.prompt_ids is not None):
        return handle, None
    return handle, HeldSequence.from_tokens(result.sequence()[:n], block_size, prefix=prefix)


def _previous(ctx: TurnContext) -> HeldSequence | None:
    """The session's held sequence before this turn: the new one usually extends it (its block hashes are
    reused instead of hashed again)."""
    state = ctx.state
    return (state.cached or state.held) if state is not None else None


def _decode_sample(ctx: TurnContext, leg: FinalLeg, result: LegResult) -> DecodeSample:
    """What D's side of the turn teaches the policy, against what its placement assumed (D's load and cache)."""
    the_plan, placed = leg.plan, leg.placed
    usage = result.usage if isinstance(result.usage, dict) else {}
    prompt = usage.get("prompt_tokens") if isinstance(usage.get("prompt_tokens"), int) else None
    if prompt is None and result.prompt_ids is not None:
        prompt = len(result.prompt_ids)  # a stream without usage: D's first chunk carries the prompt ids
    return DecodeSample(
        node=the_plan.decode,
        local=the_plan.action is HandleAction.DECODE_LOCAL,
        load=placed.load_at_plan(the_plan.decode),
        prompt_tokens=prompt,
        # D's own count when usage came back, else what the gateway verified it holds.
        cached_tokens=B.cached_tokens(usage) if usage else placed.decode_cached,
        sent_at=leg.sent_at,
        first_chunk_at=ctx.t0 + result.first_chunk if result.first_chunk is not None else None,
        arrivals_before_first=result.arrivals_before_first,
        out_first_at=result.out_first_at,
        out_last_at=result.out_last_at,
        out_tokens_timed=result.out_tokens_timed,
    )


def _prefill_copies_after(sv: Services, ctx: TurnContext, placed: Placement,
                          result: LegResult) -> tuple[PC.PrefillCopy, ...]:
    """The session's prefix-cache copies on P once this turn ran: its P (with prefix caching on) holds the
    prompt; the others are cut to the prompt's overlap with the history they were prefixes of."""
    prior = ctx.state.prefill_copies if ctx.state is not None else ()
    url = placed.plan.prefill
    node = sv.cluster.nodes.get(url) if url is not None else None
    if node is None or node.prefix_caching is not True or not result.ok or result.prompt_ids is None:
        return PC.cut(prior, placed.decode_cached, drop=url)
    assert url is not None
    return PC.after_prefill(prior, placed.decode_cached, url, len(result.prompt_ids), sv.cluster.block_size(url),
                            sv.learning.prefill_written.get(url, 0))


def _running_means(base: SessionState | None, result: LegResult,
                   total: int | None) -> tuple[float | None, float | None]:
    """The session's mean answer length and mean suffix (what a turn adds to the last prompt + answer),
    exponentially weighted: what the policy's look-ahead expects of the next turn."""
    w = _MEAN_WEIGHT
    avg_out = base.avg_output_tokens if base is not None else None
    avg_suffix = base.avg_suffix_tokens if base is not None else None
    usage = result.usage if isinstance(result.usage, dict) else {}
    out = len(result.output_ids) or usage.get("completion_tokens")
    if isinstance(out, int) and out > 0:
        avg_out = float(out) if avg_out is None else (1 - w) * avg_out + w * out
    if total is not None and result.prompt_ids is not None and base is not None and base.last_tokens is not None:
        suffix = max(0, len(result.prompt_ids) - base.last_tokens)
        avg_suffix = float(suffix) if avg_suffix is None else (1 - w) * avg_suffix + w * suffix
    return avg_out, avg_suffix
