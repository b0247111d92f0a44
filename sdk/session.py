"""``AgentSession``: one agent conversation, its per-turn client metrics and its optional recorder.

The session is bookkeeping: the stamped clients (``kvtether.sdk.client``) report each chat call's life to
it (``_begin`` → chunks → ``_finish``), and it keeps the metrics, ends the tracing span and appends the turn
to the session file. Its one request of its own is the session's end, sent through the clients it wrapped
(``close``/``aclose``): the gateway then releases what the decode node holds for it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import quote

import httpx

from . import contract, tracing
from .sessionfile import Recorded, TurnRecord, turn_line

if TYPE_CHECKING:
    from typing import Self

_C = TypeVar("_C")

# Crockford base32, lower case: URL- and header-safe, no ambiguous letters, sorts like the numbers.
_CROCKFORD = "0123456789abcdefghjkmnpqrstvwxyz"
_ID_RE = re.compile(r"^[A-Za-z0-9._~:@-]{1,200}$")
# The end of a session is a courtesy to the gateway: bounded, never retried, never raised.
_END_OPTIONS: Any = {"timeout": 2.0, "max_retries": 0}
_id_lock = threading.Lock()
_last_id: tuple[int, int] = (0, 0)


def new_session_id() -> str:
    """A ULID-style id: 48-bit millisecond time + 80 random bits, 26 base32 chars, sortable.

    Ids made in the same millisecond by this process increase (random part + 1), so sorting by id
    sorts by creation even under bursts.
    """
    global _last_id
    with _id_lock:
        ms = time.time_ns() // 1_000_000
        last_ms, last_rand = _last_id
        if ms <= last_ms:
            ms, rand = last_ms, (last_rand + 1) & ((1 << 80) - 1)
        else:
            rand = secrets.randbits(80)
        _last_id = (ms, rand)
    n = (ms << 80) | rand
    return "".join(_CROCKFORD[(n >> shift) & 31] for shift in range(125, -1, -5))


def _check_session_id(value: str) -> str:
    if not _ID_RE.fullmatch(value):
        # It travels in a header and in gateway URLs: refuse anything that needs escaping.
        raise ValueError(f"session id must match {_ID_RE.pattern}, got {value!r}")
    return value


def _jsonable(obj: Any) -> Any:
    """Plain JSON data from a request body that may still hold SDK pydantic objects."""

    def default(o: Any) -> Any:
        dump = getattr(o, "model_dump", None)
        if callable(dump):
            return dump(exclude_none=True, mode="json")
        if isinstance(o, tuple | set | frozenset):
            return list(o)
        raise TypeError(f"not JSON-serialisable: {type(o).__name__}")

    return json.loads(json.dumps(obj, default=default, ensure_ascii=False))


@dataclass(slots=True)
class TurnMetrics:
    """What the client saw for one chat call of the session. Filled in live; ``done`` once final.

    Times are milliseconds from the moment the call was issued (before the first attempt), so a
    hidden SDK retry shows up in them; ``attempts`` says how many HTTP attempts were made.
    """

    seq: int  # position of the call in this session (0-based, call order)
    turn: int  # turn index stamped on the request (assistant messages in its history)
    prefix: str | None
    parent: str | None
    model: str | None
    stream: bool
    started_at: float  # wall clock (time.time()) when the call was issued
    attempts: int = 0
    request_id: str | None = None  # the server's x-request-id, when it sends one
    ttfc_ms: float | None = None  # first SSE chunk of any kind (streams only)
    ttft_ms: float | None = None  # first chunk with content, tool-call, refusal or reasoning delta
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


class _Answer:
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


def _has_token(delta: Mapping[str, Any]) -> bool:
    return bool(
        delta.get("content")
        or delta.get("tool_calls")
        or delta.get("refusal")
        or delta.get("reasoning_content")
        or delta.get("reasoning")
    )


@dataclass(eq=False)
class _Call:
    """Private state of one chat call; ``metrics`` is what the user sees."""

    session: AgentSession
    metrics: TurnMetrics
    body: dict[str, Any]
    t0_ns: int
    span: tracing.CallSpan | None = None
    answer: _Answer = field(default_factory=_Answer)
    include_usage: bool = False
    iterator_wrapped: bool = False  # the returned stream's iterator is observed: it says when the stream ends
    finished_choices: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def _ms(self, now_ns: int) -> float:
        return (now_ns - self.t0_ns) / 1e6

    def on_data(self, data: Any, now_ns: int) -> None:
        """One parsed JSON payload of the response: a stream chunk or a whole completion."""
        if not isinstance(data, Mapping):
            return
        kind = data.get("object")
        m = self.metrics
        finish = False
        with self.lock:
            if m.done:
                return
            if data.get("usage"):
                self._usage(data["usage"])
            if m.model is None and isinstance(data.get("model"), str):
                m.model = data["model"]
            choices = data.get("choices") or []
            first = choices[0] if choices and isinstance(choices[0], Mapping) else {}
            if kind == "chat.completion" or (kind is None and "message" in first):
                msg = first.get("message") or {}
                m.answer = {k: v for k, v in msg.items() if v is not None} if isinstance(msg, Mapping) else None
                m.finish_reason = first.get("finish_reason")
                finish = True
            elif kind == "chat.completion.chunk" or "choices" in data:
                m.chunks += 1
                if m.ttfc_ms is None:
                    m.ttfc_ms = self._ms(now_ns)
                for choice in choices:
                    if not isinstance(choice, Mapping):
                        continue
                    delta = choice.get("delta") or {}
                    if m.ttft_ms is None and isinstance(delta, Mapping) and _has_token(delta):
                        m.ttft_ms = self._ms(now_ns)
                    if choice.get("index", 0) == 0:
                        if isinstance(delta, Mapping):
                            self.answer.add(delta)
                        if choice.get("finish_reason"):
                            m.finish_reason = choice["finish_reason"]
                            self.finished_choices = True
                # Without the stream's iterator (raw/streaming-response paths) the end is inferred:
                # the usage chunk is last when asked for, otherwise the finish_reason chunk is.
                if not self.iterator_wrapped and (
                    data.get("usage") or (self.finished_choices and not self.include_usage)
                ):
                    finish = True
        if finish:
            self.session._finish(self)

    def _usage(self, usage: Any) -> None:
        if not isinstance(usage, Mapping):
            return
        m = self.metrics
        if isinstance(usage.get("prompt_tokens"), int):
            m.prompt_tokens = usage["prompt_tokens"]
        if isinstance(usage.get("completion_tokens"), int):
            m.completion_tokens = usage["completion_tokens"]
        details = usage.get("prompt_tokens_details")
        if isinstance(details, Mapping) and isinstance(details.get("cached_tokens"), int):
            m.cached_tokens = details["cached_tokens"]


class AgentSession:
    """One agent conversation: its id (sent as ``x-session-id``), per-turn metrics, recorder, spans.

    ``session_id``: caller-given (header-/URL-safe: letters, digits, ``._~:@-``) or a generated
    sortable ULID-style id. ``tenant_key`` keys the prefix hash (``contract.stamps_for_body``); the
    gateway must use the same key to agree. ``record_to`` appends each completed turn to a
    kvtether session file (``docs/session-format.md``). ``tracer_provider`` overrides the global
    OpenTelemetry provider; with neither configured, tracing costs nothing.
    """

    def __init__(
        self,
        session_id: str | None = None,
        *,
        tenant: str | None = None,
        tenant_key: str | bytes | None = None,
        record_to: str | os.PathLike[str] | None = None,
        tracer_provider: Any = None,
        end_on_close: bool = True,
    ) -> None:
        self.id = _check_session_id(session_id) if session_id is not None else new_session_id()
        # close() tells the gateway the session is over (DELETE {base_url}/sessions/{id}), so the decode node's
        # hold of its history is released now rather than at the engine's TTL.
        self.end_on_close = end_on_close
        self._clients: list[Any] = []  # the clients wrap() made, to end the session through
        self.tenant = tenant
        self.tenant_key = tenant_key
        self.record_to = Path(record_to) if record_to is not None else None
        self.tracer_provider = tracer_provider
        self.closed = False
        self._lock = threading.Lock()
        self._turns: list[TurnMetrics] = []
        self._pending: list[_Call] = []
        self._last_end_ns: int | None = None
        # Recorder state: what the previous recorded turn sent and got, to write new_messages only.
        self._rec_count = 0
        self._rec_model: str | None = None
        self._rec_tools: list[Any] | None = None
        self._rec_messages: list[dict[str, Any]] | None = None
        self._rec_answer: dict[str, Any] | None = None

    def __repr__(self) -> str:
        return f"AgentSession(id={self.id!r}, turns={len(self._turns)}, closed={self.closed})"

    # --- public -----------------------------------------------------------------------------

    @property
    def turns(self) -> list[TurnMetrics]:
        """Metrics of every chat call so far, in call order (a copy of the list; entries are live)."""
        with self._lock:
            return list(self._turns)

    @property
    def last_turn(self) -> TurnMetrics | None:
        with self._lock:
            return self._turns[-1] if self._turns else None

    def headers(self) -> dict[str, str]:
        """The session's constant headers, for clients the SDK cannot wrap (e.g. ``default_headers``)."""
        return {contract.SESSION_HEADER: self.id}

    def wrap(self, client: _C) -> _C:
        """A copy of an ``OpenAI``/``AsyncOpenAI`` client (or subclass) that stamps for this session.

        The copy shares the original's connection pool (``with_options()``); the original is left
        untouched, so one base client can serve many sessions.
        """
        from .client import wrap_client

        return wrap_client(client, self)

    def close(self) -> None:
        """End the session: unfinished calls are closed as aborted (their spans end), and the gateway behind
        each synchronous client this session wrapped is told the session is over (best effort: a backend that
        does not know the call, or cannot be reached, is ignored). Idempotent. With ``AsyncOpenAI`` clients use
        ``await session.aclose()`` or ``async with``."""
        if self._end_locally():
            for client in self._end_targets(asynchronous=False):
                with contextlib.suppress(Exception):
                    client.delete(self._end_path(), cast_to=httpx.Response, options=_END_OPTIONS)

    async def aclose(self) -> None:
        """``close()`` for asynchronous clients: ends the session on the gateway behind each client it wrapped."""
        if self._end_locally():
            for client in self._end_targets(asynchronous=True):
                with contextlib.suppress(Exception):
                    await client.delete(self._end_path(), cast_to=httpx.Response, options=_END_OPTIONS)
            for client in self._end_targets(asynchronous=False):
                with contextlib.suppress(Exception):
                    client.delete(self._end_path(), cast_to=httpx.Response, options=_END_OPTIONS)

    def _end_locally(self) -> bool:
        """Close the session's own state; True the first time (the gateway is told once)."""
        with self._lock:
            first = not self.closed
            self.closed = True
            pending = list(self._pending)
        for call in pending:
            self._finish(call, aborted=True)
        return first and self.end_on_close

    def _end_targets(self, *, asynchronous: bool) -> list[Any]:
        import openai

        seen: set[str] = set()
        out = []
        for client in self._clients:
            base = str(getattr(client, "base_url", ""))
            if base in seen or isinstance(client, openai.AsyncOpenAI) != asynchronous:
                continue
            seen.add(base)
            out.append(client)
        return out

    def _end_path(self) -> str:
        return contract.SESSION_END_PATH.format(session_id=quote(self.id, safe=""))

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    # --- called by the stamped clients --------------------------------------------------------

    def _stamps(self, body: Mapping[str, Any]) -> contract.Stamps:
        return contract.stamps_for_body(body, key=self.tenant_key)

    def _begin(self, body: Mapping[str, Any], server: tuple[str | None, int | None]) -> _Call:
        if self.closed:
            raise RuntimeError(f"agent session {self.id} is closed")
        t0 = time.perf_counter_ns()
        stamps = self._stamps(body)
        # A JSON round trip only when recording: the recorder needs plain data, metrics do not.
        plain = _jsonable(dict(body)) if self.record_to is not None else dict(body)
        stream = bool(plain.get("stream"))
        opts = plain.get("stream_options")
        with self._lock:
            metrics = TurnMetrics(
                seq=len(self._turns),
                turn=stamps.turn,
                prefix=stamps.prefix,
                parent=stamps.parent,
                model=plain.get("model") if isinstance(plain.get("model"), str) else None,
                stream=stream,
                started_at=time.time(),
            )
            call = _Call(
                session=self,
                metrics=metrics,
                body=plain,
                t0_ns=t0,
                include_usage=isinstance(opts, Mapping) and bool(opts.get("include_usage")),
            )
            self._turns.append(metrics)
            self._pending.append(call)
        call.span = tracing.start_span(self, metrics, plain, server)
        return call

    def _finish(self, call: _Call, *, error: BaseException | None = None, aborted: bool = False) -> None:
        now = time.perf_counter_ns()
        m = call.metrics
        with call.lock:
            if m.done:
                return
            m.done = True
            m.e2e_ms = (now - call.t0_ns) / 1e6
            if error is not None:
                m.error = type(error).__name__
            m.aborted = aborted and error is None
            if m.stream and m.answer is None and (call.answer.content or call.answer.tool_calls or m.chunks):
                m.answer = call.answer.message()
        with self._lock:
            if call in self._pending:
                self._pending.remove(call)
            delay_ms = 0.0 if self._last_end_ns is None else max(0.0, (call.t0_ns - self._last_end_ns) / 1e6)
            self._last_end_ns = max(self._last_end_ns or 0, now)
            if self.record_to is not None and m.error is None and not m.aborted:
                self._record(call, delay_ms)
        if call.span is not None:
            tracing.end_span(call.span, m, error)

    def _record(self, call: _Call, delay_ms: float) -> None:
        """Append one turn line. Caller holds ``self._lock`` so lines and chaining state agree."""
        assert self.record_to is not None
        m = call.metrics
        body = call.body
        messages = list(body.get("messages") or [])
        tools = body.get("tools")
        model: str = body["model"] if isinstance(body.get("model"), str) else (m.model or "unknown")
        params = {k: v for k, v in body.items() if k not in ("messages", "tools", "model")}
        if self._rec_model is not None and model != self._rec_model:
            params["model"] = model  # a later turn switched model; the line's model names the session's
        turn = TurnRecord(index=self._rec_count, delay_ms=round(delay_ms, 3), params=params)
        prev, answer = self._rec_messages, self._rec_answer
        if prev is not None and answer is not None and self._extends(messages, prev, answer):
            turn.new_messages = messages[len(prev) + 1 :]
        else:
            turn.messages = messages
        first = self._rec_count == 0
        if not first and tools != self._rec_tools:
            turn.tools = tools if tools is not None else []
        turn.recorded = Recorded(
            answer=m.answer,
            ttfc_ms=_r(m.ttfc_ms),
            ttft_ms=_r(m.ttft_ms),
            e2e_ms=_r(m.e2e_ms),
            prompt_tokens=m.prompt_tokens,
            completion_tokens=m.completion_tokens,
            cached_tokens=m.cached_tokens,
            finish_reason=m.finish_reason,
        )
        # Line-level tools only on the first line: the reader takes a session's tools from the
        # first line that has them, so a later line's tools would rewrite earlier turns.
        line = turn_line(self.id, self._rec_model or model, turn, tools=tools if first else None)
        self.record_to.parent.mkdir(parents=True, exist_ok=True)
        with self.record_to.open("a", encoding="utf-8") as f:
            f.write(line)
        self._rec_count += 1
        if first:
            self._rec_model = model
        self._rec_tools = tools
        self._rec_messages = messages
        self._rec_answer = m.answer

    @staticmethod
    def _extends(messages: list[dict[str, Any]], prev: list[dict[str, Any]], answer: dict[str, Any]) -> bool:
        """Is ``messages`` == ``prev`` + [``answer``] + more, as the chat template sees them?"""
        n = len(prev)
        if len(messages) < n + 1:
            return False
        canon = contract.canonical_message
        try:
            return all(canon(a) == canon(b) for a, b in zip(messages[:n], prev, strict=True)) and canon(
                messages[n]
            ) == canon(answer)
        except (TypeError, KeyError):
            return False


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 3)
