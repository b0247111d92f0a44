"""Hosted tools (``hosted_tools = "drop"``) and client bookkeeping items (``bookkeeping_items = "drop"``) the
gateway left out of an agent-API turn: how it says so.

The translations (``kvtether.protocol``) decide what is dropped and report the types; here the answer carries
them in a header, a metric counts them by type, and the log says it once per session — a client such as Codex
sends the same hosted tool on every call of every turn (and a stateless client resends the same bookkeeping
item), and one line per call would drown the log.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence

from kvtether.gateway import telemetry as T
from kvtether.protocol.common import tool_family
from prometheus_client import Counter
from starlette.responses import Response

log = logging.getLogger(__name__)

# Sessions remembered as warned about; the least recently seen are forgotten first (then warned about again).
WARNED_SESSIONS = 10_000


def header_value(dropped: Sequence[str]) -> str:
    """The dropped-tools header: the types as the client sent them (the translations drop only known types,
    whose names are plain ASCII), comma-separated."""
    return ",".join(dropped)


def metric_type(kind: str) -> str:
    """The metric's label for a dropped type: its family, from a closed set (a client's spelling never becomes a
    series of its own)."""
    family = tool_family(kind)
    return family if family in T.DROPPED_TOOL_TYPES else "other"


class DroppedTools:
    """Counts the hosted tools each turn dropped and warns once per session (a bounded memory of the sessions
    already warned about, so a long-running gateway's memory does not grow with its sessions)."""

    def __init__(self, counter: Counter, capacity: int = WARNED_SESSIONS) -> None:
        self._counter = counter
        self._capacity = capacity
        self._warned: OrderedDict[str, None] = OrderedDict()

    def note(self, dropped: Sequence[str], session: str | None, route: str) -> bool:
        """One turn's dropped tools: counted; logged if its session was not warned about yet (True then). A turn
        the gateway never placed in a session (refused before) shares one key with every other such turn."""
        for kind in dropped:
            self._counter.labels(metric_type(kind)).inc()
        if not dropped or not self._first(session or ""):
            return False
        log.warning("session %s: %s left hosted tools out of its turns (%s): the model behind the gateway cannot "
                    "call them. Set hosted_tools = \"refuse\" to answer 400 instead; said once per session",
                    session or "(none)", route, ", ".join(dropped))
        return True

    def note_items(self, left_out: Sequence[str], session: str | None, route: str, counter: Counter) -> bool:
        """One turn's client bookkeeping items left out: counted on ``counter`` by type; logged if its session
        was not warned about them yet (True then)."""
        for kind in left_out:
            counter.labels(kind if kind in T.DROPPED_ITEM_TYPES else "other").inc()
        if not left_out or not self._first(f"items\0{session or ''}"):
            return False
        log.warning("session %s: %s left items out of its turns (%s): client bookkeeping, or tool results' blocks "
                    "the model behind the gateway cannot read. Set bookkeeping_items = \"refuse\" to answer 400 "
                    "instead; said once per session", session or "(none)", route, ", ".join(left_out))
        return True

    def _first(self, key: str) -> bool:
        if key in self._warned:
            self._warned.move_to_end(key)
            return False
        self._warned[key] = None
        if len(self._warned) > self._capacity:
            self._warned.popitem(last=False)
        return True


def tell(response: Response, dropped: Sequence[str], header: str = T.HEADER_DROPPED_TOOLS) -> Response:
    """The answer with the dropped-tools (or dropped-items) header (before anything is sent: the header list is
    the one sent)."""
    if dropped:
        response.raw_headers.append((header.encode(), header_value(dropped).encode("latin-1")))
    return response
