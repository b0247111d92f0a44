"""What a prefill leg did with a handle, read from P's reported cached tokens (gateway/guard/readback.py).

The model of P below is vLLM 0.32's rule (``nixl/pull_scheduler.py`` ``get_num_new_matched_tokens`` with the
scheduler's whole-block local hit); the reading must agree with it on every offer the gateway makes.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from kvtether.gateway.guard.readback import DECODE_PULL, NONE, PREFILL_CACHE, read_of, readable_offer
from kvtether.gateway.guard.verify import handle_num_tokens


def _handle(n: int, block_size: int) -> dict[str, object]:
    return {"do_remote_decode": True, "remote_num_tokens": n, "remote_block_ids": [list(range(-(-n // block_size)))],
            "remote_engine_id": "d", "remote_request_id": "r", "remote_host": "h", "remote_port": 1}


def _p_cached(prompt: int, local: int, offered: int | None, threshold: int) -> tuple[int, bool]:
    """vLLM's P: (cached tokens it reports, whether it read from D)."""
    if offered is None:
        return local, False
    count = min(offered, prompt) - local
    if count <= 0 or (threshold > 0 and count < threshold):
        return local, False
    return local + count, True


@given(block_size=st.sampled_from([1, 2, 16, 64]), prompt=st.integers(2, 5000), held=st.integers(1, 6000),
       local_blocks=st.integers(0, 400), threshold=st.sampled_from([0, 1, 4, 64]))
def test_the_reading_agrees_with_what_p_did_on_every_offer_the_gateway_makes(
        block_size: int, prompt: int, held: int, local_blocks: int, threshold: int) -> None:
    # P's own hit: whole blocks, and never the whole prompt (it computes at least the last token).
    local = min(local_blocks, (prompt - 1) // block_size) * block_size
    offer = readable_offer(_handle(held, block_size), prompt, block_size)
    n = handle_num_tokens(offer)
    assert n is not None and 0 < n <= held
    cached, did_read = _p_cached(prompt, local, n, threshold)
    read = read_of(n, prompt, cached)
    if block_size > 1 and min(held, prompt - 1) > 1:
        assert (read.source == DECODE_PULL) == did_read, (n, local, cached)
        assert read.handle_unread == (not did_read)
        # At most one token of reuse given up for the reading.
        assert n >= min(held, prompt - 1) - 1
    assert read.cached_tokens == cached


def test_a_truncated_handle_inside_ps_own_cache_is_not_a_pull() -> None:
    # The guard verified 256 tokens (the edit point, whole blocks) and P's prefix cache holds them: P reads
    # nothing, and its cached count (its own 256) is not the offer (255).
    offer = readable_offer(_handle(256, 16), 900, 16)
    assert handle_num_tokens(offer) == 255 and len(offer["remote_block_ids"][0]) == 16
    read = read_of(255, 900, 256)
    assert (read.source, read.cached_tokens, read.handle_unread) == (PREFILL_CACHE, 256, True)
    # P's cache held less than the handle and the rest was read: a pull of the whole offer.
    assert read_of(255, 900, 255).source == DECODE_PULL
    # Below P's recompute threshold it computed everything.
    assert read_of(255, 900, 0).source == NONE and read_of(255, 900, 0).handle_unread


def test_without_reported_details_nothing_is_confirmed() -> None:
    read = read_of(255, 900, None)
    assert read.source == NONE and read.handle_unread
    assert read_of(None, 900, 32).source == PREFILL_CACHE and not read_of(None, 900, 32).handle_unread


def test_offers_already_readable_stay_whole_and_short_prompts_cap_them() -> None:
    h = _handle(301, 16)
    assert readable_offer(h, 1000, 16) == h
    assert handle_num_tokens(readable_offer(h, 200, 16)) == 199  # under the prompt, not whole blocks
    assert handle_num_tokens(readable_offer(h, 193, 16)) == 191  # 192 would be 12 whole blocks
