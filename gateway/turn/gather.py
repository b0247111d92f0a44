"""What the plan needs to know about a turn, gathered before placing it.

The session's handle is taken from the store (atomic, single use: a concurrent turn of the same session
goes cold). The prompt is tokenized only when there is something to compare it with — a handle's held
sequence, or what D's prefix cache holds after a decode-local turn — since ``/tokenize`` sits on the TTFT
path; the guard (pure, ``guard/verify.py``) then says how much of the held sequence the prompt verifiably
extends. The result is a :class:`~kvtether.gateway.policy.placement.Turn`: plain facts for ``plan``, which the
legs and the end of the turn read too (what D's and each P's prefix cache hold, the answer's expected length).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtether.gateway import telemetry as T
from kvtether.gateway.guard.verify import as_tokens, handle_groups, handle_num_tokens, verified_reuse
from kvtether.gateway.policy.copies import cut
from kvtether.gateway.policy.placement import HandleState, Turn
from kvtether.gateway.stores.sessions import TakenHandle
from kvtether.gateway.turn import body as B
from kvtether.gateway.turn.context import Progress, Services, TurnContext
from kvtether.gateway.turn.tokenize import tokenize


@dataclass
class Gathered:
    turn: Turn
    taken: TakenHandle | None  # the session's handle, now out of the store
    has_handle: bool  # taken and not expired
    prompt_ids: list[int] | None  # None: not tokenized (nothing to compare with) or tokenize failed

    @property
    def decode_cached(self) -> int:
        """The prefix of the prompt the pinned D's prefix cache holds, verified (0: none or not checked)."""
        return self.turn.decode_cached_tokens

    @property
    def prefill_cached(self) -> dict[str, int]:
        """What each P's prefix cache may still hold of the prompt (policy/copies.py)."""
        return dict(self.turn.prefill_cached)


async def gather(sv: Services, ctx: TurnContext, round_robin: int, progress: Progress) -> Gathered:
    """What the plan needs to know of the turn; a ``/tokenize`` wait is added to the turn's `progress`."""
    policy = sv.config.placement_policy
    state = ctx.state
    taken, handle_state = await _take_handle(sv, ctx)
    T.set_attrs(ctx.span, {T.ATTR_TURN: state.turns if state else 0,
                           T.ATTR_PINNED: state.decode if state else None})
    has_handle = taken is not None and handle_state is HandleState.PRESENT
    prompt_ids: list[int] | None = None
    reuse: int | None = None
    decode_cached = 0
    cached_held = state.cached if state is not None and sv.config.cache_aware else None
    if policy.tokenizes_prompts and (has_handle or cached_held is not None):
        prompt_ids = B.literal_prompt_ids(ctx.kind, ctx.body) or await tokenize(sv, ctx, progress)
        if prompt_ids is not None:
            reuse, decode_cached = _guard(sv, ctx, taken if has_handle else None, prompt_ids)
    elif policy.sizes_pool_turns and (sv.cluster.pool_urls()
                                      or (state is None and sv.config.starts_sessions_on_decode)):
        # On a pool even a first turn (or one gone cold) is weighed: which instance starts it, by itself or with a
        # prefill leg beside whose decodes, only its length can tell. Unweighed, its prefill would stall an
        # instance's answers past their objective unchecked. On P/D a first turn, when a decode node may start a
        # session over its quotas to keep the TTFT objective (decode_ttft_rescue).
        prompt_ids = B.literal_prompt_ids(ctx.kind, ctx.body) or await tokenize(sv, ctx, progress)
    elif policy.tokenizes_prompts:
        _warm_tokenizer(sv, ctx)
    turn = Turn(
        policy=policy.name,
        new_session=state is None,
        pinned_decode=state.decode if state is not None else None,
        handle=handle_state,
        handle_tokens=handle_num_tokens(taken.handle) if taken else None,
        handle_groups=handle_groups(taken.handle) if taken else 1,
        prompt_tokens=len(prompt_ids) if prompt_ids is not None else None,
        reuse_tokens=reuse,
        min_reuse_tokens=sv.config.min_reuse_tokens,
        partial_reuse=sv.config.partial_reuse,
        round_robin=round_robin,
        **_auto_facts(sv, ctx, taken, prompt_ids, decode_cached),
    )
    return Gathered(turn, taken, has_handle, prompt_ids)


async def _take_handle(sv: Services, ctx: TurnContext) -> tuple[TakenHandle | None, HandleState]:
    """The session's handle, out of the store (single use), and whether it is still fresh."""
    state = ctx.state
    if state is None or ctx.session_id is None or not sv.config.placement_policy.pulls:
        return None, HandleState.MISSING
    taken = await sv.store.take_handle(ctx.session_id)
    if taken is None:
        if state.handle is not None:
            # A concurrent turn of the same session took it first, or the store could not hand it out (it
            # answered the read just before): either way this one goes cold.
            sv.metrics.handle_outcomes.labels("lost_race" if sv.store.available else "store_unavailable").inc()
        return None, HandleState.MISSING
    age = sv.clock() - taken.handle_at
    ctx.span.set_attribute(T.ATTR_HANDLE_AGE, age)
    return taken, HandleState.EXPIRED if age >= sv.config.session_ttl_s else HandleState.PRESENT


def _warm_tokenizer(sv: Services, ctx: TurnContext) -> None:
    """A turn the guard does not check (the session's first, or one gone cold): its prompt is the next turn's
    history, which the guard will check. With the local tokenizer, encode it now, in the background."""
    guard_tok = sv.tokenizer
    if guard_tok is None or not guard_tok.usable(ctx.model) or B.literal_prompt_ids(ctx.kind, ctx.body):
        return
    payload = B.tokenize_body(ctx.kind, ctx.body)
    if payload is not None:
        guard_tok.warm(payload)


def _guard(sv: Services, ctx: TurnContext, taken: TakenHandle | None, prompt_ids: list[int]) -> tuple[int | None, int]:
    """The verified reuse of the handle's held sequence (None: no held sequence to check), and what D's prefix
    cache holds of the prompt (0: not known)."""
    held = taken.held if taken is not None else None
    cached_held = ctx.state.cached if ctx.state is not None and sv.config.cache_aware else None
    if held is None and cached_held is None:
        return None, 0
    reuse: int | None = None
    decode_cached = 0
    tokens = as_tokens(prompt_ids)  # converted once for both comparisons below
    with sv.tracer.start_as_current_span(T.SPAN_GUARD, context=ctx.parent_ctx, kind=T.KIND_INTERNAL) as span:
        if held is not None:
            reuse = verified_reuse(held, tokens)
            verdict = T.guard_verdict(reuse, held.num_tokens, sv.config.min_reuse_tokens)
            T.set_attrs(span, {T.ATTR_HELD_TOKENS: held.num_tokens, T.ATTR_REUSE_TOKENS: reuse,
                               T.ATTR_GUARD_VERDICT: verdict})
            ctx.span.set_attribute(T.ATTR_GUARD_VERDICT, verdict)
        if cached_held is not None:
            # Not a correctness check (a local turn hits D's prefix cache by content hash, never
            # positionally): the cost policy's estimate of how much of the prompt D holds.
            decode_cached = verified_reuse(cached_held, tokens)
            span.set_attribute(T.ATTR_DECODE_CACHED_TOKENS, decode_cached)
        span.set_attribute(T.ATTR_PROMPT_TOKENS, len(prompt_ids))
    return reuse, decode_cached


def _auto_facts(sv: Services, ctx: TurnContext, taken: TakenHandle | None, prompt_ids: list[int] | None,
                decode_cached: int) -> dict[str, Any]:
    """The session facts the cost policy weighs (docs/placement.md); harmless for the other policies."""
    state = ctx.state
    facts: dict[str, Any] = {"decode_cached_tokens": decode_cached}
    if taken is not None:
        facts["handle_age_s"] = max(0.0, sv.clock() - taken.handle_at)
    max_tokens = ctx.body.get("max_completion_tokens") or ctx.body.get("max_tokens")
    if state is not None and state.avg_output_tokens is not None:
        out = round(state.avg_output_tokens)
        facts["expected_output_tokens"] = min(out, max_tokens) if isinstance(max_tokens, int) else out
    elif isinstance(max_tokens, int) and max_tokens > 0:
        facts["expected_output_tokens"] = max_tokens
    if state is None:
        if prompt_ids is not None:
            facts["suffix_tokens"] = len(prompt_ids)  # all of it is new
        return facts
    facts["last_prefill"] = state.last_prefill
    facts["local_keeps_handle"] = sv.local_handle_due(ctx, state.decode)
    if prompt_ids is not None and state.last_tokens is not None:
        facts["suffix_tokens"] = max(0, len(prompt_ids) - state.last_tokens)
    if state.avg_suffix_tokens is not None:
        facts["next_suffix_tokens"] = round(state.avg_suffix_tokens)
    facts["decode_elsewhere"] = cut(state.elsewhere, decode_cached)
    prefill_cached = sv.learning.prefill_cached(state.prefill_copies, decode_cached, sv.cluster.nodes)
    facts["prefill_cached"] = tuple(prefill_cached.items())
    return facts
