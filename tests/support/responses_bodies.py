"""OpenAI Responses bodies the protocol tests share: a request shaped like Codex's (with its reasoning seal and
tool schema), a chat stream's chunk, and Hypothesis's chat answers."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st
from kvtether.protocol.responses import ReasoningSeal

SEAL = ReasoningSeal(b"k" * 32)
SCHEMA = {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}


def codex_like_request() -> dict[str, Any]:
    """Shaped like Codex 0.171's second request (captured): developer messages, input_text parts, a reasoning
    item handed back with the gateway's encrypted_content, an answer, a namespaced call and a custom (freeform)
    call with their outputs, function/namespace/custom tools, store false, reasoning effort."""
    return {
        "model": "m", "stream": True, "store": False, "include": ["reasoning.encrypted_content"],
        "instructions": "You are a coding agent.",
        "reasoning": {"effort": "high", "summary": "auto"}, "parallel_tool_calls": True, "tool_choice": "auto",
        "prompt_cache_key": "thread-1", "client_metadata": {"session_id": "thread-1"},
        "tools": [
            {"type": "function", "name": "exec_command", "description": "Run a command", "strict": False,
             "parameters": SCHEMA},
            {"type": "namespace", "name": "agents", "description": "Sub-agents",
             "tools": [{"type": "function", "name": "spawn", "description": "Spawn one", "parameters": SCHEMA}]},
            {"type": "custom", "name": "apply_patch", "description": "Apply a patch",
             "format": {"type": "text"}},
        ],
        "input": [
            {"type": "message", "id": "msg_a", "role": "developer",
             "content": [{"type": "input_text", "text": "Sandbox: read-only."}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "<env/>"},
                                                            {"type": "input_text", "text": "Read README."}]},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": None,
             "encrypted_content": SEAL.seal("I should read it.")},
            {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
             "content": [{"type": "output_text", "text": "Reading.", "annotations": []}]},
            {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "exec_command",
             "arguments": "{\"cmd\":\"cat README\"}"},
            {"type": "function_call", "id": "fc_2", "call_id": "call_2", "name": "spawn", "namespace": "agents",
             "arguments": "{\"cmd\":\"x\"}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "hello"},
            {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "ok"}]},
            {"type": "custom_tool_call", "call_id": "call_3", "name": "apply_patch", "input": "*** Begin Patch é"},
            {"type": "custom_tool_call_output", "call_id": "call_3", "output": "done"},
            {"type": "message", "role": "user", "content": "Now summarise."},
        ],
    }


def chat_chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"id": "chatcmpl-s", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


_text = st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=20)


@st.composite
def chat_answers(draw: st.DrawFn) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant"}
    if draw(st.booleans()):
        message["reasoning"] = draw(_text.filter(bool))
    if draw(st.booleans()):
        message["content"] = draw(_text.filter(bool))
    calls = draw(st.lists(st.tuples(st.sampled_from(["exec_command", "agents__spawn", "apply_patch"]), _text),
                          max_size=3))
    if calls:
        message["tool_calls"] = [
            {"id": f"call_{i}", "type": "function", "function": {
                "name": name, "arguments": json.dumps({"input": arg}, ensure_ascii=False) if name == "apply_patch"
                else json.dumps({"cmd": arg})}} for i, (name, arg) in enumerate(calls)]
    return {"id": "chatcmpl-h", "choices": [{"index": 0, "finish_reason": "stop", "message": message}]}
