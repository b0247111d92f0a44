"""The message-chain hash is a wire contract between SDK and gateway versions: its bytes must not drift, and the
gateway's one-pass chain (prompt hashed at identify, the answer one step more at remember) must name exactly
what hashing the whole conversation names."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from kvtether.gateway.turn import body as B
from kvtether.protocol import contract

MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "Tu es bref. ü — 漢字 \u2028 \x01"},
    {"role": "user", "content": [{"type": "text", "text": "Wetter in Oslo?"}]},
    {"role": "assistant", "content": None, "reasoning_content": "think", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\":\"Oslo\", \"t\": 1.5e-07}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "4C, rain"},
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"t": {"type": "number", "minimum": 1e-07, "maximum": 1e16}}}}}]
RENDERING = {"chat_template_kwargs": {"enable_thinking": False}}


def test_prefix_ids_are_pinned() -> None:
    """Golden values: a change here breaks every deployed SDK's session matching."""
    plain = contract.prefix_chain(MESSAGES, model="m", tools=TOOLS, rendering=RENDERING)
    keyed = contract.prefix_chain(MESSAGES, model="m", tools=TOOLS, rendering=RENDERING, key="tenant-a")
    assert plain == ["56f82aff0e593edb", "9d9930c85874b494", "aba3e565c76cd748", "0b2be5c06f511dfd"]
    assert keyed == ["70315392e22ff210", "b805819e39ace123", "c3647ba48964cb0c", "f4e3f44509001c46"]


def _reference(messages: list[Any], model: str, tools: list[Any] | None) -> list[str]:
    """The algorithm as the module docstring states it, written out independently."""
    def canon(obj: Any) -> bytes:
        return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()

    def b(data: bytes) -> bytes:
        return hashlib.blake2b(data, digest_size=8, key=b"").digest()

    fields = ("role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content", "reasoning")
    h = b(b"kvtether-prefix-v1\0" + canon({"model": model, "tools": tools or [], "rendering": {}}))
    out = []
    for m in messages:
        h = b(h + canon({k: m[k] for k in fields if m.get(k) is not None}))
        out.append(h.hex())
    return out


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool"])},
    optional={"content": st.text() | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text()}),
                                              max_size=3),
              "name": st.text(max_size=10), "tool_call_id": st.text(max_size=10)})


@settings(max_examples=200, deadline=None)
@given(messages=st.lists(_message, min_size=1, max_size=6), tools=st.none() | st.lists(_json, max_size=3))
def test_prefix_chain_is_the_documented_algorithm(messages: list[dict[str, Any]], tools: list[Any] | None) -> None:
    try:
        expected = _reference(messages, "m", tools)
    except UnicodeEncodeError:  # a lone surrogate: neither side can hash it
        return
    assert contract.prefix_chain(messages, model="m", tools=tools) == expected


@settings(max_examples=200, deadline=None)
@given(messages=st.lists(_message, min_size=1, max_size=6), answer=_message)
def test_the_answer_extends_the_prompts_chain_as_rehashing_would(messages: list[dict[str, Any]],
                                                                   answer: dict[str, Any]) -> None:
    body = {"model": "m", "messages": messages, "tools": TOOLS}
    try:
        chain = B.chat_chain(body)
        whole = contract.prefix_chain([B._normal_message(m) for m in [*messages, answer]], model="m",
                                      tools=TOOLS, keep_reasoning=False)
    except UnicodeEncodeError:
        return
    assert chain.prompt.id == whole[-2]
    assert chain.after(answer) == whole[-1]
    # The next turn, sent with that answer in its history, finds this one by its parent key.
    follow = B.chat_chain({**body, "messages": [*messages, answer, {"role": "user", "content": "next"}]})
    if answer["role"] == "assistant":
        assert follow.parent == chain.after(answer)
