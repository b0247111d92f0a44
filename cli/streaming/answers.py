"""The readers of a streamed answer, one per API: each takes the stream's events (parsed JSON, stamped on
arrival), tells the clock which of them carried a token, and keeps the answer in chat-completions terms (what a
next turn resends), its usage, finish reason and response id, and an error event if one came.

What carries a token, and which event ends the generation, is ``kvtether.protocol.tokens``'s rule, the one the
SDK and the gateway read too (the package docstring has the definitions).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

from kvtether.cli.streaming.clock import TokenClock
from kvtether.protocol import tokens
from kvtether.protocol.common import int_or_none
from kvtether.protocol.responses import read_usage
from kvtether.protocol.tokens import CHAT, COMPLETIONS, MESSAGES, MESSAGES_DELTA_FIELDS, REASONING_FIELDS, RESPONSES

APIS = (CHAT, COMPLETIONS, RESPONSES, MESSAGES)


class AnswerReader(ABC):
    """What every reader keeps; ``keep`` is the API's."""

    api = CHAT

    def __init__(self, clock: TokenClock) -> None:
        self.clock = clock
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.cached_tokens: int | None = None
        self.finish_reason: str | None = None
        self.response_id: str | None = None
        self.error: str | None = None  # an error event inside a 200 stream
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.reasoning_key = REASONING_FIELDS[0]  # the server's name for it
        self.calls: dict[int, dict[str, Any]] = {}

    def read(self, data: Mapping[str, Any], now: int) -> None:
        """Take one event of the stream, received at `now` (the clock's ns): the clock is told whether it carries
        a token or ends the generation (protocol/tokens.py), and the answer keeps what it says."""
        if tokens.has_token(self.api, data):
            self.clock.token(now)
        if tokens.ends_generation(self.api, data):
            self.clock.finished(now)
        self.keep(data)

    @abstractmethod
    def keep(self, data: Mapping[str, Any]) -> None:
        """What one event says of the answer (its text, calls, usage, finish reason, an error)."""

    def _call(self, index: int) -> dict[str, Any]:
        return self.calls.setdefault(index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})

    @property
    def text(self) -> str:
        return "".join(self.content)

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        return [self.calls[i] for i in sorted(self.calls)]

    def message(self) -> dict[str, Any]:
        """The answer as the assistant message a chat history carries."""
        text = self.text
        # A tool-call-only answer has content null, as the server's non-streamed message and the SDK recorder have.
        msg: dict[str, Any] = {"role": "assistant", "content": text if text or not self.calls else None}
        if self.reasoning:
            msg[self.reasoning_key] = "".join(self.reasoning)
        if self.calls:
            msg["tool_calls"] = self.tool_calls
        return msg


class ChatReader(AnswerReader):
    """``chat.completion.chunk`` events; the answer is choice 0's."""

    def keep(self, data: Mapping[str, Any]) -> None:
        choice = self._choice(data)
        delta = choice.get("delta") if choice is not None else None
        if isinstance(delta, Mapping) and tokens.chat_delta_has_token(delta):
            self.add(delta)

    def _choice(self, data: Mapping[str, Any]) -> Mapping[str, Any] | None:
        """Choice 0 of an event (None: an error, or no choice), once what any event may carry is read: an
        error, the answer's id, its usage, choice 0's finish reason."""
        if "error" in data:
            self.error = _error_text(data["error"])
            return None
        if self.response_id is None and data.get("id"):
            self.response_id = str(data["id"])
        self._usage(data.get("usage"))
        choices = data.get("choices") or []
        if not choices or not isinstance(choices[0], Mapping):
            return None
        choice: Mapping[str, Any] = choices[0]
        self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return choice

    def add(self, delta: Mapping[str, Any]) -> None:
        if delta.get("content"):
            self.content.append(str(delta["content"]))
        for key in REASONING_FIELDS:  # both names for the same text: take the first
            if delta.get(key):
                self.reasoning.append(str(delta[key]))
                self.reasoning_key = key
                break
        for tc in delta.get("tool_calls") or ():
            if not isinstance(tc, Mapping):
                continue
            call = self._call(int_or_none(tc.get("index")) or 0)
            if tc.get("id"):
                call["id"] = tc["id"]
            fn = tc.get("function") or {}
            if fn.get("name"):
                call["function"]["name"] += fn["name"]
            if fn.get("arguments"):
                call["function"]["arguments"] += fn["arguments"]

    def _usage(self, usage: Any) -> None:
        if not isinstance(usage, Mapping):
            return
        self.prompt_tokens = int_or_none(usage.get("prompt_tokens"))
        self.completion_tokens = int_or_none(usage.get("completion_tokens"))
        details = usage.get("prompt_tokens_details")
        if isinstance(details, Mapping) and int_or_none(details.get("cached_tokens")) is not None:
            self.cached_tokens = details["cached_tokens"]


class CompletionsReader(ChatReader):
    """``text_completion`` events (``/v1/completions``): choice 0's ``text``."""

    api = COMPLETIONS

    def keep(self, data: Mapping[str, Any]) -> None:
        choice = self._choice(data)
        if choice is not None and choice.get("text"):
            self.content.append(str(choice["text"]))


class ResponsesReader(AnswerReader):
    """OpenAI Responses events (``response.*``)."""

    api = RESPONSES

    def keep(self, data: Mapping[str, Any]) -> None:
        kind = str(data.get("type") or "")
        if kind == "error":
            self.error = _error_text(data.get("error") or data.get("message") or data)
        elif kind.endswith(".delta") and isinstance(data.get("delta"), str) and data["delta"]:
            self._delta(kind, int_or_none(data.get("output_index")) or 0, data["delta"])
        elif kind == "response.output_item.added" and isinstance(data.get("item"), Mapping):
            item = data["item"]
            if item.get("type") == "function_call" and item.get("name"):
                call = self._call(int_or_none(data.get("output_index")) or 0)
                call["id"] = str(item.get("call_id") or item.get("id") or "")
                call["function"]["name"] = str(item["name"])
        elif kind == "response.created" and isinstance(data.get("response"), Mapping):
            self.response_id = data["response"].get("id") or self.response_id
        elif kind in tokens.RESPONSES_ENDS and isinstance(data.get("response"), Mapping):
            self._final(data["response"])

    def _delta(self, kind: str, index: int, delta: str) -> None:
        if kind == "response.output_text.delta":
            self.content.append(delta)
        elif kind.startswith("response.reasoning"):
            self.reasoning.append(delta)
        elif kind == "response.function_call_arguments.delta":
            self._call(index)["function"]["arguments"] += delta

    def _final(self, response: Mapping[str, Any]) -> None:
        self.response_id = response.get("id") or self.response_id
        self.finish_reason = str(response.get("status") or "") or None
        if response.get("status") == "failed":
            self.error = _error_text(response.get("error") or "response failed")
        if isinstance(response.get("usage"), Mapping):
            u = read_usage(response)
            self.prompt_tokens, self.completion_tokens = u.input_tokens, u.output_tokens
            self.cached_tokens = u.cached_tokens


class MessagesReader(AnswerReader):
    """Anthropic Messages events; the prompt is the input tokens and the cached ones together."""

    api = MESSAGES

    def keep(self, data: Mapping[str, Any]) -> None:
        kind = data.get("type")
        if kind == "error":
            self.error = _error_text(data.get("error") or data)
        elif kind == "message_start" and isinstance(data.get("message"), Mapping):
            self.response_id = data["message"].get("id") or self.response_id
            self._usage(data["message"].get("usage"))
        elif kind == "content_block_start" and isinstance(data.get("content_block"), Mapping):
            block = data["content_block"]
            if block.get("type") == "tool_use" and block.get("name"):
                call = self._call(int_or_none(data.get("index")) or 0)
                call["id"] = str(block.get("id") or "")
                call["function"]["name"] = str(block["name"])
        elif kind == "content_block_delta" and isinstance(data.get("delta"), Mapping):
            self._delta(int_or_none(data.get("index")) or 0, data["delta"])
        elif kind == "message_delta":
            delta = data.get("delta")
            if isinstance(delta, Mapping) and delta.get("stop_reason"):
                self.finish_reason = str(delta["stop_reason"])
            self._usage(data.get("usage"))

    def _delta(self, index: int, delta: Mapping[str, Any]) -> None:
        field = MESSAGES_DELTA_FIELDS.get(str(delta.get("type")))
        value = delta.get(field) if field is not None else None
        if not isinstance(value, str) or not value:
            return
        if field == "text":
            self.content.append(value)
        elif field == "thinking":
            self.reasoning.append(value)
        else:
            self._call(index)["function"]["arguments"] += value

    def _usage(self, usage: Any) -> None:
        if not isinstance(usage, Mapping):
            return
        read = int_or_none(usage.get("cache_read_input_tokens"))
        if int_or_none(usage.get("input_tokens")) is not None:
            self.prompt_tokens = (usage["input_tokens"] + (read or 0)
                                  + (int_or_none(usage.get("cache_creation_input_tokens")) or 0))
        if read is not None:
            self.cached_tokens = read
        if int_or_none(usage.get("output_tokens")) is not None:
            self.completion_tokens = usage["output_tokens"]


def _error_text(error: Any) -> str:
    if isinstance(error, Mapping) and error.get("message"):
        return str(error["message"])
    return error if isinstance(error, str) else json.dumps(error, default=str)


def reader_for(api: str, clock: TokenClock) -> AnswerReader:
    readers: dict[str, type[AnswerReader]] = {CHAT: ChatReader, COMPLETIONS: CompletionsReader,
                                              RESPONSES: ResponsesReader, MESSAGES: MessagesReader}
    if api not in readers:
        raise ValueError(f"api must be one of {', '.join(APIS)}, not {api!r}")
    return readers[api](clock)
