"""A deterministic agent loop for the gateway tests: tools, tool results, growing history, edits."""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from typing import Any

import anyio
import httpx

MODEL = "kvtether-sim"

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file of the repository",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "run_shell", "description": "Run a shell command",
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}, "timeout": {"type": "integer"}},
                       "required": ["cmd"]}}},
]

_WORDS = (
    "alpha", "beta", "gamma", "delta", "build", "test", "cache", "node", "block", "token", "prefix",
    "decode", "prefill", "session", "handle", "pull", "error", "file", "line", "value", "config", "module",
    "graph", "queue", "batch", "lease",
)


def tool_result(seed: str, n_words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(n_words))


def first_messages(session: int, *, system_words: int = 120) -> list[dict[str, Any]]:
    return [
        {"role": "system",
         "content": f"You are coding agent #{session}. " + tool_result(f"sys{session}", system_words)},
        {"role": "user", "content": f"Task {session}: " + tool_result(f"task{session}", 30)},
    ]


def next_messages(messages: list[dict[str, Any]], answer: Mapping[str, Any], session: int, turn: int,
                  *, result_words: int = 60) -> list[dict[str, Any]]:
    """The history after ``answer``: its tool calls' results, or a user follow-up."""
    out = [*messages, dict(answer)]
    calls = answer.get("tool_calls") or []
    if calls:
        for i, call in enumerate(calls):
            out.append({"role": "tool", "tool_call_id": call.get("id") or f"call{i}",
                        "content": tool_result(f"r{session}.{turn}.{i}", result_words)})
    else:
        out.append({"role": "user", "content": f"Continue ({turn}): " + tool_result(f"u{session}.{turn}", 20)})
    return out


def request_body(messages: list[dict[str, Any]], *, stream: bool, thinking: bool = False,
                 max_tokens: int = 80) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "messages": messages, "tools": TOOLS, "temperature": 0,
                            "max_tokens": max_tokens, "stream": stream}
    if thinking:
        body["chat_template_kwargs"] = {"enable_thinking": True}
    return body


def comparable(answer: Mapping[str, Any]) -> dict[str, Any]:
    """What must be identical between two correct runs (tool-call ids are random by design)."""
    calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
             for c in answer.get("tool_calls") or []]
    return {"content": answer.get("content") or "", "reasoning": answer.get("reasoning_content") or "",
            "tool_calls": calls}


async def chat(client: httpx.AsyncClient, url: str, body: dict[str, Any],
               headers: Mapping[str, str] | None = None, *, clean: bool = True,
               response_headers: dict[str, str] | None = None) -> dict[str, Any]:
    """One chat call (streamed or not); returns the assistant message as a client would keep it, and the
    response's headers into ``response_headers`` when given."""
    if not body.get("stream"):
        resp = await client.post(f"{url}/v1/chat/completions", json=body, headers=dict(headers or {}))
        assert resp.status_code == 200, resp.text
        if response_headers is not None:
            response_headers.update(resp.headers)
        data = resp.json()
        if clean:
            _assert_clean(data, body)
        msg = data["choices"][0]["message"]
        out: dict[str, Any] = {"role": "assistant", "content": msg.get("content")}
        if msg.get("tool_calls"):
            out["tool_calls"] = msg["tool_calls"]
        if msg.get("reasoning_content"):
            out["reasoning_content"] = msg["reasoning_content"]
        return out
    content: list[str] = []
    reasoning: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=dict(headers or {})) as resp:
        assert resp.status_code == 200, (await resp.aread()).decode()
        if response_headers is not None:
            response_headers.update(resp.headers)
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            chunk = json.loads(payload)
            assert "error" not in chunk, chunk
            if clean:
                _assert_clean(chunk, body)
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                if delta.get("content"):
                    content.append(delta["content"])
                if delta.get("reasoning_content"):
                    reasoning.append(delta["reasoning_content"])
                for call in delta.get("tool_calls") or []:
                    slot = calls.setdefault(call.get("index", 0), {"id": None, "type": "function",
                                                                   "function": {"name": "", "arguments": ""}})
                    if call.get("id"):
                        slot["id"] = call["id"]
                    fn = call.get("function") or {}
                    slot["function"]["name"] += fn.get("name") or ""
                    slot["function"]["arguments"] += fn.get("arguments") or ""
    out = {"role": "assistant", "content": "".join(content) or None}
    if calls:
        out["tool_calls"] = [calls[i] for i in sorted(calls)]
    if reasoning:
        out["reasoning_content"] = "".join(reasoning)
    return out


def _assert_clean(obj: Mapping[str, Any], body: Mapping[str, Any]) -> None:
    text = json.dumps(obj)
    assert "kv_transfer_params" not in text, text
    if not body.get("return_token_ids"):
        assert "token_ids" not in text, text


async def short_sessions(client: httpx.AsyncClient, url: str,
                         sessions: Mapping[str, int]) -> dict[str, list[dict[str, Any]]]:
    """Each session's first turn (non-streamed, 10-token answers), by session id and its seed; the messages of
    each one's next turn (a 10-word tool result)."""
    histories = {}
    for sid, seed in sessions.items():
        first = first_messages(seed)
        got = await chat(client, url, request_body(first, stream=False, max_tokens=10), {"x-session-id": sid})
        histories[sid] = next_messages(first, got, seed, 0, result_words=10)
    return histories


async def turn_until(client: httpx.AsyncClient, url: str, session: str, messages: list[dict[str, Any]],
                     timeout_s: float = 30.0) -> None:
    """One non-streamed turn (10-token answer) that the client gives up on after `timeout_s`: the turn a test
    leaves hanging on a node (the simulator's `hang_next` fault) while it looks at the gateway."""
    with anyio.move_on_after(timeout_s):
        await client.post(f"{url}/v1/chat/completions", headers={"x-session-id": session},
                          json=request_body(messages, stream=False, max_tokens=10))
