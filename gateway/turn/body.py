"""Pure transformations of OpenAI request and response bodies: the legs' bodies, stripping, keys.

Kept apart from the HTTP shell so the rules (what P gets, what D gets, what the client may see) are
testable without a network.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from kvtether.gateway.guard.readback import reported_cached_tokens
from kvtether.protocol.common import effort_in_template_kwargs
from kvtether.protocol.contract import Chain, rendering_fields
from kvtether.protocol.tokens import chat_chunk_has_token
from kvtether.protocol.wire import COLD_PREFILL_PARAMS, KV_FIELD

# Fields the gateway adds for its own use and must never show a client who did not ask.
TOKEN_ID_FIELDS = ("prompt_token_ids", "token_ids")

def prefill_body(body: Mapping[str, Any], kv_params: Mapping[str, Any] | None) -> dict[str, Any]:
    # A shallow copy: only top-level keys change, and a long history is not worth copying (it is serialized,
    # never mutated).
    out = dict(body)
    out[KV_FIELD] = dict(kv_params) if kv_params is not None else dict(COLD_PREFILL_PARAMS)
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    for key in ("stream_options", "min_tokens", "return_token_ids"):
        out.pop(key, None)
    return out


def decode_body(
    body: Mapping[str, Any], kv_params: Mapping[str, Any] | None, *, want_token_ids: bool
) -> dict[str, Any]:
    out = dict(body)  # shallow, as in prefill_body
    if kv_params is not None:
        out[KV_FIELD] = dict(kv_params)
    if want_token_ids:
        # The held sequence (prompt + output ids) is what the guard checks the next turn against.
        out["return_token_ids"] = True
    return out


def with_host(params: Mapping[str, Any], host: str) -> dict[str, Any]:
    """Rewrite ``remote_host`` to the host the gateway reached the node at, as the reference proxy does.

    Engines report their NIXL side-channel host, which defaults to ``localhost``.
    """
    out = dict(params)
    out["remote_host"] = host
    return out


def strip_internal(obj: dict[str, Any], *, keep_token_ids: bool) -> bool:
    """Remove internal fields from a response body or stream chunk in place; True when anything changed."""
    changed = KV_FIELD in obj  # a null value is a field the client did not ask for all the same
    obj.pop(KV_FIELD, None)
    if keep_token_ids:
        return changed
    for key in TOKEN_ID_FIELDS:
        if key in obj:
            del obj[key]
            changed = True
    choices = obj.get("choices")
    if isinstance(choices, list):
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            for key in (*TOKEN_ID_FIELDS, KV_FIELD):
                if key in choice:
                    del choice[key]
                    changed = True
            delta = choice.get("delta")
            if isinstance(delta, dict):
                for key in TOKEN_ID_FIELDS:
                    if key in delta:
                        del delta[key]
                        changed = True
    return changed


def prompt_ids_of(obj: Mapping[str, Any]) -> list[int] | None:
    """Prompt token ids from a body or first chunk: top level (chat) or on the first choice (completions)."""
    ids = obj.get("prompt_token_ids")
    if isinstance(ids, list):
        return ids
    choices = obj.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        ids = choices[0].get("prompt_token_ids")
        if isinstance(ids, list):
            return ids
    return None


def output_ids_of(choice: Mapping[str, Any]) -> list[int] | None:
    ids = choice.get("token_ids")
    if isinstance(ids, list):
        return ids
    delta = choice.get("delta")
    if isinstance(delta, Mapping) and isinstance(delta.get("token_ids"), list):
        return list(delta["token_ids"])
    return None


# TTFT: the first chunk that carries a token of any kind (protocol/tokens.py, the rule the SDK and the CLI read).
has_first_token = chat_chunk_has_token


def _normal_message(message: Any) -> Any:
    # Clients echo an assistant turn back with content "" or null, tool_calls [] or absent,
    # interchangeably; all render the same, so they must hash the same.
    if isinstance(message, Mapping) and message.get("role") == "assistant":
        return {k: v for k, v in message.items() if not (k in ("content", "tool_calls") and not v)}
    return message


@dataclass(frozen=True)
class ChatChain:
    """A chat prompt's message-chain hash, computed once per turn (identify); the answer extends it (remember)
    without hashing the history again."""

    parent: str | None  # the history up to the last assistant message: what the previous turn left
    prompt: Chain  # the whole prompt

    def after(self, answer: Mapping[str, Any]) -> str:
        """The prompt plus its answer: what the next turn's parent key will be."""
        return self.prompt.extend(_normal_message(answer), keep_reasoning=False).id


def chat_chain(body: Mapping[str, Any]) -> ChatChain:
    """The message-chain hash of a chat body (the SDK's); without messages, the chain's seed.

    Reasoning is left out, so a client that strips it still finds its session (the token guard then decides
    how much KV is really reusable).
    """
    chain = Chain.start(body.get("model"), body.get("tools"), rendering_fields(body))
    parent = None
    for m in body.get("messages") or ():
        m = _normal_message(m)
        chain = chain.extend(m, keep_reasoning=False)
        if isinstance(m, Mapping) and m.get("role") == "assistant":
            parent = chain.id
    return ChatChain(parent, chain)


def answer_message(choice: Mapping[str, Any]) -> dict[str, Any]:
    """The assistant message a client will send back, from a non-streamed choice."""
    msg = choice.get("message")
    if isinstance(msg, Mapping):
        return {k: msg[k] for k in ("role", "content", "tool_calls", "reasoning_content", "reasoning") if k in msg}
    return {"role": "assistant", "content": choice.get("text")}


class StreamAnswer:
    """Accumulates a streamed chat answer (content + tool calls) to compute the next turn's key."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}

    def add(self, choice: Mapping[str, Any]) -> None:
        delta = choice.get("delta")
        if not isinstance(delta, Mapping):
            return
        if isinstance(delta.get("content"), str):
            self.content.append(delta["content"])
        for call in delta.get("tool_calls") or []:
            if not isinstance(call, Mapping):
                continue
            idx = call.get("index", 0)
            empty = {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
            slot = self.calls.setdefault(idx, empty)
            if call.get("id"):
                slot["id"] = call["id"]
            if call.get("type"):
                slot["type"] = call["type"]
            fn = call.get("function")
            if isinstance(fn, Mapping):
                if fn.get("name"):
                    slot["function"]["name"] += fn["name"]
                if fn.get("arguments"):
                    slot["function"]["arguments"] += fn["arguments"]

    def message(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": "assistant", "content": "".join(self.content) or None}
        if self.calls:
            out["tool_calls"] = [self.calls[i] for i in sorted(self.calls)]
        return out


def tokenize_body(kind: str, body: Mapping[str, Any]) -> dict[str, Any] | None:
    """vLLM ``/tokenize`` request that renders the prompt exactly as the completion request will."""
    if kind == "chat":
        out: dict[str, Any] = {"model": body.get("model"), "messages": _reasoning_renamed(body.get("messages"))}
        out["add_generation_prompt"] = body.get("add_generation_prompt", True)
        for key in ("tools", "continue_final_message", "add_special_tokens", "chat_template",
                    "chat_template_kwargs", "documents", "mm_processor_kwargs"):
            if body.get(key) is not None:
                out[key] = body[key]
        # /tokenize has no reasoning_effort: without this the guard would compare against a prompt rendered otherwise.
        effort_in_template_kwargs(out, body.get("reasoning_effort"))
        return out
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        return None
    out = {"model": body.get("model"), "prompt": prompt}
    if body.get("add_special_tokens") is not None:
        out["add_special_tokens"] = body["add_special_tokens"]
    return out


def _reasoning_renamed(messages: Any) -> Any:
    """Messages with ``reasoning_content`` renamed ``reasoning``: vLLM's chat completion request does that
    before rendering, its /tokenize request does not (vLLM 0.32), so without it /tokenize would leave out
    reasoning the completion renders."""
    if not isinstance(messages, list) or not any(isinstance(m, Mapping) and "reasoning_content" in m
                                                 for m in messages):
        return messages
    out = []
    for m in messages:
        if isinstance(m, Mapping) and "reasoning_content" in m:
            renamed = {k: v for k, v in m.items() if k != "reasoning_content"}
            if renamed.get("reasoning") is None and m["reasoning_content"] is not None:
                renamed["reasoning"] = m["reasoning_content"]
            m = renamed
        out.append(m)
    return out


def dumps(obj: Any) -> bytes:
    """JSON bytes of a leg's body: orjson (several times faster on long histories), else the stdlib for what
    orjson refuses (integers beyond 64 bits)."""
    try:
        return orjson.dumps(obj)
    except TypeError:
        return json.dumps(obj, ensure_ascii=False).encode()


def literal_prompt_ids(kind: str, body: Mapping[str, Any]) -> list[int] | None:
    """A completions prompt given as token ids needs no tokenizer."""
    if kind != "completions":
        return None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    return None


def cached_tokens(usage: Any) -> int:
    """The node's reported cached prompt tokens, 0 when it reports none."""
    return reported_cached_tokens(usage) or 0


def response_identity(data: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """(id, model) of a node's answer, from the whole answer or a stream's chunk."""
    rid, model = data.get("id"), data.get("model")
    return (rid if isinstance(rid, str) else None), (model if isinstance(model, str) else None)
