"""Stamped anthropic clients (``StampedAsyncAnthropic``, ``StampedAnthropic``, ``session.wrap``) against a real
local HTTP server speaking Anthropic Messages. Skipped without the ``anthropic`` extra, except the test that
``kvtether.sdk`` imports without it."""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from kvtether.protocol import contract
from kvtether.sdk import AgentSession
from kvtether.sdk.sessionfile import read_sessions
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.support.fake_openai import FakeOpenAI, Reply, Seen

try:
    import anthropic
except ImportError:  # the extra is optional: only the lazy-import test runs without it
    anthropic = None

needs_anthropic = pytest.mark.skipif(anthropic is None, reason="the anthropic extra is not installed")

STAMPS = (contract.SESSION_HEADER, contract.TURN_HEADER, contract.PREFIX_HEADER, contract.PREFIX_PARENT_HEADER)
SYSTEM = "You are terse."
TOOLS: list[Any] = [
    {
        "name": "get_weather",
        "description": "Weather for a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]


class FakeAnthropic(FakeOpenAI):
    """The fake server of the openai tests, serving Anthropic Messages (streamed and not) and the session end."""

    def app(self) -> Starlette:
        return Starlette(routes=[
            Route("/v1/messages", self._messages, methods=["POST"]),
            Route("/v1/sessions/{session_id}", self._end, methods=["DELETE"]),
        ])

    def messages_requests(self) -> list[Seen]:
        return [s for s in self.seen if s.path == "/v1/messages"]

    async def _end(self, request: Request) -> Response:
        self.seen.append(Seen(dict(request.headers), b"", 204, request.url.path))
        return Response(status_code=204)

    async def _messages(self, request: Request) -> Response:
        raw = await request.body()
        headers = {k.lower(): v for k, v in request.headers.items()}
        reply = self.replies[0] if self.replies else None
        if reply is not None and reply.fail_first > 0:
            reply.fail_first -= 1
            self.seen.append(Seen(headers, raw, 529, request.url.path))
            error = {"type": "error", "error": {"type": "overloaded_error", "message": "scripted"}}
            return JSONResponse(error, status_code=529, headers={"retry-after-ms": "5", "x-should-retry": "true"})
        if reply is not None:
            self.replies.popleft()
        self.seen.append(Seen(headers, raw, 200, request.url.path))
        body = json.loads(raw)
        reply = reply or _auto_reply(body)
        n = next(self._ids)
        rid = {"request-id": f"req_{n}"}
        if body.get("stream"):
            return StreamingResponse(_events(reply, n, body), media_type="text/event-stream", headers=rid)
        return JSONResponse(_message(reply, n, body, done=True), headers=rid)


def _auto_reply(body: dict[str, Any]) -> Reply:
    last = (body.get("messages") or [{}])[-1]
    content = last.get("content")
    blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content or []
    results = [b for b in blocks if b.get("type") == "tool_result"]
    if results:
        return Reply(content=f"Done: {results[0].get('content')}")
    if body.get("tools"):
        return Reply(tool_calls=[(body["tools"][0]["name"], json.dumps({"city": "x"}))])
    return Reply(content="echo " + "".join(b.get("text", "") for b in blocks))


def _blocks(reply: Reply, n: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if reply.reasoning:
        out.append({"type": "thinking", "thinking": reply.reasoning, "signature": "sig"})
    if reply.content is not None:
        out.append({"type": "text", "text": reply.content})
    for i, (name, args) in enumerate(reply.tool_calls or []):
        out.append({"type": "tool_use", "id": f"toolu_{n}_{i}", "name": name, "input": json.loads(args)})
    return out


def _usage(body: dict[str, Any], reply: Reply) -> dict[str, int]:
    # Like Anthropic (and the gateway): input_tokens besides the cached ones.
    return {"input_tokens": 7, "cache_read_input_tokens": 30, "cache_creation_input_tokens": 0,
            "output_tokens": len((reply.content or "").split()) + 8 * len(reply.tool_calls or [])}


def _message(reply: Reply, n: int, body: dict[str, Any], *, done: bool) -> dict[str, Any]:
    stop = "tool_use" if reply.tool_calls else "end_turn"
    usage = _usage(body, reply) if done else {**_usage(body, reply), "output_tokens": 1}
    return {"id": f"msg_{n}", "type": "message", "role": "assistant", "model": body.get("model"),
            "content": _blocks(reply, n) if done else [], "stop_reason": stop if done else None,
            "stop_sequence": None, "usage": usage}


async def _events(reply: Reply, n: int, body: dict[str, Any]) -> AsyncIterator[bytes]:
    def event(kind: str, **fields: Any) -> bytes:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n".encode()

    yield event("message_start", message=_message(reply, n, body, done=False))
    yield event("ping")
    if reply.first_token_delay_s:
        await asyncio.sleep(reply.first_token_delay_s)
    for index, block in enumerate(_blocks(reply, n)):
        if block["type"] == "thinking":
            yield event("content_block_start", index=index, content_block={"type": "thinking", "thinking": ""})
            for word in block["thinking"].split():
                yield event("content_block_delta", index=index, delta={"type": "thinking_delta", "thinking": word})
            yield event("content_block_delta", index=index, delta={"type": "signature_delta", "signature": "sig"})
        elif block["type"] == "text":
            yield event("content_block_start", index=index, content_block={"type": "text", "text": ""})
            for i, word in enumerate(block["text"].split(" ")):
                yield event("content_block_delta", index=index,
                            delta={"type": "text_delta", "text": word if i == 0 else " " + word})
                await asyncio.sleep(0)
        else:
            yield event("content_block_start", index=index, content_block={**block, "input": {}})
            args = json.dumps(block["input"])
            for j in range(0, len(args), 5):
                yield event("content_block_delta", index=index,
                            delta={"type": "input_json_delta", "partial_json": args[j : j + 5]})
        yield event("content_block_stop", index=index)
    done = _message(reply, n, body, done=True)
    yield event("message_delta", delta={"stop_reason": done["stop_reason"], "stop_sequence": None},
                usage={"output_tokens": done["usage"]["output_tokens"]})
    yield event("message_stop")


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeAnthropic]:
    server = FakeAnthropic().start()
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def _clean(fake: FakeAnthropic) -> None:
    fake.reset()


def root(fake: FakeAnthropic) -> str:
    """Anthropic clients take the server root: their paths start with /v1."""
    return fake.url.removesuffix("/v1")


def stamps_of(seen: Seen) -> dict[str, str]:
    return {k: seen.headers[k] for k in STAMPS if k in seen.headers}


def gateway_view(body: dict[str, Any], key: str | bytes | None = None) -> dict[str, str]:
    return contract.stamps_for_messages_body(body, key=key).headers()


def prefix_of(body: dict[str, Any], n_messages: int) -> str | None:
    return contract.stamps_for_messages_body({**body, "messages": body["messages"][:n_messages]}).prefix


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def cached(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The history with a cache_control marker on the newest message only, as Claude Code sends it."""
    *head, last = messages
    content = last["content"]
    blocks = [{"type": "text", "text": content}] if isinstance(content, str) else list(content)
    blocks[-1] = {**blocks[-1], "cache_control": {"type": "ephemeral"}}
    return [*head, {**last, "content": blocks}]


def test_kvtether_sdk_imports_without_anthropic() -> None:
    code = (
        "import sys\n"
        "sys.modules['anthropic'] = None  # as if the extra were not installed\n"
        "import kvtether.sdk as sdk\n"
        "from kvtether.sdk import AgentSession, StampedAsyncOpenAI\n"
        "AgentSession()\n"
        "try:\n"
        "    sdk.StampedAsyncAnthropic\n"
        "except ImportError as e:\n"
        "    print('ImportError', 'kvtether[anthropic]' in str(e))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "ImportError True"
    plain = "import sys, kvtether.sdk as s; s.AgentSession; s.StampedAsyncOpenAI; print('anthropic' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", plain], capture_output=True, text=True, check=True).stdout == "False\n"


@needs_anthropic
@pytest.mark.anyio
async def test_tool_loop_turns_prefixes_and_metrics(fake: FakeAnthropic) -> None:
    from kvtether.sdk import StampedAsyncAnthropic

    session = AgentSession(tenant_key=b"k2")
    client = StampedAsyncAnthropic(session=session, base_url=root(fake), api_key="k")
    assert isinstance(client, anthropic.AsyncAnthropic)
    messages: list[dict[str, Any]] = [user("Weather in Oslo?")]
    system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=aaaa;"},
              {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    first = await client.messages.create(model="m", max_tokens=64, system=system, tools=TOOLS,
                                         messages=cached(messages))
    [tool_use] = [b for b in first.content if b.type == "tool_use"]
    # The SDK's own content objects go back into the history, as agent loops do.
    messages += [{"role": "assistant", "content": first.content},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use.id, "content": "4C"}]}]
    # Claude Code's billing block changes every request: it must not change the prefix.
    system[0] = {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=bbbb;"}
    second = await client.messages.create(model="m", max_tokens=64, system=system, tools=TOOLS,
                                          messages=cached(messages))
    assert second.content[0].type == "text" and second.content[0].text == "Done: 4C"
    messages += [{"role": "assistant", "content": second.content}, user("And Bergen?")]
    await client.messages.create(model="m", max_tokens=64, system=system, tools=TOOLS, messages=cached(messages))

    seen = fake.messages_requests()
    assert [s.headers[contract.SESSION_HEADER] for s in seen] == [session.id] * 3
    assert [s.headers[contract.TURN_HEADER] for s in seen] == ["0", "1", "2"]
    for s in seen:
        assert stamps_of(s) == {contract.SESSION_HEADER: session.id, **gateway_view(s.body, key=b"k2")}
    # The cache_control marker moved to the newest message and the billing block changed: the earlier
    # prompt is still the start of the later one.
    for before, after in itertools.pairwise(seen):
        kept = {**after.body, "messages": after.body["messages"][: len(before.body["messages"])]}
        assert contract.stamps_for_messages_body(kept, key=b"k2").prefix == before.headers[contract.PREFIX_HEADER]
    body = seen[2].body
    parent = contract.stamps_for_messages_body({**body, "messages": body["messages"][:-1]}, key=b"k2").prefix
    assert seen[2].headers[contract.PREFIX_PARENT_HEADER] == parent

    t0, t1, t2 = session.turns
    assert [(t.api, t.turn, t.done) for t in session.turns] == [("messages", 0, True), ("messages", 1, True),
                                                               ("messages", 2, True)]
    assert t0.finish_reason == "tool_calls" and t0.answer is not None
    assert t0.answer["tool_calls"] == [{"id": tool_use.id, "type": "function",
                                        "function": {"name": "get_weather", "arguments": '{"city": "x"}'}}]
    assert t1.answer == {"role": "assistant", "content": "Done: 4C"} and t1.finish_reason == "stop"
    # Anthropic's input_tokens excludes the cached ones: the prompt is their sum.
    assert (t1.prompt_tokens, t1.cached_tokens, t1.completion_tokens) == (37, 30, 2)
    assert t2.request_id is not None and t2.request_id.startswith("req_")
    await client.close()


def test_edited_history_changes_the_prefix() -> None:
    messages: list[Any] = [user("Weather in Oslo?"),
                           {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather",
                                                              "input": {"city": "Oslo"}}]},
                           {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                         "content": "4C"}]}]
    body = {"model": "m", "system": SYSTEM, "messages": messages, "tools": TOOLS}
    base = contract.stamps_for_messages_body(body)
    assert base.turn == 1 and base.parent == prefix_of(body, 2)

    def prefix(**changes: Any) -> str | None:
        return contract.stamps_for_messages_body({**body, **changes}).prefix

    assert prefix(messages=[user("Weather in Bergen?"), *messages[1:]]) != base.prefix
    assert prefix(system="You are verbose.") != base.prefix
    assert prefix(tools=[]) != base.prefix
    assert prefix(thinking={"type": "enabled", "budget_tokens": 1024}) != base.prefix
    assert prefix(messages=cached(messages)) == base.prefix
    assert prefix(system=[{"type": "text", "text": "x-anthropic-billing-header: cch=1;"},
                          {"type": "text", "text": SYSTEM}]) == contract.stamps_for_messages_body(
        {**body, "system": [{"type": "text", "text": SYSTEM}]}).prefix
    assert prefix(max_tokens=5, temperature=0.5, metadata={"user_id": "u"}) == base.prefix
    # A Messages chain never equals the chat chain of the same text.
    assert contract.stamps_for_messages_body({"model": "m", "messages": [user("hi")]}).prefix != \
        contract.stamps_for_body({"model": "m", "messages": [user("hi")]}).prefix


@needs_anthropic
@pytest.mark.anyio
async def test_messages_stream_ttft_answer_and_retry(fake: FakeAnthropic) -> None:
    from kvtether.sdk import StampedAsyncAnthropic

    session = AgentSession()
    client = StampedAsyncAnthropic(session=session, base_url=root(fake), api_key="k", max_retries=2)
    fake.script(Reply(content="It is 4C and raining.", reasoning="look it up", first_token_delay_s=0.2,
                      fail_first=1))
    async with client.messages.stream(model="m", max_tokens=64, messages=[user("Weather in Oslo?")]) as stream:
        text = [t async for t in stream.text_stream]
        final = await stream.get_final_message()
    assert "".join(text) == "It is 4C and raining." and final.stop_reason == "end_turn"
    failed, ok = fake.messages_requests()
    assert (failed.status, ok.status) == (529, 200)
    assert stamps_of(failed) == stamps_of(ok) == {contract.SESSION_HEADER: session.id, **gateway_view(ok.body)}
    [turn] = session.turns
    assert turn.done and not turn.aborted and turn.stream and turn.attempts == 2 and turn.api == "messages"
    # TTFC is message_start (before the pause); TTFT the first content_block_delta after it.
    assert turn.ttfc_ms is not None and turn.ttft_ms is not None and turn.ttft_ms - turn.ttfc_ms >= 150
    assert turn.answer == {"role": "assistant", "content": "It is 4C and raining.", "reasoning": "lookitup"}
    assert turn.finish_reason == "stop" and (turn.prompt_tokens, turn.completion_tokens) == (37, 5)
    await client.close()


@needs_anthropic
def test_sync_wrap_stream_record_and_session_end(fake: FakeAnthropic, tmp_path: Path) -> None:
    session = AgentSession(record_to=tmp_path / "a.jsonl")
    base = anthropic.Anthropic(base_url=root(fake), api_key="k")
    client = session.wrap(base)
    assert isinstance(client, anthropic.Anthropic) and client.session is session  # type: ignore[attr-defined]
    messages: list[Any] = [user("Weather in Oslo?")]
    stream = client.messages.create(model="m", max_tokens=64, system=SYSTEM, tools=TOOLS, messages=messages,
                                    stream=True)
    kinds = [event.type for event in stream]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    first = session.turns[0]
    assert first.done and first.ttft_ms is not None and first.finish_reason == "tool_calls"
    assert first.answer is not None
    [call] = first.answer["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "x"}'}
    messages += [{"role": "assistant", "content": [{"type": "tool_use", "id": call["id"], "name": "get_weather",
                                                    "input": {"city": "x"}}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call["id"], "content": "4C"}]}]
    out = client.messages.create(model="m", max_tokens=64, system=SYSTEM, tools=TOOLS, messages=messages)
    assert out.content[0].type == "text" and out.content[0].text == "Done: 4C"
    client.messages.count_tokens  # noqa: B018 - resources other than messages.create stay untouched
    assert [t.turn for t in session.turns] == [0, 1]

    # Recorded as the chat turns they stand for; the second extends the first by the tool result.
    [record] = list(read_sessions(tmp_path / "a.jsonl"))
    t0, t1 = record.turns
    assert t0.messages == [{"role": "system", "content": SYSTEM}, user("Weather in Oslo?")]
    assert t0.params == {"max_tokens": 64, "stream": True, "tool_choice": "auto",
                         "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    assert t1.new_messages == [{"role": "tool", "tool_call_id": call["id"], "content": "4C"}]
    assert record.tools == [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city", "parameters": TOOLS[0]["input_schema"]}}]

    # The session's end goes to the gateway's /v1/sessions/{id}, through the client stamping for it.
    session.close()
    [end] = [s for s in fake.seen if s.path.startswith("/v1/sessions/")]
    assert end.path == f"/v1/sessions/{session.id}" and end.headers[contract.SESSION_HEADER] == session.id
    base.close()
