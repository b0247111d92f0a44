"""The stamping hooks shared by the openai and anthropic clients (both are Stainless-generated: same base client).

Mechanism (the same on openai 1.99+ … 3.x and anthropic 0.40+ … 2.x; only client methods, never the HTTP library):

- ``request()`` (one call, all retries) opens the turn: start time, metrics, tracing span. It puts
  the turn in a context variable that the hooks below read; they run inside it.
- ``_prepare_options()`` runs once per attempt on a fresh copy of the options. It computes the
  stamps from that attempt's body (``json_data`` + ``extra_body``, i.e. what the gateway parses),
  so retries and replays carry identical stamps without any counter, and adds ``traceparent``.
- ``_process_response()`` ties the HTTP response object to the turn, and when it returns the
  ``Stream``/``AsyncStream`` it swaps that object's internal iterator for one that passes every
  item through and notices the end: the caller gets the very object the client made.
- ``_process_response_data()`` sees every parsed SSE payload (and the whole body of a non-streamed
  answer) before it becomes a pydantic object: first-event / first-token times, the assembled
  answer and usage. It also covers ``with_raw_response``/``with_streaming_response``, which build
  their stream later and outside ``request()``.

What differs between the libraries (which paths are model calls of which API, their sentinel and stream
types, where the gateway's ``/v1`` is) is a ``Library``; the hooks read it from the client class.
"""

from __future__ import annotations

import contextvars
import threading
import time
import weakref
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar
from urllib.parse import quote, urlsplit

from kvtether.protocol import contract

from . import tracing
from .session import AgentSession
from .turns import Call

if TYPE_CHECKING:
    from typing import Self

    class _ClientBase:
        """What the shared hooks reach through super(): every Stainless client has it, with these arguments."""

        base_url: Any

        def copy(self, *args: Any, **kwargs: Any) -> Self: ...

        def with_options(self, *args: Any, **kwargs: Any) -> Self: ...

        def _process_response_data(self, *, data: object, cast_to: Any, response: Any) -> Any: ...

        def delete(self, *args: Any, **kwargs: Any) -> Any: ...

    class _AsyncBase(_ClientBase):
        async def _prepare_options(self, options: Any) -> Any: ...

        async def request(self, cast_to: Any, options: Any, *args: Any, **kwargs: Any) -> Any: ...

        async def _process_response(self, **kwargs: Any) -> Any: ...

    class _SyncBase(_ClientBase):
        def _prepare_options(self, options: Any) -> Any: ...

        def request(self, cast_to: Any, options: Any, *args: Any, **kwargs: Any) -> Any: ...

        def _process_response(self, **kwargs: Any) -> Any: ...
else:
    # At run time the hooks are mixins: they sit in front of whichever client class they stamp
    # (AsyncOpenAI, AsyncAzureOpenAI, AsyncAnthropic, a framework's subclass …) and reach it through super().
    _ClientBase = object
    _AsyncBase = object
    _SyncBase = object

# The end of a session is a courtesy to the gateway: bounded, never retried, never raised. ``str``: the body is
# read as text whatever it is (every Stainless client parses that the same way).
_END_OPTIONS: Any = {"timeout": 2.0, "max_retries": 0}


@dataclass(frozen=True)
class Library:
    """What the hooks need to know about one client library."""

    name: str  # gen_ai.provider.name
    routes: tuple[tuple[str, str], ...]  # (path suffix of a POST, API name in turns): the model calls
    sentinels: tuple[type, ...]  # the library's Omit/NotGiven types: absent from the body on the wire
    streams: tuple[type, type]  # (AsyncStream, Stream)
    v1: str  # from the client's base_url to the gateway's /v1 ("" when base_url already ends in /v1)

    def api(self, options: Any) -> str | None:
        """The API of a request when it is a model call the SDK stamps, else None."""
        if str(getattr(options, "method", "")).lower() != "post":
            return None
        if not isinstance(getattr(options, "json_data", None), Mapping):
            return None
        path = urlsplit(str(getattr(options, "url", "") or "")).path.rstrip("/")
        return next((api for suffix, api in self.routes if path.endswith(suffix)), None)

    def body(self, options: Any) -> dict[str, Any]:
        """The JSON body as it goes on the wire: ``json_data`` with ``extra_body`` merged over it."""
        body = dict(options.json_data)
        extra = getattr(options, "extra_json", None)
        if isinstance(extra, Mapping):
            body.update(extra)
        return {k: v for k, v in body.items() if not isinstance(v, self.sentinels)}


_current: contextvars.ContextVar[Call | None] = contextvars.ContextVar("kvtether_sdk_call", default=None)
# Response object -> turn. Weak: a response dropped unread must not keep the turn (or itself) alive.
_by_response: weakref.WeakKeyDictionary[Any, Call] = weakref.WeakKeyDictionary()
_map_lock = threading.Lock()


def _stamp(lib: Library, session: AgentSession | None, options: Any) -> Any:
    """Stamp one attempt's (already prepared) options in place; returns them."""
    if session is None:
        return options
    given = options.headers if isinstance(options.headers, Mapping) else {}
    ours: dict[str, str] = {contract.SESSION_HEADER: session.id}
    api = lib.api(options)
    call = _current.get()
    if api is not None:
        ours.update(session._stamps(api, lib.body(options)).headers())
        if call is not None:
            with call.lock:
                call.metrics.attempts += 1
            if call.span is not None:
                tracing.inject(call.span, ours)
    # Headers the caller set (extra_headers, or Omit() to drop one) win over ours; compare
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


def _begin(client: _StampingHooks, options: Any) -> Call | None:
    session = client._kvt_session
    lib = client._kvt_lib
    api = lib.api(options) if session is not None else None
    if session is None or api is None:
        return None
    return session._begin(api, lib.body(options), _server(client), lib.name)


def _register(response: Any, call: Call) -> None:
    try:
        request_id = response.headers.get("x-request-id") or response.headers.get("request-id")
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


def _finish_stream(call: Call, exc: BaseException | None) -> None:
    if exc is None:
        call.session._finish(call)
    elif isinstance(exc, GeneratorExit):
        # Closed early. A consumer that stops after the answer's end (finish reason, stop event) has it whole.
        call.session._finish(call, aborted=not call.complete)
    else:
        call.session._finish(call, error=exc)


@contextmanager
def _streaming(call: Call) -> Iterator[None]:
    # Runs around the whole iteration inside the wrapping generator, so closing that generator
    # (GeneratorExit) reaches it as well as the end of the stream or an error.
    try:
        yield
    except BaseException as e:
        _finish_stream(call, e)
        raise
    _finish_stream(call, None)


async def _observed_async(inner: AsyncIterator[Any], call: Call) -> AsyncIterator[Any]:
    with _streaming(call):
        async for item in inner:
            yield item


def _observed_sync(inner: Iterator[Any], call: Call) -> Iterator[Any]:
    with _streaming(call):
        yield from inner


@contextmanager
def _turn(client: _StampingHooks, options: Any) -> Iterator[None]:
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


def _responding(response: Any) -> Call | None:
    """Before ``_process_response()``: tie the HTTP response to the current turn, and return that turn."""
    call = _current.get()
    if call is not None:
        _register(response, call)
    return call


def _responded(lib: Library, call: Call | None, result: Any) -> Any:
    """After ``_process_response()``: a stream it returned for the current turn gets its iterator
    swapped for one that passes every item through and ends the turn."""
    async_stream, sync_stream = lib.streams
    if call is None or not isinstance(result, async_stream | sync_stream):
        return result
    call.iterator_wrapped = True
    # Setting the attribute works whether the library keeps the iterator in an attribute (openai) or in a
    # cached_property (anthropic): either way the instance's own value is what iteration reads.
    if isinstance(result, async_stream):
        result._iterator = _observed_async(result._iterator, call)  # type: ignore[attr-defined]
    else:
        result._iterator = _observed_sync(result._iterator, call)  # type: ignore[attr-defined]
    return result


class _StampingHooks(_ClientBase):
    """What the async and sync hooks share: everything but the calls that the async client awaits."""

    _kvt_lib: ClassVar[Library]
    _kvt_async: ClassVar[bool]
    _kvt_session: AgentSession | None = None

    def _kvt_start(self, session: AgentSession | None) -> None:
        """Constructors: stamp for ``session`` (a new one when not given), which ends through this client."""
        self._kvt_session = session if session is not None else AgentSession()
        self._kvt_session._attach(self)

    @property
    def session(self) -> AgentSession | None:
        """The session this client stamps for."""
        return self._kvt_session

    def for_session(self, session: AgentSession) -> Self:
        """A copy (same connection pool) that stamps for another session."""
        new = self.with_options()
        new._kvt_session = session
        session._attach(new)
        return new

    def copy(self, *args: Any, **kwargs: Any) -> Self:
        # The base copy() builds self.__class__(...) from its own known arguments: carry the session.
        new = super().copy(*args, **kwargs)
        new._kvt_session = self._kvt_session
        return new

    with_options = copy

    def _kvt_end_url(self, session_id: str) -> str:
        return str(self.base_url).rstrip("/") + self._kvt_end_path(session_id)

    def _kvt_end(self, session_id: str) -> Any:
        """DELETE the session on the gateway (an awaitable on async clients)."""
        return self.delete(self._kvt_end_path(session_id), cast_to=str, options=_END_OPTIONS)

    def _kvt_end_path(self, session_id: str) -> str:
        return self._kvt_lib.v1 + contract.SESSION_END_PATH.format(session_id=quote(session_id, safe=""))

    def _process_response_data(self, *, data: object, cast_to: Any, response: Any) -> Any:
        _on_data(response, data)
        return super()._process_response_data(data=data, cast_to=cast_to, response=response)


class AsyncHooks(_StampingHooks, _AsyncBase):
    _kvt_async = True

    async def _prepare_options(self, options: Any) -> Any:
        return _stamp(self._kvt_lib, self._kvt_session, await super()._prepare_options(options))

    async def request(self, cast_to: Any, options: Any, *args: Any, **kwargs: Any) -> Any:
        with _turn(self, options):
            return await super().request(cast_to, options, *args, **kwargs)

    async def _process_response(self, **kwargs: Any) -> Any:
        call = _responding(kwargs.get("response"))
        return _responded(self._kvt_lib, call, await super()._process_response(**kwargs))


class SyncHooks(_StampingHooks, _SyncBase):
    _kvt_async = False

    def _prepare_options(self, options: Any) -> Any:
        return _stamp(self._kvt_lib, self._kvt_session, super()._prepare_options(options))

    def request(self, cast_to: Any, options: Any, *args: Any, **kwargs: Any) -> Any:
        with _turn(self, options):
            return super().request(cast_to, options, *args, **kwargs)

    def _process_response(self, **kwargs: Any) -> Any:
        call = _responding(kwargs.get("response"))
        return _responded(self._kvt_lib, call, super()._process_response(**kwargs))


def stamped_class(base: type, lib: Library, asynchronous: bool, cache: dict[type, type], lock: threading.Lock) -> type:
    """The hooked subclass of a client class (made once per class)."""
    with lock:
        cls = cache.get(base)
        if cls is None:
            hooks: type = AsyncHooks if asynchronous else SyncHooks
            cls = type(f"Stamped{base.__name__}", (hooks, base), {"__module__": __name__, "_kvt_lib": lib})
            cache[base] = cls
        return cls


def wrap(client: Any, session: AgentSession, cls: type) -> Any:
    """A stamping copy of ``client`` (sharing its connection pool) as an instance of the hooked ``cls``."""
    # with_options() is the client's own public way to derive a client that shares its connection
    # pool. Its state moves into an instance of the hooked subclass (made without __init__, which
    # would build a second pool): the copy is fresh, so it holds no resource caches bound to
    # itself, and the caller's client stays unstamped. (Re-classing in place is not possible:
    # CPython refuses __class__ assignment to a class with a mixin in front.)
    fresh = client.with_options()
    new: Any = object.__new__(cls)
    new.__dict__.update(fresh.__dict__)
    new._kvt_session = session
    session._attach(new)
    return new
