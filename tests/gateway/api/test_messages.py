"""Anthropic Messages through the gateway on the simulator: a Claude-Code-like tool loop (billing header, session
header, tools, tool results), streamed and not, answered as the oracle answers the same turn sent as chat, with
later turns reusing the decode node's KV; errors and keys in Anthropic's shape; count_tokens."""

from __future__ import annotations

from typing import Any

import pytest
from kvtether.protocol import messages as M

from tests.support.gateway_agent import MODEL, tool_result
from tests.support.gateway_messages import comparable, follow_up, oracle, request, send
from tests.support.sim_rig import metric, rig

pytestmark = pytest.mark.anyio


async def test_a_messages_tool_loop_answers_as_the_oracle_and_later_turns_reuse() -> None:
    async with rig(sim={"decoder_kv_blocks_ttl": 1e9}) as r:
        headers = {"x-claude-code-session-id": "cc-1", "anthropic-version": "2023-06-01", "x-api-key": "any"}
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Fix the build. " + tool_result("t", 30)}]
        sources = []
        kinds: set[str] = set()
        for turn in range(5):
            body = request(messages, turn, stream=turn % 2 == 1)
            got, resp_headers = await send(r, body, headers)
            want = await oracle(r, body)
            assert comparable(got) == comparable(want), f"turn {turn} differs from the oracle"
            kinds.update(b["type"] for b in got["content"])
            assert got["role"] == "assistant" and got["usage"]["output_tokens"] > 0
            sources.append(resp_headers.get("x-kvtether-reuse-source"))
            messages = follow_up(messages, got, turn)
        assert {"text", "tool_use"} <= kinds, kinds  # the loop had tool calls and text answers
        # The billing block changes every turn and is stripped, so every later turn pulls the history back.
        assert sources[1:] == ["decode_pull"] * 4, sources
        assert await metric(r.client, r.url, "kvtether_handle_outcomes_total", outcome="attached") == 4
        [s] = (await r.client.get(f"{r.url}/admin/sessions")).json()
        assert s["session_id"] == "cc-1" and s["turns"] == 5
        assert await metric(r.client, r.url, "kvtether_requests_total", route="messages", status="2xx") == 5


async def test_claude_code_subagents_and_metadata_name_their_own_sessions() -> None:
    async with rig() as r:
        body = request([{"role": "user", "content": "hello " + tool_result("sa", 10)}], 0, stream=False)
        await send(r, body, {"x-claude-code-session-id": "cc-2", "x-claude-code-agent-id": "explore-1"})
        await send(r, body, {})  # no header: metadata.user_id's session_id
        ids = sorted(s["session_id"] for s in (await r.client.get(f"{r.url}/admin/sessions")).json())
        assert ids == ["cc-2:agent:explore-1", "meta-session"]


async def test_errors_come_in_anthropics_shape() -> None:
    async with rig(api_keys={"key-messages-01": "team"}) as r:
        body = request([{"role": "user", "content": "hi"}], 0, stream=False)
        no_key = await r.client.post(f"{r.url}/v1/messages", json=body)
        assert no_key.status_code == 401
        assert no_key.json()["type"] == "error" and no_key.json()["error"]["type"] == "authentication_error"
        ok = await r.client.post(f"{r.url}/v1/messages", json=body, headers={"x-api-key": "key-messages-01"})
        assert ok.status_code == 200 and ok.json()["type"] == "message"
        bad = await r.client.post(f"{r.url}/v1/messages", json={**body, "max_tokens": 0},
                                  headers={"x-api-key": "key-messages-01"})
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
        assert "max_tokens" in bad.json()["error"]["message"]
        # Server tools are dropped by default (tests/gateway/api/test_hosted_tools.py); a tool_choice naming one is
        # still refused.
        server_tool = {**body, "tools": [{"type": "web_search_20250305", "name": "web_search"}],
                       "tool_choice": {"type": "tool", "name": "web_search"}}
        refused = await r.client.post(f"{r.url}/v1/messages", json=server_tool,
                                      headers={"x-api-key": "key-messages-01"})
        assert refused.status_code == 400 and "web_search" in refused.json()["error"]["message"]
        assert refused.json()["error"]["type"] == "invalid_request_error"
        unknown = await r.client.post(f"{r.url}/v1/messages", json={**body, "model": "claude-opus-4"},
                                      headers={"x-api-key": "key-messages-01"})
        assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"
        smuggled = await r.client.post(f"{r.url}/v1/messages", json={**body, "kv_transfer_params": {"x": 1}},
                                       headers={"x-api-key": "key-messages-01"})
        assert smuggled.status_code == 400 and smuggled.json()["type"] == "error"


async def test_a_model_alias_serves_the_model_it_names_and_the_answer_keeps_the_name_the_client_used() -> None:
    """Claude Code asks for a model of its own (`claude-opus-4-8`) beside the one it is configured with: with
    ``model_aliases`` the cluster's model answers it. An exact alias is listed in /v1/models, a pattern is not;
    the answer names the model the client asked for, the turn is the served model's (the oracle's answer); an alias
    of a model no backend serves, and any other name, are refused 404 in the API's own error shape."""
    aliases = {"gpt-4o": MODEL, "claude-*": MODEL, "claude-opus-4-8-beta": "no-such-model"}
    async with rig(model_aliases=aliases) as r:
        listed = [m["id"] for m in (await r.client.get(f"{r.url}/v1/models")).json()["data"]]
        assert MODEL in listed and "gpt-4o" in listed
        assert not {"claude-*", "claude-opus-4-8-beta"} & set(listed)
        body = {**request([{"role": "user", "content": "Fix it. " + tool_result("al", 20)}], 0, stream=False),
                "model": "claude-opus-4-8"}
        got, _ = await send(r, body, {"x-claude-code-session-id": "cc-alias"})
        assert got["model"] == "claude-opus-4-8"
        assert comparable(got) == comparable(await oracle(r, {**body, "model": MODEL}))
        counted = await r.client.post(f"{r.url}/v1/messages/count_tokens", json=body)
        assert counted.status_code == 200 and counted.json()["input_tokens"] > 100
        chat = await r.client.post(f"{r.url}/v1/chat/completions",
                                   json={"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}],
                                         "max_tokens": 5})
        assert chat.status_code == 200, chat.text
        answered = await r.client.post(f"{r.url}/v1/responses",
                                       json={"model": "gpt-4o", "input": "hi", "max_output_tokens": 16})
        assert answered.status_code == 200 and answered.json()["model"] == "gpt-4o", answered.text
        dangling = await r.client.post(f"{r.url}/v1/messages", json={**body, "model": "claude-opus-4-8-beta"})
        assert dangling.status_code == 404 and dangling.json()["error"]["type"] == "not_found_error"
        assert "no-such-model" in dangling.json()["error"]["message"]
        other = await r.client.post(f"{r.url}/v1/chat/completions",
                                    json={"model": "gpt-5", "messages": [{"role": "user", "content": "hi"}]})
        assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"


async def test_count_tokens_is_the_prompt_the_decode_node_renders() -> None:
    async with rig() as r:
        body = request([{"role": "user", "content": "count me " + tool_result("c", 40)}], 0, stream=False)
        resp = await r.client.post(f"{r.url}/v1/messages/count_tokens", json=body)
        assert resp.status_code == 200, resp.text
        chat = M.to_chat(body)
        done = await r.client.post(f"{r.oracle}/v1/chat/completions", json={**chat, "max_tokens": 1})
        assert resp.json() == {"input_tokens": done.json()["usage"]["prompt_tokens"]}
        bad = await r.client.post(f"{r.url}/v1/messages/count_tokens", json={"model": MODEL})
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"



async def test_count_tokens_counts_under_the_served_name_whatever_name_the_client_used() -> None:
    """The gateway's public `model` (and an alias) name what vLLM serves under another name: counted as the turn
    would run, with the served name (vLLM's /tokenize refuses any other); a name nobody serves is refused 404."""
    async with rig(model="team-model", model_aliases={"claude-*": "team-model"}) as r:
        body = request([{"role": "user", "content": "count me " + tool_result("c", 40)}], 0, stream=False)
        want = (await r.client.post(f"{r.url}/v1/messages/count_tokens", json={**body, "model": MODEL})).json()
        for name in ("team-model", "claude-opus-4-8"):
            got = await r.client.post(f"{r.url}/v1/messages/count_tokens", json={**body, "model": name})
            assert got.status_code == 200 and got.json() == want, (name, got.text)
        unknown = await r.client.post(f"{r.url}/v1/messages/count_tokens", json={**body, "model": "gpt-5"})
        assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"
