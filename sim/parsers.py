"""Output parsing like vLLM's Qwen3 reasoning parser and its hermes or glm47 tool parser.

One streaming state machine serves both modes: a non-streamed response's content and reasoning are the
concatenation of the deltas, and its tool calls are the calls completed by ``</tool_call>``, so the two
can never disagree on a complete answer. Newlines that only frame a section (after ``<think>``, before
``</think>``, before ``<tool_call>``) are dropped, because the chat template adds them back when the
client returns the message — that is what makes the round trip token-exact.

Tool calls stream the way vLLM's hermes parser streams them: one delta with ``index``, ``id``, ``type``
and ``function.name`` (no ``arguments`` key, as vLLM's ``exclude_none`` dump) once the name string is
closed, then ``function.arguments`` fragments as the arguments are generated. A call cut off by
``max_tokens`` has therefore streamed its name and the arguments generated so far; non-streamed, vLLM's
``extract_tool_calls`` fails to ``json.loads`` the cut call and returns the raw text as ``content`` with
no tool calls (see ``ChatOutputParser.finish``).

GLM-4.7 / GLM-5 calls (``tool_format="glm47"``, vLLM's ``glm47`` parser) are
``<tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value>...</tool_call>``, every tag one special token.
The name goes out when the first ``<arg_key>`` (or ``</tool_call>``) arrives, so a call's first delta waits
for the name's tokens plus one, not for the ~12 tokens of a hermes head. Each finished pair then streams as
a fragment of the arguments' JSON object. A value is JSON where it reads back to the same text (numbers,
booleans, objects), else a string, so a call sent back by the client renders to the tokens generated. A
call cut off by ``max_tokens`` is raw content, non-streamed (vLLM's regex needs ``</tool_call>``).
"""

from __future__ import annotations

import codecs
import hashlib
import itertools
import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from kvtether.sim.template import GLM47, HERMES, TOOL_FORMATS
from kvtether.sim.tokenizer import (
    ARG_KEY_END,
    ARG_KEY_START,
    ARG_VALUE_END,
    ARG_VALUE_START,
    THINK_END,
    THINK_START,
    TOOL_CALL_END,
    TOOL_CALL_START,
    Tokenizer,
)


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str


@dataclass(slots=True)
class ToolCallDelta:
    """One streamed tool-call fragment; None fields are left out of the chunk (vLLM's exclude_none)."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"index": self.index}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
        fn: dict[str, str] = {}
        if self.name is not None:
            fn["name"] = self.name
        if self.arguments is not None:
            fn["arguments"] = self.arguments
        out["function"] = fn
        return out


@dataclass(slots=True)
class Delta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def empty(self) -> bool:
        return not (self.content or self.reasoning or self.tool_calls)

    def extend(self, later: Delta) -> None:
        """Appends the delta of the tokens after this one's: what vLLM's parsers give for the text of both at once
        (a chunk of several tokens under --stream-interval). A call's later argument fragments join its earlier
        one; a call's head (its id and name) always opens a fragment of its own."""
        self.content += later.content
        self.reasoning += later.reasoning
        for call in later.tool_calls:
            last = self.tool_calls[-1] if self.tool_calls else None
            if last is not None and last.index == call.index and call.id is None and call.name is None:
                self.tool_calls[-1] = ToolCallDelta(last.index, last.id, last.name,
                                                    (last.arguments or "") + (call.arguments or ""))
            else:
                self.tool_calls.append(call)


def tool_call_ids(seed: bytes | Callable[[], bytes]) -> Callable[[], str]:
    """vLLM's tool-call ids (``chatcmpl-tool-`` + 32 hex), drawn in order from `seed`: the request's (sim/api.py),
    so that the same request gets the same ids whatever ran before it, and a replay's histories repeat exactly.
    A callable seed is called once, at the first id: most answers call no tool, and a request's seed hashes its
    whole prompt."""
    counter = itertools.count()
    known: list[bytes] = []

    def next_id() -> str:
        if not known:
            known.append(seed() if callable(seed) else seed)
        return "chatcmpl-tool-" + hashlib.blake2b(known[0] + next(counter).to_bytes(4, "little"),
                                                  digest_size=16).hexdigest()

    return next_id


# Parsers made without a request's seed (tests, one-off parses) still give every call an id of its own.
_UNSEEDED_PARSERS = itertools.count()


# The head of a hermes call up to its closed name string, then the separator before the arguments value.
_NAME_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")')
_ARGS_HEAD = re.compile(r'\s*,\s*"arguments"\s*:\s*(?=\S)')


class _ArgsScanner:
    """Finds where a streamed JSON object/array value ends (string-aware bracket depth), char by char."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_str = False
        self.esc = False
        self.done = False

    def feed(self, text: str) -> str:
        """The part of `text` that belongs to the value (everything up to its closing bracket)."""
        for i, ch in enumerate(text):
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif ch == "\\":
                    self.esc = True
                elif ch == '"':
                    self.in_str = False
            elif ch == '"':
                self.in_str = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return text[: i + 1]
        return text


def glm47_value(text: str) -> Any:
    """An <arg_value> back as a JSON value: parsed where that reads back to the very text, else the string."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    if isinstance(value, str) or json.dumps(value, ensure_ascii=False) != text:
        return text
    return value


class _Glm47Call:
    """One glm47 call being generated: its name, then key/value pairs, as the tag tokens arrive."""

    def __init__(self) -> None:
        self.part = "name"  # "name" | "key" | "between" | "value"
        self.name = ""
        self.key = ""
        self.value = ""
        self.pairs: list[str] = []  # '"key": value' JSON members, in order

    def text(self, s: str) -> None:
        if self.part == "name":
            self.name += s
        elif self.part == "key":
            self.key += s
        elif self.part == "value":
            self.value += s
        # between the tags ("between"): GLM-4.5 puts newlines there; they are not part of the call

    def arguments(self) -> str:
        return "{" + ", ".join(self.pairs) + "}"


class ChatOutputParser:
    def __init__(self, tok: Tokenizer, *, parse_tools: bool = True, tool_format: str = HERMES,
                 call_ids: Callable[[], str] | None = None) -> None:
        if tool_format not in TOOL_FORMATS:
            raise ValueError(f"tool_format must be one of {TOOL_FORMATS}, got {tool_format!r}")
        self._tok = tok
        self._parse_tools = parse_tools
        self._call_id = call_ids or tool_call_ids(b"parser-%d" % next(_UNSEEDED_PARSERS))
        self._glm = tool_format == GLM47
        self._arg_tags = {
            tok.special(ARG_KEY_START): ARG_KEY_START,
            tok.special(ARG_KEY_END): ARG_KEY_END,
            tok.special(ARG_VALUE_START): ARG_VALUE_START,
            tok.special(ARG_VALUE_END): ARG_VALUE_END,
        }
        self._glm_call = _Glm47Call()
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
        # Streaming state of the tool call being generated (see the module docstring).
        self._tool_count = 0  # calls started in the stream: the next call's index
        self._tool_id: str | None = None  # set once the current call's name delta went out
        self._name_end = -1  # offset in _tool_buf where the closed name string ends
        self._args_at = -1  # offset of the arguments value in _tool_buf (-1: not seen yet)
        self._args_scan: _ArgsScanner | None = None  # None: arguments are not streamed incrementally
        self._args_sent = ""

    def push(self, token_id: int) -> Delta:
        d = Delta()
        if token_id == self._think_start and self._section == "content":
            self._enter("reasoning")
        elif token_id == self._think_end and self._section == "reasoning":
            self._enter("content")
        elif token_id == self._tool_start and self._parse_tools and self._section != "tool":
            self._enter("tool")
            self._tool_buf = ""
            self._tool_id, self._name_end, self._args_at, self._args_scan, self._args_sent = None, -1, -1, None, ""
            self._glm_call = _Glm47Call()
        elif token_id == self._tool_end and self._section == "tool":
            self._close_tool(d)
            self._enter("content")
        elif self._glm and self._section == "tool" and token_id in self._arg_tags:
            tag = self._arg_tags[token_id]
            self._tool_buf += tag
            self._glm_tag(tag, d)
        elif self._tok.is_special(token_id):
            pass  # eos and other specials are skipped, as with skip_special_tokens
        else:
            text = self._decoder.decode(self._tok.token_bytes(token_id))
            if self._section == "tool":
                self._tool_buf += text
                if self._glm:
                    self._glm_call.text(text)
                else:
                    self._stream_tool(d)
            else:
                self._text(text, d)
        return d

    def _glm_name(self, d: Delta) -> None:
        """The glm47 name is complete (an <arg_key> or </tool_call> follows it): its delta goes out."""
        name = self._glm_call.name.strip()
        if self._tool_id is None and name:
            self._tool_id = self._call_id()
            d.tool_calls.append(ToolCallDelta(self._tool_count, id=self._tool_id, name=name))
            self._tool_count += 1

    def _glm_tag(self, tag: str, d: Delta) -> None:
        call = self._glm_call
        if tag == ARG_KEY_START:
            if call.part == "name":
                self._glm_name(d)
            call.part, call.key = "key", ""
        elif tag == ARG_KEY_END and call.part == "key":
            call.part = "between"
        elif tag == ARG_VALUE_START and call.part == "between":
            call.part, call.value = "value", ""
        elif tag == ARG_VALUE_END and call.part == "value":
            member = f"{json.dumps(call.key.strip(), ensure_ascii=False)}: "
            member += json.dumps(glm47_value(call.value), ensure_ascii=False)
            if self._tool_id is not None:
                d.tool_calls.append(ToolCallDelta(self._tool_count - 1, arguments=("{" if not call.pairs else ", ")
                                                  + member))
            call.pairs.append(member)
            call.part = "between"

    def _close_glm(self, d: Delta, *, cut: bool) -> None:
        call = self._glm_call
        if cut:
            d.content = f"{TOOL_CALL_START}{self._tool_buf}"
            return
        if call.part == "name":
            self._glm_name(d)
        # The name only grows before the first tag, and _glm_name sent it there if it had any: a call without
        # an id here has none, and vLLM's parser gives its raw text back.
        if self._tool_id is None:
            d.content = f"{TOOL_CALL_START}{self._tool_buf}{TOOL_CALL_END}"
            return
        d.tool_calls.append(ToolCallDelta(self._tool_count - 1, arguments="}" if call.pairs else "{}"))
        self.tool_calls.append(ToolCall(id=self._tool_id, name=call.name.strip(), arguments=call.arguments()))

    def _stream_tool(self, d: Delta) -> None:
        """Emit the current call's name as soon as it is closed, then its arguments as they grow."""
        buf = self._tool_buf
        if self._tool_id is None:
            m = _NAME_HEAD.match(buf)
            if m is None:
                return
            try:
                name = json.loads(m.group(1))
            except ValueError:
                return
            self._tool_id, self._name_end = self._call_id(), m.end()
            d.tool_calls.append(ToolCallDelta(self._tool_count, id=self._tool_id, name=str(name)))
            self._tool_count += 1
        if self._args_at < 0:
            head = _ARGS_HEAD.match(buf, self._name_end)
            if head is None:
                return
            self._args_at = head.end()
            # Objects and arrays stream as generated (the model writes them as json.dumps does, so the raw
            # text is the parsed arguments' canonical form); anything else goes out whole at </tool_call>.
            self._args_scan = _ArgsScanner() if buf[self._args_at] in "{[" else None
        scan = self._args_scan
        if scan is None or scan.done:
            return
        new = scan.feed(buf[self._args_at + len(self._args_sent) :])
        if new:
            self._args_sent += new
            d.tool_calls.append(ToolCallDelta(self._tool_count - 1, arguments=new))

    def _close_tool(self, d: Delta, *, cut: bool = False) -> None:
        if self._glm:
            self._close_glm(d, cut=cut)
            return
        call = self._parse_tool(self._tool_buf)
        if call is None:
            # vLLM's non-streamed hermes parse falls back to the raw text when json.loads fails; a cut call
            # has no closing tag to give back.
            d.content = f"{TOOL_CALL_START}{self._tool_buf}" + ("" if cut else TOOL_CALL_END)
            return
        if self._tool_id is None:
            # The name never streamed (an unusual layout): the whole call goes out in one delta.
            call.id = self._call_id()
            d.tool_calls.append(ToolCallDelta(self._tool_count, id=call.id, name=call.name, arguments=call.arguments))
            self._tool_count += 1
        else:
            call.id = self._tool_id
            # Whatever of the canonical arguments has not been streamed yet (all of it for non-objects).
            sent = self._args_sent
            if call.arguments.startswith(sent) and len(call.arguments) > len(sent):
                d.tool_calls.append(ToolCallDelta(self._tool_count - 1, arguments=call.arguments[len(sent) :]))
        self.tool_calls.append(call)

    def finish(self) -> Delta:
        """End of output. A call cut off inside ``<tool_call>`` (max_tokens) is, as in vLLM's non-streamed
        hermes parse, a tool call if its text parses anyway, else raw ``content`` (``<tool_call>`` and the
        text after it). A stream drops that content when `unfinished_call` said it streamed the call."""
        d = Delta()
        if self._section == "tool":
            self._close_tool(d, cut=True)
            self._enter("content")
        return d

    @property
    def unfinished_call(self) -> bool:
        """A call is being generated and its name delta has gone out already."""
        return self._section == "tool" and self._tool_id is not None

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
        # The id is the streamed one when the name streamed (_close_tool), so draw one only when it did not.
        return ToolCall(id="", name=obj["name"], arguments=arguments)


@dataclass(slots=True)
class ParsedOutput:
    content: str | None
    reasoning: str | None
    tool_calls: list[ToolCall]


def parse_chat_output(
    tok: Tokenizer, ids: Iterable[int], *, parse_tools: bool = True, tool_format: str = HERMES
) -> ParsedOutput:
    """The non-streamed parse (tool-call deltas are ignored: complete calls come from ``tool_calls``)."""
    parser = ChatOutputParser(tok, parse_tools=parse_tools, tool_format=tool_format)
    content, reasoning = "", ""
    for t in ids:
        d = parser.push(t)
        content += d.content
        reasoning += d.reasoning
    content += parser.finish().content
    return ParsedOutput(
        content=content if content or not parser.tool_calls else None,
        reasoning=reasoning or None,
        tool_calls=parser.tool_calls,
    )
