"""Session stores: where the gateway keeps each session's pin, handle and held sequence between turns.

``memory`` (the default) keeps them in the gateway process; a ``redis://``, ``rediss://`` or ``unix://`` URL
keeps them in Redis or Valkey, shared by every worker and replica, behind :class:`FailSafeStore` (bounded
calls; a store outage makes turns cold, never failed). :func:`open_store` builds the configured one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtether.gateway.clock import DEFAULT_CLOCK, Clock
from kvtether.gateway.stores.failsafe import FailSafeStore, pin_by_hash
from kvtether.gateway.stores.memory import MemorySessionStore
from kvtether.gateway.stores.sessions import SessionState, SessionStore, TakenHandle

if TYPE_CHECKING:
    from kvtether.gateway.config import GatewayConfig
    from kvtether.gateway.telemetry import Metrics

__all__ = ["FailSafeStore", "MemorySessionStore", "SessionState", "SessionStore", "TakenHandle", "open_store",
           "pin_by_hash"]


def open_store(config: GatewayConfig, *, metrics: Metrics | None = None,
               clock: Clock = DEFAULT_CLOCK) -> SessionStore:
    """The store ``config.store`` names. Connects lazily: a Redis that is down at start-up only makes the
    first turns cold."""
    if config.store == "memory":
        return MemorySessionStore(max_sessions=config.max_sessions, clock=clock)
    from kvtether.gateway.stores.redis import RedisSessionStore, connect

    inner = RedisSessionStore(connect(config.store, timeout_s=config.store_timeout_s),
                              key_prefix=config.store_key_prefix, handle_ttl_s=config.session_ttl_s, clock=clock)
    return FailSafeStore(inner, timeout_s=config.store_timeout_s, metrics=metrics,
                         pins=tuple(config.decode + config.nodes or config.aggregated), clock=clock)
