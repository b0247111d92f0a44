"""Streams of several tokens a chunk (vLLM --stream-interval): relayed whole, timed right, and not read as the
engine's steps. A chunk's arrival marks a decode step only when every step sends one (policy/steps.py); under an
interval of N the gaps between arrivals are N steps, which read as steps would make every local prefill look N
times dearer."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from kvtether.cli.simstack import sim_stack

from tests.support.sim_rig import LIMITS, stack_spec

pytestmark = pytest.mark.anyio

LONG = {"model": "kvtether-sim", "messages": [{"role": "user", "content": "Write at length."}], "max_tokens": 64,
        "min_tokens": 64, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


async def relayed(url: str, body: dict[str, Any]) -> tuple[int, str, int]:
    """(chunks with content, the text, completion tokens) of one streamed answer through the gateway."""
    chunks, text, tokens = 0, "", 0
    async with httpx.AsyncClient(timeout=60, limits=LIMITS) as client, \
            client.stream("POST", f"{url}/v1/chat/completions", json=body, headers={"x-session-id": "s"}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = httpx.Response(200, content=line[6:]).json()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices") or ():
                if choice["delta"].get("content"):
                    chunks += 1
                    text += choice["delta"]["content"]
    return chunks, text, tokens


async def arrivals_and_answer(interval: int, body: dict[str, Any]) -> tuple[int, tuple[int, str, int]]:
    """Chunk arrivals the gateway recorded as step ends on the node while one answer streamed, and the answer."""
    spec = stack_spec(prefill=1, decode=1, speed=1.0, preset="qwen3-32b-h200-tp8",
                      **({"stream_interval": interval} if interval > 1 else {}))
    async with sim_stack(spec, "auto", calibrated=False) as stack:
        answer = await relayed(stack.url, body)
        learning = stack.app.state.gateway.orchestrator.learning
        assert learning.steps  # a P/D gateway reads decode steps off its streams
        return len(learning.chunk_times.since(stack.config.decode[0], 0.0)), answer


async def test_coalesced_chunks_are_relayed_whole_and_not_read_as_steps() -> None:
    per_token, (chunks1, text1, tokens1) = await arrivals_and_answer(1, LONG)
    coalesced, (chunks8, text8, tokens8) = await arrivals_and_answer(8, LONG)
    assert tokens1 == tokens8 == 64 and text8 == text1
    assert chunks8 < chunks1 / 4  # the node's chunks reached the client as they were: 8 tokens each
    assert per_token >= 60  # one arrival per step after the first chunk
    assert coalesced == 0


async def test_a_request_asking_for_chunks_of_n_is_not_read_as_steps_either() -> None:
    asked, (_, _, tokens) = await arrivals_and_answer(1, {**LONG, "stream_interval": 8})
    assert tokens == 64
    assert asked == 0
