"""The tracing hook: a CLIENT span per chat call and a traceparent that names it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kvtether.protocol import contract
from kvtether.sdk import AgentSession, StampedAsyncOpenAI
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from tests.support.fake_openai import FakeOpenAI, Reply


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeOpenAI]:
    server = FakeOpenAI().start()
    yield server
    server.stop()


@pytest.mark.anyio
async def test_span_per_call_with_conversation_id_and_ttfc(fake: FakeOpenAI) -> None:
    fake.reset()
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    session = AgentSession(tenant="acme", tracer_provider=provider)
    client = StampedAsyncOpenAI(session=session, base_url=fake.url, api_key="k", max_retries=1)
    msgs = [{"role": "user", "content": "hi"}]
    fake.script(Reply(content="hello there", fail_first=1), Reply(fail_first=1))
    stream = await client.chat.completions.create(
        model="m", messages=msgs, stream=True, stream_options={"include_usage": True}, max_tokens=9  # type: ignore[arg-type]
    )
    async for _ in stream:
        pass
    with pytest.raises(Exception, match="scripted failure"):
        await client.with_options(max_retries=0).chat.completions.create(model="m", messages=msgs)  # type: ignore[arg-type]

    ok, failed = exporter.get_finished_spans()
    assert ok.name == "chat m" and ok.kind is SpanKind.CLIENT
    attrs = dict(ok.attributes or {})
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.conversation.id"] == session.id
    assert attrs["gen_ai.request.model"] == "m" and attrs["gen_ai.request.stream"] is True
    assert attrs["gen_ai.request.max_tokens"] == 9
    assert attrs["server.address"] == "127.0.0.1"
    turn = session.turns[0]
    assert turn.ttfc_ms is not None and turn.ttft_ms is not None
    assert attrs["gen_ai.response.time_to_first_chunk"] == pytest.approx(turn.ttfc_ms / 1000)
    assert attrs["kvtether.time_to_first_token"] == pytest.approx(turn.ttft_ms / 1000)
    assert attrs["kvtether.prefix"] == turn.prefix and attrs["kvtether.turn.index"] == 0
    assert attrs["kvtether.attempts"] == 2 and attrs["kvtether.tenant"] == "acme"
    assert attrs["gen_ai.usage.output_tokens"] == 2

    first, second, third = fake.chat_requests()
    ctx = ok.context
    assert ctx is not None
    want = f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-"  # then the flags (sampled, maybe random-id)
    # Both attempts of the retried call carry the same traceparent, naming the call's span.
    assert first.headers[contract.TRACEPARENT_HEADER] == second.headers[contract.TRACEPARENT_HEADER]
    assert first.headers[contract.TRACEPARENT_HEADER].startswith(want)
    assert not third.headers[contract.TRACEPARENT_HEADER].startswith(want)

    assert failed.status.status_code is StatusCode.ERROR
    assert dict(failed.attributes or {})["error.type"] == "InternalServerError"
    await client.close()


@pytest.mark.anyio
async def test_no_provider_no_span_no_traceparent(fake: FakeOpenAI) -> None:
    fake.reset()
    session = AgentSession()
    client = StampedAsyncOpenAI(session=session, base_url=fake.url, api_key="k")
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    [seen] = fake.chat_requests()
    assert contract.TRACEPARENT_HEADER not in seen.headers
    assert session.turns[0].done
    await client.close()
