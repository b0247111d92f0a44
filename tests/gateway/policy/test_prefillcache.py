"""What prefill nodes' prefix caches still hold of a session (gateway/policy/copies.py, pure)."""

from __future__ import annotations

from kvtether.gateway.policy.copies import (
    MAX_COPIES,
    PrefillCopy,
    after_prefill,
    cached_tokens,
    cut,
    new_kv_tokens,
    surviving,
)

P0, P1 = "http://p0", "http://p1"


def test_a_prompt_leaves_its_full_blocks_in_the_cache() -> None:
    assert cached_tokens(1000, 64) == 960
    assert cached_tokens(1024, 64) == 1024
    assert cached_tokens(63, 64) == 0
    assert cached_tokens(-5, 16) == 0


def test_new_kv_is_the_prompt_less_the_prefills_own_hit() -> None:
    assert new_kv_tokens(10_000, 8_000) == 2_000
    assert new_kv_tokens(10_000, 0) == 10_000
    assert new_kv_tokens(100, 500) == 0


def test_a_copy_survives_until_newer_writes_take_the_room_tail_first() -> None:
    copy = PrefillCopy(P0, 20_000, written_at=1_000)
    # Unknown capacity: assumed kept.
    assert surviving(copy, 10**9, None) == 20_000
    # 100k tokens of cache: 50k written since leaves room for all of it, 90k leaves 10k (the prefix).
    assert surviving(copy, 51_000, 100_000) == 20_000
    assert surviving(copy, 91_000, 100_000) == 10_000
    assert surviving(copy, 101_000, 100_000) == 0
    # Blocks of requests in flight are not evictable: half the cache in use halves the room.
    assert surviving(copy, 41_000, 100_000, kv_usage=0.5) == 10_000
    assert surviving(PrefillCopy(P0, 0, 0), 0, 100_000) == 0


def test_copies_are_cut_to_the_prompts_overlap_with_the_history() -> None:
    copies = (PrefillCopy(P0, 8_000, 5), PrefillCopy(P1, 12_000, 7))
    assert cut(copies, 10_000) == (PrefillCopy(P0, 8_000, 5), PrefillCopy(P1, 10_000, 7))
    assert cut(copies, 10_000, drop=P0) == (PrefillCopy(P1, 10_000, 7),)
    assert cut(copies, 0) == ()  # an edited history (or none verified): nothing is known to match


def test_the_turns_prefill_node_holds_its_prompt_afterwards() -> None:
    copies = (PrefillCopy(P0, 8_000, 5), PrefillCopy(P1, 6_000, 7))
    out = after_prefill(copies, 9_000, P0, 9_500, 64, written_now=40)
    assert out == (PrefillCopy(P1, 6_000, 7), PrefillCopy(P0, 9_472, 40))
    # Bounded: the oldest copies go first.
    many = tuple(PrefillCopy(f"http://p{i}", 1_000, i) for i in range(MAX_COPIES + 3))
    out = after_prefill(many, 5_000, "http://new", 2_000, 16, written_now=99)
    assert len(out) == MAX_COPIES and out[-1] == PrefillCopy("http://new", 2_000, 99)
