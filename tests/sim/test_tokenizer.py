"""Tokenizer: lossless, canonical, specials as single ids, about a token per word."""

from __future__ import annotations

import random

import pytest
from kvtether.sim.tokenizer import IM_END, IM_START, SPECIAL_TOKENS, IncrementalDetokenizer, Tokenizer


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer()


SAMPLES = [
    "",
    "Hello world",
    "  leading spaces and trailing  ",
    "tabs\tand\r\nwindows lines\n\n\n",
    "unicode: café, naïve, 日本語, emoji 😀👍, Ελληνικά",
    "numbers 1234567 3.14159 -42 1e10",
    'json {"name": "get_weather", "arguments": {"city": "Paris"}}',
    "supercalifragilisticexpialidocious internationalization xyzzy",
    f"{IM_START}user\nhi{IM_END}\n<think>\nhmm\n</think>\n\n<tool_call>x</tool_call>",
    "lone surrogate \ud800 kept",
    "<|im_start|without close <think",
]


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip_and_canonical(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.encode(tok.decode(ids)) == ids


def test_random_unicode_round_trip(tok: Tokenizer) -> None:
    rng = random.Random(7)
    alphabet = "ab Z9 \n\t.,;'\"{}[]éß漢😀" + "".join(SPECIAL_TOKENS)
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.encode(tok.decode(ids)) == ids


def test_specials_are_single_ids(tok: Tokenizer) -> None:
    for s in SPECIAL_TOKENS:
        assert tok.encode(s) == [tok.special(s)]
    assert tok.eos_id == tok.special(IM_END)


def test_about_one_token_per_common_word(tok: Tokenizer) -> None:
    text = "The model will look at the cache and find the prefix of this request"
    assert len(tok.encode(text)) == len(text.split())


def test_newline_splits_cleanly(tok: Tokenizer) -> None:
    # The chat template relies on this: text after a newline encodes the same whatever precedes it.
    a, b = "assistant\n", "Sure, the answer is 42."
    assert tok.encode(a + b) == tok.encode(a) + tok.encode(b)


def test_incremental_detokenizer_never_splits_characters(tok: Tokenizer) -> None:
    text = "naïve 😀 done"
    d = IncrementalDetokenizer(tok)
    pieces = [d.push(t) for t in tok.encode(text)]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_repeated_segments_hit_the_cache_with_identical_ids() -> None:
    tok = Tokenizer()
    history = f"{IM_START}user\nFind the config_loader bug{IM_END}\n{IM_START}assistant\nLooking at it now.{IM_END}\n"
    first = tok.encode(history)
    misses = tok.cache_info()["misses"]
    turn2 = history + f"{IM_START}user\nand the parseArgs one{IM_END}\n"
    second = tok.encode(turn2)
    info = tok.cache_info()
    # Only the new message body missed; the resent history came from the cache, token for token.
    assert info["misses"] == misses + 1
    assert info["hits"] >= 3
    assert second[: len(first)] == first
    assert second == Tokenizer().encode(turn2)  # a cold tokenizer agrees
    assert tok.decode(second) == turn2


def test_segment_cache_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtether.sim import tokenizer as mod

    monkeypatch.setattr(mod, "SEGMENT_CACHE_ENTRIES", 8)
    monkeypatch.setattr(mod, "SEGMENT_CACHE_CHARS", 200)
    tok = Tokenizer()
    for i in range(50):
        text = f"message number {i} about the cache"
        assert tok.decode(tok.encode(text)) == text
        info = tok.cache_info()
        assert info["segments"] <= 8 and info["segment_chars"] <= 200
    # Least recently used goes first: the newest entry is still there, the oldest is not.
    before = tok.cache_info()["hits"]
    tok.encode("message number 49 about the cache")
    assert tok.cache_info()["hits"] == before + 1
    tok.encode("message number 0 about the cache")
    assert tok.cache_info()["hits"] == before + 1
    # A segment larger than the whole budget is encoded but never cached (it would evict everything).
    big = "word " * 100
    assert tok.decode(tok.encode(big)) == big
    assert tok.cache_info()["segment_chars"] <= 200


def test_cached_encoding_matches_uncached_on_random_text() -> None:
    cached, ref, rng = Tokenizer(), Tokenizer(), random.Random(11)
    alphabet = "ab Z9 \n\t.,;_'\"{}[]éß漢😀" + "".join(SPECIAL_TOKENS)
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60))) for _ in range(100)]
    for text in texts + texts:  # second pass: every segment is a cache hit
        ref.clear_cache()
        assert cached.encode(text) == ref.encode(text)
        ref.clear_cache()
        assert cached.encode(text, allow_special=False) == ref.encode(text, allow_special=False)


def test_tokenize_and_chat_paths_share_the_cache() -> None:
    from kvtether.sim.requests import chat_prompt_ids, parse_request

    tok = Tokenizer()
    history: list[dict[str, str]] = [{"role": "system", "content": "You are an agent."}]
    for turn in range(5):
        history += [
            {"role": "user", "content": f"step {turn}: read src/mod_{turn}.py"},
            {"role": "assistant", "content": f"def handler_{turn}(x): return x * {turn}"},
        ]
        body = {"messages": history}
        ids = chat_prompt_ids(tok, body)  # the gateway's /tokenize before the turn
        misses = tok.cache_info()["misses"]
        parsed = parse_request(tok, body, chat=True, max_model_len=1 << 20)  # then the turn itself
        assert parsed.prompt_ids == ids and tok.cache_info()["misses"] == misses
    # Each turn only encoded its two new messages (plus the few framing segments of the first turn).
    assert tok.cache_info()["misses"] <= 2 * 5 + 4
