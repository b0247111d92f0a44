"""Property: no request body or header makes the gateway answer 5xx, break a stream or take a node out.

Hypothesis builds requests around a valid chat or completion body — fields replaced by arbitrary JSON,
messages and tools of arbitrary shape, odd session headers — and sends each to a gateway in front of the
simulator. Every answer must be a 2xx or an OpenAI-shaped 4xx, and the cluster must be as healthy after as
before (benchmarks/fuzz_gateway.py runs the same idea at scale, with malformed bytes too).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from anyio.from_thread import start_blocking_portal
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.gateway_agent import MODEL
from tests.support.sim_rig import Rig, rig

FIELDS = ["model", "messages", "stream", "max_tokens", "max_completion_tokens", "min_tokens", "temperature",
          "top_p", "top_k", "n", "tools", "tool_choice", "stop", "seed", "logprobs", "top_logprobs",
          "return_token_ids", "stream_options", "response_format", "chat_template_kwargs", "presence_penalty",
          "kv_transfer_params", "prompt", "ignore_eos", "add_generation_prompt"]
ROLES = ["system", "user", "assistant", "tool", "developer", "function", "wizard", ""]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8)
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(ROLES)},
    optional={"content": st.text(max_size=30) | json_values, "tool_calls": json_values,
              "name": json_values, "tool_call_id": json_values}), min_size=0, max_size=4)


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, dict[str, Any], dict[str, str]]:
    chat = draw(st.booleans())
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 8}
    if chat:
        body["messages"] = [{"role": "user", "content": "hello there"}]
    else:
        body["prompt"] = "Once upon a time"
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=4, unique=True)):
        if draw(st.booleans()) and name in body:
            del body[name]
        elif name == "messages":
            body[name] = draw(messages)
        else:
            body[name] = draw(json_values)
    headers = draw(st.dictionaries(st.sampled_from(["x-session-id", "x-kvtether-turn", "x-kvtether-prefix",
                                                    "x-correlation-id"]),
                                   st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126),
                                           max_size=300), max_size=2))
    return ("/v1/chat/completions" if chat else "/v1/completions"), body, headers


@pytest.fixture(scope="module")
def live() -> Iterator[Rig]:
    with start_blocking_portal() as portal, portal.wrap_async_context_manager(
            rig(prefill=1, decode=1, policy="auto", min_reuse_tokens=4)) as r:
        yield r


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(req=requests())
def test_no_request_makes_the_gateway_fail(live: Rig, req: tuple[str, dict[str, Any], dict[str, str]]) -> None:
    path, body, headers = req
    with httpx.Client(timeout=30) as client:
        resp = client.post(f"{live.url}{path}", content=json.dumps(body), headers=headers)
        text = resp.text
    assert resp.status_code < 500, (resp.status_code, text, body)
    if resp.status_code >= 400:
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
    else:
        assert "upstream_error" not in text and "kv_transfer_params" not in text, text[:500]
    nodes = live.gw.cluster.nodes.values()
    assert all(n.healthy for n in nodes), [(n.url, n.last_error) for n in nodes]


def test_the_fuzz_script_finds_no_5xx_reset_or_hang() -> None:
    """benchmarks/fuzz_gateway.py at a smaller scale (its default is 600 requests): malformed bytes, deep JSON,
    huge prompts and odd headers included."""
    import argparse

    import anyio

    from tests.support.benchmark_scripts import load

    fuzz = load("fuzz_gateway")
    args = argparse.Namespace(requests=150, seed=7, concurrency=8, timeout_s=30.0)
    assert anyio.run(fuzz.run, args) == 0


RESPONSES_FIELDS = ["model", "input", "instructions", "stream", "max_output_tokens", "temperature", "tools",
                    "tool_choice", "reasoning", "include", "text", "store", "previous_response_id", "conversation",
                    "prompt_cache_key", "truncation", "background", "kv_transfer_params", "chat_template_kwargs",
                    "parallel_tool_calls", "metadata"]
ITEM_TYPES = ["message", "reasoning", "function_call", "function_call_output", "custom_tool_call",
              "custom_tool_call_output", "web_search_call", "item_reference", ""]
items = st.lists(st.fixed_dictionaries(
    {"type": st.sampled_from(ITEM_TYPES)},
    optional={"role": st.sampled_from(ROLES), "content": st.text(max_size=20) | json_values,
              "call_id": json_values, "name": json_values, "arguments": json_values, "output": json_values,
              "summary": json_values, "encrypted_content": json_values, "namespace": json_values,
              "status": json_values}), min_size=0, max_size=4)
# Function-like and hosted tool types (dropped by default), and tool choices that name them or need a tool.
TOOL_TYPES = ["function", "custom", "namespace", "web_search", "web_search_preview", "file_search", "mcp",
              "code_interpreter", "local_shell", "image_generation", "computer_use_preview", "tool_search", ""]
tools = st.lists(st.fixed_dictionaries(
    {"type": st.sampled_from(TOOL_TYPES)},
    optional={"name": st.sampled_from(["f", "g", ""]) | json_values, "parameters": json_values,
              "tools": json_values, "format": json_values}), min_size=0, max_size=3)
tool_choices = st.sampled_from(["auto", "none", "required", {"type": "web_search"}, {"type": "file_search"},
                                {"type": "function", "name": "f"}, {"type": "mcp", "server_label": "x"}])


@st.composite
def responses_requests(draw: st.DrawFn) -> tuple[dict[str, Any], dict[str, str]]:
    body: dict[str, Any] = {"model": MODEL, "max_output_tokens": 8, "input": "hello there"}
    for name in draw(st.lists(st.sampled_from(RESPONSES_FIELDS), max_size=4, unique=True)):
        if draw(st.booleans()) and name in body:
            del body[name]
        elif name == "input":
            body[name] = draw(items)
        elif name == "tools":
            body[name] = draw(tools | json_values)
        elif name == "tool_choice":
            body[name] = draw(tool_choices | json_values)
        else:
            body[name] = draw(json_values)
    headers = draw(st.dictionaries(st.sampled_from(["thread-id", "session-id", "x-codex-turn-metadata",
                                                    "x-session-id"]),
                                   st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126),
                                           max_size=80), max_size=2))
    return body, headers


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(req=responses_requests())
def test_no_responses_request_makes_the_gateway_fail(live: Rig, req: tuple[dict[str, Any], dict[str, str]]) -> None:
    """The same property on /v1/responses: its translation, state lookups and stream conversion."""
    body, headers = req
    with httpx.Client(timeout=30) as client:
        resp = client.post(f"{live.url}/v1/responses", content=json.dumps(body), headers=headers)
        text = resp.text
    assert resp.status_code < 500, (resp.status_code, text, body)
    if resp.status_code >= 400:
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
    else:
        assert "kv_transfer_params" not in text, text[:500]
    nodes = live.gw.cluster.nodes.values()
    assert all(n.healthy for n in nodes), [(n.url, n.last_error) for n in nodes]
