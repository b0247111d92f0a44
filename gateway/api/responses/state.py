"""The Responses state the gateway owns: stored responses (``previous_response_id``) and conversations.

vLLM keeps ``previous_response_id`` state in one API server's memory (off by default, never evicted), and a P/D
request's two legs run on two servers, so the gateway keeps it: each stored response (``store``, true by
default) is a record in the session store — memory, or Redis/Valkey shared by replicas — under the caller's
tenant, for ``responses_ttl_s``. A record holds the answer and the chat messages of its whole history *with*
the answer (reasoning and tool calls included, which vLLM's own replay drops), so a chained request is expanded
to exactly the messages a stateless client would have resent. A ``conversation`` is a record too: its messages,
extended by each response made in it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson
from kvtether.gateway.errors import GatewayError
from kvtether.gateway.stores.failsafe import StoreUnavailable
from kvtether.gateway.stores.sessions import SessionStore
from kvtether.gateway.tenancy import scoped
from kvtether.protocol import responses as R

log = logging.getLogger(__name__)


class ResponsesState:
    """The stored responses and conversations, as records of the session store."""

    def __init__(self, store: SessionStore, ttl_s: float, seal: R.ReasoningSeal) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self.seal = seal

    async def get(self, tenant: str | None, kind: str, key: str) -> dict[str, Any] | None:
        try:
            raw = await self.store.get_record(scoped(tenant, f"{kind}:{key}"))
        except StoreUnavailable:
            raise GatewayError(503, "the Responses state store does not answer; retry shortly",
                               code="store_unavailable", retry_after_s=1.0) from None
        if raw is None:
            return None
        try:
            record = orjson.loads(raw)
        except orjson.JSONDecodeError:
            log.warning("responses state: an unreadable %s record was treated as absent", kind)
            return None
        return record if isinstance(record, dict) else None

    async def put(self, tenant: str | None, kind: str, key: str, record: Mapping[str, Any]) -> None:
        await self.store.put_record(scoped(tenant, f"{kind}:{key}"), orjson.dumps(record), self.ttl_s)

    async def delete(self, tenant: str | None, kind: str, key: str) -> bool:
        try:
            return await self.store.delete_record(scoped(tenant, f"{kind}:{key}"))
        except StoreUnavailable:
            raise GatewayError(503, "the Responses state store does not answer; retry shortly",
                               code="store_unavailable", retry_after_s=1.0) from None


def seal_for(key: str | None) -> R.ReasoningSeal:
    """The reasoning seal of the configured key, or of a random one (one gateway process)."""
    return R.ReasoningSeal(key.encode() if key else os.urandom(32))


@dataclass
class Pending:
    """One Responses request on its way: what its answer is built from and what gets stored after it."""

    body: dict[str, Any]
    tenant: str | None
    state: ResponsesState
    base: dict[str, Any]
    messages: list[dict[str, Any]]  # the chat messages sent, without the request's own instructions
    conversation: str | None
    session: str | None = None  # the session the chat path served it in (unscoped), once known
    final: dict[str, Any] | None = None
    input_items: list[Any] = field(default_factory=list)
    dropped: tuple[str, ...] = ()  # hosted tool types left out of the turn (hosted_tools = "drop")
    left_out: tuple[str, ...] = ()  # client bookkeeping item types left out of it (bookkeeping_items = "drop")

    @property
    def seal(self) -> R.ReasoningSeal | None:
        include = self.body.get("include")
        return self.state.seal if isinstance(include, list) and R.ENCRYPTED_REASONING in include else None

    def identified(self, session_id: str) -> None:
        prefix = f"{self.tenant}/" if self.tenant is not None else ""
        self.session = session_id[len(prefix):] if prefix and session_id.startswith(prefix) else session_id

    async def record(self) -> None:
        """Store the finished answer (``store``) and extend its conversation."""
        if self.final is None:
            return
        answer = R.input_messages(self.final["output"], self.state.seal) if self.final["output"] else []
        history = self.messages + answer
        if self.body.get("store", True) is not False:
            await self.state.put(self.tenant, "resp", self.final["id"], {
                "response": self.final, "messages": history, "input": self.input_items, "session": self.session})
        if self.conversation is not None:
            await self.state.put(self.tenant, "conv", self.conversation,
                                 {"messages": history, "session": self.session})
