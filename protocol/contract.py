"""The wire contract between an agent (via the SDK) and the kvtether gateway.

Everything a client and the gateway must agree on lives here and only here: header names and the
prefix-hash algorithm. The SDK stamps with this module (and re-exports it as ``kvtether.sdk.contract``); the
gateway imports it from here, not from the client SDK. The gateway never trusts the client's stamps for
isolation, it recomputes them from the body and uses the client's copy only as a routing hint.

Prefix hash (version ``v1``)::

    seed = B(key, "kvtether-prefix-v1\\0" || canon({"model", "tools", rendering fields}))
    h_i  = B(key, h_{i-1} || canon(message_i))        i = 1..n
    B    = BLAKE2b, 8-byte digest, keyed with the tenant key (empty key when none)

``canon`` is compact, key-sorted JSON of only the fields a chat template can see. Whitespace and
JSON inside ``tool_calls[].function.arguments`` are kept verbatim: the server renders what it
receives, so normalising them would claim a match the engine will not see.

The same chain covers the agents' other APIs (``stamps_for_responses_body``, ``stamps_for_messages_body``), with
the API's name in the seed so that a Responses or Messages chain never equals a chat chain:

- **OpenAI Responses**: seed ``{"api": "responses", model, tools, rendering}`` (rendering: the chat fields above
  and ``reasoning.effort``, which vLLM passes to the template). Chain: ``instructions`` (when given) as
  ``{"type": "instructions", "content": ...}``, then each ``input`` item (a string ``input`` is one user
  message item). An item is hashed as sent, minus what the server never renders and clients resend
  inconsistently: item ``id`` and ``status``, content parts' ``annotations`` and ``logprobs``, and ``None``
  values; a ``{"role", "content"}`` item without ``type`` is a ``"message"``. The turn index counts the model's
  answers in ``input``: runs of consecutive model items (assistant messages, ``reasoning``, ``*_call``), so a
  reasoning item + parallel function calls is one answer, as one assistant message is in chat.
- **Anthropic Messages**: seed ``{"api": "messages", model, tools, rendering}`` (rendering: the chat fields
  and ``thinking.type``). Chain: ``system`` (when given) as ``{"role": "system", "content": ...}``, then each
  message's ``role`` and ``content`` (a string as the one text block it stands for). ``cache_control`` is
  dropped everywhere (clients move the marker to the newest message every turn, and it is never rendered),
  and so are system blocks that start with ``x-anthropic-billing-header`` (a per-request hash that vLLM
  strips before rendering). The turn index counts assistant messages, as in chat (consecutive ones, which
  the API merges, count once).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvtether.protocol.messages.common import BILLING_HEADER_PREFIX

CONTRACT_VERSION = "v1"

SESSION_HEADER = "x-session-id"
TURN_HEADER = "x-kvtether-turn"
PREFIX_HEADER = "x-kvtether-prefix"
PREFIX_PARENT_HEADER = "x-kvtether-prefix-parent"
TRACEPARENT_HEADER = "traceparent"
# "true" on a session's last turn: the gateway releases the decode node's hold once the answer is out and
# forgets the session. Dynamo's name for the same mark is accepted too.
FINAL_HEADER = "x-kvtether-session-final"
FOREIGN_FINAL_HEADERS: tuple[str, ...] = ("x-dynamo-session-final",)
# DELETE {base_url}/sessions/{id} (base_url ends in /v1, as the openai clients' does) ends a session without a
# turn: what AgentSession.close() sends.
SESSION_END_PATH = "/sessions/{session_id}"

# Session ids that existing tools already send (Dynamo, AIPerf), accepted by the gateway after
# SESSION_HEADER, in this order, so third-party benchmark tools get pinning without the SDK.
FOREIGN_SESSION_HEADERS: tuple[str, ...] = (
    "x-dynamo-session-id",
    "x-claude-code-session-id",
    "x-session-affinity",
    "x-correlation-id",
)

# Body fields (besides model and tools) that change how the chat template renders a prompt.
RENDERING_FIELDS: tuple[str, ...] = ("chat_template", "chat_template_kwargs")

# Message fields a chat template can see. Anything else (e.g. the SDK's `refusal`, `annotations`)
# never reaches the prompt and must not break a match.
_MESSAGE_FIELDS: tuple[str, ...] = (
    "role",
    "content",
    "name",
    "tool_calls",
    "tool_call_id",
    "reasoning_content",
    "reasoning",
)
_TOOL_CALL_FIELDS: tuple[str, ...] = ("id", "type", "function")
_FUNCTION_FIELDS: tuple[str, ...] = ("name", "arguments")
_REASONING_FIELDS: tuple[str, ...] = ("reasoning_content", "reasoning")

_DIGEST_SIZE = 8
_SEED_TAG = b"kvtether-prefix-v1\0"


def _plain(obj: Any) -> Any:
    """Turn SDK pydantic objects into plain data without touching plain dicts."""
    dump = getattr(obj, "model_dump", None)
    if callable(dump):
        return dump(exclude_none=True)
    return obj


def _pick(obj: Any, fields: Iterable[str]) -> dict[str, Any]:
    obj = _plain(obj)
    if not isinstance(obj, Mapping):
        raise TypeError(f"expected a mapping, got {type(obj).__name__}")
    return {k: obj[k] for k in fields if obj.get(k) is not None}


def canonical_message(message: Any, *, keep_reasoning: bool = True) -> dict[str, Any]:
    """The part of a chat message that the chat template sees, as plain JSON-able data."""
    out = _pick(message, _MESSAGE_FIELDS)
    content = out.get("content")
    if isinstance(content, list):
        out["content"] = [_plain(part) for part in content]
    if "tool_calls" in out:
        calls = []
        for call in out["tool_calls"]:
            picked = _pick(call, _TOOL_CALL_FIELDS)
            if "function" in picked:
                picked["function"] = _pick(picked["function"], _FUNCTION_FIELDS)
            calls.append(picked)
        out["tool_calls"] = calls
    if not keep_reasoning:
        for field in _REASONING_FIELDS:
            out.pop(field, None)
    return out


# One encoder for every call: json.dumps with non-default options builds a new one each time, which cost more
# than encoding a short message. Same options, same bytes.
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def canonical_json(obj: Any) -> bytes:
    return _CANONICAL.encode(obj).encode()


def _key_bytes(key: str | bytes | None) -> bytes:
    if key is None:
        return b""
    raw = key.encode() if isinstance(key, str) else key
    # BLAKE2b keys are at most 64 bytes; longer secrets are folded to a fixed-size key.
    return raw if len(raw) <= 64 else hashlib.blake2b(raw, digest_size=64).digest()


def _b(key: bytes, data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=_DIGEST_SIZE, key=key).digest()


def chain_seed(
    model: str | None,
    tools: Sequence[Any] | None = None,
    rendering: Mapping[str, Any] | None = None,
    *,
    key: str | bytes | None = None,
    api: str | None = None,
) -> bytes:
    fields = dict(rendering or {})
    seed_obj: dict[str, Any] = {
        "model": model or "",
        "tools": [_plain(t) for t in tools] if tools else [],
        "rendering": {k: fields[k] for k in sorted(fields) if fields[k] is not None},
    }
    if api is not None:  # chat seeds stay as they were: no "api" key
        seed_obj["api"] = api
    return _b(_key_bytes(key), _SEED_TAG + canonical_json(seed_obj))


@dataclass(frozen=True, slots=True)
class Chain:
    """The message-chain hash at some point of a conversation, to be extended one message at a time: a turn's
    prompt is hashed once, and its answer is one more step rather than the whole history again."""

    key: bytes  # the tenant key, folded (_key_bytes)
    tip: bytes  # h_i after i messages (the seed before the first)

    @classmethod
    def start(cls, model: str | None, tools: Sequence[Any] | None = None,
              rendering: Mapping[str, Any] | None = None, *, key: str | bytes | None = None,
              api: str | None = None) -> Chain:
        return cls(_key_bytes(key), chain_seed(model, tools, rendering, key=key, api=api))

    def extend(self, message: Any, *, keep_reasoning: bool = True) -> Chain:
        return self.extend_canonical(canonical_message(message, keep_reasoning=keep_reasoning))

    def extend_canonical(self, canonical: Any) -> Chain:
        """One step with an element already in its canonical form (plain JSON data)."""
        return Chain(self.key, _b(self.key, self.tip + canonical_json(canonical)))

    @property
    def id(self) -> str:
        """The chain's id as headers and session keys carry it (16 hex chars)."""
        return self.tip.hex()


def prefix_chain(
    messages: Sequence[Any],
    *,
    model: str | None,
    tools: Sequence[Any] | None = None,
    rendering: Mapping[str, Any] | None = None,
    key: str | bytes | None = None,
    keep_reasoning: bool = True,
) -> list[str]:
    """Chained ids, one per message: ``ids[i]`` identifies ``messages[: i + 1]`` (16 hex chars)."""
    chain = Chain.start(model, tools, rendering, key=key)
    ids: list[str] = []
    for message in messages:
        chain = chain.extend(message, keep_reasoning=keep_reasoning)
        ids.append(chain.id)
    return ids


def turn_index(messages: Sequence[Any]) -> int:
    """A turn's index is derived from the request, never counted: retries and replays agree."""
    return sum(1 for m in messages if _pick(m, ("role",)).get("role") == "assistant")


@dataclass(frozen=True, slots=True)
class Stamps:
    """What the SDK stamps on a chat request and what the gateway recomputes from its body."""

    turn: int
    prefix: str | None  # chain tip over the whole prompt
    parent: str | None  # chain tip at the last assistant message: what the previous turn left

    def headers(self) -> dict[str, str]:
        out = {TURN_HEADER: str(self.turn)}
        if self.prefix is not None:
            out[PREFIX_HEADER] = self.prefix
        if self.parent is not None:
            out[PREFIX_PARENT_HEADER] = self.parent
        return out


def rendering_fields(body: Mapping[str, Any]) -> dict[str, Any]:
    return {k: body[k] for k in RENDERING_FIELDS if body.get(k) is not None}


def stamps_for_body(body: Mapping[str, Any], *, key: str | bytes | None = None) -> Stamps:
    """Stamps for an OpenAI chat-completions body (``messages``, ``model``, ``tools`` …)."""
    messages = list(body.get("messages") or [])
    ids = prefix_chain(
        messages,
        model=body.get("model"),
        tools=body.get("tools"),
        rendering=rendering_fields(body),
        key=key,
    )
    parent = None
    for i in range(len(messages) - 1, -1, -1):
        if _pick(messages[i], ("role",)).get("role") == "assistant":
            parent = ids[i]
            break
    return Stamps(turn=turn_index(messages), prefix=ids[-1] if ids else None, parent=parent)


def _stamps_for_chain(
    steps: Sequence[Any], answers: Sequence[bool], chain: Chain
) -> Stamps:
    """Stamps from canonical steps; ``answers[i]`` says whether step i is (part of) a model answer. The turn
    index is the number of answer runs and the parent is the tip at the end of the last one."""
    turn, parent, tip = 0, None, None
    for i, step in enumerate(steps):
        chain = chain.extend_canonical(step)
        tip = chain.id
        if answers[i]:
            if i == 0 or not answers[i - 1]:
                turn += 1
            parent = tip
    return Stamps(turn=turn, prefix=tip, parent=parent)


def _without_none(obj: Mapping[str, Any], drop: Iterable[str] = ()) -> dict[str, Any]:
    dropped = set(drop)
    return {k: v for k, v in obj.items() if v is not None and k not in dropped}


_RESPONSES_ITEM_DROP = ("id", "status")
_RESPONSES_PART_DROP = ("annotations", "logprobs")


def canonical_response_item(item: Any) -> dict[str, Any]:
    """A Responses ``input`` item as the prefix hash sees it (see the module docstring)."""
    plain = _plain(item)
    if not isinstance(plain, Mapping):
        raise TypeError(f"expected a Responses input item, got {type(plain).__name__}")
    out = _without_none(plain, _RESPONSES_ITEM_DROP)
    if "type" not in out and "role" in out:
        out["type"] = "message"
    content = out.get("content")
    if isinstance(content, list):
        parts = [_plain(part) for part in content]
        out["content"] = [_without_none(p, _RESPONSES_PART_DROP) if isinstance(p, Mapping) else p for p in parts]
    return out


def is_model_item(item: Mapping[str, Any]) -> bool:
    """Whether a Responses item is model output (answer) rather than input the client wrote."""
    kind = item.get("type")
    if kind == "message":
        return item.get("role") == "assistant"
    return isinstance(kind, str) and (kind == "reasoning" or kind.endswith("_call") or kind.startswith("mcp_list"))


def responses_rendering(body: Mapping[str, Any]) -> dict[str, Any]:
    out = rendering_fields(body)
    reasoning = _plain(body.get("reasoning"))
    if isinstance(reasoning, Mapping) and reasoning.get("effort") is not None:
        out["reasoning_effort"] = reasoning["effort"]
    return out


def stamps_for_responses_body(body: Mapping[str, Any], *, key: str | bytes | None = None) -> Stamps:
    """Stamps for an OpenAI Responses body (``input``, ``instructions``, ``model``, ``tools`` …)."""
    raw_input = body.get("input")
    items: list[Any] = (
        [{"type": "message", "role": "user", "content": raw_input}] if isinstance(raw_input, str)
        else list(raw_input or [])
    )
    steps: list[Any] = []
    answers: list[bool] = []
    if body.get("instructions") is not None:
        steps.append({"type": "instructions", "content": _plain(body["instructions"])})
        answers.append(False)
    for item in items:
        canon = canonical_response_item(item)
        steps.append(canon)
        answers.append(is_model_item(canon))
    chain = Chain.start(body.get("model"), body.get("tools"), responses_rendering(body), key=key, api="responses")
    return _stamps_for_chain(steps, answers, chain)



def _without_cache_control(block: Any) -> Any:
    plain = _plain(block)
    return _without_none(plain, ("cache_control",)) if isinstance(plain, Mapping) else plain


def canonical_anthropic_content(content: Any) -> Any:
    """Message or system content as a list of blocks without ``cache_control`` markers. A string is the API's
    shorthand for one text block, and clients switch between the two forms (to place a marker, for one)."""
    content = _plain(content)
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if isinstance(content, list):
        return [_without_cache_control(block) for block in content]
    return content


def _anthropic_system(system: Any) -> Any:
    system = canonical_anthropic_content(system)
    if isinstance(system, list):
        system = [
            b for b in system
            if not (isinstance(b, Mapping) and str(b.get("text", "")).startswith(BILLING_HEADER_PREFIX))
        ]
    return system


def messages_rendering(body: Mapping[str, Any]) -> dict[str, Any]:
    out = rendering_fields(body)
    thinking = _plain(body.get("thinking"))
    if isinstance(thinking, Mapping) and thinking.get("type") is not None:
        out["thinking"] = thinking["type"]
    return out


def stamps_for_messages_body(body: Mapping[str, Any], *, key: str | bytes | None = None) -> Stamps:
    """Stamps for an Anthropic Messages body (``system``, ``messages``, ``model``, ``tools`` …)."""
    steps: list[Any] = []
    answers: list[bool] = []
    if body.get("system") is not None:
        steps.append({"role": "system", "content": _anthropic_system(body["system"])})
        answers.append(False)
    for message in body.get("messages") or []:
        picked = _pick(message, ("role", "content"))
        if "content" in picked:
            picked["content"] = canonical_anthropic_content(picked["content"])
        steps.append(picked)
        answers.append(picked.get("role") == "assistant")
    tools = [_without_cache_control(t) for t in body.get("tools") or []]
    chain = Chain.start(body.get("model"), tools, messages_rendering(body), key=key, api="messages")
    return _stamps_for_chain(steps, answers, chain)


def session_final_from_headers(headers: Mapping[str, str]) -> bool:
    """Whether a request marks its session's last turn (FINAL_HEADER or a known third-party one)."""
    lowered = {k.lower(): v for k, v in headers.items()}
    return any((lowered.get(name) or "").strip().lower() in ("1", "true", "yes")
               for name in (FINAL_HEADER, *FOREIGN_FINAL_HEADERS))


def session_id_from_headers(headers: Mapping[str, str]) -> str | None:
    """The session id a request names, from our header or a known third-party one."""
    lowered = {k.lower(): v for k, v in headers.items()}
    for name in (SESSION_HEADER, *FOREIGN_SESSION_HEADERS):
        value = lowered.get(name)
        if value and value.strip():
            return value.strip()
    return None
