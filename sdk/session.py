"""``AgentSession``: one agent conversation, its per-turn client metrics and its optional recorder.

The session is bookkeeping: the stamped clients (``kvtether.sdk.client`` for openai, ``kvtether.sdk.anthropic``)
report each call's life to it (``_begin`` → payloads → ``_finish``), and it keeps the metrics, ends the tracing
span and appends the turn to the session file. Its one request of its own is the session's end, sent through the
clients stamping for it (``close``/``aclose``): the gateway then releases what the decode node holds for it.

Imports point one way: the client modules import this one, which imports ``turns``, ``tracing``, ``contract`` and
``sessionfile``, none of which imports it back. ``wrap()`` finds the client module by the wrapped client's
library name and imports it only then (``_WRAPPERS``), so this module never imports a client library.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import os
import re
import secrets
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

from kvtether.protocol import contract

from . import tracing
from .sessionfile import Recorded, TurnRecord, turn_line
from .turns import CHAT, MESSAGES, RESPONSES, Call, TurnMetrics, chat_request, reader_for

__all__ = ["AgentSession", "TurnMetrics", "new_session_id"]

if TYPE_CHECKING:
    from typing import Self

_C = TypeVar("_C")

# Crockford base32, lower case: URL- and header-safe, no ambiguous letters, sorts like the numbers.
_CROCKFORD = "0123456789abcdefghjkmnpqrstvwxyz"
_ID_RE = re.compile(r"^[A-Za-z0-9._~:@-]{1,200}$")
# wrap(): the kvtether module that stamps each client library's clients, by the library's top-level package.
_WRAPPERS = {"openai": "kvtether.sdk.client", "anthropic": "kvtether.sdk.anthropic"}
_STAMPS = {
    CHAT: contract.stamps_for_body,
    RESPONSES: contract.stamps_for_responses_body,
    MESSAGES: contract.stamps_for_messages_body,
}
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


class _Stamping(Protocol):
    """A client stamping for a session, as the session sees it (the hooks in ``_stamping``)."""

    _kvt_async: ClassVar[bool]

    def _kvt_end_url(self, session_id: str) -> str: ...

    def _kvt_end(self, session_id: str) -> Any: ...


class AgentSession:
    """One agent conversation: its id (sent as ``x-session-id``), per-turn metrics, recorder, spans.

    ``session_id``: caller-given (header-/URL-safe: letters, digits, ``._~:@-``) or a generated
    sortable ULID-style id. ``tenant_key`` keys the prefix hashes (``contract.stamps_for_*``); the
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
        # close() tells the gateway the session is over (DELETE …/v1/sessions/{id}), so the decode node's
        # hold of its history is released now rather than at the engine's TTL.
        self.end_on_close = end_on_close
        self._clients: list[_Stamping] = []  # the clients stamping for it, to end the session through
        self.tenant = tenant
        self.tenant_key = tenant_key
        self.record_to = Path(record_to) if record_to is not None else None
        self.tracer_provider = tracer_provider
        self.closed = False
        self._lock = threading.Lock()
        self._turns: list[TurnMetrics] = []
        self._pending: list[Call] = []
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
        """Metrics of every model call so far, in call order (a copy of the list; entries are live)."""
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
        """A copy of a client that stamps for this session: ``OpenAI``/``AsyncOpenAI`` (or a subclass), or
        ``Anthropic``/``AsyncAnthropic`` (with the ``anthropic`` extra).

        The copy shares the original's connection pool (``with_options()``); the original is left
        untouched, so one base client can serve many sessions.
        """
        # The first class in the MRO from a known library: frameworks subclass the clients.
        libraries = (cls.__module__.partition(".")[0] for cls in type(client).__mro__)
        module = next((_WRAPPERS[lib] for lib in libraries if lib in _WRAPPERS), None)
        if module is None:
            raise TypeError(f"expected an openai or anthropic client, got {type(client).__name__}")
        wrapped: _C = importlib.import_module(module).wrap_client(client, self)
        return wrapped

    def close(self) -> None:
        """End the session: unfinished calls are closed as aborted (their spans end), and the gateway behind
        each synchronous client stamping for it is told the session is over (best effort: a backend that
        does not know the call, or cannot be reached, is ignored). Idempotent. With async clients use
        ``await session.aclose()`` or ``async with``."""
        if self._end_locally():
            for client in self._end_targets(asynchronous=False):
                with contextlib.suppress(Exception):
                    client._kvt_end(self.id)

    async def aclose(self) -> None:
        """``close()`` for asynchronous clients: ends the session on the gateway behind each client stamping for it."""
        if self._end_locally():
            for client in self._end_targets(asynchronous=True):
                with contextlib.suppress(Exception):
                    ended = client._kvt_end(self.id)
                    if inspect.isawaitable(ended):
                        await ended
            for client in self._end_targets(asynchronous=False):
                with contextlib.suppress(Exception):
                    client._kvt_end(self.id)

    def _attach(self, client: _Stamping) -> None:
        """A client now stamps for this session: the session's end is sent through it."""
        with self._lock:
            self._clients.append(client)

    def _end_locally(self) -> bool:
        """Close the session's own state; True the first time (the gateway is told once)."""
        with self._lock:
            first = not self.closed
            self.closed = True
            pending = list(self._pending)
        for call in pending:
            self._finish(call, aborted=True)
        return first and self.end_on_close

    def _end_targets(self, *, asynchronous: bool) -> list[_Stamping]:
        """One client per gateway (by the URL the end goes to), of the kind asked for."""
        seen: set[str] = set()
        out = []
        with self._lock:
            clients = list(self._clients)
        for client in clients:
            url = client._kvt_end_url(self.id)
            if url in seen or client._kvt_async != asynchronous:
                continue
            seen.add(url)
            out.append(client)
        return out

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

    def _stamps(self, api: str, body: Mapping[str, Any]) -> contract.Stamps:
        return _STAMPS[api](body, key=self.tenant_key)

    def _begin(
        self, api: str, body: Mapping[str, Any], server: tuple[str | None, int | None], system: str
    ) -> Call:
        """A call of ``api`` opens (``system``: the client library's vendor, for the span)."""
        if self.closed:
            raise RuntimeError(f"agent session {self.id} is closed")
        t0 = time.perf_counter_ns()
        stamps = self._stamps(api, body)
        # A JSON round trip only when recording: the recorder needs plain data, metrics do not.
        plain = _jsonable(dict(body)) if self.record_to is not None else dict(body)
        with self._lock:
            metrics = TurnMetrics(
                seq=len(self._turns),
                turn=stamps.turn,
                prefix=stamps.prefix,
                parent=stamps.parent,
                model=plain.get("model") if isinstance(plain.get("model"), str) else None,
                stream=bool(plain.get("stream")),
                started_at=time.time(),
                api=api,
            )
            call = Call(
                session=self, metrics=metrics, body=plain, t0_ns=t0, reader=reader_for(api, plain)
            )
            self._turns.append(metrics)
            self._pending.append(call)
        where = tracing.SpanContext(self.id, self.tenant, self.tracer_provider, system)
        call.span = tracing.start_span(where, metrics, plain, server)
        return call

    def _finish(self, call: Call, *, error: BaseException | None = None, aborted: bool = False) -> None:
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
            call.final_answer()
        with self._lock:
            if call in self._pending:
                self._pending.remove(call)
            delay_ms = 0.0 if self._last_end_ns is None else max(0.0, (call.t0_ns - self._last_end_ns) / 1e6)
            self._last_end_ns = max(self._last_end_ns or 0, now)
            if self.record_to is not None and m.error is None and not m.aborted:
                self._record(call, delay_ms)
        if call.span is not None:
            tracing.end_span(call.span, m, error)

    def _record(self, call: Call, delay_ms: float) -> None:
        """Append one turn line, in chat terms whatever the API (``turns.chat_request``). Caller holds ``self._lock`` so
        lines and chaining state agree."""
        assert self.record_to is not None
        m = call.metrics
        body = chat_request(m.api, call.body)
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
