"""The simulator serves /v1/responses and /v1/messages as vLLM does (sim/agent_apis.py): a direct client's
request answers as the same turn sent as chat, P/D legs run on these APIs with kv_transfer_params, and vLLM's
limits (no Responses store, no encrypted reasoning, no handle on Messages streams) hold."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from kvtether.protocol import messages as M
from kvtether.protocol import responses as R
from kvtether.sim.cluster import ClusterSpec, SimCluster

from tests.support.gateway_agent import MODEL, tool_result

pytestmark = pytest.mark.anyio

P_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None}
TOOLS = [{"type": "function", "name": "read_file", "description": "Read a file",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]
SEAL = R.ReasoningSeal(b"t" * 32)


def responses_body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "instructions": "Be brief. " + tool_result("i", 40), "tools": TOOLS,
            "reasoning": {"effort": "low"}, "max_output_tokens": 80, "temperature": 0,
            "input": [{"type": "message", "role": "user",
                       "content": [{"type": "input_text", "text": "Look. " + tool_result("u", 60)}]}], **extra}


def messages_body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 80, "temperature": 0,
            "system": [{"type": "text", "text": "x-anthropic-billing-header: cch=1;"},
                       {"type": "text", "text": "Be brief. " + tool_result("s", 40)}],
            "messages": [{"role": "user", "content": "Look. " + tool_result("m", 60)}], **extra}


async def sse_events(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = []
    async with client.stream("POST", url, json=body) as resp:
        assert resp.status_code == 200, (await resp.aread()).decode()
        name = ""
        async for line in resp.aiter_lines():
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                out.append((name, json.loads(line[5:])))
    return out


def same(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in items]


async def test_responses_answer_as_the_same_turn_sent_as_chat_whole_and_streamed() -> None:
    async with SimCluster(ClusterSpec(prefill=0, decode=0, aggregated=1, speed=50.0)) as c, \
            httpx.AsyncClient(timeout=60) as client:
        node = c.aggregated_urls[0]
        body = responses_body()
        chat = (await client.post(f"{node}/v1/chat/completions", json=R.to_chat(body, seal=SEAL))).json()
        want = R.from_chat(chat, R.skeleton(body, "r", 0.0), tools=TOOLS, seal=None)
        whole = await client.post(f"{node}/v1/responses", json=body)
        assert whole.status_code == 200, whole.text
        got = whole.json()
        assert same(got["output"]) == same(want["output"])
        # The same prompt, rendered by the translation and by the chat endpoint (the cache hit differs: it is
        # the second time the node sees it).
        assert (got["usage"]["input_tokens"], got["usage"]["output_tokens"]) == \
            (want["usage"]["input_tokens"], want["usage"]["output_tokens"])
        assert {i["type"] for i in want["output"]} >= {"reasoning"}
        events = await sse_events(client, f"{node}/v1/responses", {**body, "stream": True})
        assert events[0][0] == "response.created" and events[-1][0] in ("response.completed", "response.incomplete")
        assert same(events[-1][1]["response"]["output"]) == same(want["output"])
        # vLLM's limits: no store, so no chain; no encrypted reasoning.
        chained = await client.post(f"{node}/v1/responses", json={**body, "previous_response_id": "resp_1"})
        assert chained.status_code == 404 and chained.json()["error"]["param"] == "previous_response_id"
        sealed = {**body, "input": [*body["input"], {"type": "reasoning", "summary": [],
                                                      "encrypted_content": SEAL.seal("x")}]}
        refused = await client.post(f"{node}/v1/responses", json=sealed)
        assert refused.status_code == 400 and "encrypted_content" in refused.json()["error"]["message"]
        # A hosted tool (Codex's web_search) beside the function tools is left out of the prompt, as vLLM 0.32
        # does: the same prompt, and the same answer, as without it.
        hosted = await client.post(f"{node}/v1/responses", json={**body, "tools": [*TOOLS, {"type": "web_search"}]})
        assert hosted.status_code == 200, hosted.text
        assert hosted.json()["usage"]["input_tokens"] == got["usage"]["input_tokens"]
        assert same(hosted.json()["output"]) == same(got["output"])


async def test_responses_and_messages_run_as_p_d_legs_with_kv_transfer_params() -> None:
    """What a P/D proxy in front of vLLM sends on these APIs: the P leg capped at one token with cold params, the
    D leg with P's; D's answer equals the aggregated node's, and carries D's handle where vLLM's does."""
    async with SimCluster(ClusterSpec(prefill=1, decode=1, aggregated=1, speed=50.0)) as c, \
            httpx.AsyncClient(timeout=60) as client:
        p, d, agg = c.prefill_urls[0], c.decode_urls[0], c.aggregated_urls[0]
        body = responses_body()
        first = await client.post(f"{p}/v1/responses", json={**body, "max_output_tokens": 1,
                                                             "kv_transfer_params": P_PARAMS})
        assert first.status_code == 200, first.text
        params = first.json()["kv_transfer_params"]
        assert params["do_remote_prefill"] is True
        events = await sse_events(client, f"{d}/v1/responses", {**body, "stream": True, "kv_transfer_params": params})
        final = events[-1][1]["response"]
        want = (await client.post(f"{agg}/v1/responses", json=body)).json()
        assert same(final["output"]) == same(want["output"])
        # Responses streams end with the whole response, D's handle included (vLLM 0.32 already).
        assert "kv_transfer_params" in final

        mbody = messages_body()
        first = await client.post(f"{p}/v1/messages", json={**mbody, "max_tokens": 1,
                                                            "kv_transfer_params": P_PARAMS})
        assert first.status_code == 200, first.text
        params = first.json()["kv_transfer_params"]
        whole = await client.post(f"{d}/v1/messages", json={**mbody, "kv_transfer_params": params})
        want_m = (await client.post(f"{agg}/v1/messages", json=mbody)).json()
        assert whole.json()["content"] == want_m["content"]
        # A second P leg, and its D leg streamed: vLLM's Messages streams never carry the handle.
        again = (await client.post(f"{p}/v1/messages", json={**mbody, "max_tokens": 1,
                                                             "kv_transfer_params": P_PARAMS})).json()
        events = await sse_events(client, f"{d}/v1/messages", {**mbody, "stream": True,
                                                                "kv_transfer_params": again["kv_transfer_params"]})
        assert events[0][0] == "message_start" and events[-1][0] == "message_stop"
        assert all("kv_transfer_params" not in json.dumps(data) for _, data in events)
        text = "".join(d["delta"].get("text", "") for name, d in events if name == "content_block_delta")
        assert text == "".join(b.get("text", "") for b in want_m["content"] if b["type"] == "text")


async def test_messages_errors_and_count_tokens() -> None:
    async with SimCluster(ClusterSpec(prefill=0, decode=0, aggregated=1, speed=50.0)) as c, \
            httpx.AsyncClient(timeout=60) as client:
        node = c.aggregated_urls[0]
        body = messages_body()
        counted = await client.post(f"{node}/v1/messages/count_tokens", json=body)
        tokens = await client.post(f"{node}/tokenize", json={
            k: v for k, v in M.count_tokens_body(body).items() if k in ("model", "messages", "tools")})
        assert counted.json() == {"input_tokens": len(tokens.json()["tokens"])}
        answered = (await client.post(f"{node}/v1/messages", json=body)).json()
        assert answered["usage"]["input_tokens"] + answered["usage"].get("cache_read_input_tokens", 0) == \
            counted.json()["input_tokens"]
        bad = await client.post(f"{node}/v1/messages", json={**body, "max_tokens": 0})
        assert bad.status_code == 400 and bad.json()["type"] == "error"
        unknown = await client.post(f"{node}/v1/messages", json={**body, "model": "other"})
        assert unknown.status_code == 404 and unknown.json()["type"] == "error"
