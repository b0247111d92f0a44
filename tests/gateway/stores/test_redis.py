"""The shared session store: its record format, its contract on a real Redis/Valkey server (single-use handles
across clients, native TTLs, key namespaces), and what the gateway gets when the store is down or slow."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from kvtether.gateway import telemetry as T
from kvtether.gateway.config import load_config
from kvtether.gateway.guard.verify import HeldSequence
from kvtether.gateway.nodes.cluster import Cluster
from kvtether.gateway.nodes.retention import Retention
from kvtether.gateway.policy.copies import DecodeCopy, PrefillCopy
from kvtether.gateway.policy.retention import ReleaseReason
from kvtether.gateway.stores import FailSafeStore, codec, pin_by_hash
from kvtether.gateway.stores.failsafe import StoreUnavailable
from kvtether.gateway.stores.memory import MemorySessionStore
from kvtether.gateway.stores.redis import RedisSessionStore, connect
from kvtether.gateway.stores.sessions import SessionState

from tests.support.redis_server import RedisServer, free_port, running_redis

# A real redis-server over real sockets: the wall clock (tests/gateway/conftest.py).
pytestmark = pytest.mark.wall_clock

HANDLE = {"do_remote_decode": True, "do_remote_prefill": False, "remote_block_ids": [[1, 2, 3]],
          "remote_engine_id": "d-engine", "remote_request_id": "req-1", "remote_host": "10.0.0.2",
          "remote_port": 5600, "remote_num_tokens": 41, "transfer_mode": "pull"}
TIMES = ("handle_at", "expires_at", "created_at", "last_turn_at")


def full_state(now: float, **changes: Any) -> SessionState:
    """A state with every field set to something other than its default."""
    state = SessionState(
        session_id="tenant-a/sess-1", decode="http://d1:8000", handle=dict(HANDLE),
        held=HeldSequence.from_tokens(list(range(41)), 16), handle_at=now - 1.5, expires_at=now + 60.0, turns=7,
        created_at=now - 100.0, prefix_key="tenant-a/abc123", cached=HeldSequence.from_tokens(list(range(50)), 16),
        last_tokens=51, last_prefill="http://p1:8000", avg_output_tokens=37.25, avg_suffix_tokens=12.5,
        elsewhere=(DecodeCopy("http://d2:8000", 32),), prefill_copies=(PrefillCopy("http://p1:8000", 48, 900),),
        last_turn_at=now - 2.0, mean_gap_s=3.25, cache_scope="0123456789abcdef")
    return state.with_(**changes)


def assert_same(got: SessionState | None, want: SessionState) -> None:
    """Equal, times to the millisecond (they travel as wall-clock time)."""
    assert got is not None
    for name in TIMES:
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None) and (a is None or abs(a - b) < 1e-3), name
    assert got.with_(**{n: None for n in TIMES}) == want.with_(**{n: None for n in TIMES})


# ---- the record format (no server) ---------------------------------------------------------------


def test_codec_round_trips_every_field_exactly() -> None:
    defaults = SessionState("x")
    state = full_state(1000.0)
    # A field added to SessionState must be given a value here, and a place in codec.py.
    for f in dataclasses.fields(SessionState):
        assert getattr(state, f.name) != getattr(defaults, f.name) or f.name == "session_id", f.name
    rec = codec.encode_session(state, offset=0.0)
    handle = codec.encode_handle(state, offset=0.0, now=1000.0)
    got = codec.decode_session(state.session_id, rec, state.prefix_key, handle, offset=0.0)
    assert got == state
    assert got.held == state.held and got.cached == state.cached  # hash chain and tail, exactly
    bare = SessionState("y", expires_at=5.0)
    assert codec.decode_session("y", codec.encode_session(bare, 0.0), None, None, 0.0) == bare
    assert codec.encode_handle(bare, 0.0, now=1.0) is None


def test_times_travel_as_wall_clock() -> None:
    # Two gateways whose own clocks differ by 500 s read the same wall-clock instants.
    state = full_state(1000.0)
    rec = codec.encode_session(state, offset=5000.0)
    got = codec.decode_session(state.session_id, rec, None, codec.encode_handle(state, 5000.0, 1000.0), 4500.0)
    assert got.expires_at == state.expires_at + 500.0 and got.handle_at == pytest.approx(state.handle_at + 500.0)


def test_held_sequence_is_stored_as_its_hash_chain() -> None:
    held = HeldSequence.from_tokens([(i * 7919) % 150_000 for i in range(8200)], 16)
    state = SessionState("s", handle=dict(HANDLE), held=held, handle_at=0.0)
    record = codec.encode_handle(state, 0.0, 0.0)
    assert record is not None
    tokens_as_json = len(",".join(str((i * 7919) % 150_000) for i in range(8200)))
    # 512 blocks x 8 bytes of hash (base64) + 8 tail tokens + the handle: a fraction of the token list.
    assert len(record) < 6000 < tokens_as_json // 4
    assert codec.decode_handle(record, 0.0).held == held


def test_pin_by_hash_is_stable_spread_and_moves_only_a_lost_nodes_sessions() -> None:
    nodes = [f"http://d{i}:8000" for i in range(4)]
    pins = {f"s{i}": pin_by_hash(f"s{i}", nodes) for i in range(400)}
    assert pins == {s: pin_by_hash(s, list(reversed(nodes))) for s in pins}
    assert all(60 < sum(p == n for p in pins.values()) < 140 for n in nodes)
    after = {s: pin_by_hash(s, nodes[1:]) for s in pins}
    assert all(after[s] == pins[s] for s in pins if pins[s] != nodes[0])
    assert pin_by_hash("s", []) is None


# ---- on a real server ----------------------------------------------------------------------------

@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with running_redis(tmp_path / "redis") as srv:
        yield srv


@pytest.fixture
async def store(server: RedisServer) -> AsyncIterator[RedisSessionStore]:
    s = RedisSessionStore(connect(server.url, timeout_s=2.0), key_prefix="kvt", handle_ttl_s=30.0)
    try:
        yield s
    finally:
        await s.aclose()


@pytest.mark.anyio
async def test_put_get_take_round_trip(store: RedisSessionStore) -> None:
    now = time.monotonic()
    state = full_state(now)
    await store.put(state)
    assert_same(await store.get(state.session_id), state)
    taken = await store.take_handle(state.session_id)
    assert taken is not None and taken.handle == HANDLE and taken.held == state.held
    assert taken.handle_at == pytest.approx(state.handle_at, abs=1e-3)
    assert await store.take_handle(state.session_id) is None  # single use
    after = await store.get(state.session_id)
    assert after is not None and after.handle is None and after.held is None and after.cached == state.cached
    assert await store.get("nobody") is None


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_a_conditional_take_gets_the_handle_only_while_it_is_still_that_one(
        kind: str, tmp_path: Path) -> None:
    """A release decided on an earlier read names the hold (D's remote_request_id): a newer handle stored
    meanwhile is never taken by it."""
    with contextlib.ExitStack() as stack:
        if kind == "memory":
            st: Any = MemorySessionStore()
        else:
            srv = stack.enter_context(running_redis(tmp_path / "redis"))
            st = RedisSessionStore(connect(srv.url, timeout_s=2.0), key_prefix="kvt", handle_ttl_s=30.0)
        try:
            now = time.monotonic()
            await st.put(full_state(now))
            newer = {**HANDLE, "remote_request_id": "req-2"}
            assert await st.take_handle("tenant-a/sess-1", "req-2") is None
            await st.put(full_state(now, handle=newer))
            assert await st.take_handle("tenant-a/sess-1", "req-1") is None  # the old one is gone
            still = await st.get("tenant-a/sess-1")
            assert still is not None and still.handle == newer
            taken = await st.take_handle("tenant-a/sess-1", "req-2")
            assert taken is not None and taken.handle == newer
            assert await st.take_handle("tenant-a/sess-1") is None
        finally:
            if kind == "redis":
                await st.aclose()


@pytest.mark.anyio
async def test_two_replicas_racing_for_a_handle_never_both_get_it(server: RedisServer) -> None:
    a = RedisSessionStore(connect(server.url, timeout_s=2.0), key_prefix="kvt", handle_ttl_s=30.0)
    b = RedisSessionStore(connect(server.url, timeout_s=2.0), key_prefix="kvt", handle_ttl_s=30.0)
    now = time.monotonic()
    sessions = [f"race-{i}" for i in range(40)]
    for sid in sessions:
        await a.put(full_state(now, session_id=sid, handle={**HANDLE, "remote_request_id": sid}, prefix_key=None))
    got: dict[str, list[str]] = {sid: [] for sid in sessions}

    async def take(s: RedisSessionStore, sid: str) -> None:
        taken = await s.take_handle(sid)
        if taken is not None:
            got[sid].append(taken.handle["remote_request_id"])

    async with anyio.create_task_group() as tg:
        for sid in sessions:
            for k in range(6):
                tg.start_soon(take, a if k % 2 else b, sid)
    assert got == {sid: [sid] for sid in sessions}
    await a.aclose()
    await b.aclose()


@pytest.mark.anyio
async def test_native_ttls_expire_handles_and_sessions(server: RedisServer) -> None:
    store = RedisSessionStore(connect(server.url, timeout_s=2.0), key_prefix="kvt", handle_ttl_s=1.0)
    now = time.monotonic()
    # The handle was returned 0.8 s ago: 0.2 s of its 1 s TTL left. The session lives 0.6 s.
    await store.put(full_state(now, handle_at=now - 0.8, expires_at=now + 0.6))
    # A handle already past its TTL is never stored.
    await store.put(full_state(now, session_id="stale", prefix_key=None, handle_at=now - 1.5))
    stale = await store.get("stale")
    assert stale is not None and stale.handle is None and await store.take_handle("stale") is None
    assert await store.count() == 2
    await anyio.sleep(0.35)
    left = await store.get("tenant-a/sess-1")
    assert left is not None and left.handle is None and left.decode == "http://d1:8000"
    assert await store.take_handle("tenant-a/sess-1") is None
    await anyio.sleep(0.4)
    assert await store.get("tenant-a/sess-1") is None
    assert await store.find_by_prefix("tenant-a/abc123") is None
    assert [s.session_id for s in await store.list()] == ["stale"]
    assert await store.sweep() == 1 and await store.count() == 1
    await store.aclose()


@pytest.mark.anyio
async def test_prefix_keys_move_and_delete_cleans_up(store: RedisSessionStore) -> None:
    now = time.monotonic()
    await store.put(SessionState("s1", expires_at=now + 60, prefix_key="k1"))
    assert await store.find_by_prefix("k1") == "s1"
    await store.put(SessionState("s1", expires_at=now + 60, prefix_key="k2"))
    assert await store.find_by_prefix("k1") is None and await store.find_by_prefix("k2") == "s1"
    # Another session took k2 over: s1's next put must not remove it.
    await store.put(SessionState("s2", expires_at=now + 60, prefix_key="k2"))
    await store.put(SessionState("s1", expires_at=now + 60, prefix_key=None))
    assert await store.find_by_prefix("k2") == "s2"
    await store.put(full_state(now, session_id="s3", prefix_key="k3"))
    await store.delete("s3")
    assert await store.get("s3") is None and await store.take_handle("s3") is None
    assert await store.find_by_prefix("k3") is None
    assert sorted(s.session_id for s in await store.list()) == ["s1", "s2"] and await store.count() == 2


@pytest.mark.anyio
async def test_key_prefixes_keep_deployments_apart(server: RedisServer) -> None:
    a = RedisSessionStore(connect(server.url, timeout_s=2.0), key_prefix="prod", handle_ttl_s=30.0)
    b = RedisSessionStore(connect(server.url, timeout_s=2.0), key_prefix="staging", handle_ttl_s=30.0)
    now = time.monotonic()
    await a.put(full_state(now))
    assert await b.get("tenant-a/sess-1") is None and await b.take_handle("tenant-a/sess-1") is None
    assert await b.find_by_prefix("tenant-a/abc123") is None and await b.count() == 0
    keys = sorted([k.decode() async for k in a.client.scan_iter("*")])
    assert keys and all(k.startswith("prod:") for k in keys)
    assert "prod:s:tenant-a/sess-1" in keys and "prod:h:tenant-a/sess-1" in keys
    await a.aclose()
    await b.aclose()


# ---- failures: the store down, slow, restarted ---------------------------------------------------

DECODES = ("http://d0:8000", "http://d1:8000", "http://d2:8000")


def failures(metrics: T.Metrics, operation: str, reason: str) -> float:
    value = metrics.registry.get_sample_value(T.M_STORE_FAILURES, {"operation": operation, "reason": reason})
    return value or 0.0


def failsafe(url: str, metrics: T.Metrics, timeout_s: float = 0.1, cooldown_s: float = 0.05) -> FailSafeStore:
    inner = RedisSessionStore(connect(url, timeout_s=timeout_s), key_prefix="kvt", handle_ttl_s=30.0)
    return FailSafeStore(inner, timeout_s=timeout_s, metrics=metrics, pins=DECODES, cooldown_s=cooldown_s,
                         max_cooldown_s=max(0.2, cooldown_s))


@pytest.mark.wall_clock  # a real socket to a Redis that is down
@pytest.mark.anyio
async def test_a_store_that_is_down_answers_cold_at_once_and_never_raises() -> None:
    metrics = T.Metrics()
    # The pause after a failure is real time: long enough that no stall of a busy machine ends it between the
    # calls below, which must all be skipped (answered at once, without a try that could wait).
    cooldown_s = 2.0
    store = failsafe(f"redis://127.0.0.1:{free_port()}/0", metrics, cooldown_s=cooldown_s)
    state = await store.get("tenant-a/sess-9")
    # Pinned by hash, the same on every replica; no handle, nothing to verify.
    assert state is not None and state.decode == pin_by_hash("tenant-a/sess-9", DECODES)
    assert state.handle is None and state.held is None and state.cached is None
    assert await store.take_handle("tenant-a/sess-9") is None
    assert await store.find_by_prefix("k") is None
    await store.put(full_state(time.monotonic()))
    await store.delete("x")
    assert await store.list() == [] and await store.sweep() == 0 and await store.count() == 0
    assert failures(metrics, "get", "error") == 1
    for operation in ("take_handle", "find_by_prefix", "put", "delete", "list", "sweep", "count"):
        assert failures(metrics, operation, "skipped") == 1, operation
    assert not store.available
    await anyio.sleep(cooldown_s + 0.1)  # the pause is over: the store is asked again, and fails again
    assert await store.take_handle("s") is None and failures(metrics, "take_handle", "error") == 1
    await store.aclose()


@pytest.mark.wall_clock  # a real socket to a Redis that is down
@pytest.mark.anyio
async def test_with_the_store_down_sessions_are_pinned_among_the_nodes_that_take_them_now() -> None:
    """The gateway's fail-safe store hashes a session over the nodes in service now: a discovered node once it is
    ready, not a prefill node, nor one draining, joining or taken out; a node leaving moves only its sessions."""
    from kvtether.gateway.nodes.discovery.members import Member
    from kvtether.gateway.shell.app import Gateway

    d0, d1, new = "http://d0:8000", "http://d1:8000", "http://10.0.0.9:8000"
    gw = Gateway(load_config(None, prefill=["http://p0:8000"], decode=[d0, d1], store_timeout_s=0.1,
                             store=f"redis://127.0.0.1:{free_port()}/0"))
    store = gw.store
    assert isinstance(store, FailSafeStore)
    sessions = [f"s{i}" for i in range(60)]

    async def pins() -> dict[str, str | None]:
        store._paused_until = 0.0  # ask the (down) store every time: each answer is the fallback's
        out = {}
        for s in sessions:
            state = await store.get(s)
            assert state is not None and state.handle is None
            out[s] = state.decode
        return out

    try:
        before = await pins()
        assert set(before.values()) == {d0, d1}
        gw.cluster.apply_members({new: Member("decode")})  # discovered: joining, no sessions yet
        assert await pins() == before
        gw.cluster.nodes[new].state = "ready"
        joined = await pins()
        assert new in joined.values()
        assert all(joined[s] == before[s] for s in sessions if joined[s] != new)  # only the newcomer's moved
        gw.cluster.take_out(gw.cluster.nodes[d1], "failing")
        out = await pins()
        assert d1 not in out.values() and all(out[s] == joined[s] for s in sessions if joined[s] != d1)
        assert out == {s: pin_by_hash(s, [d0, new]) for s in sessions}
    finally:
        await store.aclose()
        for client in (gw.client, gw.tokenize_client, gw.upstream, gw.poller):
            await client.aclose()


@pytest.mark.anyio
async def test_a_slow_store_is_cut_off_at_its_timeout_and_used_again_when_it_answers(server: RedisServer) -> None:
    metrics = T.Metrics()
    store = failsafe(server.url, metrics)
    now = time.monotonic()
    await store.put(full_state(now))
    server.pause()
    try:
        # A stopped server never answers: only the store's timeout ends the call (counted as a timeout).
        with anyio.fail_after(30):
            assert await store.take_handle("tenant-a/sess-1") is None
        assert failures(metrics, "take_handle", "timeout") == 1
    finally:
        server.resume()
    await anyio.sleep(0.1)
    await store.put(full_state(now, session_id="after"))
    got = await store.get("after")
    assert store.available and got is not None and got.handle == HANDLE
    assert (await store.take_handle("after")) is not None and await store.take_handle("after") is None
    seconds = metrics.registry.get_sample_value(T.M_STORE_SECONDS + "_count", {"operation": "put"})
    assert seconds is not None and seconds >= 2
    await store.aclose()


@pytest.mark.anyio
async def test_a_restarted_store_is_used_again_without_a_wedged_pool(server: RedisServer) -> None:
    metrics = T.Metrics()
    store = failsafe(server.url, metrics)
    now = time.monotonic()
    for i in range(8):
        await store.put(full_state(now, session_id=f"s{i}", prefix_key=None))
    server.stop()
    results: list[Any] = []

    async def turn(i: int) -> None:
        results.append(await store.get(f"s{i}"))
        results.append(await store.take_handle(f"s{i}"))

    async with anyio.create_task_group() as tg:
        for i in range(64):
            tg.start_soon(turn, i % 8)
    assert all(r is None or (isinstance(r, SessionState) and r.handle is None) for r in results)
    server.start()  # same port, empty (no persistence)
    deadline = time.monotonic() + 3
    while True:
        state = await store.get("s0")
        if store.available:
            break
        assert time.monotonic() < deadline, "the store was not used again"
        await anyio.sleep(0.05)
    assert state is None  # the restart lost it: the session starts over, cold
    await store.put(full_state(now, session_id="fresh"))
    taken = await store.take_handle("fresh")
    assert taken is not None and taken.handle == HANDLE and await store.take_handle("fresh") is None
    assert failures(metrics, "get", "error") + failures(metrics, "get", "skipped") >= 1
    await store.aclose()


@pytest.mark.anyio
async def test_records_round_trip_expire_and_delete_on_redis_and_in_memory(server: RedisServer) -> None:
    """The Responses API's state: opaque records with their own lifetime, the same on both stores."""
    clock = [1000.0]
    memory = MemorySessionStore(clock=lambda: clock[0])
    redis = RedisSessionStore(connect(server.url, timeout_s=1.0), key_prefix="kvt-rec", handle_ttl_s=30.0)
    try:
        for store in (memory, redis):
            await store.put_record("team/resp:1", b'{"a": 1}', 0.4)
            await store.put_record("other/resp:1", b"x", 60.0)
            assert await store.get_record("team/resp:1") == b'{"a": 1}'
            assert await store.get_record("team/resp:2") is None
            assert await store.delete_record("other/resp:1") is True
            assert await store.delete_record("other/resp:1") is False
            assert await store.get_record("other/resp:1") is None
        clock[0] += 0.5
        await anyio.sleep(0.5)
        for store in (memory, redis):
            assert await store.get_record("team/resp:1") is None  # past its TTL
    finally:
        await redis.aclose()


@pytest.mark.anyio
async def test_records_have_no_cold_stand_in_when_the_store_is_down() -> None:
    metrics = T.Metrics()
    store = failsafe(f"redis://127.0.0.1:{free_port()}", metrics)
    await store.put_record("k", b"v", 10.0)  # dropped, never raised: the answer already went out
    with pytest.raises(StoreUnavailable):
        await store.get_record("k")
    assert failures(metrics, "put_record", "error") + failures(metrics, "get_record", "error") >= 1
    await store.aclose()


# ---- every session, page by page (the retention review's read) --------------------------------------


@contextlib.asynccontextmanager
async def some_store(kind: str, tmp_path: Path, **redis_kw: Any) -> AsyncIterator[Any]:
    """A memory store, or a Redis store on a fresh server whose index is a listpack (a small sorted set, which
    ZSCAN returns whole) or a hash table (forced: ZSCAN then pages with its cursor)."""
    if kind == "memory":
        yield MemorySessionStore()
        return
    with running_redis(tmp_path / "redis") as srv:
        st = RedisSessionStore(connect(srv.url, timeout_s=2.0), key_prefix="kvt", handle_ttl_s=30.0, **redis_kw)
        if kind == "redis-hashtable":
            await st.client.config_set("zset-max-listpack-entries", 0)
        try:
            yield st
        finally:
            await st.aclose()


async def zscan_calls(st: Any) -> int:
    stats = await st.client.info("commandstats")
    return int(stats.get("cmdstat_zscan", {}).get("calls", 0))


STORES = ["memory", "redis-listpack", "redis-hashtable"]


@pytest.mark.anyio
@pytest.mark.parametrize("kind", STORES)
async def test_a_scan_reads_every_live_session_once_in_pages_past_the_list_limit(kind: str, tmp_path: Path) -> None:
    async with some_store(kind, tmp_path, list_limit=5) as st:
        now = time.monotonic()
        ids = [f"t/s{i}" for i in range(20)]
        for sid in ids:
            await st.put(SessionState(sid, decode="http://d1:8000", expires_at=now + 60, created_at=now))
        for sid in ("t/gone-1", "t/gone-2"):  # already expired: never read
            await st.put(SessionState(sid, expires_at=now - 1.0, created_at=now - 10))
        pages = [page async for page in st.scan(7)]
        got = [s.session_id for page in pages for s in page]
        assert sorted(got) == sorted(ids) and all(1 <= len(p) <= 7 for p in pages) and len(pages) >= 3
        assert all(s.decode == "http://d1:8000" for page in pages for s in page)
        if kind != "memory":
            assert len(await st.list()) == 5  # the admin view keeps its limit
        if kind == "redis-hashtable":
            assert await zscan_calls(st) > 1  # the cursor went round more than once
        with pytest.raises(ValueError):
            await anext(st.scan(0))


@pytest.mark.anyio
@pytest.mark.parametrize("kind", STORES)
async def test_a_scan_under_concurrent_writes_misses_no_session_that_lived_throughout(kind: str,
                                                                                     tmp_path: Path) -> None:
    """Between pages, turns go on: the first page's sessions are written again (their expiry moves later,
    which reorders the index by expiry), three sessions not read yet are deleted and five new ones start.
    Every session live from start to end is read exactly once; no deleted one is read."""
    async with some_store(kind, tmp_path) as st:
        now = time.monotonic()
        ids = [f"t/s{i}" for i in range(20)]
        for i, sid in enumerate(ids):
            await st.put(SessionState(sid, expires_at=now + 60 + i, created_at=now))
        seen: list[str] = []
        gone: list[str] = []
        async for page in st.scan(7):
            seen += [s.session_id for s in page]
            if not gone:
                for s in page:
                    await st.put(s.with_(expires_at=now + 300))
                gone = [sid for sid in ids if sid not in seen][:3]
                for sid in gone:
                    await st.delete(sid)
                for i in range(5):
                    await st.put(SessionState(f"t/new{i}", expires_at=now + 60, created_at=now))
        assert len(seen) == len(set(seen))
        assert set(ids) - set(gone) <= set(seen) and not set(gone) & set(seen)


@pytest.mark.anyio
@pytest.mark.parametrize("kind", STORES)
async def test_the_retention_review_covers_every_session_not_only_the_listed_ones(kind: str, tmp_path: Path) -> None:
    """40 sessions hold a handle on one decode node, a store listing shows 5: 20 handles are at their expiry
    (stored a session TTL ago), 20 fresh. The review reads all of them in pages of 7: it releases the 20
    expiring handles and counts the 20 fresh ones' blocks."""
    d = "http://d1:8000"
    # The handle TTL of some_store's Redis store.
    cfg = load_config(None, prefill=["http://p1:8000"], decode=[d], policy="pull", session_ttl_s=30.0)
    async with some_store(kind, tmp_path, list_limit=5) as st, httpx.AsyncClient() as client:
        now = time.monotonic()
        for i in range(40):
            old = i < 20
            handle = {**HANDLE, "remote_request_id": f"req-{i}", "remote_num_tokens": 100}
            at = now - (cfg.session_ttl_s - 1.0 if old else 1.0)
            await st.put(SessionState(f"t/s{i}", decode=d, handle=handle, handle_at=at,
                                      expires_at=now + 60, created_at=now - 600, last_turn_at=at, mean_gap_s=5.0))
        metrics = T.Metrics()
        retention = Retention(cfg, Cluster(cfg, client), st, metrics, client, scan_page=7)
        releases = await retention.review_once()
        assert sorted(r.session_id for r in releases) == sorted(f"t/s{i}" for i in range(20))
        assert {r.reason for r in releases} == {ReleaseReason.EXPIRED}
        left = [s async for page in st.scan() for s in page if s.handle is not None]
        assert sorted(s.session_id for s in left) == sorted(f"t/s{i}" for i in range(20, 40))
        # 100 tokens in blocks of 16 (the default before any poll): 112 each, counted whole (D's prefix
        # caching is unknown until a poll).
        assert metrics.registry.get_sample_value(T.M_HELD_KV_TOKENS, {"node": d}) == 20 * 112


class _FailsMidScan(MemorySessionStore):
    async def scan(self, page_size: int = 500) -> Any:
        pages = super().scan(page_size)
        yield await anext(pages)
        raise ConnectionError("store went away")


@pytest.mark.anyio
async def test_a_review_the_store_cannot_answer_to_the_end_decides_nothing() -> None:
    d = "http://d1:8000"
    cfg = load_config(None, prefill=["http://p1:8000"], decode=[d], policy="pull")
    metrics = T.Metrics()
    inner = _FailsMidScan()
    store = FailSafeStore(inner, timeout_s=1.0, metrics=metrics, cooldown_s=0.01)
    now = time.monotonic()
    for i in range(10):
        await inner.put(SessionState(f"t/s{i}", decode=d, handle={**HANDLE, "remote_request_id": f"r{i}"},
                                     handle_at=now, expires_at=now + 60, last_turn_at=now - 500.0))
    with pytest.raises(StoreUnavailable):
        _ = [p async for p in store.scan(3)]
    assert failures(metrics, "scan", "error") == 1
    async with httpx.AsyncClient() as client:
        await anyio.sleep(0.05)  # past the store's pause
        retention = Retention(cfg, Cluster(cfg, client), store, metrics, client, scan_page=3)
        assert await retention.review_once() == []  # every session is idle, but the review saw only some
    assert all(s.handle is not None for s in await inner.list())
