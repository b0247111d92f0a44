"""The kvtether session file: JSONL, versioned, written by the SDK recorder, read by ``kvtether replay``.

Two kinds of line may appear in one file (documented in ``docs/session-format.md``):

- ``{"v": 1, "kind": "session", "session_id", "model", "tools", "metadata", "turns": [turn, ...]}``
  a whole session on one line (generators, importers, ``kvtether`` exports);
- ``{"v": 1, "kind": "turn", "session_id", "model", "tools", "turn": turn}``
  one turn, appended by a live recorder as it happens (crash-safe, no rewrite); consecutive or
  interleaved turn lines of one session id are grouped in file order.

A turn carries either ``messages`` (the full request history, authoritative) or ``new_messages``
(the request is the previous turn's messages + the previous turn's answer + these). A recorder
writes ``new_messages`` only when that identity holds, so an edited history is always kept whole.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

FORMAT_VERSION = 1

History = Literal["recorded", "live"]


class SessionFileError(ValueError):
    """A malformed session file: names the line and what is wrong."""

    def __init__(self, line: int, problem: str, path: str | None = None) -> None:
        where = f"{path}:{line}" if path else f"line {line}"
        super().__init__(f"{where}: {problem}")
        self.line = line
        self.problem = problem


@dataclass(slots=True)
class Recorded:
    """What happened when the turn was recorded (all optional: importers may know little)."""

    answer: dict[str, Any] | None = None  # the assistant message as returned
    ttfc_ms: float | None = None
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__ if getattr(self, k) is not None}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Recorded:
        unknown = set(obj) - set(cls.__slots__)
        if unknown:
            raise ValueError(f"unknown recorded field(s): {sorted(unknown)}")
        return cls(**obj)


@dataclass(slots=True)
class TurnRecord:
    index: int
    messages: list[dict[str, Any]] | None = None
    new_messages: list[dict[str, Any]] | None = None
    delay_ms: float = 0.0  # think/tool time after the previous turn's answer, before this request
    tools: list[dict[str, Any]] | None = None  # overrides the session's tools from this turn on
    params: dict[str, Any] = field(default_factory=dict)  # max_tokens, temperature, stream, extra body …
    recorded: Recorded | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index, "delay_ms": self.delay_ms}
        if self.messages is not None:
            out["messages"] = self.messages
        if self.new_messages is not None:
            out["new_messages"] = self.new_messages
        if self.tools is not None:
            out["tools"] = self.tools
        if self.params:
            out["params"] = self.params
        if self.recorded is not None:
            out["recorded"] = self.recorded.to_json()
        return out

    @classmethod
    def from_json(cls, obj: Any) -> TurnRecord:
        if not isinstance(obj, dict):
            raise ValueError("a turn must be a JSON object")
        if ("messages" in obj) == ("new_messages" in obj):
            raise ValueError("a turn needs exactly one of 'messages' or 'new_messages'")
        msgs = obj.get("messages", obj.get("new_messages"))
        if not isinstance(msgs, list) or not all(isinstance(m, dict) and "role" in m for m in msgs):
            raise ValueError("messages must be a list of objects with a 'role'")
        index = obj.get("index")
        if not isinstance(index, int) or index < 0:
            raise ValueError("turn 'index' must be a non-negative integer")
        delay = obj.get("delay_ms", 0.0)
        if not isinstance(delay, int | float) or delay < 0:
            raise ValueError("'delay_ms' must be a non-negative number")
        params = obj.get("params", {})
        if not isinstance(params, dict):
            raise ValueError("'params' must be an object")
        rec = obj.get("recorded")
        return cls(
            index=index,
            messages=obj.get("messages"),
            new_messages=obj.get("new_messages"),
            delay_ms=float(delay),
            tools=obj.get("tools"),
            params=params,
            recorded=Recorded.from_json(rec) if isinstance(rec, dict) else None,
        )


@dataclass(slots=True)
class SessionRecord:
    session_id: str
    model: str
    turns: list[TurnRecord] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "v": FORMAT_VERSION,
            "kind": "session",
            "session_id": self.session_id,
            "model": self.model,
        }
        if self.tools is not None:
            out["tools"] = self.tools
        if self.metadata:
            out["metadata"] = self.metadata
        out["turns"] = [t.to_json() for t in self.turns]
        return out

    def requests(
        self, history: History = "recorded", live_answers: Sequence[dict[str, Any] | None] = ()
    ) -> Iterator[tuple[TurnRecord, list[dict[str, Any]], list[dict[str, Any]] | None]]:
        """Yield ``(turn, request messages, tools)`` in order.

        ``history="live"`` threads ``live_answers[i]`` (the answer actually received for turn i)
        in place of the recorded answer when building turn i+1 from ``new_messages``. Callers
        iterate lazily, appending each live answer before asking for the next turn.
        """
        prev: list[dict[str, Any]] | None = None
        tools = self.tools
        for i, turn in enumerate(self.turns):
            if turn.tools is not None:
                tools = turn.tools
            if turn.messages is not None:
                msgs = list(turn.messages)
            else:
                if prev is None:
                    msgs = list(turn.new_messages or [])
                else:
                    answer = None
                    if history == "live" and i - 1 < len(live_answers):
                        answer = live_answers[i - 1]
                    if answer is None:
                        rec = self.turns[i - 1].recorded
                        answer = rec.answer if rec else None
                    msgs = prev + ([answer] if answer is not None else []) + list(turn.new_messages or [])
            prev = msgs
            yield turn, msgs, tools


def _session_from_line(obj: dict[str, Any]) -> SessionRecord:
    sid = obj.get("session_id")
    model = obj.get("model")
    if not isinstance(sid, str) or not sid:
        raise ValueError("'session_id' must be a non-empty string")
    if not isinstance(model, str) or not model:
        raise ValueError("'model' must be a non-empty string")
    tools = obj.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise ValueError("'tools' must be a list")
    meta = obj.get("metadata", {})
    if not isinstance(meta, dict):
        raise ValueError("'metadata' must be an object")
    return SessionRecord(session_id=sid, model=model, tools=tools, metadata=meta)


def parse_lines(lines: Iterable[str], path: str | None = None) -> list[SessionRecord]:
    sessions: dict[str, SessionRecord] = {}
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise SessionFileError(n, f"not valid JSON ({e.msg} at column {e.colno})", path) from None
        try:
            if not isinstance(obj, dict):
                raise ValueError("each line must be a JSON object")
            if obj.get("v") != FORMAT_VERSION:
                raise ValueError(f"unsupported format version {obj.get('v')!r} (expected {FORMAT_VERSION})")
            kind = obj.get("kind")
            if kind == "session":
                rec = _session_from_line(obj)
                turns = obj.get("turns")
                if not isinstance(turns, list) or not turns:
                    raise ValueError("'turns' must be a non-empty list")
                rec.turns = [TurnRecord.from_json(t) for t in turns]
                if rec.turns[0].messages is None and rec.turns[0].new_messages is None:
                    raise ValueError("the first turn has no messages")
                if rec.session_id in sessions:
                    raise ValueError(f"session {rec.session_id!r} appears twice")
                sessions[rec.session_id] = rec
            elif kind == "turn":
                rec = _session_from_line(obj)
                turn = TurnRecord.from_json(obj.get("turn"))
                existing = sessions.setdefault(rec.session_id, rec)
                if existing.tools is None and rec.tools is not None:
                    existing.tools = rec.tools
                existing.turns.append(turn)
            else:
                raise ValueError(f"unknown line kind {kind!r} (expected 'session' or 'turn')")
        except ValueError as e:
            raise SessionFileError(n, str(e), path) from None
    return list(sessions.values())


def read_sessions(path: str | Path) -> list[SessionRecord]:
    p = Path(path)
    with p.open(encoding="utf-8") as f:
        return parse_lines(f, str(p))


def write_sessions(path: str | Path, sessions: Iterable[SessionRecord]) -> None:
    with Path(path).open("w", encoding="utf-8") as f:
        for s in sessions:
            f.write(json.dumps(s.to_json(), ensure_ascii=False) + "\n")


def turn_line(
    session_id: str, model: str, turn: TurnRecord, tools: list[dict[str, Any]] | None = None
) -> str:
    obj: dict[str, Any] = {"v": FORMAT_VERSION, "kind": "turn", "session_id": session_id, "model": model}
    if tools is not None:
        obj["tools"] = tools
    obj["turn"] = turn.to_json()
    return json.dumps(obj, ensure_ascii=False) + "\n"
