"""A whole chat completion → the Responses object it stands for (what the gateway answers, and the simulator
as vLLM does); and, for clients that read Responses answers in chat terms (the SDK's metrics and recorder), a
response back to the chat answer it stands for."""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvtether.protocol.common import int_or_none, reasoning_of
from kvtether.protocol.responses.common import ReasoningSeal, decode_custom_input, flat_name
from kvtether.protocol.responses.request import input_messages

# Output items that are the model's tool calls.
_CALL_ITEMS = ("function_call", "custom_tool_call")


# ---------------------------------------------------------------------------------------------------------
# Response: chat → Responses


def response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def skeleton(body: Mapping[str, Any], rid: str, created_at: float, *, previous: str | None = None
             ) -> dict[str, Any]:
    """The response object before its output: what ``response.created`` shows, echoing the request."""
    reasoning = body.get("reasoning") if isinstance(body.get("reasoning"), Mapping) else None
    conversation = body.get("conversation")
    return {
        "id": rid, "object": "response", "created_at": int(created_at), "status": "in_progress",
        "background": False, "error": None, "incomplete_details": None,
        "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
        "max_tool_calls": body.get("max_tool_calls"), "model": body.get("model"), "output": [],
        "parallel_tool_calls": body.get("parallel_tool_calls", True), "previous_response_id": previous,
        "conversation": {"id": conversation_id(conversation)} if conversation is not None else None,
        "reasoning": {"effort": (reasoning or {}).get("effort"), "summary": (reasoning or {}).get("summary")},
        "service_tier": body.get("service_tier", "auto"), "store": body.get("store", True) is not False,
        "temperature": body.get("temperature"), "text": body.get("text") or {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
        "top_logprobs": body.get("top_logprobs"), "top_p": body.get("top_p"),
        "truncation": body.get("truncation", "disabled"), "usage": None, "user": body.get("user"),
        "metadata": body.get("metadata") or {}, "prompt_cache_key": body.get("prompt_cache_key"),
    }


def conversation_id(conversation: Any) -> str | None:
    if isinstance(conversation, str) and conversation:
        return conversation
    if isinstance(conversation, Mapping) and isinstance(conversation.get("id"), str) and conversation["id"]:
        return str(conversation["id"])
    return None


class ToolNames:
    """Which flat chat tool names are custom tools, and which are namespaced (vLLM's name maps)."""

    def __init__(self, tools: Any) -> None:
        self.custom: set[str] = set()  # flat names: a namespace's custom tools are custom tools too
        self.namespaced: dict[str, tuple[str, str]] = {}
        for tool in tools if isinstance(tools, list) else ():
            if not isinstance(tool, Mapping):
                continue
            if tool.get("type") == "custom" and isinstance(tool.get("name"), str):
                self.custom.add(tool["name"])
            elif tool.get("type") == "namespace" and isinstance(tool.get("name"), str):
                for member in tool.get("tools") or ():
                    if isinstance(member, Mapping) and isinstance(member.get("name"), str):
                        flat = flat_name(tool["name"], member["name"])
                        self.namespaced[flat] = (tool["name"], member["name"])
                        if member.get("type") == "custom":
                            self.custom.add(flat)

    def item(self, call_id: str, name: str, arguments: str, item_id: str) -> dict[str, Any]:
        namespace, short = self.namespaced.get(name, (None, name))
        if name in self.custom:
            call = {"type": "custom_tool_call", "id": item_id, "call_id": call_id, "name": short,
                    "input": decode_custom_input(arguments), "status": "completed"}
            return {**call, "namespace": namespace} if namespace is not None else call
        out = {"type": "function_call", "id": item_id, "call_id": call_id, "name": short, "arguments": arguments,
               "status": "completed"}
        if namespace is not None:
            out["namespace"] = namespace
        return out


def output_item_id(prefix: str, chat_id: Any, n: int) -> str:
    base = chat_id if isinstance(chat_id, str) and chat_id else uuid.uuid4().hex
    return f"{prefix}_{hashlib.sha256(f'{base}:{n}'.encode()).hexdigest()[:32]}"


def reasoning_item(text: str, item_id: str, *, seal: ReasoningSeal | None) -> dict[str, Any]:
    item: dict[str, Any] = {"type": "reasoning", "id": item_id, "summary": [],
                            "content": [{"type": "reasoning_text", "text": text}]}
    if seal is not None:
        item["encrypted_content"] = seal.seal(text)
    return item


def message_item(text: str, item_id: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def usage(chat_usage: Any) -> dict[str, Any] | None:
    if not isinstance(chat_usage, Mapping):
        return None
    prompt, completion = _int(chat_usage.get("prompt_tokens")), _int(chat_usage.get("completion_tokens"))
    pdetails = chat_usage.get("prompt_tokens_details")
    cdetails = chat_usage.get("completion_tokens_details")
    cached = _int(pdetails.get("cached_tokens")) if isinstance(pdetails, Mapping) else 0
    reasoning = _int(cdetails.get("reasoning_tokens")) if isinstance(cdetails, Mapping) else 0
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": _int(chat_usage.get("total_tokens")) or prompt + completion}


def _int(value: Any) -> int:
    return int_or_none(value) or 0


@dataclass(frozen=True, slots=True)
class Usage:
    """A Responses object's token counts as a reader takes them: None where the server sent none."""

    input_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None


def read_usage(response: Mapping[str, Any]) -> Usage:
    """The token counts of a Responses object (or a ``response.completed`` event's response)."""
    u = response.get("usage")
    if not isinstance(u, Mapping):
        return Usage()
    details = u.get("input_tokens_details")
    cached = int_or_none(details.get("cached_tokens")) if isinstance(details, Mapping) else None
    return Usage(int_or_none(u.get("input_tokens")), int_or_none(u.get("output_tokens")), cached)


def finish(response: dict[str, Any], finish_reason: Any) -> dict[str, Any]:
    """The response's final status from the chat finish reason: ``length`` is incomplete (max_output_tokens)."""
    if finish_reason == "length":
        response["status"] = "incomplete"
        response["incomplete_details"] = {"reason": "max_output_tokens"}
    else:
        response["status"] = "completed"
    return response


def from_chat(chat: Mapping[str, Any], base: dict[str, Any], *, tools: Any,
              seal: ReasoningSeal | None) -> dict[str, Any]:
    """The Responses object for a non-streamed chat completion (its first choice). ``base``: :func:`skeleton`;
    ``seal``: given when the request asked for ``reasoning.encrypted_content``."""
    choices = chat.get("choices")
    choice: Mapping[str, Any] = choices[0] if isinstance(choices, list) and choices \
        and isinstance(choices[0], Mapping) else {}
    message = choice.get("message") if isinstance(choice.get("message"), Mapping) else {}
    assert isinstance(message, Mapping)
    chat_id = chat.get("id")
    output: list[dict[str, Any]] = []
    reasoning = reasoning_of(message)
    if reasoning:
        output.append(reasoning_item(reasoning, output_item_id("rs", chat_id, 0), seal=seal))
    text = message.get("content")
    if isinstance(text, str) and text:
        output.append(message_item(text, output_item_id("msg", chat_id, 1)))
    names = ToolNames(tools)
    for n, call in enumerate(message.get("tool_calls") or ()):
        if not isinstance(call, Mapping):
            continue
        fn = call.get("function") if isinstance(call.get("function"), Mapping) else {}
        assert isinstance(fn, Mapping)
        arguments = fn.get("arguments")
        output.append(names.item(str(call.get("id") or f"call_{n}"), str(fn.get("name") or ""),
                                 arguments if isinstance(arguments, str) else json.dumps(arguments or {}),
                                 output_item_id("fc", chat_id, 2 + n)))
    response = {**base, "output": output, "usage": usage(chat.get("usage"))}
    return finish(response, choice.get("finish_reason"))


def output_text(response: Mapping[str, Any]) -> str:
    """The SDKs' ``output_text``: every output_text part of the output's messages, joined."""
    return "".join(part.get("text", "") for item in response.get("output") or () if item.get("type") == "message"
                   for part in item.get("content") or () if part.get("type") == "output_text")


# ---------------------------------------------------------------------------------------------------------
# Back to chat: a response as the chat answer it stands for


def chat_answer(output: Iterable[Any]) -> dict[str, Any]:
    """The chat assistant message for a response's ``output`` items: the message the next request carries them
    as (:func:`input_messages`, lenient: items with no chat form, such as hosted tool calls, are left out), with
    ``content`` null when the answer has no text. Items vLLM would not merge into one message (two reasoning
    items, say) are joined: their texts, their reasoning and their tool calls, in order."""
    messages = [m for m in input_messages(list(output), None, lenient=True) if m.get("role") == "assistant"]
    answer = messages[0] if len(messages) == 1 else _joined(messages)
    answer.setdefault("content", None)
    return answer


def _joined(messages: list[dict[str, Any]]) -> dict[str, Any]:
    answer: dict[str, Any] = {"role": "assistant"}
    texts = [m["content"] for m in messages if isinstance(m.get("content"), str)]
    reasoning = [m["reasoning"] for m in messages if isinstance(m.get("reasoning"), str)]
    calls = [call for m in messages for call in m.get("tool_calls") or ()]
    if reasoning:
        answer["reasoning"] = "".join(reasoning)
    if texts:
        answer["content"] = "".join(texts)
    if calls:
        answer["tool_calls"] = calls
    return answer


def chat_finish_reason(response: Mapping[str, Any]) -> str | None:
    """A response's end as the chat finish reason it stands for (:func:`finish` read backwards): ``length`` when
    cut at ``max_output_tokens``; when completed, ``tool_calls`` if it calls a tool, else ``stop``; a status
    with no chat counterpart (``failed``, ``cancelled``…) as it is."""
    status = response.get("status")
    if status == "completed":
        called = any(isinstance(i, Mapping) and i.get("type") in _CALL_ITEMS for i in response.get("output") or ())
        return "tool_calls" if called else "stop"
    details = response.get("incomplete_details")
    if status == "incomplete" and isinstance(details, Mapping) and details.get("reason") == "max_output_tokens":
        return "length"
    return status if isinstance(status, str) else None
