"""The recorder: a live agent session appended to a session file re-parses into the same turns."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kvtether.sdk import AgentSession, StampedAsyncOpenAI
from kvtether.sdk.sessionfile import read_sessions

from tests.support.fake_openai import FakeOpenAI, Reply

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
        },
    }
]


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeOpenAI]:
    server = FakeOpenAI().start()
    yield server
    server.stop()


async def agent_turns(client: StampedAsyncOpenAI, messages: list[dict[str, Any]], stream: bool) -> None:
    """A minimal agent loop: call, run tools, append, until a text answer."""
    while True:
        if stream:
            s = await client.chat.completions.create(
                model="m", messages=messages, tools=TOOLS, stream=True, stream_options={"include_usage": True},  # type: ignore[arg-type]
                max_tokens=64,
            )  # fmt: skip
            content, calls = "", {}
            async for chunk in s:
                for ch in chunk.choices:
                    content += ch.delta.content or ""
                    for tc in ch.delta.tool_calls or []:
                        slot = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                        slot["id"] = tc.id or slot["id"]
                        slot["name"] += (tc.function and tc.function.name) or ""
                        slot["arguments"] += (tc.function and tc.function.arguments) or ""
            msg: dict[str, Any] = {"role": "assistant", "content": content or None}
            if calls:
                msg["tool_calls"] = [
                    {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                    for c in calls.values()
                ]
        else:
            out = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=64)  # type: ignore[arg-type]
            msg = out.choices[0].message.model_dump(exclude_none=True)
        messages.append(msg)
        if not msg.get("tool_calls"):
            return
        for call in msg["tool_calls"]:
            args = json.loads(call["function"]["arguments"])
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": str(args["a"] + args["b"])})


@pytest.mark.anyio
@pytest.mark.parametrize("stream", [True, False])
async def test_recorded_session_reparses_into_the_same_turns(fake: FakeOpenAI, tmp_path: Path, stream: bool) -> None:
    fake.reset()
    path = tmp_path / "rec" / "session.jsonl"
    session = AgentSession(record_to=path)
    client = StampedAsyncOpenAI(session=session, base_url=fake.url, api_key="k")
    messages: list[dict[str, Any]] = [{"role": "system", "content": "calc"}, {"role": "user", "content": "1+2?"}]
    fake.script(Reply(tool_calls=[("add", '{"a": 1, "b": 2}')]), Reply(content="It is 3."))
    await agent_turns(client, messages, stream)
    # The user edits history (drops the tool exchange) and asks again: must be recorded whole.
    messages = [messages[0], {"role": "user", "content": "and 2+2?"}]
    fake.script(Reply(content="4"))
    await agent_turns(client, messages, stream)
    session.close()
    await client.close()

    sent = [json.loads(s.raw) for s in fake.chat_requests()]
    assert len(sent) == 3
    lines = path.read_text().splitlines()
    assert len(lines) == 3
    assert all(json.loads(line)["v"] == 1 and json.loads(line)["kind"] == "turn" for line in lines)

    [rec] = read_sessions(path)
    assert rec.session_id == session.id and rec.model == "m" and rec.tools == TOOLS
    t0, t1, t2 = rec.turns
    assert [t.index for t in rec.turns] == [0, 1, 2]
    assert t0.messages is not None and t1.new_messages is not None and t2.messages is not None
    assert len(t1.new_messages) == 1 and t1.new_messages[0]["role"] == "tool"  # only what is new
    rebuilt = [msgs for _, msgs, _ in rec.requests()]
    assert rebuilt == [body["messages"] for body in sent]
    assert all(tools == TOOLS for _, _, tools in rec.requests())
    for turn, body, metrics in zip(rec.turns, sent, session.turns, strict=True):
        assert turn.params["max_tokens"] == 64
        assert turn.params.get("stream", False) == stream == body.get("stream", False)
        assert turn.recorded is not None and turn.recorded.answer == metrics.answer
        assert turn.recorded.e2e_ms is not None and turn.recorded.prompt_tokens is not None
        assert (turn.recorded.ttft_ms is not None) == stream
    assert t0.recorded and t0.recorded.finish_reason == "tool_calls"
    assert t1.recorded and t1.recorded.answer == {"role": "assistant", "content": "It is 3."}
    assert t1.delay_ms >= 0


@pytest.mark.anyio
async def test_failed_and_aborted_calls_are_not_recorded(fake: FakeOpenAI, tmp_path: Path) -> None:
    fake.reset()
    path = tmp_path / "s.jsonl"
    session = AgentSession(record_to=path)
    client = StampedAsyncOpenAI(session=session, base_url=fake.url, api_key="k", max_retries=0)
    fake.script(Reply(fail_first=1), Reply(content="a b c d e f"), Reply(content="fine"))
    with pytest.raises(Exception, match="scripted failure"):
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    fake.replies.popleft()  # the failed reply stays queued (fail_first hit 0): drop it
    stream = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
    async for _ in stream:
        break  # the consumer gives up before the end
    await stream.close()
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    session.close()
    await client.close()
    failed, aborted, ok = session.turns
    assert failed.done and failed.error == "InternalServerError"
    assert aborted.done and aborted.aborted
    assert ok.done and not ok.aborted and ok.error is None
    [rec] = read_sessions(path)
    assert len(rec.turns) == 1 and rec.turns[0].recorded is not None
    assert rec.turns[0].recorded.answer == {"role": "assistant", "content": "fine"}
