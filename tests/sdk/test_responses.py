"""Stamped openai clients on the Responses API (``responses.create``, streamed and not, and the OpenAI Agents
SDK's default model) against a real local HTTP server. Runs on openai 3.x and, via scripts/test-openai1.sh, on
openai 1.x (which has the Responses API); the Agents SDK tests need openai-agents (openai 3.x)."""

from __future__ import annotations

import gc
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio.lowlevel
import openai
import pytest
from kvtether.protocol import contract
from kvtether.sdk import AgentSession, StampedAsyncOpenAI, StampedOpenAI
from kvtether.sdk.sessionfile import read_sessions

from tests.support.fake_openai import FakeOpenAI, Reply

STAMPS = (contract.SESSION_HEADER, contract.TURN_HEADER, contract.PREFIX_HEADER, contract.PREFIX_PARENT_HEADER)

TOOLS: list[Any] = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        "strict": False,
    }
]
INSTRUCTIONS = "You are terse."


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeOpenAI]:
    server = FakeOpenAI().start()
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def _clean(fake: FakeOpenAI) -> None:
    fake.reset()


def stamps_of(seen: Any) -> dict[str, str]:
    return {k: seen.headers[k] for k in STAMPS if k in seen.headers}


def gateway_view(body: dict[str, Any], key: str | bytes | None = None) -> dict[str, str]:
    """What a gateway recomputes from a Responses body."""
    return contract.stamps_for_responses_body(body, key=key).headers()


def prefix_of(body: dict[str, Any], n_items: int) -> str | None:
    """The prefix hash of the body's first ``n_items`` input items (with the same seed and instructions)."""
    return contract.stamps_for_responses_body({**body, "input": body["input"][:n_items]}).prefix


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def output_items(response: Any) -> list[dict[str, Any]]:
    """The response's output as the next request resends it (what agent loops do)."""
    return [item.model_dump(exclude_none=True) for item in response.output]


def call_id(response: Any) -> str:
    [call] = [item for item in response.output if item.type == "function_call"]
    return str(call.call_id)


@pytest.mark.anyio
async def test_tool_loop_turns_prefixes_and_metrics(fake: FakeOpenAI) -> None:
    session = AgentSession(tenant_key="k1")
    client = StampedAsyncOpenAI(session=session, base_url=fake.url, api_key="k")
    items: list[Any] = [user("Weather in Oslo?")]
    first = await client.responses.create(model="m", instructions=INSTRUCTIONS, input=items, tools=TOOLS)
    assert first.output[0].type == "function_call"
    items += [*output_items(first), {"type": "function_call_output", "call_id": call_id(first), "output": "4C, rain"}]
    second = await client.responses.create(model="m", instructions=INSTRUCTIONS, input=items, tools=TOOLS)
    assert second.output_text == "Done: 4C, rain"
    items += [*output_items(second), user("And Bergen?")]
    await client.responses.create(model="m", instructions=INSTRUCTIONS, input=items, tools=TOOLS)

    seen = fake.responses_requests()
    assert [s.headers[contract.SESSION_HEADER] for s in seen] == [session.id] * 3
    # The turn index counts the model's answers in the input, as chat counts assistant messages.
    assert [s.headers[contract.TURN_HEADER] for s in seen] == ["0", "1", "2"]
    assert contract.PREFIX_PARENT_HEADER not in seen[0].headers
    for s in seen:  # the stamps are what the gateway recomputes from the bytes it got (tenant-keyed)
        assert stamps_of(s) == {contract.SESSION_HEADER: session.id, **gateway_view(s.body, key="k1")}
    assert gateway_view(seen[0].body) != gateway_view(seen[0].body, key="k1")
    # Resent history hashes as it did when it was the whole prompt: the earlier prefix is kept.
    for before, after in itertools.pairwise(seen):
        kept = {**after.body, "input": after.body["input"][: len(before.body["input"])]}
        assert contract.stamps_for_responses_body(kept, key="k1").prefix == before.headers[contract.PREFIX_HEADER]
    # The parent is the prefix at the end of the previous answer.
    body = seen[2].body
    assert seen[2].headers[contract.PREFIX_PARENT_HEADER] == contract.stamps_for_responses_body(
        {**body, "input": body["input"][:-1]}, key="k1").prefix

    t0, t1, t2 = session.turns
    assert [t.api for t in session.turns] == ["responses"] * 3
    assert [t.turn for t in session.turns] == [0, 1, 2]
    assert t0.finish_reason == "tool_calls" and t0.answer is not None
    assert t0.answer["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "x"}'}
    assert t1.answer == {"role": "assistant", "content": "Done: 4C, rain"} and t1.finish_reason == "stop"
    assert t1.prompt_tokens is not None and t1.completion_tokens == 3 and t1.cached_tokens == 0
    assert t2.done and t2.request_id == "req-2" and t2.prefix == seen[2].headers[contract.PREFIX_HEADER]
    await client.close()


def test_edited_history_changes_the_prefix() -> None:
    """Hashing alone: what changes the chain and what must not."""
    items: list[Any] = [user("Weather in Oslo?"),
                        {"id": "fc_1", "type": "function_call", "call_id": "c1", "name": "get_weather",
                         "arguments": '{"city":"Oslo"}', "status": "completed"},
                        {"type": "function_call_output", "call_id": "c1", "output": "4C"}]
    body = {"model": "m", "instructions": INSTRUCTIONS, "input": items, "tools": TOOLS}
    base = contract.stamps_for_responses_body(body)
    assert base.turn == 1 and base.parent is not None

    def prefix(**changes: Any) -> str | None:
        return contract.stamps_for_responses_body({**body, **changes}).prefix

    edited = [user("Weather in Bergen?"), *items[1:]]
    assert prefix(input=edited) != base.prefix
    assert prefix(instructions="You are verbose.") != base.prefix
    assert prefix(tools=[]) != base.prefix
    assert prefix(model="other") != base.prefix
    assert prefix(reasoning={"effort": "high"}) != base.prefix
    # What a client resends differently but the server never renders does not count.
    resent = [items[0], {k: v for k, v in items[1].items() if k not in ("id", "status")}, items[2]]
    assert prefix(input=resent) == base.prefix
    assert prefix(input=[{"type": "message", **items[0]}, *items[1:]]) == base.prefix
    assert prefix(reasoning={"summary": "auto"}) == base.prefix
    # A string input is one user message; a Responses chain never equals a chat chain.
    assert contract.stamps_for_responses_body({"model": "m", "input": "hi"}).prefix == \
        contract.stamps_for_responses_body({"model": "m", "input": [user("hi")]}).prefix
    assert contract.stamps_for_responses_body({"model": "m", "input": [user("hi")]}).prefix != \
        contract.stamps_for_body({"model": "m", "messages": [user("hi")]}).prefix
    # A reasoning item and parallel calls after it are one answer.
    calls = [{"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
             items[1], {**items[1], "call_id": "c2"}]
    assert contract.stamps_for_responses_body({"model": "m", "input": [user("q"), *calls]}).turn == 1


@pytest.mark.anyio
async def test_stream_ttft_answer_and_retry(fake: FakeOpenAI) -> None:
    session = AgentSession()
    client = StampedAsyncOpenAI(session=session, base_url=fake.url, api_key="k", max_retries=2)
    fake.script(Reply(content="It is 4C and raining.", reasoning="look it up", first_token_delay_s=0.2,
                      fail_first=1))
    stream = await client.responses.create(model="m", input="Weather in Oslo?", stream=True)
    assert type(stream) is openai.AsyncStream
    kinds = []
    text = []
    async for event in stream:
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            text.append(event.delta)
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "".join(text) == "It is 4C and raining."
    failed, ok = fake.responses_requests()
    assert (failed.status, ok.status) == (500, 200)
    assert stamps_of(failed) == stamps_of(ok) == {contract.SESSION_HEADER: session.id, **gateway_view(ok.body)}
    [turn] = session.turns
    assert turn.done and not turn.aborted and turn.stream and turn.attempts == 2
    # TTFC is the first event (response.created, before the pause), TTFT the first delta after it.
    assert turn.ttfc_ms is not None and turn.ttft_ms is not None
    assert turn.ttft_ms - turn.ttfc_ms >= 150
    assert turn.e2e_ms is not None and turn.e2e_ms >= turn.ttft_ms
    assert turn.answer == {"role": "assistant", "content": "It is 4C and raining.", "reasoning": "look it up"}
    assert turn.finish_reason == "stop" and turn.completion_tokens == 5
    await client.close()


@pytest.mark.anyio
async def test_stream_closed_before_the_end_is_aborted(fake: FakeOpenAI) -> None:
    session = AgentSession()
    client = StampedAsyncOpenAI(session=session, base_url=fake.url, api_key="k")
    fake.script(Reply(content="one two three four"))
    stream = await client.responses.create(model="m", input="count", stream=True)
    async for event in stream:
        if event.type == "response.output_text.delta":
            break
    [turn] = session.turns
    assert not turn.done and turn.ttft_ms is not None
    await stream.close()
    del stream
    for _ in range(20):  # asyncio closes each dropped async generator (AsyncStream.__aiter__, then ours) in a task
        if turn.done:
            break
        gc.collect()
        await anyio.lowlevel.checkpoint()
    assert turn.done and turn.aborted and turn.error is None
    await client.close()


def test_sync_client_streaming_response_and_other_endpoints(fake: FakeOpenAI, tmp_path: Path) -> None:
    session = AgentSession(record_to=tmp_path / "s.jsonl")
    client = StampedOpenAI(session=session, base_url=fake.url, api_key="k")
    # with_streaming_response builds the stream outside request(): its end is seen from the events.
    with client.responses.with_streaming_response.create(model="m", input=[user("hi")], stream=True) as raw:
        events = list(raw.parse())
    assert events[-1].type == "response.completed"
    answer = session.turns[0].answer
    assert answer == {"role": "assistant", "content": "echo hi"}
    second = client.responses.create(model="m", input=[user("hi"), answer, user("again")])
    assert second.output_text == "echo again"
    client.models.list()  # not a model call: the session id only, and no turn
    [models] = [s for s in fake.seen if s.path.endswith("/models")]
    assert stamps_of(models) == {contract.SESSION_HEADER: session.id}
    t0, t1 = session.turns
    assert (t0.turn, t1.turn) == (0, 1) and t0.done and t1.done and t0.ttft_ms is not None
    # Recorded as the chat turns they stand for; the second extends the first.
    [record] = list(read_sessions(tmp_path / "s.jsonl"))
    first, nxt = record.turns
    assert first.messages == [user("hi")] and first.recorded is not None
    assert first.recorded.answer == answer
    assert nxt.new_messages == [user("again")]
    client.close()


# --- the OpenAI Agents SDK, whose default model calls responses.create ----------------------------


def _agents() -> Any:
    if int(openai.__version__.split(".")[0]) < 3:  # scripts/test-openai1.sh: the package may be there, broken
        pytest.skip("openai-agents needs openai>=3")
    agents = pytest.importorskip("agents", reason="openai-agents is not installed")
    agents.set_tracing_disabled(True)  # its default exporter would post traces to OpenAI
    return agents


@pytest.mark.anyio
@pytest.mark.parametrize("streamed", [False, True])
async def test_agents_sdk_default_model_is_stamped(fake: FakeOpenAI, streamed: bool) -> None:
    agents = _agents()

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Weather for a city."""
        return f"4C in {city}"

    session = AgentSession()
    client = StampedAsyncOpenAI(session=session, base_url=fake.url, api_key="k")
    agent = agents.Agent(name="weather", instructions=INSTRUCTIONS, tools=[get_weather],
                         model=agents.OpenAIResponsesModel(model="m", openai_client=client))
    assert isinstance(agent.model, agents.OpenAIResponsesModel)
    if streamed:
        run = agents.Runner.run_streamed(agent, "Weather in Oslo?")
        async for _ in run.stream_events():
            pass
        final = run.final_output
    else:
        final = (await agents.Runner.run(agent, "Weather in Oslo?")).final_output
    assert final == "Done: 4C in x"

    first, second = fake.responses_requests()
    assert all(s.headers[contract.SESSION_HEADER] == session.id for s in (first, second))
    assert (first.headers[contract.TURN_HEADER], second.headers[contract.TURN_HEADER]) == ("0", "1")
    for s in (first, second):
        assert stamps_of(s) == {contract.SESSION_HEADER: session.id, **gateway_view(s.body)}
        assert s.body.get("stream", False) is streamed
    # The agent resends the first request's items unchanged: its prefix is the start of the second's.
    assert prefix_of(second.body, len(first.body["input"])) == first.headers[contract.PREFIX_HEADER]
    assert second.headers[contract.PREFIX_PARENT_HEADER] == prefix_of(second.body, len(first.body["input"]) + 1)
    turns = session.turns
    assert [(t.api, t.turn, t.done, t.error) for t in turns] == [("responses", 0, True, None),
                                                                 ("responses", 1, True, None)]
    assert turns[1].answer == {"role": "assistant", "content": "Done: 4C in x"}
    if streamed:
        assert all(t.ttft_ms is not None and t.ttfc_ms is not None for t in turns)
    await client.close()


def test_recorded_body_is_chat(fake: FakeOpenAI, tmp_path: Path) -> None:
    """A Responses tool loop recorded: instructions, function calls and their outputs as chat messages."""
    session = AgentSession(record_to=tmp_path / "r.jsonl")
    client = StampedOpenAI(session=session, base_url=fake.url, api_key="k")
    items: list[Any] = [user("Weather in Oslo?")]
    first = client.responses.create(model="m", instructions=INSTRUCTIONS, input=items, tools=TOOLS,
                                    max_output_tokens=64)
    items += [*output_items(first), {"type": "function_call_output", "call_id": call_id(first), "output": "4C"}]
    client.responses.create(model="m", instructions=INSTRUCTIONS, input=items, tools=TOOLS, max_output_tokens=64)
    [record] = list(read_sessions(tmp_path / "r.jsonl"))
    assert record.tools == [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city", "parameters": TOOLS[0]["parameters"],
        "strict": False}}]
    t0, t1 = record.turns
    assert t0.messages == [{"role": "system", "content": INSTRUCTIONS}, user("Weather in Oslo?")]
    assert t0.params == {"max_tokens": 64}
    call = {"id": call_id(first), "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "x"}'}}
    assert t0.recorded is not None and t0.recorded.answer == {"role": "assistant", "content": None,
                                                              "tool_calls": [call]}
    assert t1.new_messages == [{"role": "tool", "tool_call_id": call_id(first), "content": "4C"}]
    line = json.loads((tmp_path / "r.jsonl").read_text().splitlines()[0])
    assert line["kind"] == "turn"
    client.close()


@pytest.mark.anyio
async def test_session_end_reaches_the_gateway_once(fake: FakeOpenAI) -> None:
    """A client made with session= ends its session too (one DELETE per gateway, not per client)."""
    async with AgentSession() as session:
        client = StampedAsyncOpenAI(session=session, base_url=fake.url, api_key="k")
        other = session.wrap(openai.AsyncOpenAI(base_url=fake.url, api_key="k"))
        await client.responses.create(model="m", input="hi")
        await other.responses.create(model="m", input=[user("hi"), {"role": "assistant", "content": "echo hi"},
                                                         user("bye")])
    assert [t.turn for t in session.turns] == [0, 1]
    [end] = [s for s in fake.seen if s.path.startswith("/v1/sessions/")]
    assert end.path == f"/v1/sessions/{session.id}"
    with pytest.raises(RuntimeError):
        await client.responses.create(model="m", input="closed")
    async with AgentSession() as alone:  # the constructor's client is the only way to this gateway
        only = StampedAsyncOpenAI(session=alone, base_url=fake.url, api_key="k")
    assert [s.path for s in fake.seen if s.path.startswith("/v1/sessions/")] == [end.path, f"/v1/sessions/{alone.id}"]
    for c in (client, other, only):
        await c.close()
