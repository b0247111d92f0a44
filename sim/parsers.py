"""Output parsing like vLLM's Qwen3 reasoning parser and hermes tool parser.

One streaming state machine serves both modes: a non-streamed response is the concatenation of the
deltas, so the two can never disagree. Newlines that only frame a section (after ``<think>``, before
``</think>``, before ``<tool_call>``) are dropped, because the chat template adds them back when the
client returns the message — that is what makes the round trip token-exact.
"""

from __future__ import annotations

import codecs
import json
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvtether.sim.tokenizer import THINK_END, THINK_START, TOOL_CALL_END, TOOL_CALL_START, Tokenizer


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str


@dataclass(slots=True)
class Delta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def empty(self) -> bool:
        return not (self.content or self.reasoning or self.tool_calls)


def new_tool_call_id() -> str:
    return "chatcmpl-tool-" + secrets.token_hex(16)


class ChatOutputParser:
    def __init__(self, tok: Tokenizer, *, parse_tools: bool = True) -> None:
        self._tok = tok
        self._parse_tools = parse_tools
        self._think_start = tok.special(THINK_START)
        self._think_end = tok.special(THINK_END)
        self._tool_start = tok.special(TOOL_CALL_START)
        self._tool_end = tok.special(TOOL_CALL_END)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._section = "content"  # "content" | "reasoning" | "tool"
        self._emitted = False  # anything emitted in the current section yet
        self._pending = ""  # trailing newlines held back until we know they are not framing
        self._tool_buf = ""
        self.tool_calls: list[ToolCall] = []

    def push(self, token_id: int) -> Delta:
        d = Delta()
        if token_id == self._think_start and self._section == "content":
            self._enter("reasoning")
        elif token_id == self._think_end and self._section == "reasoning":
            self._enter("content")
        elif token_id == self._tool_start and self._parse_tools and self._section != "tool":
            self._enter("tool")
            self._tool_buf = ""
        elif token_id == self._tool_end and self._section == "tool":
            call = self._parse_tool(self._tool_buf)
            if call is None:
                d.content = f"{TOOL_CALL_START}{self._tool_buf}{TOOL_CALL_END}"
            else:
                self.tool_calls.append(call)
                d.tool_calls.append(call)
            self._enter("content")
        elif self._tok.is_special(token_id):
            pass  # eos and other specials are skipped, as with skip_special_tokens
        else:
            text = self._decoder.decode(self._tok.token_bytes(token_id))
            if self._section == "tool":
                self._tool_buf += text
            else:
                self._text(text, d)
        return d

    def _enter(self, section: str) -> None:
        self._section = section
        self._emitted = False
        self._pending = ""

    def _text(self, text: str, d: Delta) -> None:
        if not self._emitted:
            text = text.lstrip("\n")
        text = self._pending + text
        body = text.rstrip("\n")
        self._pending = text[len(body) :]
        if not body:
            return
        self._emitted = True
        if self._section == "reasoning":
            d.reasoning += body
        else:
            d.content += body

    @staticmethod
    def _parse_tool(raw: str) -> ToolCall | None:
        try:
            obj = json.loads(raw.strip())
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", {})
        arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        return ToolCall(id=new_tool_call_id(), name=obj["name"], arguments=arguments)


@dataclass(slots=True)
class ParsedOutput:
    content: str | None
    reasoning: str | None
    tool_calls: list[ToolCall]


def parse_chat_output(tok: Tokenizer, ids: Iterable[int], *, parse_tools: bool = True) -> ParsedOutput:
    parser = ChatOutputParser(tok, parse_tools=parse_tools)
    content, reasoning = "", ""
    for t in ids:
        d = parser.push(t)
        content += d.content
        reasoning += d.reasoning
    return ParsedOutput(
        content=content if content or not parser.tool_calls else None,
        reasoning=reasoning or None,
        tool_calls=parser.tool_calls,
    )
