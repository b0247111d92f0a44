"""protocol/tokens.py: one rule for which events carry a token and which ends the generation, and the SDK, the CLI's
streaming client and the gateway's relay all measure TTFT by it (tool-call and reasoning turns included)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
from kvtether.cli.streaming import TokenClock, reader_for
from kvtether.gateway.turn.body import has_first_token
from kvtether.protocol import tokens
from kvtether.sdk import turns

CHAT_STREAM = [
    {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
    {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "id": "c1", "type": "function", "function": {"name": "read", "arguments": ""}}]}}]},
    {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "function": {"arguments": "{}"}}]}}]},
    {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
]
RESPONSES_STREAM = [
    {"type": "response.created", "response": {"id": "r1"}},
    {"type": "response.output_item.added", "output_index": 0,
     "item": {"type": "function_call", "call_id": "c1", "name": "read", "arguments": ""}},
    {"type": "response.function_call_arguments.delta", "output_index": 0, "delta": "{}"},
    {"type": "response.completed", "response": {"id": "r1", "status": "completed", "output": []}},
]
MESSAGES_STREAM = [
    {"type": "message_start", "message": {"id": "m1", "usage": {"input_tokens": 3}}},
    {"type": "content_block_start", "index": 0, "content_block": {"type": "tool_use", "id": "t1", "name": "read",
                                                                  "input": {}}},
    {"type": "content_block_delta", "index": 0, "delta": {"type": "input_json_delta", "partial_json": "{}"}},
    {"type": "content_block_stop", "index": 0},
    {"type": "message_delta", "delta": {"stop_reason": "tool_use"}, "usage": {"output_tokens": 2}},
    {"type": "message_stop"},
]
STREAMS = {tokens.CHAT: CHAT_STREAM, tokens.RESPONSES: RESPONSES_STREAM, tokens.MESSAGES: MESSAGES_STREAM}


@pytest.mark.parametrize("api", sorted(STREAMS))
def test_a_tool_call_turn_has_its_first_token_where_the_call_is_named(api: str) -> None:
    events = STREAMS[api]
    carries = [tokens.has_token(api, e) for e in events]
    assert carries.index(True) == 1  # the call's name, not the first arguments (nor a role-only chunk)
    ends = [tokens.ends_generation(api, e) for e in events]
    assert ends.count(True) == 1 and not any(ends[:3])


def _sdk_ttft_ms(api: str, events: list[Mapping[str, Any]]) -> float | None:
    class _Owner:
        def _finish(self, call: Any, *, error: BaseException | None = None, aborted: bool = False) -> None:
            return None

    body = {"stream": True, "stream_options": {"include_usage": True}}
    metrics = turns.TurnMetrics(seq=0, turn=0, prefix=None, parent=None, model=None, stream=True, started_at=0.0,
                                api=api)
    call = turns.Call(session=_Owner(), metrics=metrics, body=body, t0_ns=0, reader=turns.reader_for(api, body))
    for i, e in enumerate(events):
        call.on_data(e, (i + 1) * 1_000_000)  # the i-th event at (i + 1) ms
    return metrics.ttft_ms


@pytest.mark.parametrize("api", sorted(STREAMS))
def test_the_sdk_the_cli_and_the_gateway_agree_on_ttft(api: str) -> None:
    events = STREAMS[api]
    clock = TokenClock(t0=0)
    reader = reader_for(api, clock)
    for i, e in enumerate(events):
        reader.read(e, (i + 1) * 1_000_000)
    assert clock.ttft_ms() == _sdk_ttft_ms(api, events) == 2.0
    if api == tokens.CHAT:  # the gateway relays chat chunks
        assert [has_first_token(e) for e in events] == [tokens.has_token(api, e) for e in events]


@pytest.mark.parametrize(("api", "event", "carries"), [
    (tokens.CHAT, {"choices": [{"delta": {"reasoning": "hm"}}]}, True),
    (tokens.CHAT, {"choices": [{"delta": {"refusal": "no"}}]}, True),
    (tokens.CHAT, {"choices": [{"delta": {"content": ""}}]}, False),
    (tokens.COMPLETIONS, {"choices": [{"text": "a"}]}, True),
    (tokens.RESPONSES, {"type": "response.reasoning_text.delta", "delta": "hm"}, True),
    (tokens.RESPONSES, {"type": "response.output_text.delta", "delta": ""}, False),
    (tokens.RESPONSES, {"type": "response.output_item.added", "item": {"type": "message"}}, False),
    (tokens.RESPONSES, {"type": "response.output_item.added", "item": {"type": "custom_tool_call", "name": "x"}},
     True),
    (tokens.MESSAGES, {"type": "content_block_delta", "delta": {"type": "thinking_delta", "thinking": "hm"}}, True),
    (tokens.MESSAGES, {"type": "content_block_start", "content_block": {"type": "text", "text": ""}}, False),
    (tokens.MESSAGES, {"type": "content_block_delta", "delta": {"type": "signature_delta", "signature": "s"}},
     False),
])
def test_what_carries_a_token(api: str, event: dict[str, Any], carries: bool) -> None:
    assert tokens.has_token(api, event) is carries
