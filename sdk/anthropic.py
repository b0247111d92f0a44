"""anthropic clients that stamp every Messages call for an ``AgentSession`` and time its answer.

Needs the ``anthropic`` extra (``pip install 'kvtether[anthropic]'``); ``import kvtether.sdk`` works without it,
and only touching these names imports the ``anthropic`` package.

``messages.create`` (streamed or not), ``messages.stream`` and their ``beta.messages`` twins carry the session id
(``x-session-id``, the same header the openai clients send), the turn index and the prefix hashes over
``system`` + ``messages`` (``contract.stamps_for_messages_body``); their ``TurnMetrics`` get client-side TTFC and
TTFT (the first ``content_block_delta`` carrying text, tool input or thinking). Point the client at the gateway
the way Anthropic clients expect it, without ``/v1``: ``base_url="http://127.0.0.1:8000"``.

    from kvtether.sdk import AgentSession, StampedAsyncAnthropic

    session = AgentSession()
    client = StampedAsyncAnthropic(session=session, base_url="http://127.0.0.1:8000", api_key="-")
    async with client.messages.stream(model=m, max_tokens=512, messages=messages) as stream:
        async for text in stream.text_stream: ...
    print(session.last_turn.ttft_ms)
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, TypeVar, cast

try:
    import anthropic
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "kvtether's Anthropic client wrapper needs the anthropic package: pip install 'kvtether[anthropic]'"
    ) from exc

from . import _stamping
from .session import AgentSession
from .turns import MESSAGES

_C = TypeVar("_C")

ANTHROPIC = _stamping.Library(
    name="anthropic",
    # Exact suffix: /v1/messages/count_tokens and /v1/messages/batches are not model calls.
    routes=(("/v1/messages", MESSAGES),),
    sentinels=(anthropic.Omit, anthropic.NotGiven),
    streams=(anthropic.AsyncStream, anthropic.Stream),
    v1="/v1",  # anthropic clients' base_url is the server root; their paths start with /v1
)

if TYPE_CHECKING:
    # For the type checker the hooks are the anthropic client classes (their methods are what super() reaches).
    class _AsyncHooks(_stamping.AsyncHooks, anthropic.AsyncAnthropic): ...

    class _SyncHooks(_stamping.SyncHooks, anthropic.Anthropic): ...
else:
    _AsyncHooks = _stamping.AsyncHooks
    _SyncHooks = _stamping.SyncHooks


class StampedAsyncAnthropic(_AsyncHooks, anthropic.AsyncAnthropic):
    """``AsyncAnthropic`` that stamps every request for ``session`` (a new one when not given).

    Takes every ``AsyncAnthropic`` argument; ``isinstance(client, AsyncAnthropic)`` holds.
    ``session.aclose()`` ends the session on the gateway through it.
    """

    _kvt_lib = ANTHROPIC

    def __init__(self, *, session: AgentSession | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._kvt_start(session)


class StampedAnthropic(_SyncHooks, anthropic.Anthropic):
    """``Anthropic`` (sync) that stamps every request for ``session`` (a new one when not given)."""

    _kvt_lib = ANTHROPIC

    def __init__(self, *, session: AgentSession | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._kvt_start(session)


_classes: dict[type, type] = {anthropic.AsyncAnthropic: StampedAsyncAnthropic, anthropic.Anthropic: StampedAnthropic}
_classes_lock = threading.Lock()


def wrap_client(client: _C, session: AgentSession) -> _C:
    """See ``AgentSession.wrap``: an ``Anthropic``/``AsyncAnthropic`` client (or subclass) stamping for ``session``."""
    if isinstance(client, _stamping.AsyncHooks | _stamping.SyncHooks):
        return cast(_C, client.for_session(session))
    if not isinstance(client, anthropic.AsyncAnthropic | anthropic.Anthropic):
        kind = type(client).__name__
        raise TypeError(f"expected an anthropic.Anthropic or anthropic.AsyncAnthropic client, got {kind}")
    asynchronous = isinstance(client, anthropic.AsyncAnthropic)
    cls = _stamping.stamped_class(type(client), ANTHROPIC, asynchronous, _classes, _classes_lock)
    return cast(_C, _stamping.wrap(client, session, cls))
