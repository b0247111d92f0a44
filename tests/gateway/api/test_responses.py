"""OpenAI Responses through the gateway on the simulator: a Codex-like stateless tool loop (store false,
encrypted reasoning handed back, Codex's session headers) and a stateful chain (previous_response_id,
conversation), streamed and not, answered as the oracle answers the same turn sent as chat, with later turns
reusing the decode node's KV; the stored responses' routes; errors in OpenAI's shape; tenants."""

from __future__ import annotations

import json
from typing import Any

import pytest
from kvtether.protocol import responses as R

from tests.support.gateway_agent import MODEL, tool_result
from tests.support.gateway_responses import (
    CODEX_HEADERS,
    TOOLS,
    check_codex_session,
    codex_body,
    comparable,
    follow_up,
    oracle,
    send,
)
from tests.support.sim_rig import metric, rig

pytestmark = pytest.mark.anyio


async def test_a_codex_like_stateless_loop_answers_as_the_oracle_and_later_turns_reuse() -> None:
    async with rig(sim={"decoder_kv_blocks_ttl": 1e9}) as r:
        seal = r.gw.responses.seal
        items: list[dict[str, Any]] = [
            {"type": "message", "role": "developer",
             "content": [{"type": "input_text", "text": "Sandbox: read-only. " + tool_result("dev", 40)}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Fix the build."}]}]
        sources, kinds, reused, prompts, called = [], set(), [], [], []
        for turn in range(6):
            body = codex_body(items, stream=turn % 2 == 1)
            got, headers = await send(r, body, CODEX_HEADERS)
            want = await oracle(r, body, seal)
            assert comparable(got) == comparable(want), f"turn {turn} differs from the oracle"
            kinds.update(i["type"] for i in got["output"])
            assert got["usage"]["output_tokens"] > 0 and got["store"] is False
            sources.append(headers.get("x-kvtether-reuse-source"))
            reused.append(int(headers.get("x-kvtether-reuse-tokens") or 0))
            prompts.append(got["usage"]["input_tokens"])
            called.append(any(i["type"] == "function_call" for i in got["output"]))
            items = follow_up(items, got, turn)
        assert {"reasoning", "function_call"} <= kinds, kinds
        assert all(i.get("encrypted_content", "kvt1.").startswith("kvt1.") for i in items if i["type"] == "reasoning")
        # Every later turn resends the whole history, reasoning included (read back from encrypted_content), and
        # reuses it. After a tool call the template still renders that answer's reasoning, so the whole earlier
        # prompt and answer are reused: P reads what its own cache lacks (the answer) from D. (A new user
        # message makes this Qwen3-style template drop earlier reasoning: reuse then stops where that reasoning
        # was, inside the prompt P itself prefilled last turn, so P may need nothing from D: its own cache.)
        await check_codex_session(r, reused, prompts, called, sources)
        # store false: nothing kept.
        assert (await r.client.get(f"{r.url}/v1/responses/{got['id']}")).status_code == 404


async def test_a_chain_of_stored_responses_is_expanded_pinned_and_reused() -> None:
    async with rig(sim={"decoder_kv_blocks_ttl": 1e9}) as r:
        seal = r.gw.responses.seal
        # Room for whole answers: a tool call cut short streams as a call but parses as text when whole (vLLM's
        # chat behaviour, which the oracle's non-streamed turn would show).
        first = {"model": MODEL, "instructions": "Be brief.", "tools": TOOLS, "temperature": 0,
                 "max_output_tokens": 400, "reasoning": {"effort": "low"},
                 "input": "Look at the repository. " + tool_result("c0", 80)}
        got, _ = await send(r, first)
        history = R.to_chat(first, seal=seal)["messages"][1:] + R.input_messages(got["output"], seal)
        previous, sources = got["id"], []
        for turn in range(1, 5):
            calls = [i for i in got["output"] if i["type"] in ("function_call", "custom_tool_call")]
            new: list[dict[str, Any]] = [
                {"type": "function_call_output" if c["type"] == "function_call" else "custom_tool_call_output",
                 "call_id": c["call_id"], "output": tool_result(f"c{turn}.{n}", 40)} for n, c in enumerate(calls)]
            new = new or [{"type": "message", "role": "user", "content": "More. " + tool_result(f"m{turn}", 15)}]
            body = {**{k: v for k, v in first.items() if k != "input"}, "input": new, "previous_response_id": previous,
                    "stream": turn % 2 == 0}
            got, headers = await send(r, body)
            want = await oracle(r, {**body, "previous_response_id": None}, seal, history)
            assert comparable(got) == comparable(want), f"turn {turn} differs from the oracle"
            assert got["previous_response_id"] == previous
            sources.append((headers.get("x-kvtether-reuse-source"), bool(calls)))
            history = history + R.to_chat({"model": MODEL, "input": new}, seal=seal)["messages"] + \
                R.input_messages(got["output"], seal)
            previous = got["id"]
        # Every turn reuses the chain's history; after a tool call all of it, P reading the answer from D (after
        # a new user message the template drops earlier reasoning, and what is left may be in P's own cache).
        assert any(after_call for _, after_call in sources), sources
        assert all(s == "decode_pull" for s, after_call in sources if after_call), sources
        assert all(s in ("decode_pull", "prefill_cache") for s, _ in sources), sources
        # No session header: the chain itself pinned every turn to one session.
        [s] = (await r.client.get(f"{r.url}/admin/sessions")).json()
        assert s["turns"] == 5
        stored = (await r.client.get(f"{r.url}/v1/responses/{previous}")).json()
        assert stored["id"] == previous and stored["status"] in ("completed", "incomplete")
        listed = (await r.client.get(f"{r.url}/v1/responses/{previous}/input_items?order=asc")).json()
        assert [i["type"] for i in listed["data"]] == [i["type"] for i in new] and listed["has_more"] is False
        deleted = await r.client.delete(f"{r.url}/v1/responses/{previous}")
        assert deleted.json() == {"id": previous, "object": "response.deleted", "deleted": True}
        assert (await r.client.get(f"{r.url}/v1/responses/{previous}")).status_code == 404
        gone = await r.client.post(f"{r.url}/v1/responses", json={**first, "previous_response_id": previous})
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "previous_response_not_found"


async def test_an_edited_history_is_answered_as_the_oracle_answers_it() -> None:
    async with rig(sim={"decoder_kv_blocks_ttl": 1e9}) as r:
        seal = r.gw.responses.seal
        items: list[dict[str, Any]] = [{"type": "message", "role": "user",
                                        "content": "Start. " + tool_result("e0", 120)}]
        got, _ = await send(r, codex_body(items, stream=False), CODEX_HEADERS)
        items = follow_up(items, got, 0)
        # The client rewrites its first message (a compaction, an edited prompt): the held KV no longer applies.
        edited = [{"type": "message", "role": "user", "content": "Start over. " + tool_result("e1", 120)},
                  *items[1:]]
        body = codex_body(edited, stream=True)
        got, headers = await send(r, body, CODEX_HEADERS)
        assert comparable(got) == comparable(await oracle(r, body, seal))
        # At most the head both prompts share (instructions, tools) is reused: the guard cut the handle at the edit.
        async def tokens(turn_items: list[dict[str, Any]]) -> list[int]:
            chat = R.to_chat(codex_body(turn_items, stream=False), seal=seal)
            keep = ("model", "messages", "tools", "chat_template_kwargs")
            resp = await r.client.post(f"{r.oracle}/tokenize", json={k: v for k, v in chat.items() if k in keep})
            return list(resp.json()["tokens"])

        before, after = await tokens(items), await tokens(edited)
        head = next(i for i, (x, y) in enumerate(zip(before, after, strict=False)) if x != y)
        assert 50 < head < len(after) - 100
        assert int(headers.get("x-kvtether-reuse-tokens") or 0) <= head, (headers, head)
        assert got["usage"]["input_tokens_details"]["cached_tokens"] <= head


async def test_conversations_prompt_cache_key_and_codex_headers_name_sessions() -> None:
    async with rig() as r:
        base = {"model": MODEL, "max_output_tokens": 20, "input": "hello " + tool_result("s", 10)}
        for turn in range(2):
            got, _ = await send(r, {**base, "conversation": "conv_1", "input": f"turn {turn}"})
            assert got["conversation"] == {"id": "conv_1"}
        await send(r, {**base, "prompt_cache_key": "pck-1"})
        chat = await r.client.post(f"{r.url}/v1/chat/completions", json={
            "model": MODEL, "max_tokens": 5, "prompt_cache_key": "pck-1",
            "messages": [{"role": "user", "content": "a chat turn of the same session"}]})
        assert chat.status_code == 200
        await send(r, base, {"x-codex-turn-metadata": json.dumps({"thread_id": "meta-thread"})})
        await send(r, base, {"thread-id": "codex-t", "session-id": "codex-s"})
        await send(r, base, {"x-session-id": "explicit", "thread-id": "codex-t2"})
        sessions = {s["session_id"]: s["turns"] for s in (await r.client.get(f"{r.url}/admin/sessions")).json()}
        assert sessions == {"conv-conv_1": 2, "pck-1": 2, "meta-thread": 1, "codex-t": 1, "explicit": 1}
        # A conversation's second turn saw its first: the stored messages were prepended.
        conv = await r.gw.responses.get(None, "conv", "conv_1")
        assert [m["role"] for m in conv["messages"]] == ["user", "assistant", "user", "assistant"]


async def test_errors_come_in_openais_shape_and_tenants_do_not_share_state() -> None:
    keys = {"key-responses-a": "team-a", "key-responses-b": "team-b"}
    async with rig(api_keys=keys) as r:
        a, b = {"authorization": "Bearer key-responses-a"}, {"authorization": "Bearer key-responses-b"}
        body = {"model": MODEL, "input": "hi", "max_output_tokens": 10}
        assert (await r.client.post(f"{r.url}/v1/responses", json=body)).status_code == 401
        got, _ = await send(r, body, a)
        assert (await r.client.get(f"{r.url}/v1/responses/{got['id']}", headers=a)).status_code == 200
        assert (await r.client.get(f"{r.url}/v1/responses/{got['id']}", headers=b)).status_code == 404
        chained = await r.client.post(f"{r.url}/v1/responses", json={**body, "previous_response_id": got["id"]},
                                      headers=b)
        assert chained.status_code == 404
        cases = [
            # Hosted tools are dropped by default (tests/gateway/api/test_hosted_tools.py); a tool_choice naming one
            # is still refused.
            ({**body, "tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}}, 400, "web_search"),
            ({**body, "kv_transfer_params": {"do_remote_prefill": True}}, 400, "kv_transfer_params"),
            ({**body, "background": True}, 400, "background"),
            ({**body, "input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAAAB-openai"}]}, 400,
             "encrypted_content"),
            ({**body, "previous_response_id": "resp_nope"}, 404, "resp_nope"),
            ({**body, "model": "gpt-5"}, 404, "gpt-5"),
            ({**body, "previous_response_id": got["id"], "conversation": "c"}, 400, "conversation"),
            ({**body, "input": 3}, 400, "input"),
            ({**body, "input": [{"role": "user", "content": "x"}] * 100_000}, 400, "input"),
        ]
        for case, status, word in cases:
            resp = await r.client.post(f"{r.url}/v1/responses", json=case, headers=a)
            err = resp.json()["error"]
            assert resp.status_code == status and word in err["message"] and err["type"], (case, resp.text)
        not_json = await r.client.post(f"{r.url}/v1/responses", content=b"{", headers=a)
        assert not_json.status_code == 400 and "error" in not_json.json()
        cancel = await r.client.post(f"{r.url}/v1/responses/{got['id']}/cancel", headers=a)
        assert cancel.status_code == 400
        # Codex's WebSocket transport: 426 sends it to HTTP at once.
        upgrade = await r.client.get(f"{r.url}/v1/responses", headers={
            **a, "connection": "Upgrade", "upgrade": "websocket", "sec-websocket-version": "13",
            "sec-websocket-key": "dGhlIHNhbXBsZSBub25jZQ=="})
        assert upgrade.status_code == 426 and "HTTP" in upgrade.json()["error"]["message"]
        assert await metric(r.client, r.url, "kvtether_requests_total", route="responses", status="4xx") >= 10
        # Nothing any refusal touched became a session.
        assert len((await r.client.get(f"{r.url}/admin/sessions", headers=a)).json()) <= 1


@pytest.mark.wall_clock  # the openai client looks up its platform in a worker thread
async def test_the_openai_sdk_and_the_incomplete_status() -> None:
    import openai

    async with rig() as r:
        client = openai.AsyncOpenAI(base_url=f"{r.url}/v1", api_key="none", http_client=r.client)
        done = await client.responses.create(model=MODEL, input="Say something " + tool_result("sdk", 10),
                                             max_output_tokens=40)
        assert done.output_text and done.status in ("completed", "incomplete")
        again = await client.responses.retrieve(done.id)
        assert again.id == done.id and again.output_text == done.output_text
        cut = await client.responses.create(model=MODEL, input="Talk a lot", max_output_tokens=2, stream=True)
        kinds = [event.type async for event in cut]
        assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete", kinds
