"""kvtether SDK: session stamping for openai and anthropic clients, client-side TTFT, recording.

    from kvtether.sdk import AgentSession, StampedAsyncOpenAI

    session = AgentSession(record_to="session.jsonl")
    client = StampedAsyncOpenAI(session=session, base_url="http://127.0.0.1:8000/v1", api_key="-")
    # or: client = session.wrap(existing_async_openai_client)
    ...
    print(session.last_turn.ttft_ms)

Chat completions and Responses calls are stamped alike (so an OpenAI Agents SDK agent given a
``StampedAsyncOpenAI`` is stamped on every call); ``StampedAsyncAnthropic``/``StampedAnthropic`` (the
``anthropic`` extra) stamp Anthropic Messages calls.

The wire contract the clients stamp (headers, prefix-hash chain) is ``kvtether.protocol.contract``, re-exported as
``kvtether.sdk.contract``.

The names below are imported lazily: ``kvtether.sdk.contract`` and ``kvtether.sdk.sessionfile`` (the CLI reads
session files with it) must not pay for (or depend on) importing openai, and the anthropic names need the optional
``anthropic`` package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY = {
    "AgentSession": "session",
    "TurnMetrics": "turns",
    "new_session_id": "session",
    "StampedAsyncOpenAI": "client",
    "StampedOpenAI": "client",
    "wrap_client": "client",
    "StampedAsyncAnthropic": "anthropic",
    "StampedAnthropic": "anthropic",
}

__all__ = [
    "AgentSession",
    "StampedAnthropic",
    "StampedAsyncAnthropic",
    "StampedAsyncOpenAI",
    "StampedOpenAI",
    "TurnMetrics",
    "__version__",
    "new_session_id",
    "wrap_client",
]

if TYPE_CHECKING:
    from .anthropic import StampedAnthropic, StampedAsyncAnthropic
    from .client import StampedAsyncOpenAI, StampedOpenAI, wrap_client
    from .session import AgentSession, new_session_id
    from .turns import TurnMetrics


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
