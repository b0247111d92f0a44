"""One session's requests turn by turn, under ``live`` or ``recorded`` history (docs/replay.md, *History*)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from kvtether.protocol.contract import canonical_json, canonical_message
from kvtether.protocol.tokens import REASONING_FIELDS
from kvtether.sdk.sessionfile import History, SessionRecord, TurnRecord

HISTORY_MODES: tuple[History, ...] = ("live", "recorded")
DEFAULT_HISTORY: History = "live"
HISTORY_NOTES: dict[History, str] = {
    "live": "live: each turn resends the answers this replay received for the earlier turns, as the agent "
    "would (--history recorded resends the file's answers)",
    "recorded": "recorded: each turn resends the file's recorded answers, identical across runs and policies "
    "(--history live resends the answers received)",
}



def _message_key(message: dict[str, Any], *, keep_reasoning: bool) -> bytes:
    """What the chat template sees of a message; an empty content and a null one count as the same."""
    c = canonical_message(message, keep_reasoning=keep_reasoning)
    if not c.get("content"):
        c.pop("content", None)
    return canonical_json(c)


def _has_reasoning(message: dict[str, Any] | None) -> bool:
    return message is not None and any(message.get(k) for k in REASONING_FIELDS)


def _complete_call(call: Any) -> bool:
    args = (call.get("function") or {}).get("arguments") if isinstance(call, dict) else None
    if not args:
        return True  # no arguments: `{}` to a chat template
    try:
        json.loads(args)
    except (TypeError, ValueError):
        return False
    return True


def _resendable(answer: dict[str, Any]) -> dict[str, Any]:
    """The answer as an agent can send it back: without a tool call that max_tokens cut off.

    Such a call's arguments are not valid JSON; vLLM parses them when it renders the history and refuses the
    request (400), and an agent could not have run the call anyway. Any text of the answer stays."""
    calls = answer.get("tool_calls")
    if not calls:
        return dict(answer)
    kept = [c for c in calls if _complete_call(c)]
    out = {k: v for k, v in answer.items() if k != "tool_calls"}
    if kept:
        out["tool_calls"] = kept
    elif out.get("content") is None:
        out["content"] = ""
    return out


def _call_ids(message: dict[str, Any] | None) -> list[str]:
    return [str(c.get("id") or "") for c in (message or {}).get("tool_calls") or () if isinstance(c, dict)]


class SessionHistory:
    """The request messages of one session's turns, built turn by turn under ``recorded`` or ``live`` history.

    Call ``request(i)`` for turns in order and ``answered(i, message)`` after each. ``recorded`` gives exactly
    ``SessionRecord.requests("recorded")``. ``live`` puts, wherever an earlier turn's answer appears in a
    turn's messages, the answer this replay received for that turn instead:

    * a ``new_messages`` turn is the previous request as sent + the previous turn's live answer + its new
      messages;
    * a turn with full ``messages``: the earlier answers in it are found by structure first (the longest earlier
      recorded request it starts with, then an assistant message: that turn's answer), then by content (an
      assistant message equal to an earlier turn's recorded answer, reasoning aside). An answer the agent
      edited before resending (it no longer equals the recorded answer) is kept as recorded.

    A tool result keeps its recorded content; its ``tool_call_id`` is mapped to the id of the live answer's
    call at the same position, so strict chat templates still find the call. A live tool call that max_tokens
    cut off (its arguments are not valid JSON) is left out (see ``_resendable``). The live answer carries its
    reasoning only where the recorded history resent reasoning (most agents and templates drop it). A turn
    whose live answer is missing (it failed) falls back to the recorded answer.
    """

    def __init__(self, session: SessionRecord, mode: History = DEFAULT_HISTORY) -> None:
        if mode not in HISTORY_MODES:
            raise ValueError(f"history must be one of {HISTORY_MODES}, not {mode!r}")
        self.session = session
        self.mode: History = mode
        self._recorded = list(session.requests("recorded"))
        self._recorded_keys: list[list[bytes]] | None = None
        self._sent: list[list[dict[str, Any]]] = []
        self._live: list[dict[str, Any] | None] = []
        self._ids: dict[str, str] = {}  # recorded tool-call id → the live answer's

    def __len__(self) -> int:
        return len(self._recorded)

    def request(self, i: int) -> tuple[TurnRecord, list[dict[str, Any]], list[dict[str, Any]] | None]:
        """Turn i's ``(turn, messages, tools)``; turns 0 … i-1 must have been requested (and answered)."""
        if i != len(self._sent):
            raise ValueError(f"turn {i} requested out of order (next is {len(self._sent)})")
        turn, recorded, tools = self._recorded[i]
        msgs = self._live_messages(i) if self.mode == "live" and i > 0 else [dict(m) for m in recorded]
        self._sent.append(msgs)
        return turn, msgs, tools

    def answered(self, i: int, answer: dict[str, Any] | None) -> None:
        """The answer received for turn i (None: the turn failed)."""
        if i != len(self._live) or i >= len(self._sent):
            raise ValueError(f"answer for turn {i} out of order")
        self._live.append(answer)

    # -- live ---------------------------------------------------------------------------------------------

    def _recorded_answer(self, j: int) -> dict[str, Any] | None:
        rec = self._recorded[j][0].recorded
        return rec.answer if rec is not None else None

    def _answer(self, j: int, resent: dict[str, Any] | None) -> dict[str, Any] | None:
        """The message that stands for turn j's answer; `resent` is how the recording resent it, if known."""
        recorded = resent if resent is not None else self._recorded_answer(j)
        live = self._live[j] if j < len(self._live) else None
        if live is None:
            return recorded
        out = _resendable(live)
        if not _has_reasoning(recorded):
            for k in REASONING_FIELDS:
                out.pop(k, None)
        for old, new in zip(_call_ids(recorded), _call_ids(out), strict=False):
            if old and new:
                self._ids[old] = new
        return out

    def _remap(self, messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for m in messages:
            tid = m.get("tool_call_id")
            out.append({**m, "tool_call_id": self._ids[tid]} if isinstance(tid, str) and tid in self._ids else dict(m))
        return out

    def _keys(self) -> list[list[bytes]]:
        if self._recorded_keys is None:
            self._recorded_keys = [
                [_message_key(m, keep_reasoning=True) for m in msgs] for _, msgs, _ in self._recorded
            ]
        return self._recorded_keys

    def _live_messages(self, i: int) -> list[dict[str, Any]]:
        turn = self._recorded[i][0]
        if turn.messages is None:
            answer = self._answer(i - 1, None)
            new = self._remap(turn.new_messages or [])
            return [*self._sent[i - 1], *([answer] if answer is not None else []), *new]
        msgs = turn.messages
        keys = [_message_key(m, keep_reasoning=True) for m in msgs]
        recorded_keys = self._keys()
        for j in range(i - 1, -1, -1):
            n = len(recorded_keys[j])
            if len(msgs) > n and msgs[n].get("role") == "assistant" and keys[:n] == recorded_keys[j]:
                resent = msgs[n]
                expected = self._recorded_answer(j)
                if expected is not None and _message_key(expected, keep_reasoning=False) != _message_key(
                    resent, keep_reasoning=False
                ):
                    answer = resent  # edited by the agent before resending: kept as it was sent
                else:
                    answer = self._answer(j, resent) or resent
                return [*self._sent[j], answer, *self._by_content(msgs[n + 1 :], i, after=j)]
        return self._by_content(msgs, i, after=-1)

    def _by_content(self, messages: Sequence[dict[str, Any]], i: int, after: int) -> list[dict[str, Any]]:
        """Substitute the assistant messages equal to the recorded answer of an earlier turn (in turn order)."""
        answer_keys: dict[bytes, list[int]] = {}
        for j in range(after + 1, i):
            rec = self._recorded_answer(j)
            if rec is not None:
                answer_keys.setdefault(_message_key(rec, keep_reasoning=False), []).append(j)
        out: list[dict[str, Any]] = []
        for m in messages:
            if m.get("role") == "assistant":
                js = [j for j in answer_keys.get(_message_key(m, keep_reasoning=False), ()) if j > after]
                if js:
                    after = js[0]
                    out.append(self._answer(after, m) or m)
                    continue
            out.extend(self._remap([m]))
        return out
