"""openai clients that stamp every model call for an ``AgentSession`` and time its answer.

Two APIs are stamped and timed: chat completions (``chat.completions.create``/``stream``/``parse``) and
Responses (``responses.create``/``stream``/``parse``, what the OpenAI Agents SDK's default model calls). Each
call carries the session id, its turn index and its prefix hashes (``contract``; for Responses the chain runs
over ``instructions`` and the ``input`` items, see ``contract.stamps_for_responses_body``), and its
``TurnMetrics`` get client-side TTFC/TTFT (``turns``). Every other request of the client (``/models``, files …)
carries the session id only.

The hooks themselves live in ``_stamping`` (shared with the anthropic clients); this module says what is
openai-specific and offers the classes.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, TypeVar, cast

import openai

from . import _stamping
from .session import AgentSession
from .turns import CHAT, RESPONSES

_C = TypeVar("_C")

OPENAI = _stamping.Library(
    name="openai",
    # Exact suffixes: /responses/{id}, /responses/{id}/cancel and /responses/input_tokens are not model calls.
    routes=(("/chat/completions", CHAT), ("/responses", RESPONSES)),
    sentinels=(openai.Omit, openai.NotGiven),
    streams=(openai.AsyncStream, openai.Stream),
    v1="",  # openai clients' base_url ends in /v1
)

if TYPE_CHECKING:
    # For the type checker the hooks are the openai client classes (their methods are what super() reaches).
    class _AsyncHooks(_stamping.AsyncHooks, openai.AsyncOpenAI): ...

    class _SyncHooks(_stamping.SyncHooks, openai.OpenAI): ...
else:
    _AsyncHooks = _stamping.AsyncHooks
    _SyncHooks = _stamping.SyncHooks


class StampedAsyncOpenAI(_AsyncHooks, openai.AsyncOpenAI):
    """``AsyncOpenAI`` that stamps every request for ``session`` (a new one when not given).

    Takes every ``AsyncOpenAI`` argument. ``isinstance(client, AsyncOpenAI)`` holds, so it can be
    handed to agent frameworks that call ``create()`` themselves (the Agents SDK's ``OpenAIResponsesModel``
    and ``OpenAIChatCompletionsModel`` alike). ``session.close()``/``aclose()`` ends the session on the
    gateway through it.
    """

    _kvt_lib = OPENAI

    def __init__(self, *, session: AgentSession | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._kvt_start(session)


class StampedOpenAI(_SyncHooks, openai.OpenAI):
    """``OpenAI`` (sync) that stamps every request for ``session`` (a new one when not given)."""

    _kvt_lib = OPENAI

    def __init__(self, *, session: AgentSession | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._kvt_start(session)


_classes: dict[type, type] = {openai.AsyncOpenAI: StampedAsyncOpenAI, openai.OpenAI: StampedOpenAI}
_classes_lock = threading.Lock()


def wrap_client(client: _C, session: AgentSession) -> _C:
    """See ``AgentSession.wrap``."""
    if isinstance(client, _stamping.AsyncHooks | _stamping.SyncHooks):
        return cast(_C, client.for_session(session))
    if not isinstance(client, openai.AsyncOpenAI | openai.OpenAI):
        raise TypeError(f"expected an openai.OpenAI or openai.AsyncOpenAI client, got {type(client).__name__}")
    asynchronous = isinstance(client, openai.AsyncOpenAI)
    cls = _stamping.stamped_class(type(client), OPENAI, asynchronous, _classes, _classes_lock)
    return cast(_C, _stamping.wrap(client, session, cls))
