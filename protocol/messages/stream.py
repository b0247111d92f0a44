"""A chat completion stream → the Anthropic Messages event stream it stands for, framed as Anthropic frames it."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from kvtether.protocol.common import reasoning_of
from kvtether.protocol.messages.answer import (
    function_of,
    message_id,
    parses_json,
    stop_reason,
    thinking_signature,
    usage,
)
from kvtether.protocol.messages.common import error_body

Event = tuple[str, dict[str, Any]]  # (SSE event name, its data)


def sse(event: str, data: Mapping[str, Any]) -> bytes:
    """One server-sent event as Anthropic (and vLLM) frame them."""
    payload = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    # A lone surrogate (json.loads lets "\ud800" through) cannot be UTF-8: replaced, not a broken stream.
    return f"event: {event}\ndata: {payload}\n\n".encode("utf-8", "replace")


def error_event(message: str, status: int = 500) -> Event:
    """The event a stream that already started ends with when its upstream breaks."""
    return "error", error_body(status, message)


class StreamTranslator:
    """Chat Completions stream chunks (parsed ``data:`` payloads) → Anthropic Messages stream events.

    ``feed`` each chunk, ``close`` at ``[DONE]`` (or ``fail`` when the upstream breaks); each returns the
    ``(event name, data)`` pairs to send, in order (:func:`sse` frames them). Blocks follow vLLM's converter:
    one open block at a time, a new one whenever the kind changes; every tool call its own ``tool_use`` block
    (parallel calls one after another, as the chat stream sends them); a thinking block gets its
    ``signature_delta`` just before it stops; text that arrives while a tool call is open is held and sent as
    a text block after it. ``message_delta`` goes out at the usage-only chunk that ends a stream with
    ``include_usage``, or at ``close`` when there was none.
    """

    def __init__(self, model: str, *, message_id: str | None = None) -> None:
        self.model = model
        self._id = message_id
        self._started = False
        self._finished = False  # message_delta sent
        self._closed = False
        self._next_index = 0
        self._block: str | None = None  # type of the open block
        self._block_index = 0
        self._thinking: list[str] = []
        self._tool_id: str | None = None  # id of the open tool_use block
        self._tool_ids: dict[int, str] = {}  # chat tool-call index → id
        self._pending_text: list[str] = []
        self._finish_reason: Any = None
        self._matched_stop: Any = None
        self._tool_used = False
        self._last_tool_args: list[str] = []
        self._usage: Any = None

    def feed(self, chunk: Mapping[str, Any]) -> list[Event]:
        if self._closed or self._finished:
            return []
        events: list[Event] = []
        chunk_usage = chunk.get("usage")
        if isinstance(chunk_usage, Mapping):
            self._usage = chunk_usage
        if not self._started:
            events.append(self._message_start(chunk.get("id")))
        choices = chunk.get("choices")
        if not choices:
            # The usage-only chunk that stream_options.include_usage ends a stream with.
            if isinstance(chunk_usage, Mapping):
                events += self._message_delta()
            return events
        choice = next((c for c in choices if isinstance(c, Mapping) and c.get("index", 0) == 0), None)
        if choice is None:
            return events
        if choice.get("finish_reason") is not None:
            self._finish_reason = choice["finish_reason"]
            self._matched_stop = choice.get("stop_reason")
        delta = choice.get("delta")
        if not isinstance(delta, Mapping):
            return events
        reasoning = reasoning_of(delta)
        if reasoning:
            if self._block != "thinking":
                events += self._stop_and_flush()
                events.append(self._start({"type": "thinking", "thinking": ""}))
            self._thinking.append(reasoning)
            events.append(self._delta({"type": "thinking_delta", "thinking": reasoning}))
        text = delta.get("content")
        if isinstance(text, str) and text:
            if self._block == "tool_use":
                self._pending_text.append(text)
            else:
                if self._block != "text":
                    events += self._stop_and_flush()
                    events.append(self._start({"type": "text", "text": ""}))
                events.append(self._delta({"type": "text_delta", "text": text}))
        for call in delta.get("tool_calls") or ():
            if isinstance(call, Mapping):
                events += self._tool_call(call)
        return events

    def close(self) -> list[Event]:
        """The events after the stream's last chunk (``[DONE]``): the open block stopped, ``message_delta``
        if the usage chunk did not already send it, ``message_stop``."""
        if self._closed:
            return []
        events: list[Event] = []
        if not self._started:
            events.append(self._message_start(None))
        if not self._finished:
            events += self._message_delta()
        events.append(("message_stop", {"type": "message_stop"}))
        self._closed = True
        return events

    def fail(self, message: str, status: int = 500) -> list[Event]:
        """The events that end a stream whose upstream broke: the open block stopped (as vLLM 0.34 does, so
        a client's block bookkeeping stays consistent), then an ``error`` event."""
        if self._closed:
            return []
        events = self._stop_block()
        events.append(error_event(message, status))
        self._closed = True
        return events

    # --- internals ---

    def _message_start(self, chat_id: Any) -> Event:
        self._started = True
        if self._id is None:
            self._id = message_id(chat_id)
        return "message_start", {"type": "message_start", "message": {
            "id": self._id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": usage(self._usage)}}

    def _message_delta(self) -> list[Event]:
        events = self._stop_and_flush()
        complete = self._tool_used and parses_json("".join(self._last_tool_args))
        reason, sequence = stop_reason(self._finish_reason or "stop", self._matched_stop,
                                       tool_used=self._tool_used, tool_complete=complete)
        events.append(("message_delta", {"type": "message_delta",
                                         "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                         "usage": usage(self._usage)}))
        self._finished = True
        return events

    def _start(self, block: dict[str, Any]) -> Event:
        self._block = block["type"]
        self._block_index = self._next_index
        self._tool_id = block.get("id") if block["type"] == "tool_use" else None
        self._thinking = []
        return "content_block_start", {"type": "content_block_start", "index": self._block_index,
                                       "content_block": block}

    def _delta(self, delta: dict[str, Any]) -> Event:
        return "content_block_delta", {"type": "content_block_delta", "index": self._block_index, "delta": delta}

    def _stop_block(self) -> list[Event]:
        if self._block is None:
            return []
        events: list[Event] = []
        if self._block == "thinking":
            signature = thinking_signature("".join(self._thinking))
            events.append(self._delta({"type": "signature_delta", "signature": signature}))
        events.append(("content_block_stop", {"type": "content_block_stop", "index": self._block_index}))
        self._block = None
        self._tool_id = None
        self._next_index += 1
        return events

    def _stop_and_flush(self) -> list[Event]:
        events = self._stop_block()
        if self._pending_text:
            text = "".join(self._pending_text)
            self._pending_text = []
            events.append(self._start({"type": "text", "text": ""}))
            events.append(self._delta({"type": "text_delta", "text": text}))
            events += self._stop_block()
        return events

    def _tool_call(self, call: Mapping[str, Any]) -> list[Event]:
        events: list[Event] = []
        index = call.get("index", 0)
        fn = function_of(call)
        arguments = fn.get("arguments")
        call_id = call.get("id")
        if isinstance(call_id, str) and call_id:
            self._tool_ids[index] = call_id
            name = fn.get("name")
            # A new block for a new call that has its name (a chunk may carry the id before the name).
            if self._tool_id != call_id and isinstance(name, str):
                events += self._stop_and_flush()
                self._tool_used = True
                self._last_tool_args = []
                events.append(self._start({"type": "tool_use", "id": call_id, "name": name, "input": {}}))
        else:
            call_id = self._tool_ids.get(index)
        # Argument fragments go to the call's block while it is the open one (vLLM's rule: the chat stream
        # finishes one call's arguments before the next call starts).
        if isinstance(arguments, str) and arguments and call_id is not None and self._tool_id == call_id:
            self._last_tool_args.append(arguments)
            events.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
        return events
