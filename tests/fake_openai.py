"""A small fake OpenAI-compatible server for SDK tests (and for running the example by hand).

Real HTTP on 127.0.0.1 (uvicorn in a thread), so the openai client's own transport is exercised on
every major (httpx on 1.x/2.x, httpx2 on 3.x) and nothing is mocked. It records every request's
headers and raw body, and answers from a queue of scripted ``Reply``s, or, when the queue is empty,
like a toy agent model: with tools and a user turn last it calls the first tool, otherwise it answers
in text. A reply can fail its first attempts with HTTP 500 to exercise the client's retries.

    python tests/fake_openai.py --port 8000      # serves http://127.0.0.1:8000/v1
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

    # --- server -------------------------------------------------------------------------------

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
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
