"""The CLI's one streaming client (kvtether.cli.streaming): which events of each API carry a token, TTFC, TTFT and
TPOT by its one definition, the answer as the next turn resends it, and how a request fails."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterable
from typing import Any

import httpx
import pytest
from kvtether.cli.streaming import (
    CHAT,
    COMPLETIONS,
    MESSAGES,
    RESPONSES,
    StreamFailure,
    TokenClock,
    loop_clock_ns,
    reader_for,
    stream_answer,
)
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

MS = 1_000_000  # ns


def feed(api: str, events: Iterable[tuple[int, dict[str, Any]]]) -> tuple[TokenClock, Any]:
    """The events, each at its time in ms after the request was sent (t0 = 0)."""
    clock = TokenClock(t0=0)
    reader = reader_for(api, clock)
    for at_ms, data in events:
        clock.event(at_ms * MS)
        reader.read(data, at_ms * MS)
    return clock, reader


def chunk(delta: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta}], **extra}


def test_chat_ttft_is_the_first_token_of_any_kind_and_tpot_runs_from_it() -> None:
    clock, r = feed(CHAT, [
        (5, chunk({"role": "assistant", "content": ""})),  # role only: TTFC, not a token
        (40, chunk({"reasoning_content": "think", "reasoning": "think"})),  # both names, one token event
        (60, chunk({"content": "Hi"})),
        (70, chunk({"tool_calls": [{"index": 0, "id": "call_1", "function": {"name": "read", "arguments": ""}}]})),
        (100, chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"p": 1}'}}]})),
        (101, {"id": "chatcmpl-1", "choices": [], "usage": {"prompt_tokens": 50, "completion_tokens": 7,
                                                            "prompt_tokens_details": {"cached_tokens": 32}}}),
    ])
    assert clock.ttfc_ms() == 5 and clock.ttft_ms() == 40
    assert clock.tpot_ms(r.completion_tokens) == pytest.approx((100 - 40) / 6)  # from the first token, usage's 7
    assert clock.tpot_ms(None) == pytest.approx((100 - 40) / 3)  # without usage: the 4 token events
    assert (r.prompt_tokens, r.completion_tokens, r.cached_tokens, r.response_id) == (50, 7, 32, "chatcmpl-1")
    assert r.message() == {"role": "assistant", "content": "Hi", "reasoning_content": "think", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "read", "arguments": '{"p": 1}'}}]}


def test_tpot_runs_to_the_end_of_generation_which_an_end_of_sequence_token_has_no_text_for() -> None:
    # A lone stream: a token a step (10 ms), the last step sampling the end of sequence (no text, in usage). The
    # finish chunk comes with that step, so the client's TPOT is the engine's step, not 9/10 of it.
    events = [(0, chunk({"role": "assistant", "content": ""})), *((10 * i, chunk({"content": f"w{i}"}))
                                                                   for i in range(1, 10)),
              (100, {"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
              (100, {"id": "chatcmpl-1", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 10}})]
    clock, r = feed(CHAT, events)
    assert clock.ttft_ms() == 10 and clock.tpot_ms(r.completion_tokens) == pytest.approx(10.0)
    assert clock.tpot_ms(None) == pytest.approx(10.0)  # without usage: the 9 token events, 10 ms apart


def test_a_refusal_or_a_tool_call_alone_is_a_token_and_one_token_has_no_tpot() -> None:
    clock, r = feed(CHAT, [(3, chunk({"role": "assistant"})), (9, chunk({"refusal": "no"}))])
    assert clock.ttft_ms() == 9 and clock.tpot_ms(1) is None
    clock, r = feed(CHAT, [(2, chunk({"tool_calls": [{"index": 0, "id": "c", "function": {"name": "f"}}]}))])
    assert clock.ttft_ms() == 2 and r.message()["content"] is None  # a tool-call-only answer: content null


def test_an_answer_without_a_token_has_no_ttft() -> None:
    clock, r = feed(CHAT, [(1, chunk({"role": "assistant", "content": ""})),
                           (2, {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})])
    assert clock.ttfc_ms() == 1 and clock.ttft_ms() is None and clock.tpot_ms(5) is None
    assert r.finish_reason == "length" and r.message() == {"role": "assistant", "content": ""}


def test_completions_responses_and_messages_by_the_same_rule() -> None:
    clock, r = feed(COMPLETIONS, [(4, {"choices": [{"index": 0, "text": "a"}]}), (8, {"choices": [{"text": "b"}]}),
                                  (9, {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}})])
    assert (clock.ttft_ms(), clock.tpot_ms(r.completion_tokens), r.text) == (4, 4, "ab")

    clock, r = feed(RESPONSES, [
        (1, {"type": "response.created", "response": {"id": "resp_1"}}),
        (2, {"type": "response.output_item.added", "output_index": 0, "item": {"type": "message"}}),
        (6, {"type": "response.reasoning_text.delta", "output_index": 0, "delta": "hm"}),
        (8, {"type": "response.output_text.delta", "output_index": 1, "delta": "ok"}),
        (9, {"type": "response.output_item.added", "output_index": 2,
             "item": {"type": "function_call", "call_id": "c1", "name": "f"}}),
        (12, {"type": "response.function_call_arguments.delta", "output_index": 2, "delta": "{}"}),
        (13, {"type": "response.completed", "response": {"id": "resp_1", "status": "completed", "usage": {
            "input_tokens": 10, "output_tokens": 4, "input_tokens_details": {"cached_tokens": 6}}}}),
    ])
    # The end of generation is response.completed: it comes with the step that sampled the last of the 4 tokens.
    assert clock.ttfc_ms() == 1 and clock.ttft_ms() == 6
    assert clock.tpot_ms(r.completion_tokens) == pytest.approx((13 - 6) / 3)
    assert (r.prompt_tokens, r.cached_tokens, r.response_id) == (10, 6, "resp_1")
    assert r.message()["content"] == "ok" and r.message()["tool_calls"][0]["function"] == {"name": "f",
                                                                                          "arguments": "{}"}

    clock, r = feed(MESSAGES, [
        (1, {"type": "message_start", "message": {"id": "msg_1", "usage": {"input_tokens": 5,
                                                                             "cache_read_input_tokens": 20}}}),
        (2, {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
        (7, {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hi"}}),
        (9, {"type": "content_block_start", "index": 1, "content_block": {"type": "tool_use", "id": "t1",
                                                                           "name": "g"}}),
        (15, {"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta",
                                                                    "partial_json": '{"a":1}'}}),
        (16, {"type": "message_delta", "delta": {"stop_reason": "tool_use"}, "usage": {"output_tokens": 5}}),
    ])
    assert clock.ttft_ms() == 7 and clock.tpot_ms(r.completion_tokens) == pytest.approx((16 - 7) / 4)  # stop_reason
    assert (r.prompt_tokens, r.cached_tokens, r.finish_reason) == (25, 20, "tool_use")
    assert r.message()["tool_calls"] == [{"id": "t1", "type": "function",
                                          "function": {"name": "g", "arguments": '{"a":1}'}}]


def _sse(events: list[dict[str, Any]]) -> Any:
    async def gen() -> Any:
        for e in events:
            yield f"data: {json.dumps(e)}\n\n".encode()
        yield b"data: [DONE]\n\n"

    return gen()


def _app() -> Starlette:
    async def chat(request: Request) -> Response:
        body = await request.json()
        if body.get("fail"):
            return JSONResponse({"error": {"message": "no such model"}}, status_code=404)
        events = [chunk({"role": "assistant"}), chunk({"content": "a"}), chunk({"content": "b"})]
        if body.get("break"):
            events.append({"error": {"message": "KV load failure"}})
        events.append({"id": "chatcmpl-1", "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2}})
        return StreamingResponse(_sse(events), media_type="text/event-stream",
                                 headers={"x-kvtether-reuse-source": "none"})

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


@pytest.mark.anyio
async def test_stream_answer_reads_a_stream_and_names_each_failure() -> None:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=_app()), base_url="http://gw") as client:
        got = await stream_answer(client, "/v1/chat/completions", {"model": "m", "messages": [], "stream": True})
        assert got.reader.text == "ab" and got.reader.completion_tokens == 2
        assert got.headers["x-kvtether-reuse-source"] == "none"
        ttfc, ttft, e2e = got.ttfc_ms(), got.ttft_ms(), got.e2e_ms()
        assert ttfc is not None and ttft is not None and e2e is not None and 0 <= ttfc <= ttft <= e2e
        assert got.tpot_ms() is not None and got.clock.events == 4
        with pytest.raises(StreamFailure) as e:
            await stream_answer(client, "/v1/chat/completions", {"fail": True})
        assert e.value.kind == "http_404" and "no such model" in e.value.message
        with pytest.raises(StreamFailure) as e:
            await stream_answer(client, "/v1/chat/completions", {"break": True})
        assert e.value.kind == "server_error" and e.value.message == "KV load failure"
        assert e.value.headers is not None and e.value.headers["x-kvtether-reuse-source"] == "none"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    async with httpx.AsyncClient() as client:
        with pytest.raises(StreamFailure) as e:
            await stream_answer(client, f"http://127.0.0.1:{port}/v1/chat/completions", {})
        assert e.value.kind == "connection"


def test_the_lean_client_reads_the_same_stream_and_names_the_same_failures() -> None:
    """The gateway's lean HTTP/1.1 client (a virtual-time replay's) against the same app under uvicorn on a
    virtual loop: the same answer, the same times, and the same failure kinds as httpx."""
    import uvicorn
    from kvtether.gateway.transport.upstream import Upstream
    from kvtether.sim.virtual import current_virtual_loop, run_virtual

    async def both() -> None:
        loop = current_virtual_loop()
        assert loop is not None
        server = uvicorn.Server(uvicorn.Config(_app(), host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
        task = asyncio.ensure_future(server.serve())
        while not server.started:
            assert not task.done(), "the server did not start"
            await asyncio.sleep(0.01)
        url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}/v1/chat/completions"
        body = {"model": "m", "messages": [], "stream": True}
        lean, clock = Upstream(clock=loop.time), loop_clock_ns()
        try:
            async with httpx.AsyncClient() as http:
                slow = await stream_answer(http, url, body, clock_ns=clock)
            fast = await stream_answer(lean, url, body, clock_ns=clock)
            assert fast.reader.text == slow.reader.text == "ab"
            assert fast.reader.completion_tokens == 2 and fast.clock.events == slow.clock.events == 4
            assert fast.headers["X-Kvtether-Reuse-Source"] == "none"  # case-insensitive, as httpx's
            assert (fast.ttfc_ms(), fast.ttft_ms(), fast.tpot_ms(), fast.e2e_ms()) == \
                (slow.ttfc_ms(), slow.ttft_ms(), slow.tpot_ms(), slow.e2e_ms())
            for bad, kind in (({"fail": True}, "http_404"), ({"break": True}, "server_error")):
                with pytest.raises(StreamFailure) as e:
                    await stream_answer(lean, url, bad, clock_ns=clock)
                assert e.value.kind == kind
            with pytest.raises(StreamFailure) as e:
                await stream_answer(lean, "http://127.0.0.1:1/v1/chat/completions", body, clock_ns=clock)
            assert e.value.kind == "connection"
        finally:
            await lean.aclose()
            server.should_exit = True
            await task

    run_virtual(both)
