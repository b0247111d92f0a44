"""What a prefill node did with a handle, read from what it reports, never from what the gateway intended.

vLLM tells a client only one figure per request: ``usage.prompt_tokens_details.cached_tokens``, the prompt
tokens it did not compute, its own prefix-cache hit and the tokens it read from a decode node together (the
split by source exists only in its ``vllm:prompt_tokens_cached_by_source_total`` counters). The figure still
tells a read apart from no read, because of how P handles a handle (vLLM 0.32,
``nixl/pull_scheduler.py`` ``get_num_new_matched_tokens``):

- P's own hit ``local`` is whole blocks (a multiple of its block size), and stops short of the whole prompt;
- with a handle of ``n`` tokens it reads ``min(n, prompt) − local`` tokens, or nothing when that is ≤ 0 or
  below ``kv_recompute_threshold``; a read makes ``cached = min(n, prompt)``, no read leaves ``cached = local``.

So when ``min(n, prompt)`` is not a multiple of P's block size, ``cached == min(n, prompt)`` holds exactly
when P read from D. ``readable_offer`` makes every handle the gateway sends such a length (it gives up at most
one token of reuse); ``read_of`` turns P's figure into the turn's reuse source.

One thing P's figure cannot show: vLLM counts a read when it schedules it, so a read that failed and was
recomputed (``kv_load_failure_policy: recompute``) reports as a read, in ``usage`` and in P's counters alike
(``PrefillStats`` is set at scheduling, ``v1/core/sched/scheduler.py``); the failure shows in P's log and its
``vllm:nixl_num_failed_transfers`` counter.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtether.gateway.guard.verify import handle_num_tokens, truncate_handle

# Where a turn's prompt tokens that were not computed came from (the reuse-source header and metric label).
DECODE_PULL = "decode_pull"  # P read them from the decode node's held KV
PREFILL_CACHE = "prefill_cache"  # P's own prefix cache (a handle, if sent, was not read)
NONE = "none"  # every prompt token computed


@dataclass(frozen=True, slots=True)
class Read:
    """A prefill leg as P reported it: where its cached tokens came from, and how many there were."""

    source: str
    cached_tokens: int
    # A handle went with the leg and P did not read it (its own cache covered it, the read was below its
    # recompute threshold, or the read failed and P recomputed).
    handle_unread: bool = False


def readable_offer(handle: Mapping[str, Any], prompt_tokens: int | None, block_size: int) -> dict[str, Any]:
    """``handle`` cut, where needed, to a length P's own prefix-cache hit can never equal: shorter than the
    prompt (P computes at least the last prompt token itself) and not a whole number of P's blocks. A handle
    already so is returned as is (a copy)."""
    n = handle_num_tokens(handle)
    if n is None or n <= 0 or block_size < 2:
        return dict(handle)
    want = n if prompt_tokens is None else min(n, prompt_tokens - 1)
    if want % block_size == 0:
        want -= 1
    if want <= 0 or want == n:
        return dict(handle)  # a handle of (almost) nothing is still sent whole: its use frees it on D
    return truncate_handle(handle, want, block_size)


def read_of(offered: int | None, prompt_tokens: int | None, cached_tokens: int | None) -> Read:
    """What a prefill leg did, from P's reported ``cached_tokens`` (None: P reports no prompt token details,
    so nothing is confirmed and the leg counts as computed) and the handle tokens it was offered (None: no
    handle went with it)."""
    cached = cached_tokens or 0
    if offered is None or offered <= 0:
        return Read(PREFILL_CACHE if cached > 0 else NONE, cached)
    reach = offered if prompt_tokens is None else min(offered, prompt_tokens)
    if cached_tokens is not None and cached == reach:
        return Read(DECODE_PULL, cached)
    return Read(PREFILL_CACHE if cached > 0 else NONE, cached, handle_unread=True)


def reported_cached_tokens(usage: Any) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` when the node reports it (vLLM does with
    ``--enable-prompt-tokens-details``), else None."""
    if not isinstance(usage, Mapping):
        return None
    details = usage.get("prompt_tokens_details")
    if isinstance(details, Mapping) and isinstance(details.get("cached_tokens"), int):
        return int(details["cached_tokens"])
    return None
