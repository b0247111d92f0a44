"""The placement rules other gateways ship, as fixed policies (pure), so a user compares them in one run.

- ``dynamo``: NVIDIA Dynamo's conditional disaggregation (its KV router, ``lib/kv-router/src/conditional_disagg.rs``).
  The turn is prefilled on the decode worker itself (no prefill leg) when

  - ``isl_bounding`` (Dynamo's default): the tokens the decode worker's prefix cache lacks, whole blocks
    (``eff_isl = prompt − cached blocks × block size``), are fewer than 2048 AND fewer than 0.7 of the prompt;
  - ``prefill_load``: the prefill worker the turn would go to is busy (Dynamo: active tokens above its queue
    threshold × ``max_num_batched_tokens``, i.e. the request would queue there; here: requests waiting on it);
  - ``isl_or_load``: either;

  and, when ``decode_busy_share`` is set, the decode-busy veto cancels a local prefill on a decode worker whose
  KV cache is fuller than that share. Otherwise the turn is disaggregated.
- ``llm-d``: llm-d's ``prefix-based-pd-decider``: disaggregate when the tokens the chosen decode pod's prefix
  cache lacks exceed ``nonCachedTokens``; otherwise the decode pod prefills the turn itself. No load term.

Both route a session to the decode node its history is cached on (cache-aware routing: here, the session's pin)
and the prefill leg to the prefill node whose cache holds most of it (the session's previous one when no
busier). Neither reads a history back from a decode node: their prefill node computes what its own prefix
cache lacks, and the decode node's handle after a P/D turn is released as unused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from kvtether.gateway.policy.facts import NodeLoad
from kvtether.gateway.policy.reasons import DECODE_BUSY, PREFILL_BUSY, UNCACHED_LONG, UNCACHED_SHORT

DYNAMO: Final = "dynamo"
LLM_D: Final = "llm-d"
DYNAMO_RULES: Final = ("isl_bounding", "prefill_load", "isl_or_load")

# Dynamo's defaults (DEFAULT_CONDITIONAL_DISAGG_EFF_ISL_THRESHOLD, _RATIO_THRESHOLD).
DYNAMO_EFF_ISL_THRESHOLD: Final = 2048
DYNAMO_EFF_ISL_RATIO: Final = 0.7
# llm-d's examples set nonCachedTokens to 8–16 (its default, 0, turns disaggregation off).
LLM_D_NON_CACHED_TOKENS: Final = 16


@dataclass(frozen=True, slots=True)
class PeerKnobs:
    dynamo_rule: str = "isl_bounding"
    dynamo_eff_isl_threshold: int = DYNAMO_EFF_ISL_THRESHOLD
    dynamo_eff_isl_ratio: float = DYNAMO_EFF_ISL_RATIO
    dynamo_decode_busy_share: float | None = None  # the decode-busy veto's KV share; None: no veto
    llm_d_non_cached_tokens: int = LLM_D_NON_CACHED_TOKENS
    block_size: int = 16  # the decode node's KV block: its prefix cache matches whole blocks

    def __post_init__(self) -> None:
        if self.dynamo_rule not in DYNAMO_RULES:
            raise ValueError(f"dynamo_rule must be one of {', '.join(DYNAMO_RULES)}")
        if self.dynamo_decode_busy_share is not None and not 0.0 < self.dynamo_decode_busy_share <= 1.0:
            raise ValueError("dynamo_decode_busy_share must be in (0, 1]")
        if self.llm_d_non_cached_tokens < 0 or self.block_size < 1:
            raise ValueError("llm_d_non_cached_tokens must be >= 0 and block_size >= 1")


@dataclass(frozen=True, slots=True)
class PeerVerdict:
    local: bool  # prefill on the decode node (no prefill leg)
    reason: str
    bucket: str  # the reason's metric label (policy/reasons.py)


def uncached_tokens(prompt_tokens: int | None, decode_cached_tokens: int, block_size: int) -> int | None:
    """What the decode node's prefix cache lacks of the prompt (its hit is whole blocks); None: the prompt's
    length is unknown (not tokenized: nothing was cached to compare it with, so it is all uncached)."""
    if prompt_tokens is None:
        return None
    cached = (max(0, decode_cached_tokens) // block_size) * block_size
    return max(0, prompt_tokens - min(cached, prompt_tokens))


def decide(policy: str, prompt_tokens: int | None, decode_cached_tokens: int, prefill: NodeLoad | None,
           decode: NodeLoad | None, knobs: PeerKnobs) -> PeerVerdict:
    """The peer rule's verdict for a turn. ``prefill``: the prefill node the turn would go to (None: none
    healthy); ``decode``: the session's decode node as the cluster view sees it."""
    eff = uncached_tokens(prompt_tokens, decode_cached_tokens, knobs.block_size)
    if policy == LLM_D:
        if eff is None or eff > knobs.llm_d_non_cached_tokens:
            return PeerVerdict(False, f"llm-d: {_tokens(eff)} uncached on decode > nonCachedTokens "
                                      f"{knobs.llm_d_non_cached_tokens}: disaggregate", UNCACHED_LONG)
        return PeerVerdict(True, f"llm-d: {eff} uncached on decode <= nonCachedTokens "
                                 f"{knobs.llm_d_non_cached_tokens}: prefill on decode", UNCACHED_SHORT)
    if policy != DYNAMO:
        raise ValueError(f"not a peer policy: {policy!r}")
    rule = knobs.dynamo_rule
    isl = rule in ("isl_bounding", "isl_or_load") and _isl_bounded(eff, prompt_tokens, knobs)
    busy = rule in ("prefill_load", "isl_or_load") and (prefill is None or prefill.waiting > 0)
    if not (isl or busy):
        return PeerVerdict(False, f"dynamo {rule}: {_tokens(eff)} uncached on decode, prefill not busy: "
                                  "disaggregate", UNCACHED_LONG)
    share = knobs.dynamo_decode_busy_share
    if share is not None and decode is not None and decode.kv_usage > share:
        return PeerVerdict(False, f"dynamo {rule}: decode busy (KV {decode.kv_usage:.2f} > {share:g}): disaggregate",
                           DECODE_BUSY)
    why = (f"{eff} uncached on decode < {knobs.dynamo_eff_isl_threshold} and < {knobs.dynamo_eff_isl_ratio:g} "
           "of the prompt" if isl else "the prefill node is busy")
    return PeerVerdict(True, f"dynamo {rule}: {why}: prefill on decode", UNCACHED_SHORT if isl else PREFILL_BUSY)


def _isl_bounded(eff: int | None, prompt_tokens: int | None, knobs: PeerKnobs) -> bool:
    if eff is None or prompt_tokens is None:
        return False  # unknown length: nothing cached on decode, so the ratio is 1
    return eff < knobs.dynamo_eff_isl_threshold and eff / max(prompt_tokens, 1) < knobs.dynamo_eff_isl_ratio


def _tokens(eff: int | None) -> str:
    return "all tokens" if eff is None else f"{eff} tokens"
