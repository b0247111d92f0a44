"""OpenAI Responses through the gateway on the simulator, as its tests drive it: a Codex-like request and
headers, one call with a stream checked against its final response, what two correct answers share, the oracle's
answer to the same turn, and the next turn's input."""

from __future__ import annotations

import json
from typing import Any

import httpx
from kvtether.protocol import responses as R

from tests.support.gateway_agent import MODEL, tool_result
from tests.support.sim_rig import Rig, metric

SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
TOOLS = [
    {"type": "function", "name": "read_file", "description": "Read a file of the repository", "parameters": SCHEMA,
     "strict": False},
    {"type": "namespace", "name": "repo", "description": "Repository tools",
     "tools": [{"type": "function", "name": "grep", "description": "Search", "parameters": SCHEMA}]},
    {"type": "custom", "name": "apply_patch", "description": "Apply a patch", "format": {"type": "text"}},
]
CODEX_HEADERS = {"session-id": "codex-thread-1", "thread-id": "codex-thread-1", "originator": "codex_exec",
                 "x-codex-turn-metadata": json.dumps({"session_id": "codex-thread-1", "thread_id": "codex-thread-1"})}


def codex_body(items: list[dict[str, Any]], *, stream: bool) -> dict[str, Any]:
    return {"model": MODEL, "instructions": "You are a coding agent. " + tool_result("sys-r", 120),
            "input": items, "tools": TOOLS, "tool_choice": "auto", "parallel_tool_calls": True,
            "reasoning": {"effort": "medium", "summary": "auto"}, "store": False,
            "include": ["reasoning.encrypted_content"], "prompt_cache_key": "codex-thread-1", "stream": stream,
            "max_output_tokens": 60, "temperature": 0}


async def send(r: Rig, body: dict[str, Any], headers: dict[str, str] | None = None
               ) -> tuple[dict[str, Any], httpx.Headers]:
    """One Responses call; the response object (a stream's terminal event's, checked against its events)."""
    if not body.get("stream"):
        resp = await r.client.post(f"{r.url}/v1/responses", json=body, headers=headers or {})
        assert resp.status_code == 200, resp.text
        return resp.json(), resp.headers
    events: list[dict[str, Any]] = []
    async with r.client.stream("POST", f"{r.url}/v1/responses", json=body, headers=headers or {}) as resp:
        assert resp.status_code == 200, (await resp.aread()).decode()
        assert resp.headers["content-type"].startswith("text/event-stream")
        name = None
        async for line in resp.aiter_lines():
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data = json.loads(line[5:])
                assert data["type"] == name and "kv_transfer_params" not in line
                events.append(data)
        out_headers = resp.headers
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    final = events[-1]
    assert final["type"] in ("response.completed", "response.incomplete")
    # The deltas spell out what the final response holds.
    deltas: dict[int, str] = {}
    for e in events:
        if e["type"] in ("response.output_text.delta", "response.reasoning_text.delta",
                         "response.function_call_arguments.delta"):
            deltas[e["output_index"]] = deltas.get(e["output_index"], "") + e["delta"]
    for i, item in enumerate(final["response"]["output"]):
        if item["type"] == "message" or item["type"] == "reasoning":
            assert deltas[i] == item["content"][0]["text"]
        elif item["type"] == "function_call" and item["arguments"]:
            assert deltas[i] == item["arguments"]
    return final["response"], out_headers


def comparable(response: dict[str, Any]) -> dict[str, Any]:
    """What two correct runs share (item and call ids and sealed reasoning are per answer)."""
    return {"status": response["status"],
            "output": [{k: v for k, v in i.items() if k not in ("id", "call_id", "encrypted_content")}
                       for i in response["output"]]}


async def oracle(r: Rig, body: dict[str, Any], seal: R.ReasoningSeal, history: list[dict[str, Any]] | None = None
                 ) -> dict[str, Any]:
    """The same turn as chat, straight to an aggregated simulator node, raised back to a Responses answer."""
    chat = R.to_chat({**body, "stream": False}, seal=seal, history=history or [])
    resp = await r.client.post(f"{r.oracle}/v1/chat/completions", json=chat)
    assert resp.status_code == 200, resp.text
    return R.from_chat(resp.json(), R.skeleton(body, "resp_oracle", 0.0), tools=body.get("tools"), seal=None)


def follow_up(items: list[dict[str, Any]], answer: dict[str, Any], turn: int) -> list[dict[str, Any]]:
    """The next turn's input as Codex builds it: every earlier item, the answer's items as they came (reasoning
    with its encrypted_content), then the tool outputs or a new user message."""
    out = [*items, *answer["output"]]
    calls = [i for i in answer["output"] if i["type"] in ("function_call", "custom_tool_call")]
    for n, call in enumerate(calls):
        kind = "function_call_output" if call["type"] == "function_call" else "custom_tool_call_output"
        out.append({"type": kind, "call_id": call["call_id"], "output": tool_result(f"o{turn}.{n}", 50)})
    if not calls:
        out.append({"type": "message", "role": "user",
                    "content": [{"type": "input_text", "text": f"Go on ({turn}). " + tool_result(f"u{turn}", 20)}]})
    return out


async def check_codex_session(r: Rig, reused: list[int], prompts: list[int], called: list[bool],
                              sources: list[str | None]) -> None:
    """What six Codex-shaped turns of the session ``codex-thread-1`` must show: every turn after a tool call reuses
    at least the previous turn's prompt, pulled from D; every later turn reuses something, pulled or from P's own
    cache; the gateway counts one session of six turns, all answered."""
    after_calls = [t for t in range(1, 6) if called[t - 1]]
    assert after_calls and all(reused[t] >= prompts[t - 1] for t in after_calls), (reused, prompts, called)
    assert all(sources[t] == "decode_pull" for t in after_calls), (sources, called)
    assert all(s in ("decode_pull", "prefill_cache") for s in sources[1:]) and min(reused[1:]) > 0, sources
    [s] = (await r.client.get(f"{r.url}/admin/sessions")).json()
    assert s["session_id"] == "codex-thread-1" and s["turns"] == 6
    assert await metric(r.client, r.url, "kvtether_requests_total", route="responses", status="2xx") == 6
