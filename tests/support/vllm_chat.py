"""A chat session against the real vLLM pair, through the gateway or not: deterministic messages, one call
(streamed or not) that returns the answer's text and token ids, and the check that those ids are greedy decoding
of the prompt as the reference instance renders it."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

import httpx

from tests.support.vllm_fixtures import Backend, greedy_mismatch

_TEXT = (
    "alpha beta gamma delta build test cache node block token prefix decode prefill session handle pull "
    "error file line value config module graph queue batch lease import return class def self yield"
)
_WORDS = _TEXT.split()
MAX_TOKENS = 48


def words(seed: str, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def first_messages(tag: str) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": f"You are agent {tag}. " + words(f"sys-{tag}", 220)},
        {"role": "user", "content": "Task: " + words(f"task-{tag}", 60)},
    ]


def follow_up(messages: list[dict[str, Any]], answer: str, tag: str, turn: int) -> list[dict[str, Any]]:
    return [
        *messages,
        {"role": "assistant", "content": answer},
        {"role": "user", "content": f"Result {turn}: " + words(f"u-{tag}-{turn}", 50)},
    ]


def body(model: str, messages: list[dict[str, Any]], *, stream: bool) -> dict[str, Any]:
    # Token ids so that the answer is checked token by token against the reference (`answer_mismatch`).
    return {"model": model, "messages": messages, "temperature": 0, "max_tokens": MAX_TOKENS, "stream": stream,
            "return_token_ids": True}


@dataclass
class ChatAnswer:
    text: str
    ids: list[int]
    headers: httpx.Headers  # the response's (a gateway's x-kvtether-* among them)


async def chat(
    client: httpx.AsyncClient,
    url: str,
    req: dict[str, Any],
    headers: dict[str, str] | None = None,
    *,
    clean: bool = True,
) -> tuple[str, list[int]]:
    """One chat call: the answer's text and token ids. `clean`: assert no kv_transfer_params reach the client
    (the gateway strips them)."""
    got = await chat_answer(client, url, req, headers, clean=clean)
    return got.text, got.ids


async def chat_answer(
    client: httpx.AsyncClient,
    url: str,
    req: dict[str, Any],
    headers: dict[str, str] | None = None,
    *,
    clean: bool = True,
) -> ChatAnswer:
    """`chat`, with the response's headers."""
    if not req.get("stream"):
        r = await client.post(url + "/v1/chat/completions", json=req, headers=headers or {})
        assert r.status_code == 200, r.text
        data = r.json()
        if clean:
            assert "kv_transfer_params" not in data, "the gateway leaked kv_transfer_params to the client"
        choice = data["choices"][0]
        return ChatAnswer(str(choice["message"]["content"] or ""), [int(t) for t in choice.get("token_ids") or []],
                          r.headers)
    parts: list[str] = []
    ids: list[int] = []
    async with client.stream("POST", url + "/v1/chat/completions", json=req, headers=headers or {}) as r:
        assert r.status_code == 200, (await r.aread()).decode()
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            chunk = json.loads(payload)
            assert "error" not in chunk, chunk
            if clean:
                assert "kv_transfer_params" not in chunk
            for ch in chunk.get("choices") or []:
                parts.append((ch.get("delta") or {}).get("content") or "")
                ids.extend(int(t) for t in ch.get("token_ids") or [])
    return ChatAnswer("".join(parts), ids, r.headers)


async def chat_prompt(client: httpx.AsyncClient, b: Backend, messages: list[dict[str, Any]]) -> list[int]:
    """`messages`' prompt as the prefill instance renders it (the generation prompt included)."""
    r = await client.post(b.prefill_url + "/tokenize",
                          json={"model": b.model, "messages": messages, "add_generation_prompt": True})
    r.raise_for_status()
    return [int(t) for t in r.json()["tokens"]]


async def answer_mismatch(client: httpx.AsyncClient, b: Backend, messages: list[dict[str, Any]],
                          ids: list[int], *, max_tokens: int = MAX_TOKENS) -> str | None:
    """None when `ids` is the reference answer to `messages`: the prompt as the prefill instance renders it,
    decoded there greedily without P/D or a shared prefix cache (up to bf16 near-ties: `greedy_mismatch`)."""
    assert ids, "the answer carries no token ids (return_token_ids)"
    prompt = await chat_prompt(client, b, messages)
    return await greedy_mismatch(client, b.prefill_url, b.model, prompt, ids, max_tokens=max_tokens)
