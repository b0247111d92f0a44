"""Fake vLLM backends, a bare pass-through proxy and a raw HTTP client for benchmarks/gateway_overhead.py.

Fast on purpose, so that what is measured is the proxy in front: the backends and the client are plain asyncio
(uvloop) with a minimal HTTP/1.1 of their own. A backend answers like vLLM 0.33 in P/D mode: a prefill leg
(non-streamed, `kv_transfer_params` in) gets a one-token completion with P's params; a streamed request gets
`max_tokens` content chunks (with `token_ids` when asked for `return_token_ids`, the prompt's ids on the first
chunk), then a `finish_reason` chunk carrying D's handle, then `[DONE]`. With a tokenizer (guarded runs) the
prompt ids are the real ones and the answer's ids re-tokenize exactly, so the gateway's guard verifies every
turn; `/tokenize` answers with the same tokenizer.

    python benchmarks/overhead_backends.py backend --port 9001 [--tokenizer DIR]
    python benchmarks/overhead_backends.py bare --port 9002 --upstream http://127.0.0.1:9001
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import time
from typing import Any

import orjson

MODEL = "fake-model"
DEBUG = bool(os.environ.get("KVTETHER_FAKE_DEBUG"))
_ids = itertools.count()


# ---- the backend -------------------------------------------------------------------------------------------


class Backend:
    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer  # kvtether.gateway.guard.tokenizer.LocalTokenizer, or None

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                request = await read_request(reader)
                if request is None:
                    break
                method, path, body = request
                await self.route(method, path, body, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def route(self, method: str, path: str, body: bytes, writer: asyncio.StreamWriter) -> None:
        if method == "GET":
            if path.startswith("/v1/models"):
                return send_json(writer, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
            if path.startswith("/version"):
                return send_json(writer, {"version": "0.33.0"})
            if path.startswith("/metrics"):
                return send(writer, b"text/plain", b'vllm:num_requests_running{model_name="fake-model"} 0\n'
                            b'vllm:num_requests_waiting{model_name="fake-model"} 0\n'
                            b'vllm:cache_config_info{block_size="16",enable_prefix_caching="True"} 1\n')
            return send_json(writer, {})
        req = orjson.loads(body) if body else {}
        if DEBUG:
            print(method, path, body[:400], flush=True)
        if path == "/tokenize":
            ids = await self.prompt_ids(req, tokenize=True)
            return send_json(writer, {"tokens": ids, "count": len(ids), "max_model_len": 131072})
        if not req.get("stream"):
            return send_json(writer, await self.whole(req))
        await self.stream(req, writer)

    async def prompt_ids(self, req: dict[str, Any], tokenize: bool = False) -> list[int]:
        """The prompt's ids: of a /tokenize body, or of a completion request (rendered as /tokenize would)."""
        if self.tokenizer is None:
            return list(range(100, 116))
        from kvtether.gateway.turn.body import tokenize_body

        payload = req if tokenize else tokenize_body("chat" if "messages" in req else "completions", req)
        return list(await self.tokenizer.encode(payload or {}))

    async def whole(self, req: dict[str, Any]) -> dict[str, Any]:
        kv = req.get("kv_transfer_params")
        ids = await self.prompt_ids(req) if self.tokenizer is not None else []
        pulled = kv.get("remote_num_tokens", 0) if isinstance(kv, dict) else 0
        params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2, 3]],
                  "remote_engine_id": "fake-p", "remote_request_id": f"p-{next(_ids)}", "remote_host": "localhost",
                  "remote_port": 5600, "remote_num_tokens": len(ids), "tp_size": 1}
        return {"id": f"cmpl-{next(_ids)}", "object": "chat.completion", "created": 0, "model": MODEL,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "length"}],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": 1, "total_tokens": len(ids) + 1,
                          "prompt_tokens_details": {"cached_tokens": pulled}},
                "kv_transfer_params": params if kv is not None else None}

    async def stream(self, req: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        n = int(req.get("max_tokens") or 16)
        want_ids = req.get("return_token_ids") is True
        prompt = await self.prompt_ids(req) if want_ids or self.tokenizer is not None else []
        pieces, out_ids = self.answer(n)
        rid = f"chatcmpl-{next(_ids)}"
        head = {"id": rid, "object": "chat.completion.chunk", "created": 0, "model": MODEL}
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        first: dict[str, Any] = {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                      "logprobs": None, "finish_reason": None}]}
        if want_ids:
            first["prompt_token_ids"] = prompt
        event(writer, first)
        per = max(1, len(out_ids) // n)
        for i, piece in enumerate(pieces):
            choice: dict[str, Any] = {"index": 0, "delta": {"content": piece}, "logprobs": None, "finish_reason": None}
            if want_ids:
                choice["token_ids"] = out_ids[i * per:] if i == n - 1 else out_ids[i * per:(i + 1) * per]
            event(writer, {**head, "choices": [choice]})
            await asyncio.sleep(0)  # one write per chunk, as an engine emits them
        last: dict[str, Any] = {**head, "choices": [{"index": 0, "delta": {}, "logprobs": None,
                                                     "finish_reason": "stop"}]}
        if req.get("kv_transfer_params") is not None:
            # vLLM >= 0.33: D's handle on the finish chunk (prompt + output - 1 tokens).
            last["kv_transfer_params"] = {
                "do_remote_prefill": False, "do_remote_decode": True, "remote_block_ids": [[1, 2, 3]],
                "remote_engine_id": "fake-d", "remote_request_id": rid, "remote_host": "localhost",
                "remote_port": 5601, "remote_num_tokens": len(prompt) + len(out_ids) - 1,
                "remote_blocks_expiry_time": time.perf_counter() + 480, "tp_size": 1}
        if (req.get("stream_options") or {}).get("include_usage"):
            last["usage"] = {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}
        event(writer, last)
        chunk(writer, b"data: [DONE]\n\n")
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    def answer(self, n: int) -> tuple[list[str], list[int]]:
        """The answer's text pieces (one per chunk) and its token ids (as the next prompt re-tokenizes them)."""
        pieces = [f"word{i} " for i in range(n)]
        if self.tokenizer is None:
            return pieces, list(range(1000, 1000 + n))
        text = "".join(pieces)
        ids = self.tokenizer.encode_sync({"model": MODEL, "prompt": text, "add_special_tokens": False})
        return pieces, ids


# ---- minimal HTTP/1.1 ----------------------------------------------------------------------------------


async def read_request(reader: asyncio.StreamReader) -> tuple[str, str, bytes] | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    lines = head.split(b"\r\n")
    method, path, _ = lines[0].decode().split(" ", 2)
    length = 0
    chunked = False
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding" and b"chunked" in value.lower():
            chunked = True
    if chunked:
        parts = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            data = await reader.readexactly(size + 2)
            if size == 0:
                break
            parts.append(data[:-2])
        return method, path, b"".join(parts)
    return method, path, await reader.readexactly(length) if length else b""


def send(writer: asyncio.StreamWriter, ctype: bytes, data: bytes) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: " + ctype + b"\r\ncontent-length: " + str(len(data)).encode()
                 + b"\r\n\r\n" + data)


def send_json(writer: asyncio.StreamWriter, obj: Any) -> None:
    send(writer, b"application/json", orjson.dumps(obj))


def chunk(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(b"%x\r\n" % len(data) + data + b"\r\n")


def event(writer: asyncio.StreamWriter, obj: Any) -> None:
    chunk(writer, b"data: " + orjson.dumps(obj) + b"\n\n")


class Client:
    """One keep-alive connection; `post` returns (seconds to the first SSE data line, response body)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[float | None, bytes]:
        if self.writer is None or self.writer.is_closing():
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        t0 = time.perf_counter()
        self.writer.write(f"POST {path} HTTP/1.1\r\nhost: {self.host}\r\ncontent-type: application/json\r\n"
                          f"content-length: {len(body)}\r\n{extra}\r\n".encode() + body)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        lowered = head.lower()
        first: float | None = None
        if b"transfer-encoding: chunked" in lowered:
            parts = []
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
                data = await self.reader.readexactly(size + 2)
                if size == 0:
                    break
                if first is None and b"data:" in data:
                    first = time.perf_counter() - t0
                parts.append(data[:-2])
            out = b"".join(parts)
        else:
            length = int(lowered.split(b"content-length:")[1].split(b"\r\n")[0])
            out = await self.reader.readexactly(length)
            if first is None and b"data:" in out:
                first = time.perf_counter() - t0
        if status != 200:
            raise RuntimeError(f"HTTP {status} from :{self.port}{path}: {out[:300]!r}")
        if b"connection: close" in lowered:
            self.writer.close()
            self.writer = None
        return first, out

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


# ---- the bare pass-through -----------------------------------------------------------------------------


def bare_app(upstream: str) -> Any:
    """Starlette + httpx, nothing else: the request body to the upstream, its stream back as it comes."""
    import httpx
    from starlette.applications import Starlette
    from starlette.background import BackgroundTask
    from starlette.requests import Request
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    client = httpx.AsyncClient(base_url=upstream, timeout=None, limits=httpx.Limits(max_keepalive_connections=64))

    async def proxy(request: Request) -> StreamingResponse:
        req = client.build_request("POST", request.url.path, content=await request.body(),
                                   headers={"content-type": "application/json"})
        resp = await client.send(req, stream=True)
        return StreamingResponse(resp.aiter_raw(), status_code=resp.status_code,
                                 media_type=resp.headers.get("content-type"), background=BackgroundTask(resp.aclose))

    return Starlette(routes=[Route("/v1/chat/completions", proxy, methods=["POST"])])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("backend", "bare"))
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--tokenizer")
    ap.add_argument("--upstream")
    args = ap.parse_args()
    import uvloop

    if args.what == "bare":
        import uvicorn

        uvicorn.run(bare_app(args.upstream), port=args.port, log_level="warning", loop="uvloop", http="httptools",
                    access_log=False)
        return
    tokenizer = None
    if args.tokenizer:
        from kvtether.gateway.guard.tokenizer import LocalTokenizer

        tokenizer = LocalTokenizer.load(args.tokenizer)

    async def run() -> None:
        server = await asyncio.start_server(Backend(tokenizer).serve, "127.0.0.1", args.port, backlog=1024)
        async with server:
            await server.serve_forever()

    uvloop.run(run())


if __name__ == "__main__":
    main()
