"""Stamped openai clients against a real local HTTP server (runs on openai 3.x and, via
scripts/test-openai1.sh, on openai 1.x)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from kvtether.protocol import contract
from kvtether.sdk import AgentSession, StampedAsyncOpenAI, StampedOpenAI

from tests.support.fake_openai import FakeOpenAI, Reply

STAMP_HEADERS = (
    contract.SESSION_HEADER,
    contract.TURN_HEADER,
    contract.PREFIX_HEADER,
    contract.PREFIX_PARENT_HEADER,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]

HISTORY: list[dict[str, Any]] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "4C, rain"},
]


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeOpenAI]:
    server = FakeOpenAI().start()
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def _clean(fake: FakeOpenAI) -> None:
    fake.reset()


def gateway_view(seen: Any, key: str | bytes | None = None) -> dict[str, str]:
    """What the gateway recomputes from the bytes it received."""
    return contract.stamps_for_body(json.loads(seen.raw), key=key).headers()


def stamps_of(seen: Any) -> dict[str, str]:
    return {k: seen.headers[k] for k in STAMP_HEADERS if k in seen.headers}


@pytest.mark.anyio
async def test_stream_headers_match_gateway_recomputation(fake: FakeOpenAI) -> None:
    session = AgentSession(tenant="acme", tenant_key=b"tenant-secret")
    client = StampedAsyncOpenAI(session=session, base_url=fake.url, api_key="k")
    assert isinstance(client, openai.AsyncOpenAI)
    fake.script(Reply(content="It is 4C and raining."))
    stream = await client.chat.completions.create(
        model="m",
        messages=HISTORY,
        tools=TOOLS,  # type: ignore[arg-type]
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},  # part of the prefix seed
    )
    async for _ in stream:
        pass
    [seen] = fake.chat_requests()
    assert seen.headers[contract.SESSION_HEADER] == session.id
    expected = gateway_view(seen, key=b"tenant-secret")
    assert {k: seen.headers[k] for k in expected} == expected
    assert expected[contract.TURN_HEADER] == "1"
    assert contract.PREFIX_PARENT_HEADER in expected
    # The extra_body field changes the seed: stamps computed without it would not match.
    body = json.loads(seen.raw)
    assert body["chat_template_kwargs"] == {"enable_thinking": False}
    without = dict(body)
    del without["chat_template_kwargs"]
    assert contract.stamps_for_body(without, key=b"tenant-secret").prefix != expected[contract.PREFIX_HEADER]
    assert "traceparent" not in seen.headers  # no tracer provider configured

    turn = session.last_turn
    assert turn is not None and turn.done and not turn.aborted and turn.error is None
    assert turn.turn == 1 and turn.prefix == expected[contract.PREFIX_HEADER]
    assert turn.answer == {"role": "assistant", "content": "It is 4C and raining."}
    assert turn.prompt_tokens is not None and turn.completion_tokens == 5
    assert turn.finish_reason == "stop"
    assert turn.request_id is not None and turn.request_id.startswith("req-")
    await client.close()


@pytest.mark.anyio
async def test_retry_carries_identical_stamps(fake: FakeOpenAI) -> None:
    session = AgentSession()
    client = StampedAsyncOpenAI(session=session, base_url=fake.url, api_key="k", max_retries=2)
    fake.script(Reply(content="second time lucky", fail_first=1))
    stream = await client.chat.completions.create(model="m", messages=HISTORY, stream=True)
    chunks = [c async for c in stream]
    assert chunks
    first, second = fake.chat_requests()
    assert (first.status, second.status) == (500, 200)
    assert first.headers.get("x-stainless-retry-count") != second.headers.get("x-stainless-retry-count")
    assert stamps_of(first) == stamps_of(second) == {contract.SESSION_HEADER: session.id, **gateway_view(second)}
    assert first.raw == second.raw
    [turn] = session.turns
    assert turn.attempts == 2 and turn.done and turn.answer == {"role": "assistant", "content": "second time lucky"}
    await client.close()


@pytest.mark.anyio
async def test_stream_object_and_iteration_unchanged(fake: FakeOpenAI) -> None:
    plain = openai.AsyncOpenAI(base_url=fake.url, api_key="k")
    session = AgentSession()
    stamped = session.wrap(plain)
    reply = dict(content="alpha beta gamma", reasoning="think hard", tool_calls=[("get_weather", '{"city":"Oslo"}')])

    async def run(client: openai.AsyncOpenAI) -> tuple[Any, list[dict[str, Any]]]:
        fake.script(Reply(**reply))  # type: ignore[arg-type]
        stream = await client.chat.completions.create(
            model="m", messages=HISTORY[:2], tools=TOOLS, stream=True  # type: ignore[arg-type]
        )
        out: list[dict[str, Any]] = []
        async with stream:
            first = await stream.__anext__()  # manual stepping still works
            out.append(first.model_dump())
            async for chunk in stream:
                out.append(chunk.model_dump())
        return stream, out

    s_plain, chunks_plain = await run(plain)
    s_stamped, chunks_stamped = await run(stamped)
    assert type(s_stamped) is type(s_plain) is openai.AsyncStream
    assert s_stamped.response.headers["x-request-id"]

    def strip(cs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for c in cs:
            c = dict(c, id=None)
            for ch in c["choices"]:
                for tc in ch["delta"].get("tool_calls") or []:
                    tc["id"] = tc["id"] and "call"
            out.append(c)
        return out

    assert strip(chunks_stamped) == strip(chunks_plain)
    # The caller's client is left as it was: unstamped.
    assert contract.SESSION_HEADER not in fake.chat_requests()[0].headers
    assert fake.chat_requests()[1].headers[contract.SESSION_HEADER] == session.id
    assert isinstance(stamped, openai.AsyncOpenAI) and stamped is not plain

    [turn] = session.turns
    assert turn.ttfc_ms is not None and turn.ttft_ms is not None and turn.ttfc_ms <= turn.ttft_ms
    assert turn.answer is not None
    assert turn.answer["reasoning_content"] == "think hard "
    assert turn.answer["content"] == "alpha beta gamma"
    assert turn.answer["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city":"Oslo"}'}
    await plain.close()


@pytest.mark.anyio
async def test_ttft_counts_tool_calls_and_skips_role_chunk(fake: FakeOpenAI) -> None:
    session = AgentSession()
    client = StampedAsyncOpenAI(session=session, base_url=fake.url, api_key="k")
    fake.script(Reply(tool_calls=[("get_weather", '{"city":"Rome"}')], first_token_delay_s=0.25))
    stream = await client.chat.completions.create(model="m", messages=HISTORY[:2], tools=TOOLS, stream=True)  # type: ignore[arg-type]
    async for _ in stream:
        pass
    turn = session.turns[0]
    assert turn.ttfc_ms is not None and turn.ttft_ms is not None
    # The role-only first chunk is a chunk but not a token; the server paused 250 ms before the tool
    # call (the margin absorbs scheduling jitter on a loaded machine).
    assert turn.ttft_ms - turn.ttfc_ms >= 100
    assert turn.answer is not None and turn.answer["content"] is None
    [call] = turn.answer["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city":"Rome"}'}
    assert turn.finish_reason == "tool_calls"
    await client.close()


@pytest.mark.anyio
async def test_non_stream_raw_response_and_with_options(fake: FakeOpenAI) -> None:
    session = AgentSession()
    client = StampedAsyncOpenAI(session=session, base_url=fake.url, api_key="k")
    # A framework deriving a client keeps the session.
    derived = client.with_options(timeout=30)
    assert isinstance(derived, StampedAsyncOpenAI) and derived.session is session

    fake.script(Reply(content="plain"))
    completion = await derived.chat.completions.create(model="m", messages=HISTORY[:2])
    assert completion.choices[0].message.content == "plain"

    fake.script(Reply(content="raw stream"))
    raw = await client.chat.completions.with_raw_response.create(model="m", messages=HISTORY[:2], stream=True)
    assert raw.headers["x-request-id"]
    stream = raw.parse()
    texts = [c.choices[0].delta.content async for c in stream if c.choices and c.choices[0].delta.content]
    assert "".join(texts) == "raw stream"

    t_plain, t_raw = session.turns
    assert t_plain.done and not t_plain.stream and t_plain.ttft_ms is None and t_plain.e2e_ms is not None
    assert t_plain.answer == {"role": "assistant", "content": "plain"}
    assert t_raw.done and t_raw.stream and t_raw.ttft_ms is not None
    assert t_raw.answer == {"role": "assistant", "content": "raw stream"}
    for seen in fake.chat_requests():
        assert stamps_of(seen) == {contract.SESSION_HEADER: session.id, **gateway_view(seen)}
    await client.close()


@pytest.mark.anyio
async def test_explicit_headers_win_and_other_endpoints_get_session_only(fake: FakeOpenAI) -> None:
    session = AgentSession("my-session.1")
    client = StampedAsyncOpenAI(session=session, base_url=fake.url, api_key="k")
    await client.models.list()
    fake.script(Reply(content="x"))
    await client.chat.completions.create(
        model="m", messages=HISTORY[:2], extra_headers={"X-Session-Id": "override", "x-kvtether-turn": openai.Omit()}
    )
    models, chat = fake.seen
    assert models.headers[contract.SESSION_HEADER] == "my-session.1"
    assert contract.TURN_HEADER not in models.headers
    assert chat.headers[contract.SESSION_HEADER] == "override"
    assert contract.TURN_HEADER not in chat.headers
    assert chat.headers[contract.PREFIX_HEADER] == gateway_view(chat)[contract.PREFIX_HEADER]
    assert len(session.turns) == 1
    await client.close()


def test_sync_client_stream_and_plain(fake: FakeOpenAI) -> None:
    session = AgentSession()
    client = StampedOpenAI(session=session, base_url=fake.url, api_key="k", max_retries=1)
    assert isinstance(client, openai.OpenAI)
    fake.script(Reply(content="one two", fail_first=1), Reply(content="three"))
    stream = client.chat.completions.create(model="m", messages=HISTORY, stream=True)
    assert type(stream) is openai.Stream
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "one two"
    out = client.chat.completions.create(model="m", messages=HISTORY)
    assert out.choices[0].message.content == "three"
    failed, ok, plain = fake.chat_requests()
    assert stamps_of(failed) == stamps_of(ok) == stamps_of(plain)
    assert stamps_of(ok) == {contract.SESSION_HEADER: session.id, **gateway_view(ok)}
    t1, t2 = session.turns
    assert t1.attempts == 2 and t1.ttft_ms is not None and t1.answer == {"role": "assistant", "content": "one two"}
    assert t2.attempts == 1 and t2.done
    client.close()


def test_wrap_sync_and_errors(fake: FakeOpenAI) -> None:
    session = AgentSession()
    base = openai.OpenAI(base_url=fake.url, api_key="k", max_retries=0)
    wrapped = session.wrap(base)
    assert isinstance(wrapped, openai.OpenAI) and wrapped.session is session  # type: ignore[attr-defined]
    fake.script(Reply(fail_first=1))
    with pytest.raises(openai.InternalServerError):
        wrapped.chat.completions.create(model="m", messages=HISTORY[:2])
    [turn] = session.turns
    assert turn.done and turn.error == "InternalServerError" and turn.attempts == 1
    other = AgentSession()
    rewrapped = other.wrap(wrapped)
    assert rewrapped.session is other and wrapped.session is session  # type: ignore[attr-defined]
    with pytest.raises(TypeError):
        session.wrap(object())
    session.close()
    with pytest.raises(RuntimeError):
        wrapped.chat.completions.create(model="m", messages=HISTORY[:2])
    base.close()


def test_session_ids() -> None:
    from kvtether.sdk.session import new_session_id

    ids = [new_session_id() for _ in range(2000)]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert all(len(i) == 26 and i.isalnum() and i == i.lower() for i in ids)
    assert AgentSession("a:b@c.d~e-f_g").id == "a:b@c.d~e-f_g"
    for bad in ("", "has space", "x" * 201, "slash/no", "é"):
        with pytest.raises(ValueError):
            AgentSession(bad)


@pytest.mark.anyio
async def test_concurrent_calls_and_framework_subclass(fake: FakeOpenAI) -> None:
    import anyio

    class FrameworkClient(openai.AsyncOpenAI):  # e.g. a framework's own subclass
        pass

    base = FrameworkClient(base_url=fake.url, api_key="k")
    session = AgentSession()
    client = session.wrap(base)
    assert isinstance(client, FrameworkClient) and type(client).__name__ == "StampedFrameworkClient"
    histories = [[{"role": "user", "content": f"q{i}"}] for i in range(4)]
    results: dict[int, str] = {}

    async def one(i: int) -> None:
        stream = await client.chat.completions.create(model="m", messages=histories[i], stream=True)  # type: ignore[arg-type]
        results[i] = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async with anyio.create_task_group() as tg:
        for i in range(4):
            tg.start_soon(one, i)
    # Each turn's metrics belong to its own request, though the streams interleaved.
    by_prefix = {t.prefix: t for t in session.turns}
    assert len(by_prefix) == 4
    for seen in fake.chat_requests():
        turn = by_prefix[seen.headers[contract.PREFIX_HEADER]]
        question = seen.body["messages"][-1]["content"]
        assert turn.done and turn.answer == {"role": "assistant", "content": f"echo {question}"}
        assert turn.ttft_ms is not None
        assert stamps_of(seen) == {contract.SESSION_HEADER: session.id, **gateway_view(seen)}
    assert results == {i: f"echo q{i}" for i in range(4)}
    await base.close()


def test_contract_import_does_not_load_openai() -> None:
    import subprocess
    import sys

    code = "import sys, kvtether.sdk.contract, kvtether.sdk.sessionfile; print('openai' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_sync_stream_closed_early_is_aborted(fake: FakeOpenAI) -> None:
    import gc

    session = AgentSession()
    client = StampedOpenAI(session=session, base_url=fake.url, api_key="k")
    fake.script(Reply(content="one two three"))
    stream = client.chat.completions.create(model="m", messages=HISTORY, stream=True)
    for _ in stream:
        break  # the role-only first chunk: no finish_reason seen
    turn = session.last_turn
    assert turn is not None and not turn.done
    stream.close()
    del stream
    gc.collect()  # the observed iterator is closed (GeneratorExit) when the stream goes
    assert turn.done and turn.aborted and turn.error is None
    client.close()


@pytest.mark.anyio
async def test_async_error_and_stream_closed_early(fake: FakeOpenAI) -> None:
    import gc

    import anyio.lowlevel

    session = AgentSession()
    client = StampedAsyncOpenAI(session=session, base_url=fake.url, api_key="k", max_retries=0)
    fake.script(Reply(fail_first=1), Reply(content="one two three"))
    with pytest.raises(openai.InternalServerError):
        await client.chat.completions.create(model="m", messages=HISTORY[:2])
    failed = session.last_turn
    assert failed is not None and failed.done and failed.error == "InternalServerError" and failed.attempts == 1
    stream = await client.chat.completions.create(model="m", messages=HISTORY, stream=True)
    async for _ in stream:
        break
    turn = session.last_turn
    assert turn is not None and turn is not failed and not turn.done
    await stream.close()
    del stream
    for _ in range(20):  # asyncio closes each dropped async generator (AsyncStream.__aiter__, then ours) in a task
        if turn.done:
            break
        gc.collect()
        await anyio.lowlevel.checkpoint()
    assert turn.done and turn.aborted and turn.error is None
    await client.close()
