"""A whole chat completion → the Anthropic Messages answer it stands for (what the gateway answers, and the
simulator as vLLM does); and, for clients that read Messages answers in chat terms (the SDK's metrics and
recorder), an answer back to the chat answer it stands for."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any, Final

from kvtether.protocol.common import int_or_none, reasoning_of
from kvtether.protocol.messages.request import translate

# vLLM's Anthropic stop-reason vocabulary, keyed by the chat finish reason it maps from.
STOP_REASONS: Final = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


# ---------------------------------------------------------------------------------------------------------
# Response: chat → Messages


def message_id(chat_id: Any) -> str:
    """``msg_…`` from a chat completion id (``chatcmpl-abc`` → ``msg_abc``): the same answer, the same id."""
    raw = chat_id if isinstance(chat_id, str) and chat_id else "unknown"
    if raw.startswith("msg_"):
        return raw
    for prefix in ("chatcmpl-", "chatcmpl_", "cmpl-"):
        if raw.startswith(prefix) and len(raw) > len(prefix):
            return "msg_" + raw[len(prefix):]
    return "msg_" + raw


def thinking_signature(thinking: str) -> str:
    """The signature of a thinking block. vLLM fabricates one (a random uuid hex); nothing on this side ever
    checks it, so a hash of the text serves as well and keeps equal answers equal."""
    return hashlib.sha256(thinking.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def usage(chat_usage: Any) -> dict[str, int]:
    """Anthropic usage from chat usage. Anthropic counts ``input_tokens`` *besides* the cached ones, vLLM's
    ``prompt_tokens`` is the total: input = prompt − cache read − cache creation (as vLLM computes it)."""
    if not isinstance(chat_usage, Mapping):
        return {"input_tokens": 0, "output_tokens": 0}
    out: dict[str, int] = {"input_tokens": 0, "output_tokens": _int(chat_usage.get("completion_tokens"))}
    prompt = _int(chat_usage.get("prompt_tokens"))
    details = chat_usage.get("prompt_tokens_details")
    if isinstance(details, Mapping):
        cached = details.get("cached_tokens")
        if isinstance(cached, int) and not isinstance(cached, bool):
            prompt -= cached
            out["cache_read_input_tokens"] = cached
        created = details.get("created_cache_tokens")
        if isinstance(created, int) and not isinstance(created, bool):
            prompt -= created
            out["cache_creation_input_tokens"] = created
    out["input_tokens"] = max(0, prompt)
    return out


def _int(value: Any) -> int:
    return int_or_none(value) or 0


def parses_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def stop_reason(finish_reason: Any, matched_stop: Any, *, tool_used: bool,
                tool_complete: bool) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) as vLLM maps them: ``max_tokens`` always wins; complete tool calls are
    ``tool_use``; a matched stop string (vLLM's ``stop_reason`` when it is a str — an int is a stop token)
    is ``stop_sequence``, unless the calls are complete (a call it cut short must not run); then
    ``tool_use`` if a tool was called (a forced tool call finishes with ``stop``), else ``end_turn``."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason not in ("stop", "tool_calls"):
        return None, None
    if tool_complete:
        return "tool_use", None
    if isinstance(matched_stop, str):
        return "stop_sequence", matched_stop
    if finish_reason == "tool_calls" or tool_used:
        return "tool_use", None
    return "end_turn", None


def function_of(call: Mapping[str, Any]) -> Mapping[str, Any]:
    fn = call.get("function")
    return fn if isinstance(fn, Mapping) else {}


def _tool_input(arguments: Any) -> dict[str, Any]:
    if isinstance(arguments, Mapping):
        return dict(arguments)
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return {}
        if isinstance(parsed, dict):
            return parsed
    return {}


def from_chat(chat_response: Mapping[str, Any], model: str) -> dict[str, Any]:
    """An Anthropic Messages response for a non-streamed chat completion (its first choice); ``model`` is the
    name to report (the one the client asked for)."""
    choices = chat_response.get("choices")
    choice: Mapping[str, Any] = choices[0] if isinstance(choices, list) and choices \
        and isinstance(choices[0], Mapping) else {}
    message = choice.get("message")
    if not isinstance(message, Mapping):
        message = {}
    content: list[dict[str, Any]] = []
    reasoning = reasoning_of(message)
    if reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": thinking_signature(reasoning)})
    text = message.get("content")
    if isinstance(text, str) and text:
        content.append({"type": "text", "text": text})
    calls = [c for c in message.get("tool_calls") or () if isinstance(c, Mapping)]
    for call in calls:
        fn = function_of(call)
        content.append({"type": "tool_use", "id": str(call.get("id") or ""), "name": str(fn.get("name") or ""),
                        "input": _tool_input(fn.get("arguments"))})
    if not content:
        # Anthropic's shape of an empty answer is one empty text block (strict clients read content[0]).
        content.append({"type": "text", "text": ""})
    last_args = function_of(calls[-1]).get("arguments") if calls else None
    reason, sequence = stop_reason(
        choice.get("finish_reason"), choice.get("stop_reason"), tool_used=bool(calls),
        tool_complete=bool(calls) and (isinstance(last_args, Mapping)
                                       or (isinstance(last_args, str) and parses_json(last_args))))
    return {
        "id": message_id(chat_response.get("id")),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(chat_response.get("usage")),
    }


# ---------------------------------------------------------------------------------------------------------
# Back to chat: an answer as the chat answer it stands for

# STOP_REASONS read backwards; a matched stop sequence is a chat ``stop`` too.
_FINISH_REASONS: Final = {**{anthropic: chat for chat, anthropic in STOP_REASONS.items()}, "stop_sequence": "stop"}


def chat_answer(content: Iterable[Any]) -> dict[str, Any]:
    """The chat assistant message for an answer's content blocks: the message the next request carries them as
    (the lenient request translation: blocks with no chat form are left out), with ``content`` null when the
    answer has no text."""
    chat = translate({"messages": [{"role": "assistant", "content": list(content)}]}, lenient=True).chat
    answer = dict(chat["messages"][0])
    answer.setdefault("content", None)
    return answer


def chat_finish_reason(stop_reason: Any) -> str | None:
    """An answer's ``stop_reason`` as the chat finish reason it stands for; one with no chat counterpart
    (``pause_turn``, ``refusal``…) as it is."""
    if not isinstance(stop_reason, str):
        return None
    return _FINISH_REASONS.get(stop_reason, stop_reason)
