"""Importers from other tools' multi-turn formats into kvtether sessions (pure, no network).

- ``vllm``: the input of vLLM's ``benchmarks/multi_turn/benchmark_serving_multi_turn.py`` (as written
  by its ``convert_sharegpt_to_openai.py``): one JSON list of ``{"id", "messages": [{"role",
  "content"}, ...]}``. Each user message starts a turn; the assistant message after it is that
  turn's recorded answer; leading system messages go into turn 0.
- ``aiperf``: AIPerf's ``multi_turn`` custom dataset, JSONL, one ``{"session_id", "turns": [...]}``
  per line; a turn has ``text`` or ``texts`` (strings, or ``{"name", "contents"}`` objects), optional
  ``role`` (a leading ``system`` turn becomes the system prompt, as AIPerf hoists it), ``delay`` (ms),
  ``timestamp`` (ms), ``output_length``/``max_tokens`` and ``extra`` (extra body fields). Lines with
  the same ``session_id`` are joined in file order. AIPerf files carry no answers: replay them with
  ``--history live`` (with ``recorded`` the requests contain only the user messages).

Token counts are not known without a tokenizer; ``max_tokens`` for a vLLM turn is the word count of
its recorded answer (about one token per word for English), else ``default_max_tokens``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kvtether.sdk.sessionfile import Recorded, SessionRecord, TurnRecord

FORMATS = ("vllm", "aiperf")


class ImportFormatError(ValueError):
    """A file that does not match the importer's format: names where and what."""

    def __init__(self, where: str, problem: str) -> None:
        super().__init__(f"{where}: {problem}")
        self.where = where
        self.problem = problem


def _text_content(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # OpenAI content parts: keep the text parts
        parts = [p.get("text", "") for p in value if isinstance(p, dict) and p.get("type") == "text"]
        return "\n".join(parts)
    raise ValueError("message content must be a string or a list of content parts")


def import_vllm(data: Any, *, model: str, default_max_tokens: int = 256, where: str = "vllm") -> list[SessionRecord]:
    if not isinstance(data, list):
        raise ImportFormatError(where, "expected a JSON list of conversations ({'id', 'messages'})")
    sessions: list[SessionRecord] = []
    seen: set[str] = set()
    for k, conv in enumerate(data):
        at = f"{where}: conversation #{k}"
        if not isinstance(conv, dict):
            raise ImportFormatError(at, "not a JSON object")
        sid = str(conv.get("id", f"conv-{k}"))
        at = f"{at} (id {sid!r})"
        msgs = conv.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ImportFormatError(at, "'messages' must be a non-empty list")
        if sid in seen:
            raise ImportFormatError(at, "duplicate id")
        seen.add(sid)
        system: list[dict[str, Any]] = []
        turns: list[TurnRecord] = []
        for j, m in enumerate(msgs):
            if not isinstance(m, dict) or m.get("role") not in {"system", "user", "assistant"}:
                raise ImportFormatError(f"{at}, message #{j}", "needs 'role' system, user or assistant")
            try:
                content = _text_content(m.get("content"))
            except ValueError as e:
                raise ImportFormatError(f"{at}, message #{j}", str(e)) from None
            role = m["role"]
            if role == "system":
                if turns:
                    raise ImportFormatError(f"{at}, message #{j}", "a system message after the first user message")
                system.append({"role": "system", "content": content})
            elif role == "user":
                msg = {"role": "user", "content": content}
                if not turns:
                    turns.append(TurnRecord(index=0, messages=[*system, msg]))
                else:
                    turns.append(TurnRecord(index=len(turns), new_messages=[msg]))
            else:
                if not turns:
                    raise ImportFormatError(f"{at}, message #{j}", "an assistant message before any user message")
                if turns[-1].recorded is not None:
                    raise ImportFormatError(f"{at}, message #{j}", "two assistant messages in a row")
                answer = {"role": "assistant", "content": content}
                turns[-1].recorded = Recorded(answer=answer, completion_tokens=len(content.split()) or None)
        if not turns:
            raise ImportFormatError(at, "no user message")
        for t in turns:
            n = t.recorded.completion_tokens if t.recorded else None
            t.params = {"max_tokens": n or default_max_tokens}
        sessions.append(SessionRecord(session_id=sid, model=model, turns=turns, metadata={"imported_from": "vllm"}))
    return sessions


def _aiperf_text(turn: dict[str, Any]) -> str:
    if "text" in turn:
        if not isinstance(turn["text"], str):
            raise ValueError("'text' must be a string")
        return turn["text"]
    texts = turn.get("texts")
    if not isinstance(texts, list) or not texts:
        raise ValueError("a turn needs 'text' or a non-empty 'texts' list")
    out: list[str] = []
    for t in texts:
        if isinstance(t, str):
            out.append(t)
        elif isinstance(t, dict) and isinstance(t.get("contents"), list):
            out.extend(str(c) for c in t["contents"])
        else:
            raise ValueError("'texts' items must be strings or {'name', 'contents'} objects")
    # A batched AIPerf turn sends several prompts at once; a chat request has one user message.
    return "\n".join(out)


def import_aiperf(
    lines: Iterable[str], *, model: str, default_max_tokens: int = 256, where: str = "aiperf"
) -> list[SessionRecord]:
    by_id: dict[str, SessionRecord] = {}
    last_ts: dict[str, float] = {}
    n_anon = 0
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        at = f"{where}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ImportFormatError(at, f"not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("turns"), list) or not obj["turns"]:
            raise ImportFormatError(at, "expected an object with a non-empty 'turns' list")
        sid = obj.get("session_id")
        if sid is None:
            sid = f"aiperf-{n_anon}"
            n_anon += 1
        sid = str(sid)
        rec = by_id.setdefault(sid, SessionRecord(session_id=sid, model=model, metadata={"imported_from": "aiperf"}))
        system: list[dict[str, Any]] = []
        for j, turn in enumerate(obj["turns"]):
            tat = f"{at}: turn #{j}"
            if not isinstance(turn, dict):
                raise ImportFormatError(tat, "not a JSON object")
            try:
                text = _aiperf_text(turn)
            except ValueError as e:
                raise ImportFormatError(tat, str(e)) from None
            role = turn.get("role") or "user"
            if role not in {"system", "user"}:
                raise ImportFormatError(tat, f"unsupported role {role!r} (expected user or system)")
            if role == "system":
                if rec.turns or system:
                    raise ImportFormatError(tat, "only a leading system turn is supported")
                system.append({"role": "system", "content": text})
                continue
            delay = turn.get("delay")
            ts = turn.get("timestamp")
            for name, v in (("delay", delay), ("timestamp", ts)):
                if v is not None and (not isinstance(v, int | float) or v < 0):
                    raise ImportFormatError(tat, f"'{name}' must be a non-negative number of milliseconds")
            delay_ms = float(delay) if delay is not None else 0.0
            if delay is None and ts is not None and sid in last_ts:
                # A schedule, not a think time: the gap also holds the previous response. Kept as an
                # upper bound; --think-time scale:F can shrink it.
                delay_ms = max(0.0, float(ts) - last_ts[sid])
            if ts is not None:
                last_ts[sid] = float(ts)
            max_tokens = turn.get("output_length", turn.get("max_tokens"))
            if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
                raise ImportFormatError(tat, "'output_length' must be a positive integer")
            params: dict[str, Any] = {"max_tokens": max_tokens or default_max_tokens}
            extra = turn.get("extra")
            if extra is not None:
                if not isinstance(extra, dict):
                    raise ImportFormatError(tat, "'extra' must be an object")
                params.update(extra)
            msg = {"role": "user", "content": text}
            if not rec.turns:
                rec.turns.append(TurnRecord(index=0, messages=[*system, msg], params=params))
            else:
                rec.turns.append(
                    TurnRecord(index=len(rec.turns), new_messages=[msg], delay_ms=delay_ms, params=params)
                )
        if not rec.turns:
            raise ImportFormatError(at, "a session with no user turn")
    return list(by_id.values())


def import_file(path: str | Path, fmt: str, *, model: str, default_max_tokens: int = 256) -> list[SessionRecord]:
    p = Path(path)
    if fmt == "vllm":
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ImportFormatError(f"{p}:{e.lineno}", f"not valid JSON ({e.msg} at column {e.colno})") from None
        return import_vllm(data, model=model, default_max_tokens=default_max_tokens, where=str(p))
    if fmt == "aiperf":
        with p.open(encoding="utf-8") as f:
            return import_aiperf(f, model=model, default_max_tokens=default_max_tokens, where=str(p))
    raise ValueError(f"unknown format {fmt!r}; known: {', '.join(FORMATS)}")
