"""vLLM's --stream-interval on a simulated node: the first token at once, then a chunk every N tokens, the rest with
the finish; the same answer and the same token times as a stream of one token per chunk (on a virtual clock)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from kvtether.protocol.tokens import CHAT, ends_generation, has_token
from kvtether.sim.cluster import SimCluster
from kvtether.sim.virtual import VirtualLoop

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
MSGS = [{"role": "user", "content": "Tell me about the weather in Paris today, at length."}]
BODY = {"model": "kvtether-sim", "messages": MSGS, "temperature": 0, "max_tokens": 47, "ignore_eos": True,
        "return_token_ids": True, "stream_options": {"include_usage": True}}


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    return "asyncio", {"loop_factory": VirtualLoop}


Chunks = list[tuple[float, dict[str, Any]]]


async def stream(url: str, body: dict[str, Any], path: str = "/v1/chat/completions") -> Chunks:
    """The stream's chunks, each with its arrival time on the loop's (virtual) clock."""
    loop = asyncio.get_running_loop()
    out: Chunks = []
    async with httpx.AsyncClient(timeout=60) as http, http.stream("POST", url + path,
                                                                   json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append((loop.time(), json.loads(line[6:])))
    return out


@pytest.fixture
async def nodes() -> AsyncIterator[tuple[str, str]]:
    """Two nodes alike but for --stream-interval: 1 and 8."""
    loop = asyncio.get_running_loop()
    async with SimCluster(prefill=0, decode=0, aggregated=1, preset="qwen3-32b-h200-tp8", clock=loop.time) as one, \
            SimCluster(prefill=0, decode=0, aggregated=1, preset="qwen3-32b-h200-tp8", clock=loop.time,
                       stream_interval=8) as eight:
        yield one.aggregated_urls[0], eight.aggregated_urls[0]


def tokens_per_chunk(chunks: Chunks) -> list[int]:
    return [len(c["choices"][0].get("token_ids") or []) for _, c in chunks if c["choices"]]


def text_of(chunks: Chunks) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for _, c in chunks if c["choices"])


def times(chunks: Chunks) -> tuple[float, float, int]:
    """(first token, end of generation, completion tokens): what TTFT and TPOT are read from."""
    first = next(t for t, c in chunks if has_token(CHAT, c))
    end = next(t for t, c in chunks if ends_generation(CHAT, c))
    usage = next(c["usage"] for _, c in chunks if c.get("usage"))
    return first, end, usage["completion_tokens"]


@pytest.mark.anyio
async def test_a_chunk_every_n_tokens_with_the_same_answer_and_token_times(nodes: tuple[str, str]) -> None:
    one_url, eight_url = nodes
    t0 = asyncio.get_running_loop().time()
    one = await stream(one_url, BODY)
    t1 = asyncio.get_running_loop().time()
    eight = await stream(eight_url, BODY)
    # After the role chunk: one token per chunk, then the finish; with 8: 1, then 8 at a time, the remaining 6
    # with the finish (47 tokens).
    assert tokens_per_chunk(one) == [0] + [1] * 47 + [0]
    assert tokens_per_chunk(eight) == [0, 1, 8, 8, 8, 8, 8, 6]
    assert eight[-2][1]["choices"][0]["finish_reason"] == "length"
    assert text_of(eight) == text_of(one)
    # The tokens are sampled at the same steps: the first at once, the last with the finish.
    (f1, e1, n1), (f8, e8, n8) = times(one), times(eight)
    assert n1 == n8 == 47
    assert f8 - t1 == pytest.approx(f1 - t0, abs=1e-9)
    assert e8 - t1 == pytest.approx(e1 - t0, abs=1e-9)


@pytest.mark.anyio
async def test_a_request_raises_the_interval_and_never_lowers_it(nodes: tuple[str, str]) -> None:
    one_url, eight_url = nodes
    raised = await stream(one_url, {**BODY, "stream_interval": 16})
    assert tokens_per_chunk(raised) == [0, 1, 16, 16, 14]
    lowered = await stream(eight_url, {**BODY, "stream_interval": 2})
    assert tokens_per_chunk(lowered) == [0, 1, 8, 8, 8, 8, 8, 6]
    async with httpx.AsyncClient() as http:
        r = await http.post(one_url + "/v1/chat/completions", json={**BODY, "stream_interval": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_interval"


@pytest.mark.anyio
async def test_a_tool_call_streamed_in_chunks_of_n_adds_up_to_the_same_call(nodes: tuple[str, str]) -> None:
    one_url, eight_url = nodes
    body = {"model": "kvtether-sim", "messages": MSGS, "tools": TOOLS, "tool_choice": "required", "temperature": 0}

    def call_of(chunks: Chunks) -> tuple[str, str, str, int]:
        ident, name, args, fragments = "", "", "", 0
        for _, c in chunks:
            for part in (c["choices"][0]["delta"].get("tool_calls") or []) if c["choices"] else []:
                assert part["index"] == 0
                fragments += 1
                ident += part.get("id", "")
                name += part["function"].get("name", "")
                args += part["function"].get("arguments", "")
        return ident, name, args, fragments

    one, eight = call_of(await stream(one_url, body)), call_of(await stream(eight_url, body))
    assert one[:3] == eight[:3] and one[1] == "get_weather" and "city" in json.loads(one[2])
    assert eight[3] < one[3]  # fewer, longer fragments


@pytest.mark.anyio
async def test_text_completions_stream_in_chunks_of_n_too(nodes: tuple[str, str]) -> None:
    _, eight_url = nodes
    body = {"model": "kvtether-sim", "prompt": "Once upon a time", "max_tokens": 20, "ignore_eos": True,
            "temperature": 0, "return_token_ids": True}
    chunks = await stream(eight_url, body, "/v1/completions")
    assert tokens_per_chunk(chunks) == [1, 8, 8, 3]
