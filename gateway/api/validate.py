"""What the gateway accepts (pure, but for reading the body): a request it cannot serve gets a clear OpenAI-style
4xx here, before it touches a session or a node.

The checks are the ones that protect the gateway and the engines: body size and JSON depth (a deep body
must never reach a recursive walk), the shape of messages, content parts and tools, numeric ranges, the
session headers, and the prompt's length against the served model's ``max_model_len`` — by a bound on
characters, so a megabyte prompt is refused without being tokenized. Sampling fields the gateway does not
read are checked for type and sign only; vLLM owns their finer rules and answers 400 itself.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import orjson
from kvtether.gateway.errors import GatewayError
from kvtether.gateway.turn.body import KV_FIELD
from kvtether.protocol.contract import (
    FOREIGN_SESSION_HEADERS,
    PREFIX_HEADER,
    PREFIX_PARENT_HEADER,
    SESSION_HEADER,
    TURN_HEADER,
)
from starlette.requests import Request

# The deepest part of a legitimate request is a tool's JSON-schema `parameters` (objects of properties of
# items of …): 32 levels leave room for the deepest real schemas, while the gateway's own walks (copying a
# body for each leg, hashing messages) stay far below Python's recursion limit.
MAX_JSON_DEPTH = 32
# Characters one token can stand for, at most, in the tokenizers vLLM serves (BPE merges of repeated
# whitespace or punctuation reach a few dozen): a prompt longer than max_model_len × this cannot fit.
MAX_CHARS_PER_TOKEN = 32
# Work the gateway does per request grows with these (the depth walk, hashing the message chain, rendering):
# a body of 300,000 tiny messages held the event loop for seconds. Real agent histories stay far below.
MAX_MESSAGES = 10_000
MAX_TOOLS = 1_024
MAX_PARTS = 1_024  # content parts of one message
ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
# A session id travels in headers, logs, spans and store keys: printable, no spaces, bounded.
_SESSION_ID = re.compile(r"[A-Za-z0-9._:~/@+=\-]{1,256}")
_PREFIX_ID = re.compile(r"[0-9a-fA-F]{1,128}")
MAX_CACHE_SALT = 1_024
_MAX_N = 128  # choices per request (aggregated mode); vLLM's own default limit on best_of/n is of this order


def check_session_id(value: str, param: str = "session_id") -> None:
    if not _SESSION_ID.fullmatch(value):
        raise bad("a session id is 1-256 characters of A-Z a-z 0-9 . _ : ~ / @ + = -", param=param,
                  code="invalid_session_id")


def bad(message: str, param: str | None = None, code: str = "invalid_request") -> GatewayError:
    return GatewayError(400, message, param=param, code=code)


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise GatewayError(413, f"request body exceeds {limit} bytes", code="body_too_large")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise GatewayError(413, f"request body exceeds {limit} bytes", code="body_too_large")
        chunks.append(chunk)
    try:
        # orjson refuses nesting beyond 1024 levels itself (no RecursionError); the tighter limit follows.
        data = orjson.loads(b"".join(chunks))
    except orjson.JSONDecodeError as exc:
        raise GatewayError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise GatewayError(400, "request body must be a JSON object", code="invalid_json")
    for name, limit in (("messages", MAX_MESSAGES), ("input", MAX_MESSAGES), ("tools", MAX_TOOLS)):
        value = data.get(name)
        if isinstance(value, list) and len(value) > limit:  # before the walk below, which is per value
            raise bad(f"{name} holds {len(value)} items; at most {limit} are served", name, "too_many_items")
    if depth(data) > MAX_JSON_DEPTH:
        raise GatewayError(400, f"request body is nested deeper than {MAX_JSON_DEPTH} levels", code="too_deep")
    return data


def depth(obj: Any) -> int:
    """Nesting depth of a parsed JSON value (iterative: a deep value cannot exhaust the stack)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        value, d = stack.pop()
        if isinstance(value, dict):
            deepest = max(deepest, d)
            stack.extend((v, d + 1) for v in value.values())
        elif isinstance(value, list):
            deepest = max(deepest, d)
            stack.extend((v, d + 1) for v in value)
    return deepest


def check_headers(headers: Mapping[str, str]) -> None:
    for name in (SESSION_HEADER, *FOREIGN_SESSION_HEADERS):
        value = headers.get(name)
        if value is not None and value.strip() and not _SESSION_ID.fullmatch(value.strip()):
            raise bad(f"header {name} must be 1–256 characters of A–Z a–z 0–9 . _ : ~ / @ + = -", name,
                      "invalid_header")
    turn = headers.get(TURN_HEADER)
    if turn is not None and not (turn.isdigit() and len(turn) <= 9):
        raise bad(f"header {TURN_HEADER} must be a non-negative integer", TURN_HEADER, "invalid_header")
    for name in (PREFIX_HEADER, PREFIX_PARENT_HEADER):
        value = headers.get(name)
        if value is not None and not _PREFIX_ID.fullmatch(value):
            raise bad(f"header {name} must be a hex digest", name, "invalid_header")


def check_body(kind: str, body: dict[str, Any], *, pd: bool) -> None:
    """The request's shape and ranges; `pd`: P/D mode (one sequence per request: handles cover one)."""
    if KV_FIELD in body:
        raise GatewayError(400, "kv_transfer_params is set by the gateway, not by clients", param=KV_FIELD,
                           code="forbidden_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise GatewayError(400, "you must provide a model parameter", param="model", code="missing_model")
    for flag in ("stream", "return_token_ids", "logprobs", "echo", "ignore_eos", "add_generation_prompt",
                 "continue_final_message", "add_special_tokens", "parallel_tool_calls"):
        if flag in body and not isinstance(body[flag], bool):
            raise bad(f"{flag} must be a boolean", flag)
    _check_numbers(body, pd=pd)
    if kind == "chat":
        _check_messages(body.get("messages"))
        _check_tools(body)
    else:
        _check_prompt(body.get("prompt"), pd=pd)
    for name in ("stream_options", "response_format", "chat_template_kwargs", "logit_bias", "metadata"):
        if body.get(name) is not None and not isinstance(body[name], dict):
            raise bad(f"{name} must be an object", name)
    salt = body.get("cache_salt")
    if salt is not None and not (isinstance(salt, str) and 0 < len(salt) <= MAX_CACHE_SALT):
        raise bad(f"cache_salt must be a string of 1-{MAX_CACHE_SALT} characters", "cache_salt")
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) or (isinstance(stop, list)
                                                           and all(isinstance(s, str) for s in stop))):
        raise bad("stop must be a string or a list of strings", "stop")


def _number(body: Mapping[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise bad(f"{name} must be a finite number", name)
    return float(value)


def _integer(body: Mapping[str, Any], name: str, low: int, high: int | None = None) -> None:
    value = body.get(name)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        span = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise bad(f"{name} must be an integer {span}", name)


def _check_numbers(body: Mapping[str, Any], *, pd: bool) -> None:
    _integer(body, "max_tokens", 1)
    _integer(body, "max_completion_tokens", 1)
    _integer(body, "min_tokens", 0)
    _integer(body, "top_logprobs", 0, 20)
    _integer(body, "seed", -(2**63), 2**64 - 1)
    _integer(body, "n", 1, 1 if pd else _MAX_N)
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    if isinstance(body.get("min_tokens"), int) and isinstance(limit, int) and body["min_tokens"] > limit:
        raise bad("min_tokens must not exceed max_tokens", "min_tokens")
    for name in ("temperature", "min_p", "repetition_penalty"):
        v = _number(body, name)
        if v is not None and v < 0:
            raise bad(f"{name} must be >= 0", name)
    top_p = _number(body, "top_p")
    if top_p is not None and not 0 < top_p <= 1:
        raise bad("top_p must be in (0, 1]", "top_p")
    for name in ("presence_penalty", "frequency_penalty"):
        v = _number(body, name)
        if v is not None and not -2 <= v <= 2:
            raise bad(f"{name} must be in [-2, 2]", name)
    top_k = body.get("top_k")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < -1):
        raise bad("top_k must be an integer >= -1", "top_k")


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list of objects", "messages")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad("messages must be a non-empty list of objects", "messages")
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"{where}.role must be one of {', '.join(sorted(ROLES))}", f"{where}.role")
        _check_content(m.get("content"), f"{where}.content",
                       optional=role == "assistant" or (role == "function" and "name" in m))
        for key in ("name", "tool_call_id", "reasoning_content", "reasoning"):
            if m.get(key) is not None and not isinstance(m[key], str):
                raise bad(f"{where}.{key} must be a string", f"{where}.{key}")
        calls = m.get("tool_calls")
        if calls is not None:
            if role != "assistant" or not isinstance(calls, list):
                raise bad(f"{where}.tool_calls must be a list, on an assistant message", f"{where}.tool_calls")
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)
                        and isinstance(fn.get("arguments", ""), str | dict)):
                    raise bad(f"{where}.tool_calls[{j}] must have a function with a name and arguments",
                              f"{where}.tool_calls")


def _check_content(content: Any, where: str, *, optional: bool) -> None:
    if content is None:
        if not optional:
            raise bad(f"{where} is required", where)
        return
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise bad(f"{where} must be a string or a list of content parts", where)
    if len(content) > MAX_PARTS:
        raise bad(f"{where} holds {len(content)} parts; at most {MAX_PARTS} are served", where, "too_many_items")
    for j, part in enumerate(content):
        if not (isinstance(part, dict) and isinstance(part.get("type"), str)):
            raise bad(f"{where}[{j}] must be an object with a type", where)
        if part["type"] == "text" and not isinstance(part.get("text"), str):
            raise bad(f"{where}[{j}].text must be a string", where)


def _check_tools(body: Mapping[str, Any]) -> None:
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise bad("tools must be a list of function tools", "tools")
        for i, tool in enumerate(tools):
            fn = tool.get("function") if isinstance(tool, dict) else None
            if not (isinstance(tool, dict) and tool.get("type", "function") == "function" and isinstance(fn, dict)
                    and isinstance(fn.get("name"), str) and fn["name"]
                    and isinstance(fn.get("parameters", {}), dict)):
                raise bad(f"tools[{i}] must be {{type: function, function: {{name, parameters?}}}}", "tools")
    choice = body.get("tool_choice")
    if choice is not None and not (choice in ("none", "auto", "required") or (
            isinstance(choice, dict) and isinstance(choice.get("function"), dict)
            and isinstance(choice["function"].get("name"), str))):
        raise bad("tool_choice must be none, auto, required or {type: function, function: {name}}", "tool_choice")


def _check_prompt(prompt: Any, *, pd: bool) -> None:
    if prompt is None:
        raise bad("you must provide a prompt", "prompt")
    if isinstance(prompt, str):
        return
    ok = isinstance(prompt, list) and bool(prompt) and (
        all(isinstance(p, str) for p in prompt) or all(_token_id(t) for t in prompt)
        or all(isinstance(p, list) and p and all(_token_id(t) for t in p) for p in prompt))
    if not ok:
        raise bad("prompt must be a string, a list of strings, a list of token ids or a list of those", "prompt")
    batch = len(prompt) > 1 and not all(_token_id(t) for t in prompt)
    if pd and batch:
        raise bad("a P/D gateway serves one prompt per request (its KV handle covers one sequence)", "prompt")


def _token_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0


def prompt_size(kind: str, body: Mapping[str, Any]) -> tuple[int, int]:
    """(characters of text, token ids) the prompt is made of, without rendering it: messages' strings for a
    chat, the prompt's strings or literal token ids for a completion."""
    if kind != "chat":
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return len(prompt), 0
        if not isinstance(prompt, list):
            return 0, 0
        if all(_token_id(t) for t in prompt):
            return 0, len(prompt)
        chars = sum(len(p) for p in prompt if isinstance(p, str))
        return chars, max((len(p) for p in prompt if isinstance(p, list)), default=0)
    chars = 0
    for m in body.get("messages") or ():
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            chars += sum(len(p.get("text") or "") for p in content if isinstance(p, dict))
    return chars, 0


def check_length(kind: str, body: Mapping[str, Any], max_model_len: int | None) -> None:
    """A prompt that cannot fit the model's context is refused before anything tokenizes it."""
    if not max_model_len:
        return
    for name in ("max_tokens", "max_completion_tokens", "min_tokens"):
        value = body.get(name)
        if isinstance(value, int) and value > max_model_len:
            raise bad(f"{name} ({value}) is more than this model's context of {max_model_len} tokens", name,
                      "context_length_exceeded")
    chars, ids = prompt_size(kind, body)
    if chars > max_model_len * MAX_CHARS_PER_TOKEN or ids > max_model_len:
        size = f"{ids} tokens" if ids > max_model_len else f"{chars} characters"
        raise bad(f"the prompt ({size}) is longer than this model's context of {max_model_len} tokens",
                  "messages" if kind == "chat" else "prompt", "context_length_exceeded")
