"""The in-memory session store: the embedded default, for one gateway process."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import AsyncGenerator

from kvtether.gateway.clock import DEFAULT_CLOCK, Clock
from kvtether.gateway.stores.sessions import SCAN_PAGE_SIZE, SessionState, TakenHandle


class MemorySessionStore:
    """Single-process store. Methods never await, so each is atomic on the event loop."""

    available = True  # in-process: every call answers

    def __init__(self, *, max_sessions: int = 100_000, clock: Clock = DEFAULT_CLOCK) -> None:
        self._sessions: OrderedDict[str, SessionState] = OrderedDict()
        self._by_prefix: dict[str, str] = {}
        self._max = max_sessions
        self.clock = clock
        self._records: OrderedDict[str, tuple[float, bytes]] = OrderedDict()

    def _live(self, session_id: str) -> SessionState | None:
        state = self._sessions.get(session_id)
        if state is None:
            return None
        if state.expires_at <= self.clock():
            self._drop(session_id)
            return None
        return state

    def _drop(self, session_id: str) -> None:
        state = self._sessions.pop(session_id, None)
        if state is not None and state.prefix_key is not None and self._by_prefix.get(state.prefix_key) == session_id:
            del self._by_prefix[state.prefix_key]

    async def get(self, session_id: str) -> SessionState | None:
        return self._live(session_id)

    async def put(self, state: SessionState) -> None:
        old = self._sessions.get(state.session_id)
        if (old is not None and old.prefix_key is not None and old.prefix_key != state.prefix_key
                and self._by_prefix.get(old.prefix_key) == state.session_id):
            del self._by_prefix[old.prefix_key]
        self._sessions[state.session_id] = state
        self._sessions.move_to_end(state.session_id)
        if state.prefix_key is not None:
            self._by_prefix[state.prefix_key] = state.session_id
        # Bounded: the least recently written sessions go first (their handles will expire on D anyway).
        while len(self._sessions) > self._max:
            oldest = next(iter(self._sessions))
            self._drop(oldest)

    async def take_handle(self, session_id: str, request_id: str | None = None) -> TakenHandle | None:
        state = self._live(session_id)
        if state is None or state.handle is None:
            return None
        if request_id is not None and state.handle.get("remote_request_id") != request_id:
            return None
        self._sessions[session_id] = state.with_(handle=None, held=None, handle_at=None)
        return TakenHandle(state.handle, state.held, state.handle_at if state.handle_at is not None else 0.0)

    async def find_by_prefix(self, prefix_key: str) -> str | None:
        session_id = self._by_prefix.get(prefix_key)
        if session_id is None:
            return None
        if self._live(session_id) is None:
            return None
        return session_id

    async def delete(self, session_id: str) -> None:
        self._drop(session_id)

    async def sweep(self) -> int:
        now = self.clock()
        dead = [sid for sid, s in self._sessions.items() if s.expires_at <= now]
        for sid in dead:
            self._drop(sid)
        for key in [k for k, (expires_at, _) in self._records.items() if expires_at <= now]:
            del self._records[key]
        return len(dead)

    async def scan(self, page_size: int = SCAN_PAGE_SIZE) -> AsyncGenerator[list[SessionState], None]:
        if page_size < 1:
            raise ValueError("page_size must be >= 1")
        # The ids as they are now: other coroutines write between pages, which neither skips a session nor
        # breaks the iteration; each is read as it is when its page is.
        ids = list(self._sessions)
        for start in range(0, len(ids), page_size):
            page = [s for sid in ids[start:start + page_size] if (s := self._live(sid)) is not None]
            if page:
                yield page

    async def list(self) -> list[SessionState]:
        now = self.clock()
        return [s for s in self._sessions.values() if s.expires_at > now]

    async def count(self) -> int:
        return len(self._sessions)

    async def put_record(self, key: str, data: bytes, ttl_s: float) -> None:
        self._records[key] = (self.clock() + ttl_s, data)
        self._records.move_to_end(key)
        # Bounded like the sessions: the least recently written go first.
        while len(self._records) > self._max:
            self._records.popitem(last=False)

    async def get_record(self, key: str) -> bytes | None:
        entry = self._records.get(key)
        if entry is None:
            return None
        if entry[0] <= self.clock():
            del self._records[key]
            return None
        return entry[1]

    async def delete_record(self, key: str) -> bool:
        entry = self._records.pop(key, None)
        return entry is not None and entry[0] > self.clock()

    async def aclose(self) -> None:
        return None
