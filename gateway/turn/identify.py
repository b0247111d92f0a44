"""Which session a request belongs to: the first step of a turn.

The id comes from the SDK's or another router's session header, else the body's ``prompt_cache_key`` (OpenAI's
own cache-routing hint, which OpenCode and Codex set to their session id); a chat request without one is matched to
its session by the message-chain hash of its history (what the previous turn stored as *prompt + its
answer*), and otherwise starts an anonymous session that its next turn will find the same way. With API
keys, both live in the caller's tenant namespace (``tenancy.scoped``).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from kvtether.gateway import telemetry as T
from kvtether.gateway.clock import DEFAULT_CLOCK, Clock
from kvtether.gateway.stores.sessions import SessionStore
from kvtether.gateway.tenancy import scoped
from kvtether.gateway.turn import body as B
from kvtether.gateway.turn.context import TurnContext
from kvtether.protocol.contract import session_final_from_headers, session_id_from_headers
from opentelemetry import trace


async def identify(store: SessionStore, kind: str, body: dict[str, Any], headers: Mapping[str, str],
                   span: trace.Span, tenant: str | None = None, *, upstream_auth: str | None = None,
                   clock: Clock = DEFAULT_CLOCK) -> TurnContext:
    """The turn's context: its session (in the tenant's namespace: `scoped`), that session's state, and whether
    the client marked it as the session's last turn. ``clock``: the gateway's, for when the turn arrived."""
    named = session_id_from_headers(headers) or _cache_key(body)
    sid = scoped(tenant, named) if named else None
    source = "header" if sid else "none"
    chain = None
    if sid is None and kind == "chat":
        chain = B.chat_chain(body)
        if chain.parent is not None:
            sid = await store.find_by_prefix(scoped(tenant, chain.parent))
            source = "prefix" if sid else source
        if sid is None:
            # A plain OpenAI client: a fresh session the next turn finds by its message-chain hash.
            sid, source = scoped(tenant, f"anon-{uuid.uuid4().hex}"), "new"
    state = await store.get(sid) if sid else None
    T.set_attrs(span, {T.GEN_AI_CONVERSATION_ID: named if source == "header" else None,
                       T.ATTR_SESSION_SOURCE: source})
    final = session_final_from_headers(headers)
    now = clock()
    if final:
        span.set_attribute(T.ATTR_SESSION_FINAL, True)
    return TurnContext(kind, body, {k.lower(): v for k, v in headers.items()}, body.get("stream") is True,
                       body.get("return_token_ids") is True, sid, source, state, now, span,
                       tenant=tenant, named_session=named, upstream_auth=upstream_auth, chain=chain, final=final,
                       arrived_at=now)


def _cache_key(body: Mapping[str, Any]) -> str | None:
    key = body.get("prompt_cache_key")
    return key.strip()[:256] if isinstance(key, str) and key.strip() else None
