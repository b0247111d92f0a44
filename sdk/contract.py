"""The wire contract between an agent (via the SDK) and the kvtether gateway.

Everything a client and the gateway must agree on lives here and only here: header names and the
prefix-hash algorithm. The gateway imports this module; it never trusts the client's stamps for
isolation, it recomputes them from the body and uses the client's copy only as a routing hint.

Prefix hash (version ``v1``)::

    seed = B(key, "kvtether-prefix-v1\\0" || canon({"model", "tools", rendering fields}))
    h_i  = B(key, h_{i-1} || canon(message_i))        i = 1..n
    B    = BLAKE2b, 8-byte digest, keyed with the tenant key (empty key when none)

``canon`` is compact, key-sorted JSON of only the fields a chat template can see. Whitespace and
JSON inside ``tool_calls[].function.arguments`` are kept verbatim: the server renders what it
receives, so normalising them would claim a match the engine will not see.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

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
) -> bytes:
    fields = dict(rendering or {})
    seed_obj = {
        "model": model or "",
        "tools": [_plain(t) for t in tools] if tools else [],
        "rendering": {k: fields[k] for k in sorted(fields) if fields[k] is not None},
    }
    return _b(_key_bytes(key), _SEED_TAG + canonical_json(seed_obj))


@dataclass(frozen=True, slots=True)
class Chain:
    """The message-chain hash at some point of a conversation, to be extended one message at a time: a turn's
    prompt is hashed once, and its answer is one more step rather than the whole history again."""

    key: bytes  # the tenant key, folded (_key_bytes)
    tip: bytes  # h_i after i messages (the seed before the first)

    @classmethod
    def start(cls, model: str | None, tools: Sequence[Any] | None = None,
              rendering: Mapping[str, Any] | None = None, *, key: str | bytes | None = None) -> Chain:
        return cls(_key_bytes(key), chain_seed(model, tools, rendering, key=key))

    def extend(self, message: Any, *, keep_reasoning: bool = True) -> Chain:
        step = canonical_json(canonical_message(message, keep_reasoning=keep_reasoning))
        return Chain(self.key, _b(self.key, self.tip + step))

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
