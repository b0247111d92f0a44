"""One call of a session as the client sees it: ``TurnMetrics`` (public) and the reading of its answer.

A ``Call`` is fed every parsed payload of its response (each SSE event of a stream, or the whole body of a
non-streamed answer) and keeps the metrics current: TTFC, TTFT, usage, finish reason and the answer. What a
payload means depends on the API, so each API has a reader:

TTFT is the first event that carries a token of the answer, of any kind, by ``kvtether.protocol.tokens``'s rule
(the CLI and the gateway read the same): text, reasoning, a refusal, or a tool call from the event that names it.

TTFC is the first SSE event of any kind. This module knows no client library and no session: the call reports
its end through the ``Owner`` it was made by.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvtether.protocol import messages, responses, tokens
from kvtether.protocol.common import int_or_none

CHAT = "chat"
RESPONSES = "responses"
MESSAGES = "messages"


@dataclass(slots=True)
class TurnMetrics:
    """What the client saw for one call of the session. Filled in live; ``done`` once final.

    Times are milliseconds from the moment the call was issued (before the first attempt), so a
    hidden SDK retry shows up in them; ``attempts`` says how many HTTP attempts were made. ``answer`` and
    ``finish_reason`` are in chat-completions terms for every API (``api`` says which one was called).
    """

    seq: int  # position of the call in this session (0-based, call order)
    turn: int  # turn index stamped on the request (the model's answers in its history)
    prefix: str | None
    parent: str | None
    model: str | None
    stream: bool
    started_at: float  # wall clock (time.time()) when the call was issued
    attempts: int = 0
    request_id: str | None = None  # the server's x-request-id, when it sends one
    ttfc_ms: float | None = None  # first SSE event of any kind (streams only)
    ttft_ms: float | None = None  # first event carrying output: text, tool call, refusal or reasoning
    e2e_ms: float | None = None  # until the answer was complete (stream ended / body parsed)
    chunks: int = 0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    answer: dict[str, Any] | None = None  # the assistant message (assembled from deltas for streams)
    error: str | None = None  # exception type name when the call failed
    aborted: bool = False  # the stream was closed before its end (or the session closed first)
    done: bool = False
    api: str = CHAT  # "chat", "responses" (OpenAI Responses) or "messages" (Anthropic Messages)


class Owner(Protocol):
    """Who made the call and is told when it ends (the session)."""

    def _finish(self, call: Call, *, error: BaseException | None = None, aborted: bool = False) -> None: ...


class _Reader(Protocol):
    def read(self, call: Call, data: Mapping[str, Any], now_ns: int) -> bool:
        """Take one payload (under the call's lock); True when it completes the answer."""
        ...

    def complete(self) -> bool:
        """Whether the answer's end was seen (a stream closed after it lost nothing)."""
        ...

    def streamed_answer(self) -> dict[str, Any] | None:
        """The answer assembled from a stream's events, if any arrived."""
        ...


@dataclass(eq=False)
class Call:
    """Private state of one call; ``metrics`` is what the user sees."""

    session: Owner
    metrics: TurnMetrics
    body: dict[str, Any]  # the request body as sent (plain JSON data when recording)
    t0_ns: int
    reader: _Reader
    span: Any = None  # tracing.CallSpan when a tracer provider is configured
    iterator_wrapped: bool = False  # the returned stream's iterator is observed: it says when the stream ends
    lock: threading.Lock = field(default_factory=threading.Lock)

    def ms(self, now_ns: int) -> float:
        return (now_ns - self.t0_ns) / 1e6

    def first_event(self, now_ns: int) -> None:
        m = self.metrics
        m.chunks += 1
        if m.ttfc_ms is None:
            m.ttfc_ms = self.ms(now_ns)

    def first_token(self, now_ns: int) -> None:
        if self.metrics.ttft_ms is None:
            self.metrics.ttft_ms = self.ms(now_ns)

    @property
    def complete(self) -> bool:
        return self.reader.complete()

    def on_data(self, data: Any, now_ns: int) -> None:
        """One parsed JSON payload of the response: a stream event or a whole answer."""
        if not isinstance(data, Mapping):
            return
        if set(data) == {"data", "event"} and isinstance(data["data"], Mapping):
            data = data["data"]  # openai's synthesize_event_and_data wrapping
        with self.lock:
            if self.metrics.done:
                return
            if self.metrics.model is None and isinstance(data.get("model"), str):
                self.metrics.model = data["model"]
            finish = self.reader.read(self, data, now_ns)
        if finish:
            self.session._finish(self)

    def final_answer(self) -> None:
        """At the end of a stream (caller holds the lock): the assembled answer, unless a whole one came."""
        m = self.metrics
        if m.stream and m.answer is None:
            m.answer = self.reader.streamed_answer()


# --- chat completions -------------------------------------------------------------------------


class _ChatAnswer:
    """Assembles the assistant message of choice 0 from stream deltas."""

    __slots__ = ("content", "reasoning", "reasoning_key", "refusal", "tool_calls")

    def __init__(self) -> None:
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.reasoning_key = "reasoning_content"
        self.refusal: list[str] = []
        self.tool_calls: dict[int, dict[str, Any]] = {}

    def add(self, delta: Mapping[str, Any]) -> None:
        if isinstance(delta.get("content"), str):
            self.content.append(delta["content"])
        for key in ("reasoning_content", "reasoning"):
            if isinstance(delta.get(key), str):
                self.reasoning_key = key
                self.reasoning.append(delta[key])
        if isinstance(delta.get("refusal"), str):
            self.refusal.append(delta["refusal"])
        for tc in delta.get("tool_calls") or ():
            if not isinstance(tc, Mapping):
                continue
            slot = self.tool_calls.setdefault(
                int(tc.get("index") or 0), {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
            )
            if tc.get("id"):
                slot["id"] = tc["id"]
            if tc.get("type"):
                slot["type"] = tc["type"]
            fn = tc.get("function") or {}
            if fn.get("name"):
                slot["function"]["name"] += fn["name"]
            if fn.get("arguments"):
                slot["function"]["arguments"] += fn["arguments"]

    def message(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant"}
        text = "".join(self.content)
        calls = [{k: v for k, v in self.tool_calls[i].items() if v is not None} for i in sorted(self.tool_calls)]
        # Same shape as a non-streamed answer: a tool-call-only message has content null.
        msg["content"] = text if text or not calls else None
        if self.reasoning:
            msg[self.reasoning_key] = "".join(self.reasoning)
        if self.refusal:
            msg["refusal"] = "".join(self.refusal)
        if calls:
            msg["tool_calls"] = calls
        return msg


class ChatReader:
    def __init__(self, body: Mapping[str, Any]) -> None:
        opts = body.get("stream_options")
        self.include_usage = isinstance(opts, Mapping) and bool(opts.get("include_usage"))
        self.answer = _ChatAnswer()
        self.finished_choices = False
        self.any_chunk = False

    def complete(self) -> bool:
        return self.finished_choices

    def streamed_answer(self) -> dict[str, Any] | None:
        return self.answer.message() if self.any_chunk else None

    def read(self, call: Call, data: Mapping[str, Any], now_ns: int) -> bool:
        m = call.metrics
        self._usage(m, data.get("usage"))
        choices = data.get("choices") or []
        first = choices[0] if choices and isinstance(choices[0], Mapping) else {}
        kind = data.get("object")
        if kind == "chat.completion" or (kind is None and "message" in first):
            msg = first.get("message") or {}
            m.answer = {k: v for k, v in msg.items() if v is not None} if isinstance(msg, Mapping) else None
            m.finish_reason = first.get("finish_reason")
            return True
        if kind != "chat.completion.chunk" and "choices" not in data:
            return False
        self.any_chunk = True
        call.first_event(now_ns)
        for choice in choices:
            if isinstance(choice, Mapping):
                self._choice(call, choice, now_ns)
        # Without the stream's iterator (raw/streaming-response paths) the end is inferred:
        # the usage chunk is last when asked for, otherwise the finish_reason chunk is.
        return not call.iterator_wrapped and bool(
            data.get("usage") or (self.finished_choices and not self.include_usage)
        )

    def _choice(self, call: Call, choice: Mapping[str, Any], now_ns: int) -> None:
        delta = choice.get("delta") or {}
        if isinstance(delta, Mapping) and tokens.chat_delta_has_token(delta):
            call.first_token(now_ns)
        if choice.get("index", 0) == 0:
            if isinstance(delta, Mapping):
                self.answer.add(delta)
            if choice.get("finish_reason"):
                call.metrics.finish_reason = choice["finish_reason"]
                self.finished_choices = True

    @staticmethod
    def _usage(m: TurnMetrics, usage: Any) -> None:
        if not isinstance(usage, Mapping):
            return
        if int_or_none(usage.get("prompt_tokens")) is not None:
            m.prompt_tokens = usage["prompt_tokens"]
        if int_or_none(usage.get("completion_tokens")) is not None:
            m.completion_tokens = usage["completion_tokens"]
        details = usage.get("prompt_tokens_details")
        if isinstance(details, Mapping) and int_or_none(details.get("cached_tokens")) is not None:
            m.cached_tokens = details["cached_tokens"]


# --- OpenAI Responses -------------------------------------------------------------------------

_RESPONSE_ENDS = ("response.completed", "response.incomplete", "response.failed")


class ResponsesReader:
    def __init__(self) -> None:
        self.ended = False
        self.items: list[Any] = []  # output items as each finished, for a stream cut before its end

    def complete(self) -> bool:
        return self.ended

    def streamed_answer(self) -> dict[str, Any] | None:
        return responses.chat_answer(self.items) if self.items else None

    def read(self, call: Call, data: Mapping[str, Any], now_ns: int) -> bool:
        if data.get("object") == "response":  # a whole, non-streamed answer
            self._final(call.metrics, data)
            return True
        kind = data.get("type")
        if not isinstance(kind, str):
            return False
        call.first_event(now_ns)
        if tokens.responses_event_has_token(data):
            call.first_token(now_ns)
        if kind == "response.output_item.done" and isinstance(data.get("item"), Mapping):
            self.items.append(data["item"])
        elif kind in _RESPONSE_ENDS and isinstance(data.get("response"), Mapping):
            self._final(call.metrics, data["response"])
            self.ended = True
            return not call.iterator_wrapped
        return False

    @staticmethod
    def _final(m: TurnMetrics, response: Mapping[str, Any]) -> None:
        if isinstance(response.get("model"), str):
            m.model = response["model"]
        m.answer = responses.chat_answer(response.get("output") or [])
        m.finish_reason = responses.chat_finish_reason(response)
        if isinstance(response.get("usage"), Mapping):
            u = responses.read_usage(response)
            m.prompt_tokens, m.completion_tokens, m.cached_tokens = u.input_tokens, u.output_tokens, u.cached_tokens


# --- Anthropic Messages -----------------------------------------------------------------------

_DELTA_FIELDS = tokens.MESSAGES_DELTA_FIELDS


class MessagesReader:
    def __init__(self) -> None:
        self.blocks: dict[int, dict[str, Any]] = {}
        self.json_parts: dict[int, list[str]] = {}
        self.stopped = False
        self.usage: dict[str, int] = {}

    def complete(self) -> bool:
        return self.stopped

    def streamed_answer(self) -> dict[str, Any] | None:
        if not self.blocks:
            return None
        for index, parts in self.json_parts.items():
            with contextlib.suppress(ValueError):  # cut mid-JSON: keep what the block started with
                self.blocks[index]["input"] = json.loads("".join(parts) or "{}")
        return messages.chat_answer(self.blocks[i] for i in sorted(self.blocks))

    def read(self, call: Call, data: Mapping[str, Any], now_ns: int) -> bool:
        kind = data.get("type")
        if kind == "message" and "content" in data:  # a whole, non-streamed answer
            call.metrics.answer = messages.chat_answer(data.get("content") or [])
            call.metrics.finish_reason = messages.chat_finish_reason(data.get("stop_reason"))
            self._usage(call.metrics, data.get("usage"))
            return True
        if not isinstance(kind, str):
            return False
        call.first_event(now_ns)
        if tokens.messages_event_has_token(data):
            call.first_token(now_ns)
        if kind == "message_start" and isinstance(data.get("message"), Mapping):
            self._usage(call.metrics, data["message"].get("usage"))
        elif kind == "content_block_start" and isinstance(data.get("content_block"), Mapping):
            self.blocks[int_or_none(data.get("index")) or 0] = dict(data["content_block"])
        elif kind == "content_block_delta" and isinstance(data.get("delta"), Mapping):
            self._delta(call, int_or_none(data.get("index")) or 0, data["delta"], now_ns)
        elif kind == "message_delta":
            delta = data.get("delta")
            if isinstance(delta, Mapping) and delta.get("stop_reason"):
                call.metrics.finish_reason = messages.chat_finish_reason(delta["stop_reason"])
                self.stopped = True
            self._usage(call.metrics, data.get("usage"))
        elif kind == "message_stop":
            self.stopped = True
            return not call.iterator_wrapped
        return False

    def _delta(self, call: Call, index: int, delta: Mapping[str, Any], now_ns: int) -> None:
        field_name = _DELTA_FIELDS.get(str(delta.get("type")))
        if field_name is None:
            return
        value = delta.get(field_name)
        if not isinstance(value, str) or not value:
            return
        block = self.blocks.setdefault(index, {"type": "text", "text": ""})
        if field_name == "partial_json":
            self.json_parts.setdefault(index, []).append(value)
        else:
            block[field_name] = str(block.get(field_name) or "") + value

    def _usage(self, m: TurnMetrics, usage: Any) -> None:
        """Anthropic counts ``input_tokens`` besides the cached ones: the prompt is their sum."""
        if not isinstance(usage, Mapping):
            return
        for key in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens", "output_tokens"):
            value = int_or_none(usage.get(key))
            if value is not None:
                self.usage[key] = value
        if "input_tokens" in self.usage:
            m.prompt_tokens = (self.usage["input_tokens"] + self.usage.get("cache_read_input_tokens", 0)
                               + self.usage.get("cache_creation_input_tokens", 0))
        if "cache_read_input_tokens" in self.usage:
            m.cached_tokens = self.usage["cache_read_input_tokens"]
        if "output_tokens" in self.usage:
            m.completion_tokens = self.usage["output_tokens"]


def reader_for(api: str, body: Mapping[str, Any]) -> _Reader:
    if api == RESPONSES:
        return ResponsesReader()
    if api == MESSAGES:
        return MessagesReader()
    return ChatReader(body)


def chat_request(api: str, body: Mapping[str, Any]) -> Mapping[str, Any]:
    """The chat-completions body a call stands for (the recorder writes chat turns): the one the gateway sends
    for it, by the gateway's own translation, lenient (the server took the request: what the gateway would
    refuse is left out). A Responses chain (``previous_response_id``) is not expanded: the client never saw
    the history the server keeps."""
    if api == RESPONSES:
        return responses.translate(body, lenient=True).chat
    if api == MESSAGES:
        return messages.translate(body, lenient=True).chat
    return body
