"""Parsing OpenAI request bodies the way vLLM's server does (pure: no I/O).

Unknown fields are ignored, as vLLM does; malformed known fields raise ``BadRequest`` (HTTP 400).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtether.protocol.wire import KV_FIELD
from kvtether.sim.model import GenerationSpec
from kvtether.sim.template import HERMES, TemplateError, render_chat
from kvtether.sim.tokenizer import Tokenizer


class BadRequest(ValueError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class ParsedRequest:
    chat: bool
    prompt_ids: list[int]
    spec: GenerationSpec
    max_tokens: int
    stream: bool
    include_usage: bool
    return_token_ids: bool
    stop: tuple[str, ...]
    stop_token_ids: frozenset[int]
    kv_params: Mapping[str, Any] | None
    parse_tools: bool
    cache_salt: str | None = None
    tool_format: str = HERMES
    # vLLM's per-request `stream_interval` (tokens per streamed chunk); None: the server's --stream-interval.
    stream_interval: int | None = None


def _int(body: Mapping[str, Any], key: str, default: int | None, *, minimum: int = 0) -> int | None:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(f"{key} must be an integer", key)
    if v < minimum:
        raise BadRequest(f"{key} must be at least {minimum}, got {v}", key)
    return v


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,) if stop else ()
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(s for s in stop if s)
    raise BadRequest("stop must be a string or a list of strings", "stop")


def chat_prompt_ids(tok: Tokenizer, body: Mapping[str, Any], *, tool_format: str = HERMES) -> list[int]:
    """Messages + tools + template arguments → prompt ids (shared by chat and /tokenize)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", "messages")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise BadRequest("tools must be a list", "tools")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, Mapping):
        raise BadRequest("chat_template_kwargs must be an object", "chat_template_kwargs")
    try:
        text = render_chat(
            messages,
            tools=tools or None,
            add_generation_prompt=bool(body.get("add_generation_prompt", True)),
            enable_thinking=bool(kwargs.get("enable_thinking", False)),
            tool_format=tool_format,
        )
    except TemplateError as e:
        raise BadRequest(str(e), "messages") from e
    return tok.encode(text)


def completion_prompt_ids(tok: Tokenizer, body: Mapping[str, Any]) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tok.encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if any(t < 0 or t >= tok.vocab_size for t in prompt):
            raise BadRequest("prompt contains token ids outside the vocabulary", "prompt")
        return list(prompt)
    raise BadRequest("prompt must be a string or a list of token ids (one prompt only)", "prompt")


def _function_name(tool: Mapping[str, Any]) -> Any:
    fn = tool.get("function", tool)
    return fn.get("name") if isinstance(fn, Mapping) else None


def parse_request(
    tok: Tokenizer, body: Any, *, chat: bool, max_model_len: int, tool_format: str = HERMES,
    callable_tools: tuple[str, ...] | None = None,
) -> ParsedRequest:
    """``callable_tools``: the only functions the simulated model calls (NodeConfig.callable_tools)."""
    if not isinstance(body, Mapping):
        raise BadRequest("the request body must be a JSON object")
    n = _int(body, "n", 1, minimum=1)
    if n != 1:
        raise BadRequest("only n=1 is supported by the simulator", "n")
    kv_params = body.get(KV_FIELD)
    if kv_params is not None and not isinstance(kv_params, Mapping):
        raise BadRequest(f"{KV_FIELD} must be an object", KV_FIELD)
    # vLLM ≥0.32: a decode request may carry the prompt ids and skip re-tokenizing.
    carried = kv_params.get("prompt_token_ids") if kv_params else None
    if isinstance(carried, list) and carried:
        prompt_ids = [int(t) for t in carried]
    else:
        prompt_ids = chat_prompt_ids(tok, body, tool_format=tool_format) if chat else completion_prompt_ids(tok, body)
    if len(prompt_ids) >= max_model_len:
        raise BadRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{len(prompt_ids)} input tokens.",
            "messages" if chat else "prompt",
        )
    room = max_model_len - len(prompt_ids)
    max_tokens = _int(body, "max_completion_tokens", None, minimum=1) if chat else None
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", None, minimum=1)
    if max_tokens is None:
        max_tokens = room
    if max_tokens > room:
        raise BadRequest(
            f"max_tokens ({max_tokens}) is too large: the prompt has {len(prompt_ids)} tokens and the "
            f"maximum context length is {max_model_len}",
            "max_tokens",
        )
    min_tokens = _int(body, "min_tokens", 0) or 0
    temperature = body.get("temperature")
    if temperature is None:
        temperature = 1.0
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or temperature < 0:
        raise BadRequest("temperature must be a number >= 0", "temperature")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise BadRequest("seed must be an integer", "seed")
    tools = (body.get("tools") or []) if chat else []
    tool_choice = body.get("tool_choice", "auto" if tools else "none")
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if isinstance(tool_choice, str) and tool_choice not in ("none", "auto", "required"):
        raise BadRequest("tool_choice must be none, auto, required or a named function", "tool_choice")
    if tool_choice == "required" and not tools:
        raise BadRequest("tool_choice 'required' needs tools", "tool_choice")
    if isinstance(tool_choice, Mapping):
        name = (tool_choice.get("function") or {}).get("name")
        if not any(isinstance(t, Mapping) and t.get("function", t).get("name") == name for t in tools):
            raise BadRequest(f"tool_choice names an unknown function {name!r}", "tool_choice")
    kwargs = body.get("chat_template_kwargs") or {}
    stream_options = body.get("stream_options") or {}
    cache_salt = body.get("cache_salt")
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise BadRequest("cache_salt must be a non-empty string", "cache_salt")
    stream_interval = _int(body, "stream_interval", None, minimum=1)
    stop_token_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_token_ids, list):
        raise BadRequest("stop_token_ids must be a list of integers", "stop_token_ids")
    spec = GenerationSpec(
        chat=chat,
        tools=tuple(t for t in tools if isinstance(t, Mapping)
                    and (callable_tools is None or _function_name(t) in callable_tools)),
        tool_choice=tool_choice,
        enable_thinking=bool(chat and isinstance(kwargs, Mapping) and kwargs.get("enable_thinking", False)),
        temperature=float(temperature),
        seed=seed,
        min_tokens=min(min_tokens, max_tokens),
        ignore_eos=bool(body.get("ignore_eos", False)),
        tool_format=tool_format,
    )
    return ParsedRequest(
        chat=chat,
        prompt_ids=prompt_ids,
        spec=spec,
        max_tokens=max_tokens,
        stream=bool(body.get("stream", False)),
        include_usage=bool(isinstance(stream_options, Mapping) and stream_options.get("include_usage")),
        return_token_ids=bool(body.get("return_token_ids", False)),
        stop=_stop(body),
        stop_token_ids=frozenset(int(t) for t in stop_token_ids),
        kv_params=kv_params,
        parse_tools=bool(tools) and tool_choice != "none",
        cache_salt=cache_salt,
        tool_format=tool_format,
        stream_interval=stream_interval,
    )
