"""openai clients that stamp every chat request for an ``AgentSession`` and time its answer.

Mechanism (the same on openai 1.99+ … 3.x; only client methods, never the HTTP library):

- ``request()`` (one call, all retries) opens the turn: start time, metrics, tracing span. It puts
  the turn in a context variable that the hooks below read; they run inside it.
- ``_prepare_options()`` runs once per attempt on a fresh copy of the options. It computes the
  stamps from that attempt's body (``json_data`` + ``extra_body``, i.e. what the gateway parses),
  so retries and replays carry identical stamps without any counter, and adds ``traceparent``.
- ``_process_response()`` ties the HTTP response object to the turn, and when it returns the
  ``Stream``/``AsyncStream`` it swaps that object's internal iterator for one that passes every
  item through and notices the end: the caller gets the very object the client made.
- ``_process_response_data()`` sees every parsed SSE payload (and the whole body of a non-streamed
  answer) before it becomes a pydantic object: first-chunk / first-token times, the assembled
  answer and usage. It also covers ``with_raw_response``/``with_streaming_response``, which build
  their stream later and outside ``request()``.

All of this lives once, in ``_StampingHooks`` and the helpers it and the hooks call; ``_AsyncHooks`` and
``_SyncHooks`` only add the three methods the async client awaits, each a thin wrapper.
"""

from __future__ import annotations

import contextvars
import threading
import time
import weakref
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar, cast
from urllib.parse import urlsplit

import openai

from . import contract, tracing
from .session import AgentSession, _Call

if TYPE_CHECKING:
    from typing import Self

    class _ClientBase:
        """What the shared hooks reach through super(): both clients have it, with these arguments."""

        def copy(self, *args: Any, **kwargs: Any) -> Self: ...

        def _process_response_data(self, *, data: object, cast_to: Any, response: Any) -> Any: ...

    _AsyncBase = openai.AsyncOpenAI
    _SyncBase = openai.OpenAI
else:
    # At run time the hooks are mixins: they sit in front of whichever client class they stamp
    # (AsyncOpenAI, AsyncAzureOpenAI, a framework's subclass …) and reach it through super().
    _ClientBase = object
    _AsyncBase = object
    _SyncBase = object

_C = TypeVar("_C")

_current: contextvars.ContextVar[_Call | None] = contextvars.ContextVar("kvtether_sdk_call", default=None)
# Response object -> turn. Weak: a response dropped unread must not keep the turn (or itself) alive.
_by_response: weakref.WeakKeyDictionary[Any, _Call] = weakref.WeakKeyDictionary()
_map_lock = threading.Lock()


def _is_chat(options: Any) -> bool:
    url = str(getattr(options, "url", "") or "")
    return (
        str(getattr(options, "method", "")).lower() == "post"
        and url.rstrip("/").endswith("/chat/completions")
        and isinstance(getattr(options, "json_data", None), Mapping)
    )


def _body(options: Any) -> dict[str, Any]:
    """The JSON body as it goes on the wire: ``json_data`` with ``extra_body`` merged over it."""
    body = dict(options.json_data)
    extra = getattr(options, "extra_json", None)
    if isinstance(extra, Mapping):
        body.update(extra)
    return {k: v for k, v in body.items() if not isinstance(v, openai.Omit | openai.NotGiven)}


def _stamp(session: AgentSession | None, options: Any) -> Any:
    """Stamp one attempt's (already prepared) options in place; returns them."""
    if session is None:
        return options
    given = options.headers if isinstance(options.headers, Mapping) else {}
    ours: dict[str, str] = {contract.SESSION_HEADER: session.id}
    call = _current.get()
    if _is_chat(options):
        ours.update(session._stamps(_body(options)).headers())
        if call is not None:
            with call.lock:
                call.metrics.attempts += 1
            if call.span is not None:
                tracing.inject(call.span, ours)
    # Headers the caller set (extra_headers, or openai.Omit() to drop one) win over ours; compare
    # case-insensitively so one header never goes out twice.
    present = {k.lower() for k in given}
    options.headers = {**{k: v for k, v in ours.items() if k.lower() not in present}, **given}
    return options


def _server(client: Any) -> tuple[str | None, int | None]:
    try:
        parts = urlsplit(str(client.base_url))
        return parts.hostname, parts.port
    except (ValueError, AttributeError):
        return None, None


def _begin(client: Any, options: Any) -> _Call | None:
    session: AgentSession | None = client._kvt_session
    if session is None or not _is_chat(options):
        return None
    return session._begin(_body(options), _server(client))


def _register(response: Any, call: _Call) -> None:
    try:
        request_id = response.headers.get("x-request-id")
    except AttributeError:
        request_id = None
    if isinstance(request_id, str):
        call.metrics.request_id = request_id
    try:
        with _map_lock:
            _by_response[response] = call
    except TypeError:  # not weak-referenceable: chunk timing is lost, stamping still works
        pass


def _on_data(response: Any, data: object) -> None:
    now = time.perf_counter_ns()  # before the SDK parses the payload into a pydantic model
    try:
        with _map_lock:
            call = _by_response.get(response)
    except TypeError:
        return
    if call is not None:
        call.on_data(data, now)


def _finish_stream(call: _Call, exc: BaseException | None) -> None:
    if exc is None:
        call.session._finish(call)
    elif isinstance(exc, GeneratorExit):
        # Closed early. A consumer that stops after the finish_reason has the whole answer.
        call.session._finish(call, aborted=not call.finished_choices)
    else:
        call.session._finish(call, error=exc)


@contextmanager
def _streaming(call: _Call) -> Iterator[None]:
    # Runs around the whole iteration inside the wrapping generator, so closing that generator
    # (GeneratorExit) reaches it as well as the end of the stream or an error.
    try:
        yield
    except BaseException as e:
        _finish_stream(call, e)
        raise
    _finish_stream(call, None)


async def _observed_async(inner: AsyncIterator[Any], call: _Call) -> AsyncIterator[Any]:
    with _streaming(call):
        async for item in inner:
            yield item


def _observed_sync(inner: Iterator[Any], call: _Call) -> Iterator[Any]:
    with _streaming(call):
        yield from inner


@contextmanager
def _turn(client: Any, options: Any) -> Iterator[None]:
    """Around one ``request()`` (all attempts): the turn is current for the hooks that run inside it."""
    call = _begin(client, options)
    if call is None:
        yield
        return
    token = _current.set(call)
    try:
        yield
    except BaseException as e:
        call.session._finish(call, error=e)
        raise
    finally:
        _current.reset(token)


def _responding(response: Any) -> _Call | None:
    """Before ``_process_response()``: tie the HTTP response to the current turn, and return that turn."""
    call = _current.get()
    if call is not None:
        _register(response, call)
    return call


def _responded(call: _Call | None, result: Any) -> Any:
    """After ``_process_response()``: a stream it returned for the current turn gets its iterator
    swapped for one that passes every item through and ends the turn."""
    if call is None or not isinstance(result, openai.AsyncStream | openai.Stream):
        return result
    call.iterator_wrapped = True
    if isinstance(result, openai.AsyncStream):
        result._iterator = _observed_async(result._iterator, call)
    else:
        result._iterator = _observed_sync(result._iterator, call)
    return result


class _StampingHooks(_ClientBase):
    """What the async and sync hooks share: everything but the calls that the async client awaits."""

    _kvt_session: AgentSession | None = None

    @property
    def session(self) -> AgentSession | None:
        """The session this client stamps for."""
        return self._kvt_session

    def for_session(self, session: AgentSession) -> Self:
        """A copy (same connection pool) that stamps for another session."""
        new = self.with_options()
        new._kvt_session = session
        session._clients.append(new)
        return new

    def copy(self, *args: Any, **kwargs: Any) -> Self:
        # The base copy() builds self.__class__(...) from its own known arguments: carry the session.
        new = super().copy(*args, **kwargs)
        new._kvt_session = self._kvt_session
        return new

    with_options = copy

    def _process_response_data(self, *, data: object, cast_to: Any, response: Any) -> Any:
        _on_data(response, data)
        return super()._process_response_data(data=data, cast_to=cast_to, response=response)


class _AsyncHooks(_StampingHooks, _AsyncBase):
    async def _prepare_options(self, options: Any) -> Any:
        return _stamp(self._kvt_session, await super()._prepare_options(options))

    async def request(self, cast_to: Any, options: Any, *args: Any, **kwargs: Any) -> Any:
        with _turn(self, options):
            return await super().request(cast_to, options, *args, **kwargs)

    async def _process_response(self, **kwargs: Any) -> Any:
        call = _responding(kwargs.get("response"))
        return _responded(call, await super()._process_response(**kwargs))


class _SyncHooks(_StampingHooks, _SyncBase):
    def _prepare_options(self, options: Any) -> Any:
        return _stamp(self._kvt_session, super()._prepare_options(options))

    def request(self, cast_to: Any, options: Any, *args: Any, **kwargs: Any) -> Any:
        with _turn(self, options):
            return super().request(cast_to, options, *args, **kwargs)

    def _process_response(self, **kwargs: Any) -> Any:
        call = _responding(kwargs.get("response"))
        return _responded(call, super()._process_response(**kwargs))


class StampedAsyncOpenAI(_AsyncHooks, openai.AsyncOpenAI):
    """``AsyncOpenAI`` that stamps every request for ``session`` (a new one when not given).

    Takes every ``AsyncOpenAI`` argument. ``isinstance(client, AsyncOpenAI)`` holds, so it can be
    handed to agent frameworks that call ``create()`` themselves.
    """

    def __init__(self, *, session: AgentSession | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._kvt_session = session if session is not None else AgentSession()


class StampedOpenAI(_SyncHooks, openai.OpenAI):
    """``OpenAI`` (sync) that stamps every request for ``session`` (a new one when not given)."""

    def __init__(self, *, session: AgentSession | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._kvt_session = session if session is not None else AgentSession()


_classes: dict[type, type] = {openai.AsyncOpenAI: StampedAsyncOpenAI, openai.OpenAI: StampedOpenAI}
_classes_lock = threading.Lock()


def _stamped_class(base: type) -> type:
    with _classes_lock:
        cls = _classes.get(base)
        if cls is None:
            hooks: type = _AsyncHooks if issubclass(base, openai.AsyncOpenAI) else _SyncHooks
            cls = type(f"Stamped{base.__name__}", (hooks, base), {"__module__": __name__})
            _classes[base] = cls
        return cls


def wrap_client(client: _C, session: AgentSession) -> _C:
    """See ``AgentSession.wrap``."""
    if isinstance(client, _StampingHooks):
        return cast(_C, client.for_session(session))
    if not isinstance(client, openai.AsyncOpenAI | openai.OpenAI):
        raise TypeError(f"expected an openai.OpenAI or openai.AsyncOpenAI client, got {type(client).__name__}")
    # with_options() is the client's own public way to derive a client that shares its connection
    # pool. Its state moves into an instance of the hooked subclass (made without __init__, which
    # would build a second pool): the copy is fresh, so it holds no resource caches bound to
    # itself, and the caller's client stays unstamped. (Re-classing in place is not possible:
    # CPython refuses __class__ assignment to a class with a mixin in front.)
    fresh = client.with_options()
    cls = _stamped_class(type(client))
    new: Any = object.__new__(cls)
    new.__dict__.update(fresh.__dict__)
    new._kvt_session = session
    session._clients.append(new)
    return cast(_C, new)
