"""A small fake OpenAI-compatible server for SDK tests (and for running the example by hand).

Real HTTP on 127.0.0.1 (uvicorn in a thread), so the openai client's own transport is exercised on
every major (httpx on 1.x/2.x, httpx2 on 3.x) and nothing is mocked. It records every request's
headers and raw body, and answers from a queue of scripted ``Reply``s, or, when the queue is empty,
like a toy agent model: with tools and a user turn last it calls the first tool, otherwise it answers
in text. A reply can fail its first attempts with HTTP 500 to exercise the client's retries.

    python tests/support/fake_openai.py --port 8000      # serves http://127.0.0.1:8000/v1
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


@dataclass
class Reply:
    content: str | None = None  # streamed as one chunk per word
    reasoning: str | None = None  # streamed before the content as ``reasoning_content`` deltas
    tool_calls: list[tuple[str, str]] | None = None  # (function name, arguments JSON)
    fail_first: int = 0  # answer the first N attempts with HTTP 500 (retryable)
    first_token_delay_s: float = 0.0  # pause between the role-only chunk and the first token
    finish_reason: str | None = None


@dataclass
class Seen:
    headers: dict[str, str]  # lower-cased names
    raw: bytes
    status: int
    path: str

    @property
    def body(self) -> dict[str, Any]:
        return json.loads(self.raw) if self.raw else {}


@dataclass
class FakeOpenAI:
    replies: deque[Reply] = field(default_factory=deque)
    seen: list[Seen] = field(default_factory=list)
    port: int = 0
    _server: uvicorn.Server | None = None
    _thread: threading.Thread | None = None
    _ids: itertools.count[int] = field(default_factory=itertools.count)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def script(self, *replies: Reply) -> None:
        self.replies.extend(replies)

    def reset(self) -> None:
        self.replies.clear()
        self.seen.clear()

    def chat_requests(self) -> list[Seen]:
        return [s for s in self.seen if s.path.endswith("/chat/completions")]

    def responses_requests(self) -> list[Seen]:
        return [s for s in self.seen if s.path.endswith("/responses")]

    # --- server -------------------------------------------------------------------------------

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/v1/responses", self._responses, methods=["POST"]),
                Route("/v1/sessions/{session_id}", self._end_session, methods=["DELETE"]),
                Route("/v1/models", self._models, methods=["GET"]),
            ]
        )

    def start(self) -> FakeOpenAI:
        config = uvicorn.Config(self.app(), host="127.0.0.1", port=self.port, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="fake-openai", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("fake OpenAI server did not start")
            time.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=5)

    async def _models(self, request: Request) -> Response:
        self.seen.append(Seen(dict(request.headers), b"", 200, request.url.path))
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model", "owned_by": "kv"}]})

    async def _chat(self, request: Request) -> Response:
        raw = await request.body()
        headers = {k.lower(): v for k, v in request.headers.items()}
        reply = self.replies[0] if self.replies else None
        if reply is not None and reply.fail_first > 0:
            reply.fail_first -= 1
            self.seen.append(Seen(headers, raw, 500, request.url.path))
            # retry-after-ms keeps the client's backoff short on every openai major.
            return JSONResponse(
                {"error": {"message": "scripted failure", "type": "server_error"}},
                status_code=500,
                headers={"retry-after-ms": "5", "x-should-retry": "true"},
            )
        if reply is not None:
            self.replies.popleft()
        self.seen.append(Seen(headers, raw, 200, request.url.path))
        body = json.loads(raw)
        reply = reply or _auto_reply(body)
        n = next(self._ids)
        rid = {"x-request-id": f"req-{n}"}
        model = body.get("model", "fake-model")
        if body.get("stream"):
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(
                _sse(reply, n, model, usage, body), media_type="text/event-stream", headers=rid
            )
        return JSONResponse(_completion(reply, n, model, body), headers=rid)


    async def _end_session(self, request: Request) -> Response:
        """The gateway's DELETE /v1/sessions/{id} (AgentSession.close()): recorded, nothing else."""
        self.seen.append(Seen({k.lower(): v for k, v in request.headers.items()}, b"", 204, request.url.path))
        return Response(status_code=204)

    async def _responses(self, request: Request) -> Response:
        """OpenAI Responses, streamed (the full event sequence) or not, from the same scripted replies."""
        raw = await request.body()
        headers = {k.lower(): v for k, v in request.headers.items()}
        reply = self.replies[0] if self.replies else None
        if reply is not None and reply.fail_first > 0:
            reply.fail_first -= 1
            self.seen.append(Seen(headers, raw, 500, request.url.path))
            return JSONResponse(
                {"error": {"message": "scripted failure", "type": "server_error"}},
                status_code=500,
                headers={"retry-after-ms": "5", "x-should-retry": "true"},
            )
        if reply is not None:
            self.replies.popleft()
        self.seen.append(Seen(headers, raw, 200, request.url.path))
        body = json.loads(raw)
        reply = reply or _auto_response_reply(body)
        n = next(self._ids)
        rid = {"x-request-id": f"req-{n}"}
        if body.get("stream"):
            return StreamingResponse(_response_events(reply, n, body), media_type="text/event-stream", headers=rid)
        return JSONResponse(_response(reply, n, body, "completed"), headers=rid)


def _auto_response_reply(body: dict[str, Any]) -> Reply:
    """Like _auto_reply, for Responses input items: call the first tool after a user turn, then answer."""
    raw = body.get("input")
    items = [{"type": "message", "role": "user", "content": raw}] if isinstance(raw, str) else list(raw or [])
    last = items[-1] if items else {}
    tools = [t for t in body.get("tools") or [] if t.get("type") == "function"]
    if tools and last.get("role") == "user":
        props = (tools[0].get("parameters") or {}).get("properties") or {}
        args = {k: (1 if v.get("type") in ("integer", "number") else "x") for k, v in props.items()}
        return Reply(tool_calls=[(tools[0].get("name", "tool"), json.dumps(args))])
    if last.get("type") == "function_call_output":
        return Reply(content=f"Done: {last.get('output')}")
    content = last.get("content")
    text = content if isinstance(content, str) else "".join(p.get("text", "") for p in content or [])
    return Reply(content=f"echo {text}")


def _response_output(reply: Reply, n: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if reply.reasoning:
        out.append({"id": f"rs_{n}", "type": "reasoning", "summary": [],
                    "content": [{"type": "reasoning_text", "text": reply.reasoning}]})
    if reply.content is not None:
        out.append({"id": f"msg_{n}", "type": "message", "role": "assistant", "status": "completed",
                    "content": [{"type": "output_text", "text": reply.content, "annotations": [], "logprobs": []}]})
    for i, (name, args) in enumerate(reply.tool_calls or []):
        out.append({"id": f"fc_{n}_{i}", "type": "function_call", "call_id": f"call_{n}_{i}", "name": name,
                    "arguments": args, "status": "completed"})
    return out


def _response(reply: Reply, n: int, body: dict[str, Any], status: str) -> dict[str, Any]:
    done = status != "in_progress"
    prompt = len(json.dumps(body.get("input"))) // 4
    out = len((reply.content or "").split()) + len(reply.tool_calls or []) * 8
    return {
        "id": f"resp_{n}",
        "object": "response",
        "created_at": 1_700_000_000,
        "model": body.get("model", "fake-model"),
        "status": status,
        "output": _response_output(reply, n) if done else [],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": body.get("tools") or [],
        "usage": {"input_tokens": prompt, "output_tokens": out, "total_tokens": prompt + out,
                  "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}
        if done else None,
    }


def _item_started(item: dict[str, Any]) -> dict[str, Any]:
    """An output item as ``response.output_item.added`` announces it: no content yet."""
    if item["type"] == "message":
        return {**item, "status": "in_progress", "content": []}
    if item["type"] == "function_call":
        return {**item, "status": "in_progress", "arguments": ""}
    return item


async def _response_events(reply: Reply, n: int, body: dict[str, Any]) -> AsyncIterator[bytes]:
    seq = itertools.count()

    def event(kind: str, **fields: Any) -> bytes:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': next(seq), **fields})}\n\n".encode()

    yield event("response.created", response=_response(reply, n, body, "in_progress"))
    yield event("response.in_progress", response=_response(reply, n, body, "in_progress"))
    if reply.first_token_delay_s:
        await asyncio.sleep(reply.first_token_delay_s)
    for index, item in enumerate(_response_output(reply, n)):
        yield event("response.output_item.added", output_index=index, item=_item_started(item))
        if item["type"] == "reasoning":
            for word in (reply.reasoning or "").split():
                yield event("response.reasoning_text.delta", item_id=item["id"], output_index=index,
                            content_index=0, delta=word + " ")
        elif item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            yield event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                        part=part)
            words = (reply.content or "").split(" ")
            for i, word in enumerate(words):
                yield event("response.output_text.delta", item_id=item["id"], output_index=index, content_index=0,
                            delta=word if i == 0 else " " + word, logprobs=[])
                await asyncio.sleep(0)
            yield event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                        text=reply.content, logprobs=[])
            yield event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                        part={**part, "text": reply.content})
        else:
            args = item["arguments"]
            for j in range(0, len(args), 5):
                yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                            delta=args[j : j + 5])
            yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                        arguments=args, name=item["name"])
        yield event("response.output_item.done", output_index=index, item=item)
    yield event("response.completed", response=_response(reply, n, body, "completed"))


def _auto_reply(body: dict[str, Any]) -> Reply:
    messages = body.get("messages") or []
    last = messages[-1] if messages else {}
    tools = body.get("tools") or []
    if tools and last.get("role") == "user":
        fn = tools[0].get("function", {})
        props = (fn.get("parameters") or {}).get("properties") or {}
        args = {k: (1 if v.get("type") in ("integer", "number") else "x") for k, v in props.items()}
        return Reply(tool_calls=[(fn.get("name", "tool"), json.dumps(args))])
    if last.get("role") == "tool":
        return Reply(content=f"Done: {last.get('content')}")
    return Reply(content=f"echo {last.get('content')}")


def _finish(reply: Reply) -> str:
    return reply.finish_reason or ("tool_calls" if reply.tool_calls else "stop")


def _usage(body: dict[str, Any], reply: Reply) -> dict[str, Any]:
    prompt = sum(len(json.dumps(m)) // 4 for m in body.get("messages") or [])
    out = len((reply.content or "").split()) + len(reply.tool_calls or []) * 8
    return {
        "prompt_tokens": prompt,
        "completion_tokens": out,
        "total_tokens": prompt + out,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def _tool_calls(reply: Reply, n: int) -> list[dict[str, Any]]:
    return [
        {"id": f"call_{n}_{i}", "type": "function", "function": {"name": name, "arguments": args}}
        for i, (name, args) in enumerate(reply.tool_calls or [])
    ]


def _completion(reply: Reply, n: int, model: str, body: dict[str, Any]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.reasoning:
        message["reasoning_content"] = reply.reasoning
    if reply.tool_calls:
        message["tool_calls"] = _tool_calls(reply, n)
    return {
        "id": f"chatcmpl-{n}",
        "object": "chat.completion",
        "created": 1_700_000_000,
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": _finish(reply)}],
        "usage": _usage(body, reply),
    }


async def _sse(reply: Reply, n: int, model: str, include_usage: bool, body: dict[str, Any]) -> AsyncIterator[bytes]:
    def chunk(delta: dict[str, Any], finish: str | None = None, usage: Any = None, choices: bool = True) -> bytes:
        obj: dict[str, Any] = {
            "id": f"chatcmpl-{n}",
            "object": "chat.completion.chunk",
            "created": 1_700_000_000,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}] if choices else [],
        }
        if usage is not None:
            obj["usage"] = usage
        return f"data: {json.dumps(obj)}\n\n".encode()

    # Like vLLM: a role-only first chunk that carries no token.
    yield chunk({"role": "assistant", "content": ""})
    if reply.first_token_delay_s:
        await asyncio.sleep(reply.first_token_delay_s)
    for word in (reply.reasoning or "").split():
        yield chunk({"reasoning_content": word + " "})
    words = (reply.content or "").split(" ") if reply.content else []
    for i, word in enumerate(words):
        yield chunk({"content": word if i == 0 else " " + word})
        await asyncio.sleep(0)
    for i, call in enumerate(_tool_calls(reply, n)):
        fn = call["function"]
        yield chunk({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                     "function": {"name": fn["name"], "arguments": ""}}]})  # fmt: skip
        args = fn["arguments"]
        for j in range(0, len(args), 5):
            yield chunk({"tool_calls": [{"index": i, "function": {"arguments": args[j : j + 5]}}]})
    yield chunk({}, finish=_finish(reply))
    if include_usage:
        yield chunk({}, usage=_usage(body, reply), choices=False)
    yield b"data: [DONE]\n\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    fake = FakeOpenAI(port=args.port)
    uvicorn.run(fake.app(), host="127.0.0.1", port=args.port, log_level="info")


if __name__ == "__main__":
    main()
