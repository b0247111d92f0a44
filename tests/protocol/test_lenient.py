"""The lenient translations (``translate(..., lenient=True)``) and the answers read back in chat terms
(``chat_answer``, ``chat_finish_reason``): what the SDK writes for a Responses or Messages turn some server already
took. A request the gateway serves becomes exactly the chat turn the gateway sends; what the gateway refuses is
left out piece by piece, never raised; and an answer read back is the assistant message the next request
carries, so a recorded session writes only each turn's new messages."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvtether.protocol import messages as M
from kvtether.protocol import responses as R
from kvtether.protocol.contract import canonical_message

from tests.support.messages_bodies import READ_SCHEMA, WEB_SEARCH, claude_code_request
from tests.support.responses_bodies import SCHEMA, SEAL, chat_answers, chat_chunk, codex_like_request

# ---- Responses ------------------------------------------------------------------------------------------------


def test_a_request_the_gateway_serves_is_the_chat_turn_it_sends() -> None:
    """Codex's request, its reasoning in the gateway's seal: read without the key, the same turn."""
    body = codex_like_request()
    gateway = R.translate(body, seal=SEAL, hosted_tools="drop")
    assert R.translate(body, lenient=True) == gateway
    body["tools"].append({"type": "web_search", "search_context_size": "low"})
    assert R.translate(body, lenient=True) == R.translate(body, seal=SEAL, hosted_tools="drop")


def test_a_responses_request_loses_only_what_the_gateway_refuses() -> None:
    body: dict[str, Any] = {
        "model": "m", "background": True, "truncation": "auto", "kv_transfer_params": {"do_remote_decode": True},
        "max_output_tokens": 0, "stream": "yes", "text": {"format": {"type": "xml"}},
        "tools": [{"type": "web_search"}, {"type": "function", "name": "f", "parameters": SCHEMA},
                  {"type": "custom", "name": "g", "format": {"type": "grammar", "syntax": "lark", "definition": "x"}},
                  {"type": "function", "name": ""}],
        "tool_choice": {"type": "web_search"},
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Read this."},
                                                            {"type": "input_file", "file_id": "file_1"}]},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "read it"}],
             "encrypted_content": "gAAAA-openai"},
            {"type": "web_search_call", "id": "ws_1", "status": "completed"},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "f", "arguments": {}},
            {"type": "item_reference", "id": "msg_0"},
            {"type": "function_call_output", "call_id": "c1", "output": "done"},
            {"type": "message", "role": "tool", "content": "?"},
            7,
        ],
    }
    t = R.translate(body, lenient=True)
    assert t.dropped == ("web_search",)
    assert t.chat == {
        "model": "m",
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Read this."}]},
            {"role": "assistant", "reasoning": "read it", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "content": "done", "tool_call_id": "c1"},
        ],
        "tools": [{"type": "function", "function": {"name": "f", "description": None, "parameters": SCHEMA}}],
    }


@pytest.mark.parametrize("body", [
    {},
    {"input": 7, "instructions": ["x"], "tools": "all", "reasoning": "high", "chat_template_kwargs": 1},
    {"model": "m", "input": [], "tools": [{"type": "namespace"}], "tool_choice": {"type": "function"}},
])
def test_a_responses_request_with_nothing_servable_is_an_empty_turn(body: dict[str, Any]) -> None:
    chat = R.translate(body, lenient=True).chat
    assert chat["messages"] == [] and "tools" not in chat and "tool_choice" not in chat


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 3) | st.text(max_size=4),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                  max_size=3), max_leaves=6)


def _shaped(fields: dict[str, Any]) -> Any:
    """Dicts with the API's own keys (and values of any JSON shape), so the fuzz reaches past the first check."""
    return st.fixed_dictionaries({}, optional={k: v | _JSON for k, v in fields.items()})


_RESPONSES_ITEM = _shaped({"type": st.sampled_from(["message", "reasoning", "function_call", "custom_tool_call",
                                                     "function_call_output", "web_search_call"]),
                           "role": st.sampled_from(["user", "assistant", "developer", "tool"]),
                           "content": st.lists(_shaped({"type": st.sampled_from(["input_text", "input_image"]),
                                                        "text": st.text(max_size=4)}), max_size=2),
                           "call_id": st.text(max_size=3), "name": st.text(max_size=3),
                           "arguments": st.text(max_size=3), "encrypted_content": st.just(SEAL.seal("r")),
                           "summary": _JSON, "output": _JSON, "input": _JSON, "namespace": _JSON, "status": _JSON})
_RESPONSES_BODY = _shaped({"model": st.just("m"), "input": st.lists(_RESPONSES_ITEM, max_size=4),
                           "instructions": st.text(max_size=3),
                           "tools": st.lists(_shaped({"type": st.sampled_from(["function", "custom", "namespace",
                                                                               "web_search"]),
                                                      "name": st.text(max_size=3), "parameters": _JSON,
                                                      "tools": _JSON, "format": _JSON}), max_size=3),
                           "tool_choice": _JSON, "reasoning": _shaped({"effort": _JSON}),
                           "chat_template_kwargs": _JSON, "text": _JSON, "max_output_tokens": _JSON,
                           "stream": _JSON, "include": st.lists(st.text(max_size=3), max_size=2),
                           "top_logprobs": _JSON})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_RESPONSES_BODY)
def test_a_lenient_responses_translation_refuses_nothing(body: dict[str, Any]) -> None:
    chat = R.translate(body, lenient=True).chat
    assert isinstance(chat["messages"], list)
    json.dumps(chat)


def test_a_response_reads_back_as_the_message_its_next_request_carries() -> None:
    body = codex_like_request()
    chat = {"id": "chatcmpl-1", "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "reasoning": "think", "content": "Patching.", "tool_calls": [
            {"id": "call_9", "type": "function", "function": {"name": "apply_patch",
                                                              "arguments": "{\"input\": \"*** x\"}"}}]}}]}
    response = R.from_chat(chat, R.skeleton(body, "r", 0.0), tools=body["tools"], seal=SEAL)
    answer = R.chat_answer(response["output"])
    assert answer == chat["choices"][0]["message"]
    following = {**body, "input": [*body["input"], *response["output"],
                                   {"type": "custom_tool_call_output", "call_id": "call_9", "output": "ok"}]}
    sent = R.translate(following, lenient=True).chat["messages"]
    before = R.translate(body, lenient=True).chat["messages"]
    assert canonical_message(sent[len(before)]) == canonical_message(answer)
    assert R.chat_finish_reason(response) == "tool_calls"


@settings(max_examples=100, deadline=None)
@given(chat_answers())
def test_every_answer_reads_back_whole_and_streamed(chat: dict[str, Any]) -> None:
    body = codex_like_request()
    message = chat["choices"][0]["message"]
    expected = {"content": None, **message}
    whole = R.from_chat(chat, R.skeleton(body, "r", 0.0), tools=body["tools"], seal=None)
    assert R.chat_answer(whole["output"]) == expected
    t = R.StreamTranslator(R.skeleton(body, "r", 0.0), tools=body["tools"], seal=None)
    for key in ("reasoning", "content"):
        if key in message:
            t.feed(chat_chunk({key: message[key]}))
    for i, call in enumerate(message.get("tool_calls") or ()):
        t.feed(chat_chunk({"tool_calls": [{"index": i, **call}]}))
    t.close()
    assert t.final is not None and R.chat_answer(t.final["output"]) == expected


def test_output_that_vllm_would_not_merge_reads_back_as_one_message() -> None:
    output = [{"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "a"}]},
              {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
              {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "b"}]},
              {"type": "web_search_call", "id": "ws"},
              {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "done"}]}]
    assert R.chat_answer(output) == {"role": "assistant", "reasoning": "ab", "content": "done", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    assert R.chat_answer([]) == {"role": "assistant", "content": None}


@pytest.mark.parametrize(("response", "reason"), [
    ({"status": "completed", "output": [{"type": "message"}]}, "stop"),
    ({"status": "completed", "output": [{"type": "message"}, {"type": "function_call"}]}, "tool_calls"),
    ({"status": "completed", "output": [{"type": "custom_tool_call"}]}, "tool_calls"),
    ({"status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"}}, "length"),
    ({"status": "incomplete", "incomplete_details": {"reason": "content_filter"}}, "incomplete"),
    ({"status": "failed"}, "failed"),
    ({}, None),
])
def test_a_responses_end_in_chat_terms(response: dict[str, Any], reason: str | None) -> None:
    assert R.chat_finish_reason(response) == reason


# ---- Messages -------------------------------------------------------------------------------------------------


def test_a_messages_request_the_gateway_serves_is_the_chat_turn_it_sends() -> None:
    body = claude_code_request()
    assert M.translate(body, lenient=True) == M.translate(body, hosted_tools="drop")
    body["tools"].append(WEB_SEARCH)
    assert M.translate(body, lenient=True) == M.translate(body, hosted_tools="drop")


def test_a_messages_request_loses_only_what_the_gateway_refuses() -> None:
    body: dict[str, Any] = {
        "model": "m", "mcp_servers": [{"type": "url", "url": "https://mcp.example", "name": "x"}],
        "kv_transfer_params": {}, "temperature": "hot", "top_p": 0.5, "stream": "yes",
        "thinking": {"type": "enabled", "budget_tokens": 10}, "output_config": {"effort": "extreme"},
        "tools": [{"name": "Read", "input_schema": READ_SCHEMA}, {"name": "Bad"}, WEB_SEARCH],
        "tool_choice": {"type": "tool", "name": "Write"},
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Read it."},
                                         {"type": "document", "source": {"type": "text", "data": "x"}},
                                         {"type": "tool_use", "id": "t0", "name": "Read", "input": {}}]},
            {"role": "assistant", "content": [{"type": "server_tool_use", "id": "s1", "name": "web_search"},
                                              {"type": "tool_use", "id": "t1", "name": "Read", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"},
                                         {"type": "tool_result", "content": "no id"}]},
            {"role": "tool", "content": "?"},
            {"role": "system", "content": [{"type": "tool_removal",
                                            "tool": {"type": "tool_reference", "name": "Undeclared"}}]},
        ],
    }
    t = M.translate(body, lenient=True)
    assert t.dropped == ("web_search_20250305",)
    assert t.chat == {
        "model": "m",
        "messages": [
            {"role": "user", "content": "Read it."},
            {"role": "assistant", "tool_calls": [
                {"id": "t1", "type": "function", "function": {"name": "Read", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "t1", "content": "ok"},
        ],
        "top_p": 0.5,
        "stream": False,
        "parallel_tool_calls": True,
        "tools": [{"type": "function", "function": {"name": "Read", "description": None,
                                                    "parameters": READ_SCHEMA}}],
        "tool_choice": "auto",
    }


@pytest.mark.parametrize("body", [
    {},
    {"messages": "hi", "system": 5, "tools": "all", "tool_choice": "any", "max_tokens": 0, "top_k": 1.5},
    {"model": "m", "messages": [], "chat_template_kwargs": 1, "stop_sequences": "###", "cache_salt": ""},
])
def test_a_messages_request_with_nothing_servable_is_an_empty_turn(body: dict[str, Any]) -> None:
    chat = M.translate(body, lenient=True).chat
    assert chat["messages"] == [] and "tools" not in chat and "max_tokens" not in chat


_BLOCK = _shaped({"type": st.sampled_from(["text", "image", "thinking", "tool_use", "tool_result", "document",
                                           "tool_addition", "tool_removal", "redacted_thinking"]),
                  "text": st.text(max_size=4), "thinking": st.text(max_size=4), "id": st.text(max_size=3),
                  "name": st.text(max_size=3), "input": _JSON, "tool_use_id": st.text(max_size=3),
                  "content": _JSON, "source": _JSON, "tool": _JSON, "is_error": _JSON})
_MESSAGES_BODY = _shaped({"model": st.just("m"), "max_tokens": _JSON,
                          "messages": st.lists(_shaped({"role": st.sampled_from(["user", "assistant", "system"]),
                                                        "content": st.text(max_size=3) | st.lists(_BLOCK,
                                                                                                 max_size=3)}),
                                               max_size=4),
                          "system": _JSON, "tools": st.lists(_shaped({"name": st.text(max_size=3),
                                                                      "input_schema": _JSON, "type": _JSON}),
                                                             max_size=3),
                          "tool_choice": _shaped({"type": st.sampled_from(["auto", "any", "tool", "none"]),
                                                  "name": st.text(max_size=3)}),
                          "thinking": _JSON, "output_config": _JSON, "stream": _JSON, "temperature": _JSON,
                          "stop_sequences": _JSON, "chat_template_kwargs": _JSON})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_MESSAGES_BODY)
def test_a_lenient_messages_translation_refuses_nothing(body: dict[str, Any]) -> None:
    chat = M.translate(body, lenient=True).chat
    assert isinstance(chat["messages"], list)
    json.dumps(chat)


def test_an_answer_reads_back_as_the_message_its_next_request_carries() -> None:
    chat = {"id": "chatcmpl-1", "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "reasoning": "think", "content": "Reading.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "Read",
                                                               "arguments": "{\"file_path\": \"a\"}"}}]}}]}
    answer = M.from_chat(chat, "m")
    read_back = M.chat_answer(answer["content"])
    assert read_back == chat["choices"][0]["message"]
    history = [{"role": "user", "content": "Read a."}, {"role": "assistant", "content": answer["content"]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"}]}]
    sent = M.translate({"model": "m", "max_tokens": 8, "messages": history}, lenient=True).chat["messages"]
    assert canonical_message(sent[1]) == canonical_message(read_back)
    assert M.chat_finish_reason(answer["stop_reason"]) == "tool_calls"
    # An empty answer is one empty text block, which the next request leaves out: no text.
    empty = M.from_chat({"choices": [{"message": {"role": "assistant", "content": ""}, "finish_reason": "stop"}]},
                        "m")
    assert M.chat_answer(empty["content"]) == {"role": "assistant", "content": None}


def test_answer_blocks_with_no_chat_form_are_left_out() -> None:
    blocks = [{"type": "thinking", "thinking": "a", "signature": "s"}, {"type": "redacted_thinking", "data": "x"},
              {"type": "server_tool_use", "id": "s", "name": "web_search", "input": {}},
              {"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    assert M.chat_answer(blocks) == {"role": "assistant", "reasoning": "a", "content": [
        {"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}


@pytest.mark.parametrize(("stop_reason", "reason"), [
    ("end_turn", "stop"), ("stop_sequence", "stop"), ("tool_use", "tool_calls"), ("max_tokens", "length"),
    ("pause_turn", "pause_turn"), (None, None),
])
def test_a_messages_end_in_chat_terms(stop_reason: str | None, reason: str | None) -> None:
    assert M.chat_finish_reason(stop_reason) == reason
