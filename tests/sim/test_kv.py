"""Block pool: prefix hits, LRU eviction under capacity; holds: TTL and single use."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from kvtether.sim.kv import BlockPool, Hold, HoldTable, block_hashes


def fill(pool: BlockPool, tokens: list[int]) -> list:
    hashes = block_hashes(tokens, pool.block_size)
    blocks = pool.allocate(len(hashes))
    assert blocks is not None
    for i, (b, h) in enumerate(zip(blocks, hashes, strict=True)):
        b.content = tokens[i * 4 : (i + 1) * 4]
        pool.register(b, h)
    return blocks


def test_prefix_hits_and_release_keeps_cache() -> None:
    pool = BlockPool(8, 4)
    a = list(range(12))
    blocks = fill(pool, a)
    pool.release(blocks)
    assert pool.num_free == 8  # cached but evictable
    hits = pool.lookup(block_hashes([*a[:8], 99, 98, 97, 96], 4))
    assert hits == blocks[:2]
    pool.touch(hits)
    assert pool.num_used == 2


def test_lru_eviction_under_capacity() -> None:
    pool = BlockPool(4, 4)
    old = fill(pool, list(range(8)))
    new = fill(pool, list(range(100, 108)))
    pool.release(old)
    pool.release(new)
    pool.touch(pool.lookup(block_hashes(list(range(8)), 4)))  # old is used again: now most recent
    pool.release(pool.lookup(block_hashes(list(range(8)), 4)))
    fill(pool, list(range(200, 208)))  # needs 2 blocks: evicts the least recently used (new)
    assert len(pool.lookup(block_hashes(list(range(8)), 4))) == 2
    assert pool.lookup(block_hashes(list(range(100, 108)), 4)) == []
    assert pool.allocate(3) is None


def test_holds_expire_and_are_single_use() -> None:
    pool = BlockPool(4, 4)
    table = HoldTable()
    blocks = pool.allocate(2)
    assert blocks is not None
    table.put(Hold("r1", "retained", blocks, 8, expires_at=10.0))
    table.put(Hold("r2", "lease", [], 0, expires_at=20.0))
    assert table.expired(5.0) == []
    assert [h.request_id for h in table.expired(10.0)] == ["r1"]
    assert table.take("r2") is not None
    assert table.take("r2") is None
    assert table.next_expiry() is None


def test_polluted_block_is_visible() -> None:
    pool = BlockPool(2, 4)
    (b,) = pool.allocate(1) or []
    b.content = [9, 9, 9, 9]  # KV of other tokens ...
    pool.register(b, block_hashes([1, 2, 3, 4], 4)[0])  # ... registered under this request's hash
    assert b.polluted


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["put", "put_untracked", "renew", "take", "expired", "next"]),
                          st.integers(0, 5), st.integers(0, 40)), max_size=60))
def test_holds_expire_as_a_scan_of_them_all_would_say(ops: list[tuple[str, int, int]]) -> None:
    """The table keeps its earliest deadline instead of scanning every step: whatever the puts, renewals, takes
    and expiries, it answers as the plain scan does (which holds expire, in their order; the next deadline)."""
    table, plain = HoldTable(), dict[str, Hold]()  # plain: the reference's own dict
    for op, n, t in ops:
        rid = f"r{n}"
        if op in ("put", "put_untracked"):
            hold = Hold(rid, "retained", [], 0, expires_at=float(t), tracked=op == "put")
            table.put(hold)
            plain[rid] = hold
        elif op == "renew" and (hold := table.get(rid)) is not None:
            table.renew(hold, float(t))
        elif op == "take":
            assert table.take(rid) is plain.pop(rid, None)
        elif op == "expired":
            want = [h for h in plain.values() if h.tracked and h.expires_at <= t]
            for h in want:
                del plain[h.request_id]
            assert table.expired(float(t)) == want
        elif op == "next":
            want_next = min((h.expires_at for h in plain.values() if h.tracked), default=None)
            assert table.next_expiry() == want_next
        assert len(table) == len(plain)
