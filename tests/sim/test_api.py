"""The OpenAI-shaped HTTP API of one node, including the official openai client."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from kvtether.sim.cluster import SimCluster

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
MSGS = [{"role": "user", "content": "What is the weather in Paris today?"}]


@pytest.fixture
async def node_url() -> AsyncIterator[str]:
    async with SimCluster(prefill=0, decode=0, aggregated=1, speed=200) as c:
        yield c.aggregated_urls[0]


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=20) as h:
        yield h


async def sse(h: httpx.AsyncClient, url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    async with h.stream("POST", url, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = [ln async for ln in r.aiter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    for ln in lines[:-1]:
        assert ln.startswith("data: ")
        out.append(json.loads(ln[6:]))
    return out


@pytest.mark.anyio
async def test_openai_client_chat_stream_and_tools(node_url: str) -> None:
    client = openai.AsyncOpenAI(base_url=node_url + "/v1", api_key="none")
    try:
        models = await client.models.list()
        assert [m.id for m in models.data] == ["kvtether-sim"]
        r = await client.chat.completions.create(model="kvtether-sim", messages=MSGS, temperature=0)
        assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content
        text = ""
        stream = await client.chat.completions.create(model="kvtether-sim", messages=MSGS, temperature=0, stream=True)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
        assert text == r.choices[0].message.content
        t = await client.chat.completions.create(
            model="kvtether-sim", messages=MSGS, tools=TOOLS, tool_choice="required", temperature=0
        )
        assert t.choices[0].finish_reason == "tool_calls"
        call = t.choices[0].message.tool_calls[0]
        assert call.function.name == "get_weather"
        assert "city" in json.loads(call.function.arguments)
    finally:
        await client.close()


@pytest.mark.anyio
async def test_streamed_tool_call_and_token_ids(node_url: str, http: httpx.AsyncClient) -> None:
    body = {"messages": MSGS, "tools": TOOLS, "tool_choice": "required", "temperature": 0, "return_token_ids": True}
    full = (await http.post(node_url + "/v1/chat/completions", json=body)).json()
    chunks = await sse(http, node_url + "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[0]["prompt_token_ids"] == full["prompt_token_ids"]
    ids = [t for ch in chunks if ch["choices"] for t in ch["choices"][0].get("token_ids", [])]
    assert ids == full["choices"][0]["token_ids"]
    calls = [tc for ch in chunks if ch["choices"] for tc in ch["choices"][0]["delta"].get("tool_calls", [])]
    # vLLM's hermes shape: the name first (with id and type, no arguments), then argument fragments only.
    assert calls[0]["id"].startswith("chatcmpl-tool-") and calls[0]["type"] == "function"
    assert calls[0]["function"] == {"name": "get_weather"} and calls[0]["index"] == 0
    assert len(calls) > 2 and all(
        set(c) == {"index", "function"} and set(c["function"]) == {"arguments"} for c in calls[1:]
    )
    want = full["choices"][0]["message"]["tool_calls"][0]["function"]
    assert "".join(c["function"]["arguments"] for c in calls[1:]) == want["arguments"]
    assert [ch["choices"][0]["finish_reason"] for ch in chunks if ch["choices"]][-1] == "tool_calls"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == full["usage"] | {
        "prompt_tokens_details": chunks[-1]["usage"]["prompt_tokens_details"]
    }


@pytest.mark.anyio
async def test_tool_call_cut_by_max_tokens(node_url: str, http: httpx.AsyncClient) -> None:
    url = node_url + "/v1/chat/completions"
    body = {"messages": MSGS, "tools": TOOLS, "tool_choice": "required", "temperature": 0, "return_token_ids": True}
    whole = (await http.post(url, json=body)).json()
    n = whole["usage"]["completion_tokens"]
    want = whole["choices"][0]["message"]["tool_calls"][0]
    cut = {**body, "max_tokens": n - 8}  # inside the arguments: the call never closes
    full = (await http.post(url, json=cut)).json()
    choice = full["choices"][0]
    # Non-streamed, as vLLM's hermes parser: json.loads fails on the cut call, the raw text is the content.
    assert choice["finish_reason"] == "length" and choice["message"]["tool_calls"] == []
    assert choice["message"]["content"].startswith('<tool_call>\n{"name": "get_weather", "arguments": {')
    chunks = await sse(http, url, cut)
    choices = [ch["choices"][0] for ch in chunks if ch["choices"]]
    assert choices[-1]["finish_reason"] == "length"
    assert not any(c["delta"].get("content") for c in choices)
    calls = [tc for c in choices for tc in c["delta"].get("tool_calls", [])]
    # Tool-call ids are drawn from the request (its prompt and seed): the same prompt, the same id.
    assert calls[0]["function"] == {"name": "get_weather"} and calls[0]["id"] == want["id"]
    args = "".join(c["function"].get("arguments", "") for c in calls)
    # What was generated of the arguments streamed: a proper prefix of the whole call's arguments.
    assert args and want["function"]["arguments"].startswith(args) and args != want["function"]["arguments"]
    # The name delta went out well before the end (first tool-call chunk = time to first token).
    first = next(i for i, c in enumerate(choices) if c["delta"].get("tool_calls"))
    assert first < len(choices) - 3


@pytest.mark.anyio
async def test_sampling_limits(node_url: str, http: httpx.AsyncClient) -> None:
    url = node_url + "/v1/chat/completions"
    base = {"messages": MSGS, "temperature": 0}
    free = (await http.post(url, json=base)).json()
    n = free["usage"]["completion_tokens"]
    short = (await http.post(url, json={**base, "max_tokens": 3})).json()
    assert short["choices"][0]["finish_reason"] == "length" and short["usage"]["completion_tokens"] == 3
    longer = (await http.post(url, json={**base, "min_tokens": n + 10})).json()
    assert longer["usage"]["completion_tokens"] == n + 11 and longer["choices"][0]["finish_reason"] == "stop"
    forever = (await http.post(url, json={**base, "ignore_eos": True, "max_completion_tokens": n + 30})).json()
    assert forever["usage"]["completion_tokens"] == n + 30
    words = free["choices"][0]["message"]["content"].split()
    stop = words[3]
    cut = (await http.post(url, json={**base, "stop": [stop]})).json()
    assert cut["choices"][0]["finish_reason"] == "stop" and cut["choices"][0]["stop_reason"] == stop
    assert stop not in cut["choices"][0]["message"]["content"]
    assert free["choices"][0]["message"]["content"].startswith(cut["choices"][0]["message"]["content"])
    streamed = await sse(http, url, {**base, "stop": [stop]})
    text = "".join(ch["choices"][0]["delta"].get("content", "") for ch in streamed if ch["choices"])
    assert text == cut["choices"][0]["message"]["content"]
    seeded = [(await http.post(url, json={"messages": MSGS, "temperature": 0.7, "seed": 3})).json() for _ in range(2)]
    assert seeded[0]["choices"][0]["message"]["content"] == seeded[1]["choices"][0]["message"]["content"]


@pytest.mark.anyio
async def test_reasoning_is_split(node_url: str, http: httpx.AsyncClient) -> None:
    body = {"messages": MSGS, "temperature": 0, "chat_template_kwargs": {"enable_thinking": True}}
    r = (await http.post(node_url + "/v1/chat/completions", json=body)).json()
    msg = r["choices"][0]["message"]
    assert msg["reasoning_content"] and msg["content"] and "<think>" not in msg["content"]


@pytest.mark.anyio
async def test_errors_are_openai_shaped(node_url: str, http: httpx.AsyncClient) -> None:
    url = node_url + "/v1/chat/completions"
    for body in (
        {"messages": MSGS, "n": 2},
        {"messages": []},
        {"messages": MSGS, "max_tokens": "x"},
        {"messages": MSGS, "tool_choice": "required"},
        {"messages": MSGS, "max_tokens": 10**9},
    ):
        r = await http.post(url, json=body)
        assert r.status_code == 400, body
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == 400
    assert (await http.post(url, content=b"{not json")).status_code == 400
    assert (await http.post(url, json={"model": "other", "messages": MSGS})).status_code == 404
    ok = await http.post(url, json={"messages": MSGS, "max_tokens": 2, "some_future_field": {"x": 1}})
    assert ok.status_code == 200


@pytest.mark.anyio
async def test_tokenize_detokenize_and_info(node_url: str, http: httpx.AsyncClient) -> None:
    chat = (
        await http.post(node_url + "/v1/chat/completions", json={"messages": MSGS, "return_token_ids": True})
    ).json()
    tok = (await http.post(node_url + "/tokenize", json={"messages": MSGS, "add_generation_prompt": True})).json()
    assert tok["tokens"] == chat["prompt_token_ids"] and tok["count"] == len(tok["tokens"]) and tok["max_model_len"] > 0
    plain = (await http.post(node_url + "/tokenize", json={"prompt": "hello world"})).json()
    back = (await http.post(node_url + "/detokenize", json={"tokens": plain["tokens"]})).json()
    assert back["prompt"] == "hello world"
    # As vLLM's: a model other than the served one is refused on /tokenize and /detokenize too, naming it.
    for path, body in (("/tokenize", {"prompt": "hello"}), ("/detokenize", {"tokens": plain["tokens"]})):
        other = await http.post(node_url + path, json={**body, "model": "other"})
        assert other.status_code == 404 and other.json()["error"]["type"] == "NotFoundError", path
        assert other.json()["error"]["message"] == "The model `other` does not exist. Valid aliases: kvtether-sim."
    assert (await http.get(node_url + "/health")).status_code == 200
    assert (await http.get(node_url + "/version")).json() == {"version": "0.33.0"}
    metrics = (await http.get(node_url + "/metrics")).text
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        'vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="kvtether-sim",source="device"}',
        'vllm:cache_config_info{block_size="16"',
    ):
        assert name in metrics, name


@pytest.mark.anyio
async def test_text_completions(node_url: str, http: httpx.AsyncClient) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "return_token_ids": True}
    r = (await http.post(node_url + "/v1/completions", json=body)).json()
    assert r["object"] == "text_completion" and len(r["choices"][0]["token_ids"]) == 12
    chunks = await sse(http, node_url + "/v1/completions", body)
    assert "".join(ch["choices"][0]["text"] for ch in chunks if ch["choices"]) == r["choices"][0]["text"]


@pytest.mark.anyio
async def test_admin_faults(node_url: str, http: httpx.AsyncClient) -> None:
    url = node_url + "/v1/chat/completions"
    state = (await http.post(node_url + "/admin/fault", json={"fail_next": 1})).json()
    assert state["fail_next"] == 1
    assert (await http.post(url, json={"messages": MSGS})).status_code == 500
    assert (await http.post(url, json={"messages": MSGS, "max_tokens": 2})).status_code == 200
    await http.post(node_url + "/admin/fault", json={"hang_next": 1})
    with pytest.raises(httpx.ReadTimeout):
        await http.post(url, json={"messages": MSGS}, timeout=0.3)
    assert (await http.post(url, json={"messages": MSGS, "max_tokens": 2})).status_code == 200
    slow = (await http.post(node_url + "/admin/fault", json={"slow_factor": 2.0, "drop_retained": True})).json()
    assert slow["slow_factor"] == 2.0 and slow["dropped"] == 0


@pytest.mark.anyio
async def test_cache_salt_isolates_the_prefix_cache(node_url: str, http: httpx.AsyncClient) -> None:
    url = node_url + "/v1/completions"
    body = {"prompt": "The gateway restarted twice during the night and the cache was cold. " * 8, "max_tokens": 4}
    body["temperature"] = 0

    async def run(**kw: Any) -> tuple[int, str]:
        r = (await http.post(url, json={**body, **kw})).json()
        return r["usage"]["prompt_tokens_details"]["cached_tokens"], r["choices"][0]["text"]

    cold = await run()
    warm = await run()
    salted = await run(cache_salt="a")
    salted_again = await run(cache_salt="a")
    other = await run(cache_salt="b")
    assert warm[0] > 0 and salted[0] == 0 and salted_again[0] > 0 and other[0] == 0
    assert cold[1] == warm[1] == salted[1] == salted_again[1] == other[1]  # the salt never changes the answer
    bad = await http.post(url, json={**body, "cache_salt": ""})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"


@pytest.mark.anyio
async def test_a_stream_sends_nothing_before_the_first_token(node_url: str, http: httpx.AsyncClient) -> None:
    # vLLM's serving_chat sends the role chunk with the first engine output, so the first chunk marks the
    # first token (what `vllm bench serve` times as TTFT). A request that never produces one (parked by
    # the hang fault) streams its headers and nothing else.
    await http.post(node_url + "/admin/fault", json={"hang_next": 1})
    body = {"messages": MSGS, "stream": True}
    async with http.stream("POST", node_url + "/v1/chat/completions", json=body,
                           timeout=httpx.Timeout(5.0, read=0.5)) as r:
        assert r.status_code == 200
        got: list[str] = []
        with pytest.raises(httpx.ReadTimeout):
            async for line in r.aiter_lines():
                if line:
                    got.append(line)
        assert got == []
    chunks = await sse(http, node_url + "/v1/chat/completions", body)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert any(ch["choices"] and ch["choices"][0]["delta"].get("content") for ch in chunks[1:])


@pytest.mark.anyio
async def test_glm47_node_streams_and_returns_glm_tool_calls(http: httpx.AsyncClient) -> None:
    """A node serving GLM-5's format (--tool-call-parser glm47): same OpenAI shapes, GLM's tokens."""
    async with SimCluster(prefill=0, decode=0, aggregated=1, speed=200, tool_call_parser="glm47") as c:
        url = c.aggregated_urls[0] + "/v1/chat/completions"
        body = {"messages": MSGS, "tools": TOOLS, "tool_choice": "required", "temperature": 0,
                "return_token_ids": True}
        full = (await http.post(url, json=body)).json()
        choice = full["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        call = choice["message"]["tool_calls"][0]
        assert call["function"]["name"] == "get_weather" and "city" in json.loads(call["function"]["arguments"])
        # What the model generated is GLM's layout: the name right after <tool_call>, then the tags.
        text = (await http.post(c.aggregated_urls[0] + "/detokenize",
                                json={"tokens": choice["token_ids"]})).json()["prompt"]
        assert text.startswith("<tool_call>get_weather<arg_key>city</arg_key><arg_value>")
        chunks = await sse(http, url, body)
        calls = [tc for ch in chunks if ch["choices"] for tc in ch["choices"][0]["delta"].get("tool_calls", [])]
        assert calls[0]["function"] == {"name": "get_weather"} and calls[0]["type"] == "function"
        assert "".join(x["function"].get("arguments", "") for x in calls[1:]) == call["function"]["arguments"]
        # The client sends the call back: /tokenize renders it to the generated ids (the guard's prefix check).
        msgs = [*MSGS, {"role": "assistant", "content": None, "tool_calls": [call]}]
        ids = (await http.post(c.aggregated_urls[0] + "/tokenize",
                               json={"messages": msgs, "tools": TOOLS, "add_generation_prompt": False})).json()
        held = full["prompt_token_ids"] + choice["token_ids"]  # prompt + answer + eos (<|im_end|>)
        assert ids["tokens"][: len(held)] == held


def test_the_glm5_preset_serves_glm47_tool_calls_and_the_others_hermes() -> None:
    from kvtether.sim.config import NodeConfig
    from kvtether.sim.node import SimNode

    assert SimNode(NodeConfig(preset="glm-5-fp8-h200-tp8")).tool_format == "glm47"
    assert SimNode(NodeConfig(preset="qwen3-32b-h200-tp8")).tool_format == "hermes"
    assert SimNode(NodeConfig(preset="glm-5-fp8-h200-tp8", tool_call_parser="hermes")).tool_format == "hermes"
    with pytest.raises(ValueError, match="tool_call_parser"):
        NodeConfig(tool_call_parser="pythonic").validate()


@pytest.mark.anyio
async def test_callable_tools_limit_what_the_model_calls_not_what_the_prompt_offers(http: httpx.AsyncClient) -> None:
    """NodeConfig.callable_tools (the agent runs' knob): every tool offered is still rendered into the prompt,
    but the model only ever calls the ones named; with none of them offered it answers in text."""
    shell = {"type": "function", "function": {"name": "exec_command", "parameters": {
        "type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}}
    async with SimCluster(prefill=0, decode=0, aggregated=1, speed=200, callable_tools=("get_weather",)) as c, \
            SimCluster(prefill=0, decode=0, aggregated=1, speed=200) as free:
        node = c.aggregated_urls[0]
        body = {"messages": MSGS, "tools": [shell, *TOOLS]}
        ids = [(await http.post(f"{u}/tokenize", json=body)).json()["tokens"] for u in (node, free.aggregated_urls[0])]
        assert ids[0] == ids[1]
        called = set()
        for seed in range(12):
            got = (await http.post(f"{node}/v1/chat/completions",
                                   json={**body, "tool_choice": "required", "seed": seed})).json()
            called.update(t["function"]["name"] for t in got["choices"][0]["message"].get("tool_calls") or ())
        assert called == {"get_weather"}
        only_shell = (await http.post(f"{node}/v1/chat/completions",
                                      json={**body, "tools": [shell], "tool_choice": "required"})).json()
        message = only_shell["choices"][0]["message"]
        assert not message.get("tool_calls") and message["content"]
