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
