"""The retention policy (pure): which held handles to release, and why."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvtether.gateway.config import ConfigError, load_config
from kvtether.gateway.guard.verify import HeldSequence
from kvtether.gateway.nodes.retention import retention_knobs
from kvtether.gateway.policy.retention import (
    HeldHandle,
    ReleaseReason,
    RetentionKnobs,
    block_scope,
    held_blocks_tokens,
    held_by_node,
    idle_at,
    review,
)

D1, D2 = "http://d1", "http://d2"


def held(sid: str, *, node: str = D1, tokens: int = 1000, last: float = 0.0, gap: float | None = 5.0,
         stored: float | None = None, ttl: float = 450.0) -> HeldHandle:
    at = last if stored is None else stored
    return HeldHandle(sid, node, tokens, f"req-{sid}", at, at + ttl, last, gap)


def holding(sid: str, tokens: Sequence[int], block_size: int, *, node: str = D1, scope: str = "",
            guarded: bool = True, last: float = 99.0, gap: float | None = 10.0) -> HeldHandle:
    """A handle holding exactly ``tokens`` (D's token ids), with its held sequence's block hashes (guarded) or
    without (unguarded: counted whole)."""
    blocks = HeldSequence.from_tokens(list(tokens), block_size).hashes if guarded else None
    return HeldHandle(sid, node, len(tokens), f"req-{sid}", last, last + 450.0, last, gap, blocks=blocks,
                      scope=scope)


SYSTEM = list(range(1000, 1160))  # a system prompt of 160 tokens: 10 blocks of 16


KNOBS = RetentionKnobs(idle_gap_factor=4.0, idle_min_s=10.0, idle_max_s=180.0, budget_share=0.5)


def test_a_session_is_idle_after_four_of_its_gaps_bounded_below_and_above() -> None:
    assert idle_at(held("a", last=100.0, gap=5.0), KNOBS) == 120.0
    assert idle_at(held("b", last=100.0, gap=0.5), KNOBS) == 110.0  # never sooner than idle_min_s
    assert idle_at(held("c", last=100.0, gap=300.0), KNOBS) == 280.0  # never later than idle_max_s
    assert idle_at(held("d", last=100.0, gap=None), KNOBS) == 280.0  # no gap yet: the bound


def test_review_releases_idle_sessions_and_keeps_the_rest_under_no_pressure() -> None:
    handles = [held("away", last=0.0, gap=5.0), held("busy", last=15.0, gap=5.0), held("new", last=0.0, gap=None)]
    out = review(handles, {D1: 1_000_000}, now=25.0, knobs=KNOBS)
    assert [(r.session_id, r.reason) for r in out] == [("away", ReleaseReason.IDLE)]
    assert out[0].request_id == "req-away" and out[0].node == D1


def test_over_budget_the_least_likely_to_be_pulled_go_first_until_under() -> None:
    # Capacity 10,000 tokens, budget 5,000; 7,000 held on D1: two of 1,000 must go, and D2 is left alone.
    handles = [
        held("soon", tokens=1000, last=99.0, gap=10.0),  # 0.1 of its gap away: likely back
        held("overdue", tokens=1000, last=70.0, gap=10.0),  # 3 gaps away (not idle yet: 4)
        held("late", tokens=1000, last=90.0, gap=10.0),  # 1 gap away
        held("expiring", tokens=1000, last=95.0, gap=60.0, stored=0.0, ttl=120.0),  # returns after its expiry
        held("big", tokens=3000, last=99.5, gap=10.0),
        held("other", node=D2, tokens=9000, last=99.0, gap=10.0),
    ]
    out = review(handles, {D1: 10_000, D2: None}, now=100.0, knobs=KNOBS)
    assert [(r.session_id, r.reason) for r in out] == [("expiring", ReleaseReason.BUDGET),
                                                       ("overdue", ReleaseReason.BUDGET)]


def test_budget_counts_whole_blocks_and_none_is_no_budget() -> None:
    assert held_blocks_tokens(17, 16) == 32 and held_blocks_tokens(16, 16) == 16
    handles = [held("a", tokens=17, last=99.0), held("b", tokens=17, last=98.0)]
    assert held_by_node(handles, {D1: 16}) == {D1: 64}
    # 64 held against a budget of 0.5 × 100 = 50 in blocks; 34 in tokens would fit.
    assert [r.session_id for r in review(handles, {D1: 100}, 100.0, KNOBS, {D1: 16})] == ["b"]
    assert review(handles, {D1: 100}, 100.0, KNOBS) == []
    unlimited = RetentionKnobs(budget_share=None)
    assert review(handles, {D1: 10}, 100.0, unlimited, {D1: 16}) == []


@given(st.lists(st.tuples(st.sampled_from([D1, D2]), st.integers(1, 5000), st.floats(0, 200),
                          st.one_of(st.none(), st.floats(0.1, 100))), max_size=40),
       st.integers(1000, 50_000), st.floats(0.1, 1.0))
@settings(max_examples=200, deadline=None)
def test_review_leaves_every_node_under_budget_releases_each_handle_once_and_no_more_than_needed(
        specs: list[tuple[str, int, float, float | None]], capacity: int, share: float) -> None:
    knobs = RetentionKnobs(budget_share=share)
    now = 200.0
    handles = [held(f"s{i}", node=n, tokens=t, last=last, gap=gap) for i, (n, t, last, gap) in enumerate(specs)]
    out = review(handles, {D1: capacity, D2: capacity}, now, knobs)
    ids = [r.session_id for r in out]
    assert len(ids) == len(set(ids))
    gone = set(ids)
    by_id = {h.session_id: h for h in handles}
    for r in out:
        h = by_id[r.session_id]
        assert (r.reason is ReleaseReason.IDLE) == (now >= idle_at(h, knobs))
    for node in (D1, D2):
        kept = sum(h.tokens for h in handles if h.node == node and h.session_id not in gone)
        assert kept <= share * capacity
        budget_released = [by_id[r.session_id] for r in out if r.node == node and r.reason is ReleaseReason.BUDGET]
        if budget_released:
            # Minimal: without the last handle it released, the node would still have been over budget.
            assert kept + budget_released[-1].tokens > share * capacity


def test_knobs_from_the_configuration_and_their_validation() -> None:
    knobs = retention_knobs(load_config(None, prefill=["http://p"], decode=["http://d"], held_kv_budget=1.0,
                                        idle_release_s=5.0))
    assert knobs.budget_share is None and knobs.idle_max_s == 5.0 and knobs.idle_min_s == 5.0
    assert retention_knobs(load_config(None, prefill=["http://p"], decode=["http://d"])).budget_share == 0.5
    for bad in ({"held_kv_budget": 0.0}, {"held_kv_budget": 1.5}, {"idle_release_s": 0.0},
                {"release_concurrency": 0}, {"retention_interval_s": -1.0}):
        with pytest.raises(ConfigError):
            load_config(None, prefill=["http://p"], decode=["http://d"], **bad)
    with pytest.raises(ValueError):
        RetentionKnobs(idle_min_s=10.0, idle_max_s=5.0)
    assert math.isclose(idle_at(held("x", last=0.0, gap=1.0), RetentionKnobs(idle_gap_factor=2.5,
                                                                               idle_min_s=0.0)), 2.5)


# ---- held KV counted by block, once --------------------------------------------------------------------


def test_a_shared_system_prompt_is_held_once_each_partial_block_on_its_own() -> None:
    # Three sessions on D1: the same 10-block system prompt, then 40 tokens of their own (2 full blocks and
    # a partial one each): 10 + 3 × 3 = 19 blocks, where counting each handle whole says 3 × 13 = 39.
    handles = [holding(f"s{i}", SYSTEM + [i] * 40, 16) for i in range(3)]
    assert held_by_node(handles, {D1: 16}) == {D1: 19 * 16}
    assert sum(held_blocks_tokens(h.tokens, 16) for h in handles) == 39 * 16
    # Another decode node holds its own copy; so does another scope (another tenant's cache_salt) on D1; an
    # unguarded handle (no held sequence) counts whole.
    other = [holding("d2", SYSTEM + [7] * 40, 16, node=D2), holding("salted", SYSTEM + [8] * 40, 16, scope="t2"),
             holding("bare", SYSTEM + [9] * 40, 16, guarded=False)]
    assert held_by_node(handles + other, {D1: 16, D2: 16}) == {D1: (19 + 13 + 13) * 16, D2: 13 * 16}
    # Block hashes chain: the same block after different histories is another block.
    shifted = [holding("a", [1] * 16 + [5] * 16, 16), holding("b", [2] * 16 + [5] * 16, 16)]
    assert held_by_node(shifted, {D1: 16}) == {D1: 4 * 16}


def test_block_scope_separates_salts_and_models() -> None:
    assert block_scope("m", None) == block_scope("m", None) != block_scope("m", "tenant-a")
    assert block_scope("m", "tenant-a") != block_scope("m", "tenant-b") and block_scope("lora", None) != block_scope(
        "m", None)


def test_a_handle_counts_no_more_blocks_than_it_holds() -> None:
    # A held sequence longer than the handle's tokens (never made by the gateway) lends no shared block past them.
    seq = HeldSequence.from_tokens(SYSTEM, 16).hashes
    short = HeldHandle("s", D1, 40, "r", 0.0, 450.0, 0.0, None, blocks=seq)
    assert held_by_node([short], {D1: 16}) == {D1: 48}


def test_the_budget_counts_shared_blocks_once_and_releases_nothing_under_it() -> None:
    # 8 sessions: 10 shared blocks + 3 of each one's own = 34 blocks (544 tokens); whole, 104 blocks (1,664).
    handles = [holding(f"s{i}", SYSTEM + [i] * 40, 16, last=90.0 + i) for i in range(8)]
    assert held_by_node(handles, {D1: 16}) == {D1: 544}
    assert review(handles, {D1: 2000}, 100.0, KNOBS, {D1: 16}) == []  # budget 1,000 tokens
    # Whole handles would have been 1,664 over a budget of 1,000: the old count released four of them.
    whole = [h.__class__(h.session_id, h.node, h.tokens, h.request_id, h.stored_at, h.expires_at, h.last_turn_at,
                         h.mean_gap_s) for h in handles]
    assert len(review(whole, {D1: 2000}, 100.0, KNOBS, {D1: 16})) == 4
    # Over budget (400 tokens: 25 blocks): each release frees its own 3 blocks, never the shared ones, so
    # three go (34 → 25), the least likely to be pulled first (the oldest turns).
    out = review(handles, {D1: 800}, 100.0, KNOBS, {D1: 16})
    assert [r.session_id for r in out] == ["s0", "s1", "s2"]


def test_a_release_that_frees_nothing_is_skipped_for_one_that_does() -> None:
    # "prefix" holds exactly the first 10 blocks of "longer" (block-aligned, no partial block): releasing it
    # frees nothing while "longer" holds them; "longer" is more likely to be pulled, yet it is the one whose
    # release frees memory (its 3 blocks of its own).
    prefix = holding("prefix", SYSTEM, 16, last=85.0)
    longer = holding("longer", SYSTEM + [1] * 40, 16, last=95.0)
    alone = holding("alone", [3] * 64, 16, last=96.0)  # 4 blocks
    assert held_by_node([prefix, longer, alone], {D1: 16}) == {D1: (13 + 4) * 16}
    out = review([prefix, longer, alone], {D1: 500}, 100.0, KNOBS, {D1: 16})  # budget 250 tokens: 15 blocks
    assert [r.session_id for r in out] == ["longer"]
    # Two handles of the very same block-aligned sequence: neither frees anything alone, so the least likely
    # goes first, which makes the other's blocks its own, and it goes next.
    twins = [holding("old", SYSTEM, 16, last=85.0), holding("new", SYSTEM, 16, last=95.0)]
    assert held_by_node(twins, {D1: 16}) == {D1: 160}
    assert [r.session_id for r in review(twins, {D1: 200}, 100.0, KNOBS, {D1: 16})] == ["old", "new"]


_PREFIXES = st.lists(st.lists(st.integers(0, 2), max_size=12), min_size=1, max_size=3)
_HANDLES = st.lists(st.tuples(st.integers(0, 2), st.lists(st.integers(0, 2), max_size=10),
                              st.sampled_from([D1, D2]), st.sampled_from(["", "t"]), st.booleans(),
                              st.floats(0, 120), st.one_of(st.none(), st.floats(0.5, 60))),
                    max_size=14)


def _brute_force_blocks(handles: Sequence[HeldHandle], tokens: dict[str, list[int]], bs: int) -> dict[str, int]:
    """D's physical blocks, named without hashes: a full block of a guarded handle by its node, scope and every
    token up to its end (what vLLM's chained hash stands for); every other block is its handle's alone."""
    seen: dict[str, set[object]] = {}
    for h in handles:
        blocks = seen.setdefault(h.node, set())
        seq = tokens[h.session_id]
        full = len(seq) // bs if h.blocks is not None else 0
        blocks.update((h.scope, tuple(seq[: (i + 1) * bs])) for i in range(full))
        blocks.update((h.session_id, i) for i in range(full, math.ceil(len(seq) / bs)))
    return {node: len(b) for node, b in seen.items()}


def _handles(prefixes: list[list[int]], specs: list[tuple[int, list[int], str, str, bool, float, float | None]],
             bs: int) -> tuple[list[HeldHandle], dict[str, list[int]]]:
    handles, tokens = [], {}
    for i, (p, rest, node, scope, guarded, last, gap) in enumerate(specs):
        seq = prefixes[p % len(prefixes)] + rest
        if not seq:
            continue
        tokens[f"s{i}"] = seq
        handles.append(holding(f"s{i}", seq, bs, node=node, scope=scope, guarded=guarded, last=last, gap=gap))
    return handles, tokens


@given(_PREFIXES, _HANDLES, st.integers(1, 5))
@settings(max_examples=300, deadline=None)
def test_the_count_is_the_distinct_blocks_of_a_brute_force_union_and_never_the_sum_s_more(
        prefixes: list[list[int]], specs: list[tuple[int, list[int], str, str, bool, float, float | None]],
        bs: int) -> None:
    handles, tokens = _handles(prefixes, specs, bs)
    got = held_by_node(handles, {D1: bs, D2: bs})
    want = _brute_force_blocks(handles, tokens, bs)
    assert got == {node: n * bs for node, n in want.items()}
    for node, held_tokens in got.items():
        assert held_tokens <= sum(held_blocks_tokens(h.tokens, bs) for h in handles if h.node == node)


@given(_PREFIXES, _HANDLES, st.integers(1, 5), st.integers(1, 60), st.floats(0.1, 1.0))
@settings(max_examples=300, deadline=None)
def test_the_budget_on_shared_blocks_ends_under_it_and_each_release_was_needed_and_freed_what_it_could(
        prefixes: list[list[int]], specs: list[tuple[int, list[int], str, str, bool, float, float | None]],
        bs: int, capacity_blocks: int, share: float) -> None:
    knobs = RetentionKnobs(budget_share=share)
    handles, _ = _handles(prefixes, specs, bs)
    capacity = {D1: capacity_blocks * bs, D2: capacity_blocks * bs}
    out = review(handles, capacity, 120.0, knobs, {D1: bs, D2: bs})
    assert len({r.session_id for r in out}) == len(out)
    idle = {r.session_id for r in out if r.reason is ReleaseReason.IDLE}
    for node in (D1, D2):
        budget = share * capacity[node]
        kept = [h for h in handles if h.node == node and h.session_id not in idle]

        def held(hs: list[HeldHandle], node: str = node) -> int:
            return held_by_node(hs, {node: bs}).get(node, 0)

        for r in (r for r in out if r.node == node and r.reason is ReleaseReason.BUDGET):
            before = held(kept)
            assert before > budget  # needed: the node was over its budget when it went
            # It freed blocks, unless no kept handle's release would have freed any.
            could_free = any(held([k for k in kept if k is not o]) < before for o in kept)
            [h] = [h for h in kept if h.session_id == r.session_id]
            kept.remove(h)
            assert held(kept) < before or not could_free
        assert held(kept) <= budget
