"""The retention policy (pure): which held handles to release, and why. A handle is released for memory (its
decode node's budget, or its requests short of KV) or at its expiry, never because its session stayed away."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvtether.gateway import telemetry as T
from kvtether.gateway.config import ConfigError, load_config
from kvtether.gateway.guard.verify import HeldSequence
from kvtether.gateway.nodes.cluster import Cluster, parse_metrics
from kvtether.gateway.nodes.retention import Retention, retention_knobs
from kvtether.gateway.policy.retention import (
    DecodeMemory,
    HeldHandle,
    HeldLedger,
    ReleaseReason,
    RetentionKnobs,
    block_scope,
    held_blocks_tokens,
    held_by_node,
    memory_wanted,
    pull_unlikeliness,
    review,
)
from kvtether.gateway.stores.memory import MemorySessionStore
from kvtether.gateway.stores.sessions import SessionState

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


def mem(capacity: int | None, *, block_size: int = 0, usage: float = 0.0, waiting: float = 0.0,
        preempted: float = 0.0, blocked_polls: int = 0) -> DecodeMemory:
    return DecodeMemory(capacity=capacity, block_size=block_size, usage=usage, waiting=waiting, preempted=preempted,
                        blocked_polls=blocked_polls)


SYSTEM = list(range(1000, 1160))  # a system prompt of 160 tokens: 10 blocks of 16


KNOBS = RetentionKnobs(budget_share=0.5, low_water=0.9, pressure_usage=0.9, expiry_lead_s=2.0)


def test_a_session_away_for_ever_keeps_its_handle_while_its_decode_node_has_room() -> None:
    # Away 80 of its gaps, away 400 s with no gap yet, a burst of tool calls then silence: the old clock rule
    # (4 gaps, at most 180 s) released all three. D holds 3,000 of 1,000,000 tokens and nothing waits.
    handles = [held("away", last=0.0, gap=5.0), held("new", last=0.0, gap=None), held("burst", last=10.0, gap=0.5)]
    assert review(handles, {D1: mem(1_000_000, usage=0.3)}, now=400.0, knobs=KNOBS) == []
    # Requests waiting on a D whose KV is not nearly full wait for something else (a KV read in flight): no
    # release either; an unknown D (no capacity polled yet) is never short of memory.
    assert review(handles, {D1: mem(1_000_000, usage=0.5, waiting=3)}, now=400.0, knobs=KNOBS) == []
    assert review(handles, {D1: mem(None, usage=0.99, waiting=3)}, now=400.0, knobs=KNOBS) == []
    assert review(handles, {}, now=400.0, knobs=KNOBS) == []


def test_a_handle_is_released_as_it_reaches_its_expiry() -> None:
    # Handles stored at 0 with a 450 s expiry: released from 448 s on (2 s ahead, so the store still holds the
    # session), whatever D's memory; the one stored later is kept.
    handles = [held("old", last=0.0), held("young", last=100.0)]
    assert review(handles, {D1: mem(1_000_000)}, now=447.9, knobs=KNOBS) == []
    out = review(handles, {D1: mem(1_000_000)}, now=448.0, knobs=KNOBS)
    assert [(r.session_id, r.reason, r.request_id, r.node) for r in out] == [
        ("old", ReleaseReason.EXPIRED, "req-old", D1)]


def test_over_budget_the_least_likely_to_be_pulled_go_first_until_the_low_water_mark() -> None:
    # Capacity 10,000 tokens, budget 5,000 (the high-water mark), low water 4,500; 8,000 held on D1: four of
    # 1,000 must go (8,000 → 4,000 is the first count at or under 4,500), and D2 (capacity unknown) is left alone.
    handles = [
        held("soon", tokens=1000, last=99.0, gap=10.0),  # 0.1 of its gap away: likely back
        held("overdue", tokens=1000, last=70.0, gap=10.0),  # 3 gaps away
        held("late", tokens=1000, last=90.0, gap=10.0),  # 1 gap away
        held("expiring", tokens=1000, last=95.0, gap=60.0, stored=0.0, ttl=120.0),  # returns after its expiry
        held("later", tokens=1000, last=80.0, gap=10.0),  # 2 gaps away
        held("big", tokens=3000, last=99.5, gap=10.0),
        held("other", node=D2, tokens=9000, last=99.0, gap=10.0),
    ]
    out = review(handles, {D1: mem(10_000), D2: mem(None)}, now=100.0, knobs=KNOBS)
    assert [(r.session_id, r.reason) for r in out] == [("expiring", ReleaseReason.BUDGET),
                                                       ("overdue", ReleaseReason.BUDGET),
                                                       ("later", ReleaseReason.BUDGET),
                                                       ("late", ReleaseReason.BUDGET)]
    # At 5,000 (the mark itself) nothing starts.
    assert review(handles[:5], {D1: mem(10_000)}, now=100.0, knobs=KNOBS) == []


def test_requests_short_of_kv_on_a_decode_node_release_its_handles_until_its_usage_is_at_low_water() -> None:
    # 20 handles of 1,000 tokens on a D of 100,000: held 0.2, under the budget. D is 95.5 % used and a request
    # waits: the least likely go until the usage less what they free is at 0.9 × 0.9 = 0.81 (15 handles: 0.805).
    handles = [held(f"s{i:02d}", tokens=1000, last=float(i), gap=10.0) for i in range(20)]
    out = review(handles, {D1: mem(100_000, usage=0.955, waiting=1)}, now=100.0, knobs=KNOBS)
    assert [r.session_id for r in out] == [f"s{i:02d}" for i in range(15)]
    assert {r.reason for r in out} == {ReleaseReason.PRESSURE}
    # A preemption since the last poll says the same, with nothing waiting at the poll.
    preempted = review(handles, {D1: mem(100_000, usage=0.905, preempted=2)}, now=100.0, knobs=KNOBS)
    assert [r.session_id for r in preempted] == [f"s{i:02d}" for i in range(10)]
    # Not enough held to get there: every handle goes.
    assert len(review(handles[:10], {D1: mem(100_000, usage=1.0, waiting=4)}, now=100.0, knobs=KNOBS)) == 10
    assert memory_wanted(mem(100, usage=0.9, waiting=1), KNOBS) and not memory_wanted(mem(100, usage=0.89,
                                                                                           waiting=1), KNOBS)


def test_a_request_that_keeps_waiting_for_capacity_with_nothing_running_is_short_of_memory_at_any_usage() -> None:
    # No budget (held_kv_budget 1): D 60 % used, all by holds, nothing running, a request (too big for the 40 %
    # free) waits for capacity at two polls in a row: only memory keeps it out. Each poll that shows it so
    # frees a tenth of the usage (0.6 → 0.54: 6 handles of 1,000), and the next as much again, so no request
    # waits for KV until the handles expire.
    knobs = RetentionKnobs(budget_share=None)
    handles = [held(f"s{i:02d}", tokens=1000, last=float(i), gap=10.0) for i in range(60)]
    out = review(handles, {D1: mem(100_000, usage=0.6, waiting=1, blocked_polls=2)}, now=100.0, knobs=knobs)
    assert [r.session_id for r in out] == [f"s{i:02d}" for i in range(6)]
    assert {r.reason for r in out} == {ReleaseReason.PRESSURE}
    again = review(handles[6:], {D1: mem(100_000, usage=0.54, waiting=1, blocked_polls=3)}, now=100.0,
                   knobs=knobs)
    assert [r.session_id for r in again] == [f"s{i:02d}" for i in range(6, 12)]
    # One poll (a request may have arrived between two engine steps), or requests waiting under the usage mark
    # with something running (its end frees memory) or not told apart from KV reads: no sign of memory wanted.
    assert review(handles, {D1: mem(100_000, usage=0.6, waiting=1, blocked_polls=1)}, 100.0, knobs) == []
    assert review(handles, {D1: mem(100_000, usage=0.6, waiting=1)}, 100.0, knobs) == []


def test_budget_and_pressure_in_one_pass_the_budget_s_reason_first() -> None:
    # Held 8,000 of 10,000 (budget 5,000, low water 4,500) and D 99 % used with a request waiting: four go for
    # the budget (down to 4,000 held, usage 0.59), which already brings the usage under 0.81: no more.
    handles = [held(f"s{i}", tokens=1000, last=float(i), gap=10.0) for i in range(8)]
    out = review(handles, {D1: mem(10_000, usage=0.99, waiting=1)}, now=100.0, knobs=KNOBS)
    assert [(r.session_id, r.reason) for r in out] == [(f"s{i}", ReleaseReason.BUDGET) for i in range(4)]
    # Usage 1.0 on a D of 20,000 (budget 10,000: not over it): the pressure alone, 4,000 tokens to free.
    out = review(handles, {D1: mem(20_000, usage=1.0, waiting=1)}, now=100.0, knobs=KNOBS)
    assert [(r.session_id, r.reason) for r in out] == [(f"s{i}", ReleaseReason.PRESSURE) for i in range(4)]


def test_budget_counts_whole_blocks_and_none_is_no_budget() -> None:
    assert held_blocks_tokens(17, 16) == 32 and held_blocks_tokens(16, 16) == 16
    handles = [held("a", tokens=17, last=99.0), held("b", tokens=17, last=98.0)]
    assert held_by_node(handles, {D1: 16}) == {D1: 64}
    # 64 held against a budget of 0.5 × 100 = 50 in blocks; 34 in tokens would fit.
    assert [r.session_id for r in review(handles, {D1: mem(100, block_size=16)}, 100.0, KNOBS)] == ["b"]
    assert review(handles, {D1: mem(100)}, 100.0, KNOBS) == []
    unlimited = RetentionKnobs(budget_share=None)
    assert review(handles, {D1: mem(10, block_size=16)}, 100.0, unlimited) == []


_NODE_SPECS = st.tuples(st.integers(1000, 50_000), st.floats(0.0, 1.0), st.integers(0, 3), st.integers(0, 2),
                        st.integers(0, 3))
_SPECS = st.lists(st.tuples(st.sampled_from([D1, D2]), st.integers(1, 5000), st.floats(0, 200),
                            st.one_of(st.none(), st.floats(0.1, 100)), st.floats(1, 1000)), max_size=40)


_NodeSpec = tuple[int, float, int, int, int]


def _setup(specs: list[tuple[str, int, float, float | None, float]], nodes: list[_NodeSpec],
           ) -> tuple[list[HeldHandle], dict[str, DecodeMemory]]:
    handles = [HeldHandle(f"s{i}", n, t, f"req-s{i}", last, last + ttl, last, gap)
               for i, (n, t, last, gap, ttl) in enumerate(specs)]
    memory = {node: mem(cap, usage=usage, waiting=waiting, preempted=preempted, blocked_polls=blocked)
              for node, (cap, usage, waiting, preempted, blocked) in zip((D1, D2), nodes, strict=True)}
    return handles, memory


@given(_SPECS, st.lists(_NODE_SPECS, min_size=2, max_size=2), st.floats(0.1, 1.0), st.floats(0.1, 1.0),
       st.floats(0.1, 1.0))
@settings(max_examples=300, deadline=None)
def test_nothing_but_expiring_handles_goes_while_every_node_is_under_its_mark_with_nothing_short_of_kv(
        specs: list[tuple[str, int, float, float | None, float]], nodes: list[_NodeSpec],
        share: float, low: float, pressure: float) -> None:
    knobs = RetentionKnobs(budget_share=share, low_water=low, pressure_usage=pressure)
    handles, memory = _setup(specs, nodes)
    now = 200.0
    out = review(handles, memory, now, knobs)
    by_id = {h.session_id: h for h in handles}
    assert len({r.session_id for r in out}) == len(out)
    for r in out:
        h = by_id[r.session_id]
        assert (r.reason is ReleaseReason.EXPIRED) == (now >= h.expires_at - knobs.expiry_lead_s)
    live = [h for h in handles if now < h.expires_at - knobs.expiry_lead_s]
    for node, m in memory.items():
        held_here = sum(h.tokens for h in live if h.node == node)
        quiet = held_here <= share * m.capacity and not memory_wanted(m, knobs)  # type: ignore[operator]
        if quiet:
            assert not [r for r in out if r.node == node and r.reason is not ReleaseReason.EXPIRED]


@given(_SPECS, st.lists(_NODE_SPECS, min_size=2, max_size=2), st.floats(0.1, 1.0), st.floats(0.1, 1.0),
       st.floats(0.1, 1.0))
@settings(max_examples=300, deadline=None)
def test_a_pass_stops_once_under_its_low_water_mark_and_takes_the_least_likely_first(
        specs: list[tuple[str, int, float, float | None, float]], nodes: list[_NodeSpec],
        share: float, low: float, pressure: float) -> None:
    knobs = RetentionKnobs(budget_share=share, low_water=low, pressure_usage=pressure)
    handles, memory = _setup(specs, nodes)
    now = 200.0
    out = review(handles, memory, now, knobs)
    gone = {r.session_id for r in out}
    for node, m in memory.items():
        assert m.capacity is not None
        live = [h for h in handles if h.node == node and now < h.expires_at - knobs.expiry_lead_s]
        made_room = [r for r in out if r.node == node and r.reason is not ReleaseReason.EXPIRED]
        kept = [h for h in live if h.session_id not in gone]
        held_before = sum(h.tokens for h in live)
        held_after = sum(h.tokens for h in kept)
        over = held_before > share * m.capacity
        wanted = memory_wanted(m, knobs)
        budget_target = low * share * m.capacity if over else math.inf
        usage_target = low * min(m.usage, pressure) if wanted else math.inf

        def usage_after(freed: int, m: DecodeMemory = m) -> float:
            return m.usage - freed / m.capacity  # type: ignore[operator]

        # Ends under both marks, unless it ran out of handles.
        assert kept == [] or (held_after <= budget_target
                              and usage_after(held_before - held_after) <= usage_target)
        if made_room:
            # Minimal: without its last release the node was still over one of its low-water marks.
            last = next(h for h in live if h.session_id == made_room[-1].session_id)
            before_last = held_after + last.tokens
            assert before_last > budget_target or usage_after(held_before - before_last) > usage_target
            # Each release is labelled by the mark it was for: budget while held KV was over its low water.
            budget = [r for r in made_room if r.reason is ReleaseReason.BUDGET]
            assert made_room[:len(budget)] == budget
            assert not budget or over
            # The least likely to be pulled first (nothing is shared here: every release frees its blocks).
            worst_kept = min((pull_unlikeliness(h, now, knobs) for h in kept), default=None)
            for r in made_room:
                h = next(h for h in live if h.session_id == r.session_id)
                assert worst_kept is None or pull_unlikeliness(h, now, knobs) <= worst_kept


def test_knobs_from_the_configuration_and_their_validation(caplog: pytest.LogCaptureFixture) -> None:
    knobs = retention_knobs(load_config(None, prefill=["http://p"], decode=["http://d"], held_kv_budget=1.0,
                                        release_low_water=0.8, decode_pressure_usage=0.95,
                                        retention_interval_s=0.5))
    assert knobs.budget_share is None and knobs.low_water == 0.8 and knobs.pressure_usage == 0.95
    assert knobs.expiry_lead_s == 1.0  # two review intervals
    assert retention_knobs(load_config(None, prefill=["http://p"], decode=["http://d"])).budget_share == 0.5
    for bad in ({"held_kv_budget": 0.0}, {"held_kv_budget": 1.5}, {"release_low_water": 0.0},
                {"release_low_water": 1.1}, {"decode_pressure_usage": 0.0}, {"release_concurrency": 0},
                {"retention_interval_s": -1.0}):
        with pytest.raises(ConfigError):
            load_config(None, prefill=["http://p"], decode=["http://d"], **bad)
    with pytest.raises(ValueError):
        RetentionKnobs(low_water=0.0)
    # The clock rule's setting still loads (old configuration files keep working), does nothing, and says so.
    cfg = load_config(None, prefill=["http://p"], decode=["http://d"], idle_release_s=60)
    with caplog.at_level(logging.WARNING, logger="kvtether.gateway.nodes.retention"):
        Retention(cfg, Cluster(cfg, httpx.AsyncClient()), MemorySessionStore(), T.Metrics(), httpx.AsyncClient())
    assert "idle_release_s is deprecated and ignored" in caplog.text
    assert retention_knobs(cfg) == retention_knobs(load_config(None, prefill=["http://p"], decode=["http://d"]))


def test_the_poll_gives_preemptions_and_the_requests_waiting_for_capacity() -> None:
    # vLLM 0.32: waiting requests by reason add up to num_requests_waiting; "deferred" are its KV reads in flight.
    text = ('vllm:num_preemptions_total{model_name="m",engine="0"} 3.0\n'
            'vllm:num_preemptions_created 1700000000.0\nvllm:kv_cache_usage_perc{model_name="m"} 0.5\n'
            'vllm:num_requests_waiting{model_name="m",engine="0"} 5.0\n'
            'vllm:num_requests_waiting_by_reason{model_name="m",engine="0",reason="capacity"} 2.0\n'
            'vllm:num_requests_waiting_by_reason{model_name="m",engine="0",reason="deferred"} 3.0\n')
    assert parse_metrics(text) == {"running": 0.0, "waiting": 5.0, "kv_usage": 0.5, "preemptions": 3.0,
                                   "waiting_capacity": 2.0}
    assert parse_metrics("vllm:kv_cache_usage_perc 0.5\n") == {"running": 0.0, "waiting": 0.0, "kv_usage": 0.5}


@pytest.mark.anyio
async def test_a_poll_s_waiting_requests_and_preemptions_ask_for_releases_once() -> None:
    """The shell passes a decode node's waiting requests and preemptions to one review per poll: the releases
    that poll asked for go out, and the next review, which sees no newer poll, asks for no more; the next poll
    that still shows D short of KV does. It counts the polls in a row that show requests waiting for capacity
    with none running."""
    d = D1 + ":1"
    cfg = load_config(None, prefill=["http://p:1"], decode=[d], policy="pull", held_kv_budget=1.0)
    store = MemorySessionStore(clock=lambda: 100.0)
    async with httpx.AsyncClient() as client:
        cluster = Cluster(cfg, client)
        # No release worker runs: the releases wait in the queue, and the store shows which handles went.
        retention = Retention(cfg, cluster, store, T.Metrics(), client, clock=lambda: 100.0)
        for i in range(10):
            await store.put(SessionState(f"s{i}", decode=d, handle={"remote_request_id": f"r{i}",
                                                                     "remote_num_tokens": 1600},
                                         handle_at=90.0, expires_at=500.0, last_turn_at=90.0 + i, mean_gap_s=5.0))
        node = cluster.nodes[d]
        node.kv_capacity_tokens, node.block_size, node.kv_usage, node.waiting = 100 * 16 * 16, 16, 0.99, 2.0
        node.polls, node.preemptions = 1, 5.0
        # D (25,600 tokens) 99 % used, 2 requests waiting: 0.18 of it to free for 0.81, three handles of 1,600.
        seen = [retention._memory(node)]
        first = await retention.review_once()
        seen.append(retention._memory(node))
        again = await retention.review_once()  # the same poll: nothing more
        node.polls, node.preemptions = 2, 7.0  # a new poll, D as short as before
        seen.append(retention._memory(node))
        third = await retention.review_once()
        left = sorted(s.session_id for s in await store.list() if s.handle is not None)
        # vLLM 0.32 tells requests waiting for capacity (1 here) from its KV reads; nothing runs: a count of polls.
        node.waiting_capacity, node.running = 1.0, 0.0
        blocked = []
        for polls in (3, 3, 4, 5):
            node.polls = polls
            blocked.append(retention._memory(node).blocked_polls)
            await retention.review_once()
        node.running, node.polls = 1.0, 6
        blocked.append(retention._memory(node).blocked_polls)
    assert [(m.waiting, m.preempted) for m in seen] == [(2.0, 0.0), (0.0, 0.0), (2.0, 2.0)]
    assert all(m.capacity == 25_600 and m.usage == 0.99 and m.block_size == 16 for m in seen)
    assert blocked == [1, 0, 2, 3, 0]
    assert [r.session_id for r in first] == ["s0", "s1", "s2"] and again == []
    assert [r.session_id for r in third] == ["s3", "s4", "s5"]
    assert {r.reason for r in first + third} == {ReleaseReason.PRESSURE}
    assert left == [f"s{i}" for i in range(6, 10)]


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
    assert review(handles, {D1: mem(2000, block_size=16)}, 100.0, KNOBS) == []  # budget 1,000 tokens
    # Whole handles would have been 1,664 over a budget of 1,000: the old count released four of them.
    whole = [h.__class__(h.session_id, h.node, h.tokens, h.request_id, h.stored_at, h.expires_at, h.last_turn_at,
                         h.mean_gap_s) for h in handles]
    assert len(review(whole, {D1: mem(2000, block_size=16)}, 100.0, KNOBS)) == 4  # 1,664 → 832 (low water 900)
    # Over budget (400 tokens: 25 blocks; low water 22.5): each release frees its own 3 blocks, never the shared
    # ones, so four go (34 → 22), the least likely to be pulled first (the oldest turns).
    out = review(handles, {D1: mem(800, block_size=16)}, 100.0, KNOBS)
    assert [r.session_id for r in out] == ["s0", "s1", "s2", "s3"]


def test_a_release_that_frees_nothing_is_skipped_for_one_that_does() -> None:
    # "prefix" holds exactly the first 10 blocks of "longer" (block-aligned, no partial block): releasing it
    # frees nothing while "longer" holds them; "longer" is more likely to be pulled, yet it is the one whose
    # release frees memory (its 3 blocks of its own).
    prefix = holding("prefix", SYSTEM, 16, last=85.0)
    longer = holding("longer", SYSTEM + [1] * 40, 16, last=95.0)
    alone = holding("alone", [3] * 64, 16, last=96.0)  # 4 blocks
    assert held_by_node([prefix, longer, alone], {D1: 16}) == {D1: (13 + 4) * 16}
    # Budget 250 tokens (15.6 blocks), low water 225 (14.1 blocks).
    out = review([prefix, longer, alone], {D1: mem(500, block_size=16)}, 100.0, KNOBS)
    assert [r.session_id for r in out] == ["longer"]
    # Two handles of the very same block-aligned sequence: neither frees anything alone, so the least likely
    # goes first, which makes the other's blocks its own, and it goes next.
    twins = [holding("old", SYSTEM, 16, last=85.0), holding("new", SYSTEM, 16, last=95.0)]
    assert held_by_node(twins, {D1: 16}) == {D1: 160}
    assert [r.session_id for r in review(twins, {D1: mem(200, block_size=16)}, 100.0, KNOBS)] == ["old", "new"]


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


@given(_PREFIXES, _HANDLES, st.integers(1, 5), st.integers(1, 60), st.floats(0.1, 1.0), st.floats(0.1, 1.0))
@settings(max_examples=300, deadline=None)
def test_the_budget_on_shared_blocks_ends_under_low_water_and_each_release_was_needed_and_freed_what_it_could(
        prefixes: list[list[int]], specs: list[tuple[int, list[int], str, str, bool, float, float | None]],
        bs: int, capacity_blocks: int, share: float, low: float) -> None:
    knobs = RetentionKnobs(budget_share=share, low_water=low)
    handles, _ = _handles(prefixes, specs, bs)
    capacity = capacity_blocks * bs
    out = review(handles, {D1: mem(capacity, block_size=bs), D2: mem(capacity, block_size=bs)}, 120.0, knobs)
    assert len({r.session_id for r in out}) == len(out)
    assert {r.reason for r in out} <= {ReleaseReason.BUDGET}  # nothing expires, nothing waits
    for node in (D1, D2):
        kept = [h for h in handles if h.node == node]

        def held(hs: list[HeldHandle], node: str = node) -> int:
            return held_by_node(hs, {node: bs}).get(node, 0)

        mine = [r for r in out if r.node == node]
        if held(kept) <= share * capacity:
            assert mine == []  # under the high-water mark: no pass starts
            continue
        target = low * share * capacity
        for r in mine:
            before = held(kept)
            assert before > target  # needed: the node was over its low-water mark when it went
            # It freed blocks, unless no kept handle's release would have freed any.
            could_free = any(held([k for k in kept if k is not o]) < before for o in kept)
            [h] = [h for h in kept if h.session_id == r.session_id]
            kept.remove(h)
            assert held(kept) < before or not could_free
        assert held(kept) <= target


@given(_PREFIXES, _HANDLES, st.integers(1, 5), st.lists(st.lists(st.booleans(), min_size=14, max_size=14),
                                                         min_size=1, max_size=5),
       st.integers(1, 60), st.floats(0.1, 1.0))
@settings(max_examples=200, deadline=None)
def test_the_ledger_kept_between_reviews_counts_and_reviews_what_a_fresh_count_does(
        prefixes: list[list[int]], specs: list[tuple[int, list[int], str, str, bool, float, float | None]],
        bs: int, rounds: list[list[bool]], capacity_blocks: int, share: float) -> None:
    # Review after review, handles come and go (each round holds a subset of them, as sessions return and their
    # handles are replaced or released). The ledger, synced each round, must count what counting anew counts,
    # and a review given it must release what a review counting anew releases, leaving the ledger unchanged.
    handles, _ = _handles(prefixes, specs, bs)
    knobs = RetentionKnobs(budget_share=share, low_water=0.9, expiry_lead_s=2.0)
    nodes = {D1: mem(capacity_blocks * bs, block_size=bs, usage=0.95, waiting=1),
             D2: mem(capacity_blocks * bs, block_size=bs)}
    ledger = HeldLedger()
    for round_ in rounds:
        now = 100.0 + 300.0 * round_[-1]  # some rounds late enough for the earliest handles to expire
        hs = [h for h, keep in zip(handles, round_, strict=False) if keep]
        ledger.sync(hs, {D1: bs, D2: bs})
        fresh = held_by_node(hs, {D1: bs, D2: bs})
        assert {n: t for n, t in ledger.held_by_node().items() if t or n in fresh} == fresh
        assert review(hs, nodes, now, knobs, ledger) == review(hs, nodes, now, knobs)
        assert {n: t for n, t in ledger.held_by_node().items() if t or n in fresh} == fresh


def test_the_ledger_counts_a_node_anew_when_its_block_size_changes() -> None:
    # Before D's first poll its block size is unknown (0: tokens are counted); once polled, blocks are.
    seq = SYSTEM + [7] * 20  # 180 tokens: 11 full blocks of 16 and a partial one
    a, b = holding("a", seq, 16), holding("b", SYSTEM + [8] * 20, 16)
    ledger = HeldLedger()
    ledger.sync([a, b], {})
    assert ledger.held_by_node() == {D1: 360}
    ledger.sync([a, b], {D1: 16})
    assert ledger.held_by_node() == held_by_node([a, b], {D1: 16}) == {D1: (10 + 2 + 2) * 16}
    ledger.sync([a], {D1: 16})
    assert ledger.held_by_node() == {D1: 12 * 16}
    ledger.sync([], {D1: 16})
    assert ledger.held_by_node() == {}
