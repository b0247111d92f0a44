"""Which events of a streamed answer carry a token, and which one ends its generation: the one rule behind every
TTFT and TPOT kvtether reports, read by the SDK (``sdk/turns.py``), the CLI's streaming client
(``cli/streaming``: replay, assess, demo, the benchmarks) and the gateway's relay.

A token is one of the answer of any kind: text, reasoning, a refusal, or a tool call, which counts from the event
that carries its name (an agent's turn often has no text, and a client sees the call begin there):

- chat completions: a choice delta with ``content``, ``reasoning_content`` or ``reasoning``, ``refusal``, or
  ``tool_calls``; a role-only delta is not a token; completions: a choice with ``text``;
- OpenAI Responses: a ``response.*.delta`` event with a non-empty delta (text, reasoning, its summary, a refusal,
  function or custom tool input), and ``response.output_item.added`` of a function or custom tool call with its
  name;
- Anthropic Messages: a ``content_block_delta`` with text, thinking or tool input JSON, and
  ``content_block_start`` of a ``tool_use`` block with its name.

The end of generation is the event that says why the answer ended (a chat choice's ``finish_reason``, Messages'
``message_delta`` with a ``stop_reason``, Responses' ``response.completed``/``incomplete``/``failed``): it comes
with the engine step that sampled the last completion token, an end-of-sequence token included, which has no
text and so no token event of its own. TPOT runs from the first token to it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

CHAT = "chat"
COMPLETIONS = "completions"
RESPONSES = "responses"
MESSAGES = "messages"
# A server may send the reasoning under either name, even both for the same text (vLLM has used both).
REASONING_FIELDS = ("reasoning_content", "reasoning")
_CHAT_TOKEN_FIELDS = ("content", "tool_calls", "refusal", *REASONING_FIELDS)
# Responses output items whose appearance names a tool call.
_RESPONSES_CALLS = ("function_call", "custom_tool_call")
# Messages deltas that carry a token, and the field that holds it.
MESSAGES_DELTA_FIELDS = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial_json"}
RESPONSES_ENDS = ("response.completed", "response.incomplete", "response.failed")


def chat_delta_has_token(delta: Mapping[str, Any]) -> bool:
    """Whether a chat choice's delta carries a token of the answer."""
    return any(delta.get(k) for k in _CHAT_TOKEN_FIELDS)


def chat_chunk_has_token(chunk: Mapping[str, Any]) -> bool:
    """Whether any choice of a chat or completions chunk carries a token."""
    choices = chunk.get("choices")
    if not isinstance(choices, list):
        return False
    for choice in choices:
        if not isinstance(choice, Mapping):
            continue
        if choice.get("text"):
            return True
        delta = choice.get("delta")
        if isinstance(delta, Mapping) and chat_delta_has_token(delta):
            return True
    return False


def responses_event_has_token(event: Mapping[str, Any]) -> bool:
    kind = str(event.get("type") or "")
    if kind.endswith(".delta"):
        delta = event.get("delta")
        return isinstance(delta, str) and bool(delta)
    if kind == "response.output_item.added":
        item = event.get("item")
        return isinstance(item, Mapping) and item.get("type") in _RESPONSES_CALLS and bool(item.get("name"))
    return False


def messages_event_has_token(event: Mapping[str, Any]) -> bool:
    kind = event.get("type")
    if kind == "content_block_delta":
        delta = event.get("delta")
        if not isinstance(delta, Mapping):
            return False
        field = MESSAGES_DELTA_FIELDS.get(str(delta.get("type")))
        value = delta.get(field) if field is not None else None
        return isinstance(value, str) and bool(value)
    if kind == "content_block_start":
        block = event.get("content_block")
        return isinstance(block, Mapping) and block.get("type") == "tool_use" and bool(block.get("name"))
    return False


def has_token(api: str, event: Mapping[str, Any]) -> bool:
    """Whether one event of a stream of `api` (chat, completions, responses, messages) carries a token."""
    if api == RESPONSES:
        return responses_event_has_token(event)
    if api == MESSAGES:
        return messages_event_has_token(event)
    return chat_chunk_has_token(event)


def ends_generation(api: str, event: Mapping[str, Any]) -> bool:
    """Whether one event of a stream of `api` says why the answer ended (the end of generation)."""
    if api == RESPONSES:
        return event.get("type") in RESPONSES_ENDS
    if api == MESSAGES:
        delta = event.get("delta")
        return event.get("type") == "message_delta" and isinstance(delta, Mapping) and bool(delta.get("stop_reason"))
    choices = event.get("choices")
    return isinstance(choices, list) and any(isinstance(c, Mapping) and c.get("finish_reason") for c in choices)
