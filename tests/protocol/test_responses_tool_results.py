"""A Responses tool result without a ``call_id`` (the spec makes it optional; Codex sends its goal tools' results
so): lowered to a ``tool`` message answering the call it belongs to, or with a deterministic id of its own, the same
on every turn that resends it, so the history a decode node holds still renders to the same tokens."""

from __future__ import annotations

from typing import Any

from kvtether.protocol import responses as R
from kvtether.protocol.responses.request import tool_result_id

from tests.support.responses_bodies import SEAL

GOAL_CALL = {"type": "function_call", "id": "fc_1", "call_id": "call_goal", "name": "goal_objective",
             "namespace": "agent", "arguments": "{}"}
USER = {"type": "message", "role": "user", "content": "Set a goal."}


def goal_result(n: int, **extra: Any) -> dict[str, Any]:
    return {"type": "function_call_output", "id": f"fco_{n}", "name": "goal_objective", "namespace": "agent",
            "output": f"goal {n}", **extra}


def lowered(items: list[dict[str, Any]], history: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    return R.to_chat({"model": "m", "input": items}, seal=SEAL, history=history or [])["messages"]


def test_a_result_without_call_id_answers_the_unanswered_call_of_its_tool() -> None:
    messages = lowered([USER, GOAL_CALL, goal_result(0)])
    assert messages[-1] == {"role": "tool", "content": "goal 0", "tool_call_id": "call_goal"}
    # Two calls of the tool in one answer: the results answer them in order.
    second = {**GOAL_CALL, "call_id": "call_goal_2"}
    messages = lowered([USER, GOAL_CALL, second, goal_result(0), goal_result(1)])
    assert [m["tool_call_id"] for m in messages[-2:]] == ["call_goal", "call_goal_2"]
    # A chain: the call is in the stored history, the result in the new input.
    history = lowered([USER, GOAL_CALL])
    assert lowered([goal_result(0)], history)[-1]["tool_call_id"] == "call_goal"


def test_a_result_no_call_waits_for_gets_a_stable_id_of_its_own() -> None:
    answered = [USER, GOAL_CALL, {"type": "function_call_output", "call_id": "call_goal", "output": "set"}]
    own = lowered([*answered, goal_result(0)])[-1]["tool_call_id"]
    assert own.startswith("call_") and len(own) == 29 and own[5:].isalnum()
    assert own != lowered([*answered, goal_result(1)])[-1]["tool_call_id"]
    # Without an id of its own: from its content and place, so two equal results differ.
    bare = {k: v for k, v in goal_result(0).items() if k != "id"}
    a, b = [m["tool_call_id"] for m in lowered([USER, bare, bare])[-2:]]
    assert a != b and a.startswith("call_")
    assert tool_result_id(bare, lowered([USER])) == tool_result_id(dict(bare), lowered([USER]))
    # Another tool's call is not paired with it.
    other = {**GOAL_CALL, "name": "goal_status"}
    assert lowered([USER, other, goal_result(0)])[-1]["tool_call_id"] != "call_goal"


def test_every_turn_lowers_the_earlier_items_to_the_same_messages() -> None:
    """Turn after turn the client appends items; what the earlier items lowered to never changes (a later
    result answering the call does not move an earlier pairing), so the prompt extends the one before it."""
    turns = [[USER, GOAL_CALL, goal_result(0)],
             [{"type": "function_call_output", "call_id": "call_goal", "output": "set"}, goal_result(1)],
             [{"type": "message", "role": "assistant", "content": "Done."}, USER, goal_result(2)],
             [{**GOAL_CALL, "call_id": "call_goal_3"}, goal_result(3), goal_result(4)]]
    items: list[dict[str, Any]] = []
    before: list[dict[str, Any]] = []
    for new in turns:
        items += new
        messages = lowered(items)
        assert messages[:len(before)] == before
        before = messages
    ids = [m["tool_call_id"] for m in before if m["role"] == "tool"]
    assert ids[:2] == ["call_goal", "call_goal"] and ids[-2] == "call_goal_3" and len(set(ids[2:])) == len(ids) - 2


def test_a_custom_tool_result_still_needs_its_call_id_and_says_so() -> None:
    try:
        lowered([USER, {"type": "custom_tool_call_output", "output": "x"}])
    except R.ResponsesError as e:
        assert e.status == 400 and e.param == "input[1].call_id" and "custom_tool_call it answers" in e.message
    else:
        raise AssertionError("refused")
