"""The node's HTTP surface, shaped like vLLM's OpenAI server, plus NIXL and admin endpoints.

Public (vLLM-shaped): ``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses``, ``/v1/messages`` (and
``/count_tokens``), ``/tokenize``, ``/detokenize``, ``/v1/models``, ``/health``, ``/version``, ``/metrics``.
Internal: ``/nixl/read``, ``/nixl/notify``, ``/nixl/heartbeat`` (node-to-node KV pull), ``/admin/fault``,
``/admin/state``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import struct
import time
from array import array
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any

import orjson
from kvtether.protocol.wire import KV_FIELD, openai_error_body
from kvtether.sim.agent_apis import agent_api_routes
from kvtether.sim.engine import EngineRequest, ErrorEvent, Event, FinishEvent, TokenEvent
from kvtether.sim.nixl import KVLoadError, encode_blocks
from kvtether.sim.parsers import ChatOutputParser, Delta, tool_call_ids
from kvtether.sim.requests import BadRequest, ParsedRequest, chat_prompt_ids, completion_prompt_ids, parse_request
from kvtether.sim.tokenizer import IncrementalDetokenizer
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

if TYPE_CHECKING:
    from kvtether.sim.node import SimNode


def error_response(status: int, message: str, *, param: str | None = None, kind: str | None = None) -> JSONResponse:
    default_kind = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError"}
    body = openai_error_body(message, kind or default_kind.get(status, "InternalServerError"), param, status)
    return JSONResponse(body, status_code=status)


async def _json_body(request: Request) -> Any:
    raw = await request.body()
    try:
        return orjson.loads(raw)  # fast on a long history; what it refuses, the standard parser decides on
    except orjson.JSONDecodeError:
        pass
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"invalid JSON body: {e}") from e


class _BulkJSONResponse(JSONResponse):
    """A JSON answer of token ids or KV contents (``/tokenize``, a NIXL read), serialized fast: tens of
    thousands of integers per turn."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


class StopTrimmer:
    """Holds back content that might begin a stop string, and cuts at the first stop string."""

    def __init__(self, stop: tuple[str, ...]) -> None:
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._buf = ""
        self.stopped = False

    def push(self, text: str) -> str:
        if not self._stop or self.stopped:
            return "" if self.stopped else text
        self._buf += text
        cut = min((i for i in (self._buf.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            out, self._buf, self.stopped = self._buf[:cut], "", True
            return out
        keep = len(self._buf) - self._hold
        out, self._buf = self._buf[:keep], self._buf[keep:]
        return out

    def flush(self) -> str:
        out, self._buf = self._buf, ""
        return "" if self.stopped else out


def request_seed(seed: int, req: ParsedRequest) -> bytes:
    """What a request's tool-call ids are drawn from: the cluster's seed, the prompt and the sampling seed, so that
    the same request gets the same ids whatever was served before it."""
    digest = hashlib.blake2b(array("q", req.prompt_ids).tobytes(), digest_size=16)
    digest.update(struct.pack("<qq", seed, -1 if req.spec.seed is None else req.spec.seed))
    return digest.digest()


class Completion:
    """One request's run through the engine, rendered as vLLM's chat or text completion objects."""

    def __init__(self, node: SimNode, req: ParsedRequest) -> None:
        self.node = node
        self.req = req
        self.chat = req.chat
        # vLLM's ids: the response id is `cmpl-`/`chatcmpl-` + a 16-hex base; completions add the prompt index
        # (`-0`), and the engine appends `-<8 hex>` to make its internal id unique. That internal id is what
        # `remote_request_id` carries: `cmpl-<16>-0-<8>` (observed on 0.32), `chatcmpl-<16>-<8>`.
        self.id = ("chatcmpl-" if req.chat else "cmpl-") + node.next_id(16)
        engine_id = self.id if req.chat else self.id + "-0"
        self.created = int(time.time())
        self.model = node.cfg.model_name
        self.parser = ChatOutputParser(node.tokenizer, parse_tools=req.parse_tools, tool_format=req.tool_format,
                                       call_ids=tool_call_ids(lambda: request_seed(node.cfg.seed, req)))
        self.trimmer = StopTrimmer(req.stop)
        self.detok = IncrementalDetokenizer(node.tokenizer)
        self.engine_request = EngineRequest(
            request_id=f"{engine_id}-{node.next_id(8)}",
            prompt_ids=req.prompt_ids,
            spec=req.spec,
            max_tokens=req.max_tokens,
            kv_params=req.kv_params,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            hang=node.faults.take_hang(),
            cache_salt=req.cache_salt,
        )
        self.output_ids: list[int] = []
        # A request may raise the server's --stream-interval, never lower it (vLLM clamps it up).
        self.stream_interval = max(node.cfg.stream_interval, req.stream_interval or 1)

    def usage(self) -> dict[str, Any]:
        r = self.engine_request
        prompt, completion = len(r.prompt_ids), len(self.output_ids)
        # vLLM's UsageInfo with --enable-prompt-tokens-details; the null fields are what it sends (the openai
        # client's models accept the extra keys).
        return {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": {
                "cached_tokens": r.cached_tokens,
                "created_cache_tokens": None,
                "multimodal_tokens": None,
            },
            "completion_tokens_details": None,
        }

    def delta_for(self, token_id: int) -> Delta:
        d = self.parser.push(token_id) if self.chat else Delta(content=self.detok.push(token_id))
        if d.content:
            d.content = self.trimmer.push(d.content)
        return d

    def finish_reason(self, ev: FinishEvent) -> str:
        if ev.reason == "stop" and self.parser.tool_calls:
            return "tool_calls"
        return ev.reason

    async def events(self) -> AsyncIterator[Event]:
        engine = self.node.engine
        engine.submit(self.engine_request)
        try:
            while True:
                ev = await self.engine_request.events.get()
                if isinstance(ev, TokenEvent):
                    self.output_ids.append(ev.token_id)
                yield ev
                if not isinstance(ev, TokenEvent):
                    return
        finally:
            engine.abort(self.engine_request)  # no-op when finished; frees KV when the client left

    def handle_for_stream(self, ev: FinishEvent) -> dict[str, Any] | None:
        # vLLM < 0.33 returned kv_transfer_params on non-streamed bodies only.
        return ev.kv_transfer_params if self.node.cfg.emulate != "0.32" else None


def _tool_call_json(index: int, call: Any) -> dict[str, Any]:
    return {
        "index": index,
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


async def _until_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _collect(c: Completion, request: Request) -> list[Event]:
    """Run a non-streamed request, aborting it in the engine if the client disconnects."""
    out: list[Event] = []

    async def consume() -> None:
        async for ev in c.events():
            out.append(ev)

    consumer = asyncio.ensure_future(consume())
    watcher = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (consumer, watcher):
            t.cancel()
        for t in (consumer, watcher):
            with contextlib.suppress(asyncio.CancelledError):
                await t
    return out


def _full_body(c: Completion, events: list[Event]) -> Response:
    last = events[-1] if events else ErrorEvent(499, "client disconnected")
    if isinstance(last, ErrorEvent):
        return error_response(last.status, last.message)
    assert isinstance(last, FinishEvent)
    content, reasoning = "", ""
    for ev in events:
        if isinstance(ev, TokenEvent):
            d = c.delta_for(ev.token_id)
            content += d.content
            reasoning += d.reasoning
    if c.chat:
        # A tool call cut off by max_tokens comes back as its raw text (vLLM's hermes and glm47 parsers,
        # non-streamed).
        content += c.trimmer.push(c.parser.finish().content)
    content += c.trimmer.flush()
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": c.finish_reason(last)}
    if c.chat:
        calls = c.parser.tool_calls
        message: dict[str, Any] = {
            "role": "assistant",
            "content": content if content or not calls else None,
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
            "tool_calls": [_tool_call_json(i, t) for i, t in enumerate(calls)],
            "reasoning_content": reasoning or None,
            "reasoning": reasoning or None,
        }
        choice["message"] = message
    else:
        choice["text"] = content
    choice["stop_reason"] = last.stop_reason
    prompt_ids = list(c.engine_request.prompt_ids) if c.req.return_token_ids else None
    choice["token_ids"] = list(c.output_ids) if c.req.return_token_ids else None
    if c.chat:
        choice["routed_experts"] = None
    else:
        # Completions carry the prompt per choice (one prompt per choice), never at top level.
        choice["prompt_logprobs"] = None
        choice["prompt_token_ids"] = prompt_ids
    body: dict[str, Any] = {
        "id": c.id,
        "object": "chat.completion" if c.chat else "text_completion",
        "created": c.created,
        "model": c.model,
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": c.usage(),
    }
    if c.chat:
        body["prompt_logprobs"] = None
        body["prompt_token_ids"] = prompt_ids
        body["prompt_text"] = None
        body[KV_FIELD] = last.kv_transfer_params
    else:
        body[KV_FIELD] = last.kv_transfer_params
        body["ec_transfer_params"] = None
        body["metrics"] = None
    return JSONResponse(body)


def _sse(obj: dict[str, Any]) -> bytes:
    # Compact JSON, as vLLM's pydantic chunks are (model_dump_json), and UTF-8 as it is.
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def _stream(c: Completion) -> AsyncIterator[bytes]:
    obj = "chat.completion.chunk" if c.chat else "text_completion"

    def chunk(choice: dict[str, Any] | None, **extra: Any) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": c.id,
            "object": obj,
            "created": c.created,
            "model": c.model,
            "choices": [choice] if choice is not None else [],
        }
        body.update(extra)
        return body

    def choice_of(d: Delta, token_ids: list[int] | None, finish: str | None = None) -> dict[str, Any]:
        ch: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
        if c.chat:
            delta: dict[str, Any] = {}
            if d.reasoning:
                delta["reasoning_content"] = d.reasoning
                delta["reasoning"] = d.reasoning
            if d.content:
                delta["content"] = d.content
            if d.tool_calls:
                delta["tool_calls"] = [t.to_json() for t in d.tool_calls]
            ch["delta"] = delta
        else:
            ch["text"] = d.content
        if token_ids is not None:
            ch["token_ids"] = token_ids
        return ch

    def role_chunk() -> bytes:
        first: dict[str, Any] = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        extra = {"prompt_token_ids": list(c.engine_request.prompt_ids)} if c.req.return_token_ids else {}
        return _sse(chunk(first, **extra))

    pending_ids: list[int] = []
    # --stream-interval (vLLM's output processor): the first token goes out at once, then a chunk once `interval`
    # tokens have gathered since the last one, and the rest with the finish. With 1, every token is a chunk.
    interval = c.stream_interval
    gathered, since_sent, first_sent = Delta(), 0, False
    # vLLM's serving_chat sends the role chunk on the first engine output (its stream generator's
    # `first_iteration`, after prefill or the KV load and the first token), not on acceptance; an error
    # before any output is the stream's first event instead. So the first chunk marks the first token,
    # which is what `vllm bench serve` times as TTFT.
    role_pending = c.chat
    async for ev in c.events():
        if role_pending and not isinstance(ev, ErrorEvent):
            role_pending = False
            yield role_chunk()
        if isinstance(ev, TokenEvent):
            d = c.delta_for(ev.token_id)
            pending_ids.append(ev.token_id)
            if interval > 1:
                gathered.extend(d)
                since_sent += 1
                if first_sent and since_sent < interval:
                    continue
                d, gathered, since_sent, first_sent = gathered, Delta(), 0, True
            if d.empty() and not c.req.return_token_ids:
                continue
            ids = pending_ids if c.req.return_token_ids else None
            ch = choice_of(d, ids)
            if not c.chat and c.req.return_token_ids and len(c.output_ids) == 1:
                ch["prompt_token_ids"] = list(c.engine_request.prompt_ids)
            pending_ids = []
            yield _sse(chunk(ch))
        elif isinstance(ev, FinishEvent):
            tail = Delta()
            if c.chat:
                # A call cut off after its name streamed has already sent what was generated of it; one cut
                # earlier (or unparseable) ends as raw content, as the non-streamed answer does.
                streamed = c.parser.unfinished_call
                tail = c.parser.finish()
                tail.content = "" if streamed else c.trimmer.push(tail.content)
            tail.content += c.trimmer.flush()
            gathered.extend(tail)
            tail = gathered
            ch = choice_of(tail, pending_ids if c.req.return_token_ids else None, c.finish_reason(ev))
            ch["stop_reason"] = ev.stop_reason
            handle = c.handle_for_stream(ev)
            yield _sse(chunk(ch, **({KV_FIELD: handle} if handle is not None else {})))
            if c.req.include_usage:
                yield _sse(chunk(None, usage=c.usage()))
        else:
            yield _sse(openai_error_body(ev.message, "InternalServerError", None, ev.status))
    yield b"data: [DONE]\n\n"


def _peer_version(body: Mapping[str, Any]) -> str | None:
    """The reader's vLLM version, for the NIXL handshake's compatibility check (absent: not checked)."""
    v = body.get("vllm_version")
    return None if v is None else str(v)


def build_app(node: SimNode) -> Starlette:
    def _unknown_model(body: dict[str, Any]) -> Response | None:
        """vLLM's check of a request's `model` (completions, /tokenize, /detokenize): none or the served name."""
        model = body.get("model")
        if not model or model == node.cfg.model_name:
            return None
        return error_response(404, f"The model `{model}` does not exist. Valid aliases: {node.cfg.model_name}.",
                              param="model", kind="NotFoundError")

    async def completions(request: Request, *, chat: bool) -> Response:
        try:
            body = await _json_body(request)
        except BadRequest as e:
            return error_response(400, str(e), param=e.param)
        return await complete(body, request, chat=chat)

    async def complete(body: Any, request: Request, *, chat: bool) -> Response:
        """A chat or text completion of a parsed body (also what /v1/responses and /v1/messages run)."""
        try:
            if isinstance(body, dict) and (unknown := _unknown_model(body)) is not None:
                return unknown
            parsed = parse_request(node.tokenizer, body, chat=chat, max_model_len=node.cfg.max_model_len,
                                   tool_format=node.tool_format, callable_tools=node.cfg.callable_tools)
        except BadRequest as e:
            return error_response(400, str(e), param=e.param)
        if node.faults.take_fail():
            return error_response(500, "injected fault (admin/fault fail_next)")
        c = Completion(node, parsed)
        if parsed.stream:
            return StreamingResponse(_stream(c), media_type="text/event-stream")
        return _full_body(c, await _collect(c, request))

    async def chat_completions(request: Request) -> Response:
        return await completions(request, chat=True)

    async def text_completions(request: Request) -> Response:
        return await completions(request, chat=False)

    async def tokenize(request: Request) -> Response:
        try:
            body = await _json_body(request)
            if not isinstance(body, dict):
                raise BadRequest("the request body must be a JSON object")
            if (unknown := _unknown_model(body)) is not None:
                return unknown
            if "messages" in body:
                ids = chat_prompt_ids(node.tokenizer, body, tool_format=node.tool_format)
            else:
                ids = completion_prompt_ids(node.tokenizer, body)
        except BadRequest as e:
            return error_response(400, str(e), param=e.param)
        return _BulkJSONResponse(
            {"count": len(ids), "max_model_len": node.cfg.max_model_len, "tokens": ids, "token_strs": None}
        )

    async def detokenize(request: Request) -> Response:
        try:
            body = await _json_body(request)
            if isinstance(body, dict) and (unknown := _unknown_model(body)) is not None:
                return unknown
            tokens = body.get("tokens") if isinstance(body, dict) else None
            if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
                raise BadRequest("tokens must be a list of integers", "tokens")
        except BadRequest as e:
            return error_response(400, str(e), param=e.param)
        return JSONResponse({"prompt": node.tokenizer.decode(tokens)})

    async def models(request: Request) -> Response:
        m = node.cfg.model_name
        card = {
            "id": m,
            "object": "model",
            "created": int(node.started_at),
            "owned_by": "vllm",
            "root": m,
            "parent": None,
            "max_model_len": node.cfg.max_model_len,
            "permission": [],
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    async def version(request: Request) -> Response:
        return JSONResponse({"version": node.cfg.version})

    async def metrics(request: Request) -> Response:
        node.engine._update_gauges()
        return Response(node.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def nixl_read(request: Request) -> Response:
        body = await _json_body(request)
        try:
            blocks = node.engine.serve_read(
                str(body.get("engine_id") or ""),
                str(body["request_id"]),
                [int(b) for b in body["block_ids"]],
                _peer_version(body),
            )
        except KVLoadError as e:
            return error_response(409, str(e), kind="KVTransferDeclined")
        return _BulkJSONResponse(encode_blocks(blocks))

    async def nixl_notify(request: Request) -> Response:
        body = await request.json()
        freed = node.engine.serve_notify(str(body.get("engine_id") or ""), str(body["request_id"]), _peer_version(body))
        return JSONResponse({"freed": freed})

    async def nixl_heartbeat(request: Request) -> Response:
        body = await request.json()
        renewed = node.engine.serve_heartbeat(
            str(body.get("engine_id") or ""), str(body["request_id"]), _peer_version(body)
        )
        return JSONResponse({"renewed": renewed})

    async def admin_fault(request: Request) -> Response:
        body = await request.json()
        if not isinstance(body, dict):
            return error_response(400, "body must be an object")
        return JSONResponse(node.faults.apply(body, node))

    async def admin_state(request: Request) -> Response:
        return JSONResponse(node.state())

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        *agent_api_routes(node, lambda body, request: complete(body, request, chat=True)),
        Route("/v1/completions", text_completions, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/nixl/read", nixl_read, methods=["POST"]),
        Route("/nixl/notify", nixl_notify, methods=["POST"]),
        Route("/nixl/heartbeat", nixl_heartbeat, methods=["POST"]),
        Route("/admin/fault", admin_fault, methods=["POST"]),
        Route("/admin/state", admin_state, methods=["GET"]),
    ]
    return Starlette(routes=routes)
