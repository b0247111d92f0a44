"""The specs are the reference: the installed ``openai`` package's Responses types and the installed ``anthropic``
package's Messages types, walked, against what the translations know. Every input item type, content part, tool
type and field they define is lowered or refused on purpose (a release that adds one fails here until it is
placed), and requests Hypothesis builds from those types are lowered or answered with a 400 that names the piece
— never another exception (the gateway would answer 500), never a bare complaint about a field the spec allows."""

from __future__ import annotations

from typing import Any

import pytest
from anthropic.types import (
    content_block_param,
    message_create_params,
    message_param,
    tool_result_block_param,
    tool_union_param,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvtether.protocol import messages as M
from kvtether.protocol import responses as R
from kvtether.protocol.messages import request as MR
from kvtether.protocol.responses import items as I
from kvtether.protocol.responses import request as RR
from openai.types.responses import (
    namespace_tool_param,
    response_create_params,
    response_custom_tool_call_output_param,
    response_function_call_output_item_param,
    response_input_item_param,
    response_input_message_content_list_param,
    response_output_message_param,
    tool_param,
)

from tests.support import spec_types as S
from tests.support.responses_bodies import SEAL

ITEMS = response_input_item_param.ResponseInputItemParam
PARTS = (response_input_message_content_list_param.ResponseInputContentParam,
         response_function_call_output_item_param.ResponseFunctionCallOutputItemParam,
         response_custom_tool_call_output_param.OutputOutputContentList)
TOOLS = tool_param.ToolParam
BLOCKS = content_block_param.ContentBlockParam
# Block types vLLM's Messages request takes beyond the spec's (a beta's tool references and tool list changes).
VLLM_ONLY_BLOCKS = {"tool_reference", "tool_addition", "tool_removal"}
USER = {"type": "message", "role": "user", "content": "hi"}
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _item_type(member: Any) -> str:
    return (S.type_literals(member) or ("item_reference",))[0]  # an item_reference's type is optional


# --- Responses: the sets --------------------------------------------------------------------------------------


def test_every_responses_input_item_type_is_lowered_left_out_or_refused() -> None:
    spec = S.union_types(ITEMS)
    known = [set(I.LOWERED_ITEMS), set(I.BOOKKEEPING_ITEMS), set(I.REFUSED_ITEMS)]
    assert set.union(*known) == spec, (spec - set.union(*known), set.union(*known) - spec)
    assert sum(map(len, known)) == len(spec)  # each in one place


def test_every_responses_content_part_is_lowered_or_refused() -> None:
    spec = set().union(*(S.union_types(u) for u in PARTS))
    assert spec == set(I.LOWERED_PARTS) | set(I.REFUSED_PARTS)
    assert S.union_types(response_output_message_param.Content) == set(I.ASSISTANT_PARTS)


def test_every_responses_tool_type_is_lowered_or_hosted() -> None:
    spec = S.union_types(TOOLS)
    assert set(I.LOWERED_TOOLS) <= spec
    assert {kind for kind in spec - set(I.LOWERED_TOOLS) if not R.is_hosted_tool(kind)} == set()
    assert not any(R.is_hosted_tool(kind) for kind in I.LOWERED_TOOLS)
    assert S.union_types(namespace_tool_param.Tool) == {"function", "custom"}


def test_every_field_of_a_lowered_responses_item_or_tool_is_read_or_known_to_render_nothing() -> None:
    unplaced = {}
    for member in [*S.members(ITEMS), *(m for u in PARTS for m in S.members(u)),
                   *S.members(response_output_message_param.Content)]:
        kind = _item_type(member)
        if kind in I.READ_FIELDS:
            extra = S.fields(member) - I.READ_FIELDS[kind] - set(I.UNRENDERED_FIELDS)
            if extra:
                unplaced[member.__name__] = extra
    for member in [*S.members(TOOLS), *S.members(namespace_tool_param.Tool)]:
        kind = f"tool:{_item_type(member)}"
        if kind in I.READ_FIELDS:
            extra = S.fields(member) - I.READ_FIELDS[kind] - set(I.UNRENDERED_FIELDS)
            if extra:
                unplaced[member.__name__] = extra
    assert unplaced == {}


def test_every_responses_request_field_is_honoured_ignored_or_refused() -> None:
    spec = S.fields(response_create_params.ResponseCreateParamsBase) | {"stream"}
    known = set(RR.HONOURED_FIELDS) | set(RR.IGNORED_FIELDS) | set(RR.UNSERVED_FIELDS)
    assert spec - known == set()


# --- Responses: requests built from the types -----------------------------------------------------------------


def _responses_outcome(body: dict[str, Any], **kw: Any) -> Any:
    try:
        return R.translate(body, seal=SEAL, **kw)
    except R.ResponsesError as e:
        assert e.status == 400 and e.param and e.message, e
        return e


@FAST
@given(item=st.one_of([S.of(m) for m in S.members(ITEMS)]), bookkeeping=st.sampled_from(I.BOOKKEEPING_CHOICES))
def test_any_input_item_the_spec_allows_is_lowered_or_refused_by_name(item: dict[str, Any],
                                                                      bookkeeping: I.BookkeepingItems) -> None:
    got = _responses_outcome({"model": "m", "input": [USER, item]}, hosted_tools="drop", bookkeeping=bookkeeping)
    kind = item.get("type") or "item_reference"
    if kind in I.REFUSED_ITEMS:
        assert isinstance(got, R.ResponsesError) and f"`{kind}`" in got.message and got.param == "input[1]"
    elif kind in I.BOOKKEEPING_ITEMS:
        if bookkeeping == "drop":
            assert not isinstance(got, R.ResponsesError) and got.left_out == (kind,)
            assert got.chat["messages"] == [{"role": "user", "content": "hi"}]
        else:
            assert isinstance(got, R.ResponsesError) and f"`{kind}`" in got.message and "bookkeeping" in got.message
    elif isinstance(got, R.ResponsesError):
        # A lowered type refused for a value the spec's types allow but the chat path cannot take (an empty
        # name, a file part): the error names the piece, and never the bare complaint this work removed.
        assert got.param.startswith("input[1]") and got.message != "input[1].call_id must be a string"
    else:
        assert got.left_out == () and len(got.chat["messages"]) >= 1


@FAST
@given(tool=st.one_of([S.of(m) for m in S.members(TOOLS)]), hosted=st.sampled_from(("drop", "refuse")))
def test_any_tool_the_spec_allows_is_lowered_dropped_or_refused_by_name(tool: dict[str, Any], hosted: Any) -> None:
    got = _responses_outcome({"model": "m", "input": "hi", "tools": [tool]}, hosted_tools=hosted)
    kind = tool["type"]
    if R.is_hosted_tool(kind) and hosted == "drop":
        assert not isinstance(got, R.ResponsesError) and got.dropped == (kind,)
    elif R.is_hosted_tool(kind):
        assert isinstance(got, R.ResponsesError) and f"`{kind}`" in got.message
    elif isinstance(got, R.ResponsesError):
        assert got.param.startswith("tools[0]")


def test_a_namespace_serves_its_custom_tools_as_custom_tools() -> None:
    tools = [{"type": "namespace", "name": "ns", "description": "d",
              "tools": [{"type": "custom", "name": "patch"}, {"type": "function", "name": "f", "parameters": None}]}]
    chat = R.to_chat({"model": "m", "input": [USER, {"type": "custom_tool_call", "call_id": "c", "name": "patch",
                                                       "namespace": "ns", "input": "x"}], "tools": tools}, seal=SEAL)
    assert [t["function"]["name"] for t in chat["tools"]] == ["ns__patch", "ns__f"]
    assert chat["messages"][1]["tool_calls"][0]["function"] == {"name": "ns__patch", "arguments": "{\"input\": \"x\"}"}
    answer = {"id": "x", "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                             "function": {"name": "ns__patch", "arguments": "{\"input\": \"y\"}"}}]}}]}
    [call] = R.from_chat(answer, R.skeleton({"model": "m"}, "resp_1", 0.0), tools=tools, seal=None)["output"]
    assert (call["type"], call["name"], call["namespace"], call["input"]) == ("custom_tool_call", "patch", "ns", "y")


# --- Messages -------------------------------------------------------------------------------------------------


def test_every_messages_content_block_type_is_lowered_or_refused() -> None:
    spec = S.union_types(BLOCKS)
    lowered = set(MR.BLOCK_TYPES) - VLLM_ONLY_BLOCKS
    assert spec == lowered | set(MR.REFUSED_BLOCKS), (spec - lowered - set(MR.REFUSED_BLOCKS))
    assert not lowered & set(MR.REFUSED_BLOCKS)
    inner = S.union_types(tool_result_block_param.Content)
    assert inner == set(MR.TOOL_RESULT_BLOCKS) | set(MR.REFUSED_TOOL_RESULT_BLOCKS)


def test_every_messages_tool_type_is_custom_or_anthropic_defined() -> None:
    spec = S.union_types(tool_union_param.ToolUnionParam)
    assert "custom" in spec
    assert {kind for kind in spec - {"custom"} if not M.is_anthropic_defined({"type": kind})} == set()


def test_every_messages_role_and_request_field_is_known() -> None:
    roles = {r for m in S.members(message_param.MessageParam) for r in S.literals(S.hints(m)["role"])}
    assert roles == {"user", "assistant", "system"}
    spec = S.fields(message_create_params.MessageCreateParamsBase) | {"stream"}
    assert spec - set(MR.HONOURED_FIELDS) - set(MR.IGNORED_FIELDS) - {"mcp_servers"} == set()


def _messages_outcome(body: dict[str, Any]) -> Any:
    try:
        return M.translate(body, hosted_tools="drop")
    except M.MessagesError as e:
        assert e.status == 400 and e.message, e
        return e


@FAST
@given(block=S.value(BLOCKS), role=st.sampled_from(("user", "assistant")))
def test_any_content_block_the_spec_allows_is_lowered_or_refused_by_name(block: dict[str, Any], role: str) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": role, "content": [block]}]
    got = _messages_outcome({"model": "m", "max_tokens": 10, "messages": messages})
    kind = block["type"]
    if kind in MR.REFUSED_BLOCKS:
        assert isinstance(got, M.MessagesError) and kind in got.message and "messages[1].content[0]" in got.message
    elif isinstance(got, M.MessagesError):
        assert "messages[1].content[0]" in got.message


@FAST
@given(tool=S.value(tool_union_param.ToolUnionParam))
def test_any_tool_the_messages_spec_allows_is_lowered_or_dropped(tool: dict[str, Any]) -> None:
    got = _messages_outcome({"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}],
                             "tools": [tool]})
    if M.is_anthropic_defined(tool):
        assert not isinstance(got, M.MessagesError) and got.dropped == (tool["type"],)
    elif isinstance(got, M.MessagesError):
        assert "tools[0]" in got.message


@pytest.mark.parametrize("kind", sorted(MR.REFUSED_TOOL_RESULT_BLOCKS))
def test_a_tool_result_block_nothing_lowers_is_refused_by_name(kind: str) -> None:
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                              "content": [{"type": kind}]}]}]
    with pytest.raises(M.MessagesError) as err:
        M.translate({"model": "m", "max_tokens": 10, "messages": messages})
    assert kind in err.value.message and "messages[2].content[0].content[0]" in err.value.message


@pytest.mark.parametrize("kind", sorted(MR.REFUSED_TOOL_RESULT_BLOCKS))
def test_a_tool_result_block_no_model_reads_is_left_out_when_asked_and_the_rest_kept(kind: str) -> None:
    """Claude Code's read of a PDF comes back as a document block in a tool result, and the client resends it on
    every later turn: left out (as vLLM's own translation leaves it out), the turn and the session go on."""
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                              "content": [{"type": "text", "text": "page one"}, {"type": kind}]}]}]
    body = {"model": "m", "max_tokens": 10, "messages": messages}
    got = M.translate(body, unreadable_results="drop")
    assert got.left_out == (kind,)
    assert {"role": "tool", "tool_call_id": "t", "content": "page one"} in got.chat["messages"]
    # The same turn resent lowers the same way (its tokens stay stable, so reuse survives).
    assert M.translate(body, unreadable_results="drop") == got
    assert messages[2]["content"][0]["content"][1] == {"type": kind}  # the client's body is not changed
