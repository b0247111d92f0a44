"""The gateway's spans (tree, attributes, propagation), its /metrics series, and exporter selection.

A 3-turn session through the gateway on the simulator, spans captured in memory: turn 0 cold (carrying
the client's own traceparent), turn 1 extends the history (the handle is attached and P pulls), turn 2
edits the system prompt (the guard refuses the handle).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from kvtether.cli.simstack import sim_stack
from kvtether.gateway import telemetry as T
from kvtether.sim.cluster import SimCluster
from opentelemetry.trace import SpanKind
from prometheus_client.parser import text_string_to_metric_families

from tests.support.gateway_agent import MODEL, chat, first_messages, next_messages, request_body
from tests.support.sim_rig import RIG_SIM, stack_spec
from tests.support.upstream_hooks import on_send

pytestmark = pytest.mark.anyio

SPEED = 50.0
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
SID = "obs-1"


@dataclass
class Run:
    spans: list[Any]
    upstream: list[tuple[str, str | None]]  # (url path, traceparent) of every request the gateway sent
    metrics: list[dict[str, float]]  # /metrics after each step: before turn 0, after turns 0, 1, 2, the error
    nodes: dict[str, list[str]]


def _samples(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + "{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}"
            out[key] = s.value
    return out


@contextlib.asynccontextmanager
async def _gateway() -> AsyncIterator[tuple[str, Any, Any, SimCluster]]:
    provider, exporter = T.in_memory_provider()
    async with sim_stack(stack_spec(decode=2, speed=SPEED, **RIG_SIM), "pull", calibrated=False,
                         tracer_provider=provider) as stack:
        assert stack.cluster is not None
        yield stack.url, stack.app, exporter, stack.cluster


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def run() -> Run:
    upstream: list[tuple[str, str | None]] = []

    def seen(method: str, url: str, headers: Mapping[str, str]) -> None:
        upstream.append((httpx.URL(url).path, headers.get("traceparent")))

    snapshots: list[dict[str, float]] = []
    async with _gateway() as (url, app, exporter, cluster), httpx.AsyncClient(timeout=60) as client:
        on_send(app.state.gateway.upstream, seen)

        async def snap() -> None:
            snapshots.append(_samples((await client.get(f"{url}/metrics")).text))

        headers = {"x-session-id": SID}
        messages = first_messages(60)
        await snap()
        got = await chat(client, url, _body(messages),
                         {**headers, "traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
        await snap()
        messages = next_messages(messages, got, 60, 0)
        got = await chat(client, url, _body(messages), headers)
        await snap()
        messages = next_messages(messages, got, 60, 1)
        # An edited system prompt: D's KV is of other tokens from the first words on; the guard refuses it.
        edited = [{**messages[0], "content": "You are a different agent. " + messages[0]["content"]}, *messages[1:]]
        await chat(client, url, _body(edited), headers)
        await snap()
        # A request the engine rejects (prompt + max_tokens beyond the context): an upstream error. max_tokens
        # alone within the context, or the gateway itself refuses it.
        bad = request_body(first_messages(61), stream=False, max_tokens=cluster.nodes[0].cfg.max_model_len)
        resp = await client.post(f"{url}/v1/chat/completions", json=bad, headers={"x-session-id": "obs-bad"})
        assert resp.status_code >= 400
        await snap()
        nodes = cluster.urls()
    return Run(list(exporter.get_finished_spans()), upstream, snapshots, nodes)


def _body(messages: list[dict[str, Any]]) -> dict[str, Any]:
    # With include_usage, the decode leg's usage (input, output, cached) reaches its span.
    return {**request_body(messages, stream=True), "stream_options": {"include_usage": True}}


def _a(span: Any) -> dict[str, Any]:
    return dict(span.attributes or {})


def _turns(run: Run) -> list[list[Any]]:
    """The spans of the session's turns, one list per trace, in turn order."""
    by_trace: dict[int, list[Any]] = {}
    for s in run.spans:
        by_trace.setdefault(s.context.trace_id, []).append(s)
    turns = []
    for group in by_trace.values():
        server = next(s for s in group if s.kind is SpanKind.SERVER)
        if _a(server).get(T.GEN_AI_CONVERSATION_ID) == SID:
            turns.append(group)
    turns.sort(key=lambda g: next(s for s in g if s.kind is SpanKind.SERVER).start_time)
    return turns


def _server(group: list[Any]) -> Any:
    (server,) = [s for s in group if s.kind is SpanKind.SERVER]
    return server


def _leg(group: list[Any], leg: str) -> Any:
    (span,) = [s for s in group if s.kind is SpanKind.CLIENT and _a(s)[T.ATTR_LEG] == leg]
    return span


async def test_one_trace_per_turn_with_the_expected_tree(run: Run) -> None:
    turns = _turns(run)
    assert len(turns) == 3 and len({g[0].context.trace_id for g in turns}) == 3
    # The client's traceparent is honoured: turn 0 continues the client's trace, under the client's span.
    server0 = _server(turns[0])
    assert format(server0.context.trace_id, "032x") == CLIENT_TRACE
    assert server0.parent is not None and format(server0.parent.span_id, "016x") == CLIENT_SPAN
    assert _server(turns[1]).parent is None and _server(turns[2]).parent is None
    expected = [
        ["POST /v1/chat/completions", f"chat {MODEL}", f"chat {MODEL}", T.SPAN_PLAN],
        ["POST /v1/chat/completions", f"chat {MODEL}", f"chat {MODEL}", T.SPAN_GUARD, T.SPAN_PLAN, T.SPAN_TOKENIZE],
        ["POST /v1/chat/completions", f"chat {MODEL}", f"chat {MODEL}", T.SPAN_GUARD, T.SPAN_PLAN, T.SPAN_TOKENIZE],
    ]
    # Exactly these spans (no span per SSE chunk), every one a direct child of the turn's SERVER span.
    assert [sorted(s.name for s in g) for g in turns] == [sorted(e) for e in expected]
    for group in turns:
        server = _server(group)
        for s in group:
            if s is not server:
                assert s.parent is not None and s.parent.span_id == server.context.span_id, s.name
                # Children end before the SERVER span, which stays open until the stream ends.
                assert s.end_time <= server.end_time
        kinds = {s.name: s.kind for s in group}
        assert kinds[T.SPAN_PLAN] is SpanKind.INTERNAL
        decode = _leg(group, "decode")
        prefill = _leg(group, "prefill")
        assert decode.kind is SpanKind.CLIENT and prefill.kind is SpanKind.CLIENT
        # The decode leg stays open until the stream has ended: after the first token.
        first = [e for e in decode.events if e.name == T.EVENT_FIRST_TOKEN]
        assert len(first) == 1 and first[0].timestamp < decode.end_time
        assert [e.name for e in server.events].count(T.EVENT_FIRST_TOKEN) == 1


async def test_genai_and_kvtether_attributes(run: Run) -> None:
    turns = _turns(run)
    servers = [_server(g) for g in turns]
    attrs = [_a(s) for s in servers]
    assert [a[T.ATTR_TURN] for a in attrs] == [0, 1, 2]
    assert all(a[T.GEN_AI_CONVERSATION_ID] == SID for a in attrs)
    assert [a[T.ATTR_REUSE_SOURCE] for a in attrs][:2] == ["none", "decode_pull"]
    assert attrs[2][T.ATTR_REUSE_SOURCE] in ("none", "prefill_cache")  # P's own cache may hold a first block
    for a in attrs:
        assert a[T.ATTR_TTFT] > 0 and 0 <= a[T.ATTR_GATEWAY_OVERHEAD] < a[T.ATTR_TTFT]
        assert a[T.ATTR_MODE] == "pd" and a[T.ATTR_POLICY] == "pull"
    # Turn 0 had no pin; later turns name the decode node turn 0 chose, and the handle's age.
    assert T.ATTR_PINNED not in attrs[0]
    assert attrs[1][T.ATTR_PINNED] == attrs[2][T.ATTR_PINNED] == attrs[0][T.ATTR_DECODE]
    assert attrs[1][T.ATTR_HANDLE_AGE] >= 0 and attrs[2][T.ATTR_HANDLE_AGE] >= 0
    # Turn 1: the guard verified D's whole held sequence; prefill pulled it and computed only the suffix.
    assert attrs[1][T.ATTR_GUARD_VERDICT] == "match" and attrs[1][T.ATTR_PLAN_ACTION] == "attach"
    assert attrs[1][T.ATTR_REUSE_TOKENS] > 100 and attrs[1][T.ATTR_SUFFIX_TOKENS] > 0
    # Turn 2: the edited prompt fails the guard; the handle is not sent.
    assert attrs[2][T.ATTR_GUARD_VERDICT] == "refused"
    guard2 = next(s for s in turns[2] if s.name == T.SPAN_GUARD)
    assert _a(guard2)[T.ATTR_GUARD_VERDICT] == "refused" and _a(guard2)[T.ATTR_REUSE_TOKENS] < 64
    plan2 = _a(next(s for s in turns[2] if s.name == T.SPAN_PLAN))
    assert plan2[T.ATTR_HANDLE_OUTCOME] == "refused_by_guard" and plan2[T.ATTR_PLAN_REASON]
    for group in turns:
        for leg in ("prefill", "decode"):
            a = _a(_leg(group, leg))
            assert a[T.GEN_AI_OPERATION] == "chat" and a[T.GEN_AI_PROVIDER] == "openai"
            assert a[T.GEN_AI_REQUEST_MODEL] == MODEL and a[T.GEN_AI_CONVERSATION_ID] == SID
            assert a[T.GEN_AI_RESPONSE_TTFC] > 0 and a[T.GEN_AI_USAGE_INPUT] > 0 and a[T.SERVER_ADDRESS]
        d = _a(_leg(group, "decode"))
        assert d[T.GEN_AI_USAGE_OUTPUT] > 0 and d[T.GEN_AI_REQUEST_STREAM] is True
        assert d[T.ATTR_TTFT] > 0 and d[T.ATTR_REUSE_SOURCE] == _a(_server(group))[T.ATTR_REUSE_SOURCE]
    # Cache-read usage: P read turn 1's history from the pull.
    assert _a(_leg(turns[1], "prefill"))[T.GEN_AI_USAGE_CACHE_READ] == attrs[1][T.ATTR_REUSE_TOKENS]


async def test_traceparent_is_propagated_to_the_engine(run: Run) -> None:
    legs = [s for g in _turns(run) for s in g if s.kind is SpanKind.CLIENT]
    # version-trace_id-parent_id-flags; the flags may carry W3C level 2's random-trace-id bit (03).
    sent = {tuple(tp.split("-")[1:3]) for path, tp in run.upstream if path.endswith("/chat/completions") and tp}
    # Each upstream leg carried a traceparent naming its own CLIENT span: vLLM's llm_request nests under it.
    for s in legs:
        assert (f"{s.context.trace_id:032x}", f"{s.context.span_id:016x}") in sent, s.name


async def test_metrics_move_as_the_turns_run(run: Run) -> None:
    m = run.metrics
    ttft = "kvtether_ttft_seconds_count{mode=pd,policy=pull,reuse_source=%s}"
    over = "kvtether_gateway_overhead_seconds_count{mode=pd}"
    outcome = "kvtether_handle_outcomes_total{outcome=%s}"
    # Every series of the issue is exposed before the first turn (zero), without session ids as labels.
    for source in T.REUSE_SOURCES:
        assert m[0][ttft % source] == 0
    for name in ("attached", "truncated", "refused_by_guard", "expired", "missing"):
        assert m[0][outcome % name] == 0
    assert m[0][over] == 0 and m[0]["kvtether_pinned_sessions{}"] == 0
    assert not any(SID in key for snap in m for key in snap)
    # Turn 0: cold; turn 1: a pull; turn 2: refused by the guard.
    assert m[1][ttft % "none"] == 1 and m[1][over] == 1 and m[1]["kvtether_pinned_sessions{}"] == 1
    assert m[2][ttft % "decode_pull"] == 1 and m[2][outcome % "attached"] == 1 and m[2][over] == 2
    assert m[3][outcome % "refused_by_guard"] == 1 and m[3][over] == 3
    assert m[3][ttft % "none"] + m[3][ttft % "prefill_cache"] == 2
    assert m[3]["kvtether_gateway_overhead_seconds_sum{mode=pd}"] > 0
    # The rejected request (P runs it with max_tokens=1, so D is the one that refuses): an upstream error,
    # labelled by node and phase.
    errors = {k: v for k, v in m[4].items() if k.startswith("kvtether_upstream_errors_total{")}
    # Every node's series exists from the start (at zero), so a rate() over it sees the first error.
    assert sum(errors.values()) >= 1
    assert not any(v for k, v in m[3].items() if k.startswith("kvtether_upstream_errors_total{"))
    (key,) = [k for k, v in errors.items() if v]
    assert "phase=decode" in key and any(f"node={u}," in key for u in run.nodes["decode"])


def test_exporters_from_the_standard_variables() -> None:
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    assert T.make_exporters({}) == []  # nothing configured: no exporter, no retries against a missing collector
    (e,) = T.make_exporters({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})
    assert isinstance(e, Http)
    (e,) = T.make_exporters({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})
    assert isinstance(e, Grpc)
    (e,) = T.make_exporters({"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"}, otlp_endpoint="http://c:4317")
    assert isinstance(e, Grpc)
    both = T.make_exporters({"OTEL_TRACES_EXPORTER": "console,otlp"})
    assert [type(x) for x in both] == [ConsoleSpanExporter, Http]
    assert T.make_exporters({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c"}) == []
    for bad in ({"OTEL_TRACES_EXPORTER": "zipkin"}, {"OTEL_TRACES_EXPORTER": "otlp",
                                                      "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}):
        with pytest.raises(T.TracingConfigError):
            T.make_exporters(bad)


def test_sampler_comes_from_the_standard_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.25")
    provider = T.make_provider([])
    sampler = provider.sampler  # type: ignore[attr-defined]
    assert sampler.get_description() == "TraceIdRatioBased{0.25}"
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    provider = T.make_provider([])
    assert provider.sampler.get_description() == "AlwaysOffSampler"  # type: ignore[attr-defined]
