"""The look-ahead (pure): an option's horizon term is the discounted best score of the session's next turn
as that option leaves it (a fresh handle, a history only in D's prefix cache, a moved pin), recursively for
``horizon_turns`` turns with the same loads and a typical next suffix. See costmodel.py's docstring.
"""

from __future__ import annotations

import math
from dataclasses import replace

from kvtether.gateway.policy.facts import OptionEstimate, TurnFacts
from kvtether.gateway.policy.options import Nodes, d_cached_tokens, immediate, keep_probability


def after(turn: TurnFacts, o: OptionEstimate, pinned: str | None,
          c: Nodes) -> list[tuple[float, TurnFacts, str | None]]:
    """The next turn(s) as this option leaves the session: (probability, facts, pinned decode)."""
    suffix = turn.suffix_tokens if turn.next_suffix_tokens is None else turn.next_suffix_tokens
    out_toks = turn.expected_output_tokens
    held = turn.prompt_tokens + out_toks - 1  # the last sampled token's KV is never computed
    # What other decode nodes keep of the session: the same prefixes (still prefixes of the next prompt),
    # plus, when this option moves the pin, the history on the D it leaves.
    elsewhere = tuple((url, n) for url, n in turn.decode_elsewhere if url != o.decode_url)
    home = c.decode(pinned)
    if home is not None and o.decode_url != home.url:
        elsewhere = (*(e for e in elsewhere if e[0] != home.url), (home.url, d_cached_tokens(turn, c)))
    nxt = TurnFacts(
        prompt_tokens=turn.prompt_tokens + out_toks + suffix,
        suffix_tokens=suffix,
        reuse_tokens=held,
        handle_valid=True,
        handle_age_s=0.0,
        decode_cached_tokens=held,
        expected_output_tokens=out_toks,
        prefill_cached_tokens=turn.prefill_cached_tokens,
        prefill_cached=_p_copies_after(turn, o, c),
        next_suffix_tokens=suffix,
        decode_elsewhere=elsewhere,
        ttft_tail_s=turn.ttft_tail_s,
        # The same loads: the next turn finds D's decoding requests as this one does (those running now are
        # done by then, an answer later; others have taken their place).
        request_stall_credit_s=turn.request_stall_credit_s,
        request_stall_quota_s=turn.request_stall_quota_s,
        stall_credits=turn.stall_credits,
    )
    if o.option != "decode_local":
        return [(1.0, nxt, o.decode_url)]
    if turn.local_keeps_handle:
        # Marked for retention, D returns a handle of the whole sequence as after a P/D turn: pinned, fresh.
        return [(1.0, nxt, o.decode_url)]
    d = c.decode(o.decode_url)
    gap = o.ttft_s + out_toks * (c.est.tpot_s(d.url, d.running + 1) if d is not None else 0.0)
    # Unmarked, vLLM returns no handle for a turn D prefilled itself. But the handle this turn did *not* use is
    # still held on D (the gateway puts it back), and its blocks still cover a prefix of the next prompt: the next
    # turn may pull that prefix and let P compute the rest (this turn's suffix and answer, then its own),
    # provided the handle is still alive by then (it is older by this turn and its answer). Without it, the
    # history sits only in D's prefix cache, which is evicted more likely the fuller D is: vLLM's KV usage
    # counts blocks of running requests; cached-but-free blocks are evicted (LRU) only when that usage leaves
    # no free block, so the risk is ~0 below a knee and rises to 1 as usage nears full. The handle's own
    # blocks are pinned (not evictable) for as long as it lives.
    p_keep = keep_probability(d, c) if d is not None else 0.0
    keeps = turn.handle_valid and turn.reuse_tokens > 0
    pinned_prefix = min(turn.reuse_tokens, held) if keeps else 0
    hit = replace(nxt, reuse_tokens=pinned_prefix, handle_valid=keeps,
                  handle_age_s=turn.handle_age_s + gap if keeps else 0.0)
    miss = replace(hit, decode_cached_tokens=pinned_prefix)
    return [(p, t, o.decode_url) for p, t in ((p_keep, hit), (1.0 - p_keep, miss)) if p > 0.0]


def _p_copies_after(turn: TurnFacts, o: OptionEstimate, c: Nodes) -> tuple[tuple[str, int], ...]:
    # A P/D turn leaves its prompt in that P's cache (the next prompt extends it) if P caches prefixes; the
    # other copies stay prefixes of the next prompt.
    p = next((n for n in c.prefills if n.url == o.prefill_url), None)
    if p is None or not p.prefix_caching:
        return turn.prefill_cached
    return (*((u, n) for u, n in turn.prefill_cached if u != p.url), (p.url, turn.prompt_tokens))


def scored(turn: TurnFacts, pinned: str | None, c: Nodes, depth: int,
           now: bool = True) -> tuple[OptionEstimate, ...]:
    """Options with their horizon term: discount × E[value of the next turn], `depth` turns deep."""
    opts = immediate(turn, pinned, c, now)
    if depth <= 0 or c.knobs.horizon_discount == 0.0:
        return opts
    out = []
    for o in opts:
        if not o.feasible:
            out.append(o)
            continue
        future = sum(p * value(t, pin, c, depth - 1) for p, t, pin in after(turn, o, pinned, c))
        out.append(replace(o, horizon_s=c.knobs.horizon_discount * future))
    return tuple(out)


def value(turn: TurnFacts, pinned: str | None, c: Nodes, depth: int) -> float:
    """The best score of a turn (auto policy), forcing a soft-rejected option if nothing else is possible."""
    key = (turn, pinned, depth)
    if key not in c.memo:
        opts = scored(turn, pinned, c, depth, now=False)
        feasible = [o.score_s for o in opts if o.feasible]
        soft = [o.ttft_s + o.interference_s for o in opts if o.soft]
        c.memo[key] = min(feasible) if feasible else min(soft, default=math.inf)
    return c.memo[key]

