"""Responses and Anthropic Messages turns in chat-completions terms, for ``TurnMetrics.answer`` and the recorder.

The session file (``docs/session-format.md``) and ``kvtether replay`` speak chat, and the gateway serves these
APIs by lowering them to chat, so a recorded Responses or Messages turn is written as the chat turn it stands
for. The rules follow vLLM's own lowering (``construct_input_messages`` for Responses, ``AnthropicServingMessages``
for Messages) for what agents send: text, function calls and their outputs, reasoning/thinking. Items without a
chat counterpart (hosted tools, images by file id …) are left out: this is a record for replay, never what the
prefix hash is computed from (that is ``contract``, over the body as sent).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .contract import BILLING_HEADER_PREFIX, is_model_item


def _plain(obj: Any) -> Any:
    dump = getattr(obj, "model_dump", None)
    return dump(exclude_none=True, mode="json") if callable(dump) else obj


def _text_of(content: Any) -> str | None:
    """The text of a string or of a list of text-like parts (input_text, output_text, text)."""
    content = _plain(content)
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return None
    texts = [p.get("text") for p in map(_plain, content) if isinstance(p, Mapping)]
    return "".join(t for t in texts if isinstance(t, str))


def _chat_tool(name: Any, description: Any, parameters: Any) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": name}
    if description is not None:
        fn["description"] = description
    if parameters is not None:
        fn["parameters"] = parameters
    return {"type": "function", "function": fn}


def _pick_params(body: Mapping[str, Any], renames: Mapping[str, str]) -> dict[str, Any]:
    return {chat: body[field] for field, chat in renames.items() if body.get(field) is not None}


class _Assistant:
    """Folds a run of model output (text, tool calls, reasoning) into one chat assistant message."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[dict[str, Any]] = []

    def empty(self) -> bool:
        return not (self.text or self.reasoning or self.calls)

    def call(self, call_id: Any, name: Any, arguments: str) -> None:
        self.calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})

    def message(self) -> dict[str, Any]:
        text = "".join(self.text)
        msg: dict[str, Any] = {"role": "assistant", "content": text if text or not self.calls else None}
        if self.reasoning:
            msg["reasoning_content"] = "".join(self.reasoning)
        if self.calls:
            msg["tool_calls"] = self.calls
        return msg


# --- OpenAI Responses -------------------------------------------------------------------------


def _reasoning_text(item: Mapping[str, Any]) -> str:
    # vLLM: content[0].text, else summary[0].text.
    for field in ("content", "summary"):
        parts = item.get(field) or []
        if parts and isinstance(_plain(parts[0]), Mapping):
            text = _plain(parts[0]).get("text")
            if isinstance(text, str):
                return text
    return ""


def _add_model_item(answer: _Assistant, item: Mapping[str, Any]) -> None:
    kind = item.get("type")
    if kind == "message":
        answer.text.append(_text_of(item.get("content")) or "")
    elif kind == "reasoning":
        answer.reasoning.append(_reasoning_text(item))
    elif kind == "function_call":
        answer.call(item.get("call_id"), item.get("name"), str(item.get("arguments") or ""))


def responses_output_message(output: Iterable[Any]) -> dict[str, Any]:
    """The chat assistant message for a response's ``output`` items."""
    answer = _Assistant()
    for item in output:
        plain = _plain(item)
        if isinstance(plain, Mapping):
            _add_model_item(answer, plain)
    return answer.message()


def _responses_items(raw: Any) -> list[Mapping[str, Any]]:
    if isinstance(raw, str):
        return [{"type": "message", "role": "user", "content": raw}]
    items = [_plain(i) for i in raw or []]
    return [{"type": "message", **i} if "type" not in i and "role" in i else i for i in items if isinstance(i, Mapping)]


def responses_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Chat messages for a Responses body: ``instructions`` first, then ``input``."""
    out: list[dict[str, Any]] = []
    if isinstance(body.get("instructions"), str):
        out.append({"role": "system", "content": body["instructions"]})
    answer = _Assistant()
    for item in _responses_items(body.get("input")):
        if is_model_item(item):
            _add_model_item(answer, item)
            continue
        if not answer.empty():
            out.append(answer.message())
            answer = _Assistant()
        if item.get("type") == "message":
            out.append({"role": item.get("role", "user"), "content": _text_of(item.get("content")) or ""})
        elif item.get("type") == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": output if isinstance(output, str) else _text_of(output) or ""})
    if not answer.empty():
        out.append(answer.message())
    return out


def responses_tools(tools: Sequence[Any] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    plain = [_plain(t) for t in tools]
    return [_chat_tool(t.get("name"), t.get("description"), t.get("parameters"))
            for t in plain if isinstance(t, Mapping) and t.get("type") == "function"]


_RESPONSES_PARAMS = {"max_output_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p",
                     "stream": "stream", "parallel_tool_calls": "parallel_tool_calls"}


def responses_request(body: Mapping[str, Any]) -> dict[str, Any]:
    """A chat-completions body for a Responses body (messages, tools, model and the sampling fields chat has)."""
    out: dict[str, Any] = {"model": body.get("model"), "messages": responses_messages(body)}
    tools = responses_tools(body.get("tools"))
    if tools:
        out["tools"] = tools
    out.update(_pick_params(body, _RESPONSES_PARAMS))
    return out


def responses_finish_reason(response: Mapping[str, Any]) -> str | None:
    """A response's end in chat terms: stop, tool_calls or length (``status`` itself when it has none)."""
    status = response.get("status")
    if status == "completed":
        output = [_plain(i) for i in response.get("output") or []]
        called = any(isinstance(i, Mapping) and i.get("type") == "function_call" for i in output)
        return "tool_calls" if called else "stop"
    details = _plain(response.get("incomplete_details"))
    if status == "incomplete" and isinstance(details, Mapping) and details.get("reason") == "max_output_tokens":
        return "length"
    return status if isinstance(status, str) else None


# --- Anthropic Messages -------------------------------------------------------------------------


def anthropic_answer(blocks: Iterable[Any]) -> dict[str, Any]:
    """The chat assistant message for an Anthropic assistant message's content blocks."""
    answer = _Assistant()
    for block in map(_plain, blocks):
        if not isinstance(block, Mapping):
            continue
        kind = block.get("type")
        if kind == "text":
            answer.text.append(str(block.get("text") or ""))
        elif kind == "thinking":
            answer.reasoning.append(str(block.get("thinking") or ""))
        elif kind == "tool_use":
            # vLLM renders the input as json.dumps with its default separators.
            answer.call(block.get("id"), block.get("name"), json.dumps(block.get("input") or {}))
    return answer.message()


def _anthropic_system(system: Any) -> str | None:
    system = _plain(system)
    if isinstance(system, list):
        texts = [_plain(b).get("text", "") for b in system if isinstance(_plain(b), Mapping)]
        system = "".join(t for t in texts if isinstance(t, str) and not t.startswith(BILLING_HEADER_PREFIX))
    return system if isinstance(system, str) and system else None


def _anthropic_user(content: Any, out: list[dict[str, Any]]) -> None:
    if isinstance(content, str):
        out.append({"role": "user", "content": content})
        return
    texts: list[str] = []
    for block in map(_plain, content or []):
        if not isinstance(block, Mapping):
            continue
        if block.get("type") == "tool_result":
            result = block.get("content")
            out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                        "content": result if isinstance(result, str) else _text_of(result) or ""})
        elif block.get("type") == "text":
            texts.append(str(block.get("text") or ""))
    if texts:
        out.append({"role": "user", "content": "".join(texts)})


def anthropic_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Chat messages for an Anthropic body: ``system`` first, then ``messages``."""
    out: list[dict[str, Any]] = []
    system = _anthropic_system(body.get("system"))
    if system is not None:
        out.append({"role": "system", "content": system})
    for message in map(_plain, body.get("messages") or []):
        if not isinstance(message, Mapping):
            continue
        content = message.get("content")
        if message.get("role") == "assistant":
            blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content or []
            out.append(anthropic_answer(blocks))
        else:
            _anthropic_user(content, out)
    return out


_ANTHROPIC_PARAMS = {"max_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p",
                     "top_k": "top_k", "stop_sequences": "stop", "stream": "stream"}


def anthropic_request(body: Mapping[str, Any]) -> dict[str, Any]:
    """A chat-completions body for an Anthropic Messages body."""
    out: dict[str, Any] = {"model": body.get("model"), "messages": anthropic_messages(body)}
    tools = [_plain(t) for t in body.get("tools") or []]
    chat_tools = [_chat_tool(t.get("name"), t.get("description"), t.get("input_schema"))
                  for t in tools if isinstance(t, Mapping) and "input_schema" in t]
    if chat_tools:
        out["tools"] = chat_tools
    out.update(_pick_params(body, _ANTHROPIC_PARAMS))
    return out


_STOP_REASONS = {"end_turn": "stop", "stop_sequence": "stop", "tool_use": "tool_calls", "max_tokens": "length"}


def anthropic_finish_reason(stop_reason: Any) -> str | None:
    """An Anthropic ``stop_reason`` in chat terms (unknown reasons as they are)."""
    if not isinstance(stop_reason, str):
        return None
    return _STOP_REASONS.get(stop_reason, stop_reason)
