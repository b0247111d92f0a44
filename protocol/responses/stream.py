"""A chat completion stream → the Responses event stream it stands for, numbered and framed as OpenAI frames it."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from kvtether.protocol.common import reasoning_of
from kvtether.protocol.responses.answer import (
    ToolNames,
    finish,
    message_item,
    output_item_id,
    reasoning_item,
    usage,
)
from kvtether.protocol.responses.common import ReasoningSeal


def error_event(message: str, code: str = "server_error") -> dict[str, Any]:
    """The event a stream that already started ends with when its upstream breaks."""
    return {"type": "error", "code": code, "message": message, "param": None}


def sse(event: dict[str, Any]) -> bytes:
    """One event as OpenAI (and vLLM) frame Responses streams: ``event:`` line, ``data:`` line, no [DONE]."""
    payload = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {payload}\n\n".encode("utf-8", "replace")


class StreamTranslator:
    """Chat Completions stream chunks (parsed ``data:`` payloads) → Responses stream events, numbered.

    ``response.created`` and ``response.in_progress`` first; then per output item, in the order the chat stream
    produces them: ``output_item.added``, its deltas (``reasoning_text`` / ``output_text`` with their
    ``content_part`` events, ``function_call_arguments``, ``custom_tool_call_input``), its ``.done`` events and
    ``output_item.done``; at the end ``response.completed`` or ``response.incomplete`` with the whole response.
    An item is done when the stream moves to another kind of output (or another tool call), or at the end.
    """

    def __init__(self, base: dict[str, Any], *, tools: Any, seal: ReasoningSeal | None) -> None:
        self.response = dict(base)
        self._seal = seal
        self._names = ToolNames(tools)
        self._seq = 0
        self._started = False
        self._closed = False
        self._output: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item being streamed
        self._text: list[str] = []
        self._calls: dict[int, dict[str, Any]] = {}  # chat tool-call index → its item being streamed
        self._chat_id: Any = None
        self._finish_reason: Any = None
        self._usage: Any = None

    @property
    def final(self) -> dict[str, Any] | None:
        """The whole response once the stream closed cleanly."""
        return self.response if self._closed and self.response.get("status") in ("completed", "incomplete") \
            else None

    def feed(self, chunk: Mapping[str, Any]) -> list[dict[str, Any]]:
        if self._closed:
            return []
        events = self._start() if not self._started else []
        if self._chat_id is None and chunk.get("id"):
            self._chat_id = chunk["id"]
        if isinstance(chunk.get("usage"), Mapping):
            self._usage = chunk["usage"]
        choices = chunk.get("choices")
        choice = next((c for c in choices or () if isinstance(c, Mapping) and c.get("index", 0) == 0), None)
        if choice is None:
            return events
        if choice.get("finish_reason") is not None:
            self._finish_reason = choice["finish_reason"]
        delta = choice.get("delta")
        if not isinstance(delta, Mapping):
            return events
        reasoning = reasoning_of(delta)
        if reasoning:
            events += self._text_delta("reasoning", reasoning)
        content = delta.get("content")
        if isinstance(content, str) and content:
            events += self._text_delta("message", content)
        for call in delta.get("tool_calls") or ():
            if isinstance(call, Mapping):
                events += self._tool_delta(call)
        return events

    def close(self) -> list[dict[str, Any]]:
        if self._closed:
            return []
        events = self._start() if not self._started else []
        events += self._close_open()
        events += self._close_calls()
        finish(self.response, self._finish_reason)
        self.response["output"] = self._output
        self.response["usage"] = usage(self._usage)
        kind = "response.completed" if self.response["status"] == "completed" else "response.incomplete"
        events.append(self._event(kind, response=self.response))
        self._closed = True
        return events

    def fail(self, message: str) -> list[dict[str, Any]]:
        if self._closed:
            return []
        events = self._start() if not self._started else []
        self.response["status"] = "failed"
        self.response["error"] = {"code": "server_error", "message": message}
        self.response["output"] = self._output
        events.append(self._event("error", **{k: v for k, v in error_event(message).items() if k != "type"}))
        events.append(self._event("response.failed", response=self.response))
        self._closed = True
        return events

    # --- internals ---

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def _start(self) -> list[dict[str, Any]]:
        self._started = True
        snapshot = {**self.response, "output": []}
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def _item_id(self, prefix: str) -> str:
        return output_item_id(prefix, self._chat_id, len(self._output) + len(self._calls) + (self._open is not None))

    def _text_delta(self, kind: str, delta: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._open is None or self._open["type"] != kind:
            events += self._close_open()
            events += self._close_calls()
            index = len(self._output)
            if kind == "reasoning":
                item = {"type": "reasoning", "id": self._item_id("rs"), "summary": [], "content": []}
                part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
            else:
                item = message_item("", self._item_id("msg"), "in_progress")
                item["content"] = []
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self._open = {"type": kind, "item": item, "index": index}
            self._text = []
            events.append(self._event("response.output_item.added", output_index=index, item=item))
            events.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                      content_index=0, part=part))
        self._text.append(delta)
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra: dict[str, Any] = {} if kind == "reasoning" else {"logprobs": []}
        events.append(self._event(name, item_id=self._open["item"]["id"], output_index=self._open["index"],
                                  content_index=0, delta=delta, **extra))
        return events

    def _close_open(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        kind, index, item_id = self._open["type"], self._open["index"], self._open["item"]["id"]
        text = "".join(self._text)
        if kind == "reasoning":
            item = reasoning_item(text, item_id, seal=self._seal)
            part: dict[str, Any] = {"type": "reasoning_text", "text": text}
            done = self._event("response.reasoning_text.done", item_id=item_id, output_index=index,
                               content_index=0, text=text)
        else:
            item = message_item(text, item_id)
            part = item["content"][0]
            done = self._event("response.output_text.done", item_id=item_id, output_index=index, content_index=0,
                               text=text, logprobs=[])
        events = [done,
                  self._event("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                              part=part),
                  self._event("response.output_item.done", output_index=index, item=item)]
        self._output.append(item)
        self._open = None
        self._text = []
        return events

    def _tool_delta(self, call: Mapping[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        index = call.get("index", 0)
        fn = call.get("function") if isinstance(call.get("function"), Mapping) else {}
        assert isinstance(fn, Mapping)
        state = self._calls.get(index)
        if state is None:
            name = fn.get("name")
            if not isinstance(name, str) or not name:
                return events  # arguments before the call's name: nothing to attach them to yet
            events += self._close_open()
            output_index = len(self._output) + len(self._calls)
            raw_id = call.get("id")
            call_id = raw_id if isinstance(raw_id, str) and raw_id else f"call_{index}"
            item = self._names.item(call_id, name, "", self._item_id("fc"))
            item["status"] = "in_progress"
            state = {"item": item, "index": output_index, "args": [], "name": name}
            self._calls[index] = state
            events.append(self._event("response.output_item.added", output_index=output_index, item=item))
        arguments = fn.get("arguments")
        if isinstance(arguments, str) and arguments:
            state["args"].append(arguments)
            if state["item"]["type"] == "function_call":
                events.append(self._event("response.function_call_arguments.delta", item_id=state["item"]["id"],
                                          output_index=state["index"], delta=arguments))
        return events

    def _close_calls(self) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for state in sorted(self._calls.values(), key=lambda s: s["index"]):
            arguments = "".join(state["args"])
            streamed = state["item"]
            item = self._names.item(streamed["call_id"], state["name"], arguments, streamed["id"])
            if item["type"] == "function_call":
                events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                          output_index=state["index"], name=item["name"], arguments=arguments))
            else:
                # The payload is only known once the shim's JSON is whole: it goes out as one delta.
                events.append(self._event("response.custom_tool_call_input.delta", item_id=item["id"],
                                          output_index=state["index"], delta=item["input"]))
                events.append(self._event("response.custom_tool_call_input.done", item_id=item["id"],
                                          output_index=state["index"], input=item["input"]))
            events.append(self._event("response.output_item.done", output_index=state["index"], item=item))
            self._output.append(item)
        self._calls = {}
        return events

