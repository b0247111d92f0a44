"""What the agent-API tests on the real pair (Messages, Responses) share: filler words for their prompts, the
check that a text answer is greedy decoding of its prompt up to near-ties, the handle outcomes and P's pulls read
back through the gateway, and what a pull-policy session's turns must show."""

from __future__ import annotations

import json
import random
import uuid
from typing import Any, Protocol

import httpx
from kvtether.gateway.nodes.cluster import sample_sum

from tests.support.vllm_fixtures import (
    M_CACHED_BY_SOURCE,
    M_NIXL_XFER_TIME,
    MAX_TIES,
    TIE_NATS,
    TINY_MODEL,
    Backend,
    metric_sum,
    post,
)
from tests.support.vllm_rig import Rig

_TEXT = ("alpha beta gamma delta build test cache node block token prefix decode prefill session handle pull "
         "error file line value config module graph queue batch lease import return class def self yield")
_WORDS = _TEXT.split()


def words(seed: str, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(n))


class TextAnswer(Protocol):
    """An answer whose text `text_mismatch` checks (a Messages or a Responses answer)."""

    @property
    def text(self) -> str: ...


def _eos_id() -> int:
    with open(TINY_MODEL / "generation_config.json") as f:
        eos = json.load(f)["eos_token_id"]
    return int(eos[0] if isinstance(eos, list) else eos)


async def _detokenize(client: httpx.AsyncClient, b: Backend, ids: list[int]) -> str:
    resp = await client.post(b.prefill_url + "/detokenize", json={"model": b.model, "tokens": ids})
    assert resp.status_code == 200, resp.text
    return str(resp.json()["prompt"])


async def text_mismatch(client: httpx.AsyncClient, b: Backend, prompt: list[int], got: TextAnswer,
                        max_tokens: int) -> str | None:
    """None when `got`'s text is greedy decoding of `prompt` on P (no P/D, fresh cache_salt) up to near-ties.

    `vllm_fixtures.greedy_mismatch` on text: the reference is decoded with its top-5 logprobs; where its text
    leaves the answer's, the answer's token there must be one of the reference's candidates within TIE_NATS of
    its pick whose text continues the answer's (at most MAX_TIES times), and the check goes on from that pick.
    """
    eos = _eos_id()
    text = got.text
    prefix: list[int] = []
    ties = 0

    async def fits(ids: list[int]) -> bool:  # the ids' text is a prefix of the answer (a cut character aside)
        return text.startswith((await _detokenize(client, b, ids)).rstrip("\ufffd"))

    while True:
        if len(prefix) >= max_tokens:  # the last token was a near-tie
            return None if await _detokenize(client, b, prefix) == text else f"{text!r} is longer than {max_tokens}"
        resp = await post(client, b.prefill_url, "/v1/completions", {
            "model": b.model, "prompt": prompt + prefix, "max_tokens": max_tokens - len(prefix), "temperature": 0,
            "return_token_ids": True, "logprobs": 5, "return_tokens_as_token_ids": True,
            "cache_salt": f"ref-{uuid.uuid4().hex}"})
        resp.raise_for_status()
        choice = resp.json()["choices"][0]
        ref = [int(t) for t in choice["token_ids"]]
        top = [{int(str(k).removeprefix("token_id:")): float(v) for k, v in (row or {}).items()}
               for row in choice["logprobs"]["top_logprobs"]]
        path = prefix + [t for t in ref if t != eos]
        if await _detokenize(client, b, path) == text:
            return None
        j = None  # where the reference's path leaves the answer's text (its stop included)
        for i in range(len(ref)):
            if ref[i] == eos or not await fits(prefix + ref[: i + 1]):
                j = i
                break
        if j is None:
            return f"the answer goes on after the reference's {len(path)} tokens: {text!r}"
        pick = ref[j]
        candidates = [t for t, lp in sorted(top[j].items(), key=lambda kv: -kv[1])
                      if t != pick and top[j][pick] - lp <= TIE_NATS]
        ok = None
        for t in candidates:
            if t == eos:
                if await _detokenize(client, b, prefix + ref[:j]) == text:
                    return None
            elif await fits(prefix + ref[:j] + [t]):
                ok = t
                break
        if ok is None:
            want = await _detokenize(client, b, path)
            return f"at token {len(prefix) + j}: the answer {text!r} leaves the reference {want!r} there " \
                   f"without a near-tie (candidates within {TIE_NATS} nat: {candidates})"
        ties += 1
        if ties > MAX_TIES:
            return f"more than {MAX_TIES} near-ties picked the other way"
        prefix = prefix + ref[:j] + [ok]


async def outcomes(r: Rig) -> dict[str, float]:
    text = (await r.client.get(r.url + "/metrics")).text
    out = {o: sample_sum(text, "kvtether_handle_outcomes_total", outcome=o)
           for o in ("attached", "truncated", "refused_by_guard", "missing", "expired", "retried_cold")}
    out["reused_tokens"] = sample_sum(text, "kvtether_offered_tokens_total")
    return out


async def pull_counters(r: Rig) -> tuple[float, float]:
    """P's tokens read from another node (p2p) and its NIXL transfers done (vLLM's own counters)."""
    p = r.backend.prefill_url
    return (await metric_sum(r.client, p, M_CACHED_BY_SOURCE, source="p2p"),
            await metric_sum(r.client, p, M_NIXL_XFER_TIME))


def assert_pulls(rows: list[Any], sources: list[str], stream_handles: bool) -> None:
    """Turns 1–3 of a pull-policy session whose turn 1 is streamed: each turn after a whole one sent its handle
    and P read at least vLLM's kv_recompute_threshold (64) tokens from D over NIXL; after a streamed one
    (vLLM 0.32 returns no handle on streams, ``stream_handles`` false) the handle is missing and nothing is read.
    ``rows[t]``: (streamed, outcome deltas, p2p tokens, NIXL transfers) of turn t."""
    pulled = []
    for turn in range(1, 4):
        delta, p2p, xfers = rows[turn][1], rows[turn][2], rows[turn][3]
        if rows[turn - 1][0] and not stream_handles:
            assert delta["missing"] == 1 and p2p == 0, (turn, rows)
            continue
        # The handle is sent whole, or cut to what the guard verified (seen on some prompts: the re-rendered
        # history leaves D's tokens a few tokens before the handle's end); either way P must read the rest from D.
        assert delta["attached"] + delta["truncated"] == 1, (turn, rows)
        assert sources[turn] == "decode_pull", (turn, sources)
        assert p2p >= 64 and xfers >= 1, f"turn {turn}: P read nothing from D over NIXL ({rows})"
        pulled.append(turn)
    # The streamed turn 1 pulled turn 0's handle itself; turn 3 pulled turn 2's.
    assert {1, 3} <= set(pulled), rows
