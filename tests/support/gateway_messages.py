"""Anthropic Messages through the gateway on the simulator, as its tests drive it: a Claude-Code-like request
(billing header, tools, metadata), one call with a stream folded back into a message, what two correct answers
share, the oracle's answer to the same turn, and the next turn's history."""

from __future__ import annotations

import json
from typing import Any

import httpx
from kvtether.protocol import messages as M

from tests.support.gateway_agent import MODEL, tool_result
from tests.support.sim_rig import Rig

TOOLS = [
    {"name": "read_file", "description": "Read a file of the repository",
     "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}},
    {"name": "grep", "description": "Search the repository",
     "input_schema": {"type": "object", "properties": {"pattern": {"type": "string"}}, "required": ["pattern"]},
     "cache_control": {"type": "ephemeral"}},
]


def request(messages: list[dict[str, Any]], turn: int, *, stream: bool) -> dict[str, Any]:
    return {
        "model": MODEL, "max_tokens": 60, "stream": stream, "temperature": 0, "tools": TOOLS,
        "system": [
            # Claude Code's per-request attribution block: different every turn, stripped as vLLM strips it.
            {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.328; cch={turn:08x};"},
            {"type": "text", "text": "You are a coding agent. " + tool_result("sys-m", 120),
             "cache_control": {"type": "ephemeral"}},
        ],
        "messages": messages,
        "metadata": {"user_id": json.dumps({"device_id": "d", "session_id": "meta-session"})},
        "context_management": {"edits": []},
    }


async def send(r: Rig, body: dict[str, Any], headers: dict[str, str]) -> tuple[dict[str, Any], httpx.Headers]:
    """One Messages call; the message as a client rebuilds it (a stream's events folded into one)."""
    if not body["stream"]:
        resp = await r.client.post(f"{r.url}/v1/messages?beta=true", json=body, headers=headers)
        assert resp.status_code == 200, resp.text
        return resp.json(), resp.headers
    content: list[dict[str, Any]] = []
    partial: dict[int, str] = {}
    names: list[str] = []
    message: dict[str, Any] = {}
    async with r.client.stream("POST", f"{r.url}/v1/messages?beta=true", json=body, headers=headers) as resp:
        assert resp.status_code == 200, (await resp.aread()).decode()
        assert resp.headers["content-type"].startswith("text/event-stream")
        event = None
        async for line in resp.aiter_lines():
            if line.startswith("event:"):
                event = line[6:].strip()
                names.append(event)
                continue
            if not line.startswith("data:"):
                continue
            data = json.loads(line[5:])
            assert data["type"] == event
            if event == "message_start":
                message = data["message"]
            elif event == "content_block_start":
                content.append(dict(data["content_block"]))
            elif event == "content_block_delta":
                block, delta = content[data["index"]], data["delta"]
                if delta["type"] == "text_delta":
                    block["text"] = block.get("text", "") + delta["text"]
                elif delta["type"] == "input_json_delta":
                    partial[data["index"]] = partial.get(data["index"], "") + delta["partial_json"]
                elif delta["type"] == "thinking_delta":
                    block["thinking"] = block.get("thinking", "") + delta["thinking"]
            elif event == "message_delta":
                message.update(data["delta"])
                message["usage"] = {**message.get("usage", {}), **data["usage"]}
        headers_out = resp.headers
    assert names[0] == "message_start" and names[-1] == "message_stop" and "message_delta" in names
    for i, raw in partial.items():
        content[i]["input"] = json.loads(raw) if raw else {}
    message["content"] = content
    return message, headers_out


def comparable(message: dict[str, Any]) -> dict[str, Any]:
    """What two correct runs share (ids and thinking signatures are per answer)."""
    blocks = []
    for b in message["content"]:
        b = {k: v for k, v in b.items() if k not in ("id", "signature")}
        blocks.append(b)
    return {"content": blocks, "stop_reason": message.get("stop_reason")}


async def oracle(r: Rig, body: dict[str, Any]) -> dict[str, Any]:
    """The same turn as chat, straight to an aggregated simulator node, raised back to a Messages answer."""
    chat = M.to_chat({**body, "stream": False})
    resp = await r.client.post(f"{r.oracle}/v1/chat/completions", json=chat)
    assert resp.status_code == 200, resp.text
    return M.from_chat(resp.json(), MODEL)


def follow_up(messages: list[dict[str, Any]], answer: dict[str, Any], turn: int) -> list[dict[str, Any]]:
    """The next turn's history: the answer as Claude Code keeps it, then its tool results or a user message."""
    out = [*messages, {"role": "assistant", "content": answer["content"]}]
    uses = [b for b in answer["content"] if b["type"] == "tool_use"]
    if uses:
        out.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": u["id"], "content": tool_result(f"m{turn}.{i}", 50)}
            for i, u in enumerate(uses)]})
    else:
        out.append({"role": "user", "content": [{"type": "text", "text": f"Go on ({turn}). " +
                                                  tool_result(f"f{turn}", 20)}]})
    return out
