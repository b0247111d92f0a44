"""Anthropic Messages ↔ the gateway's internal Chat Completions: a pure translation (no I/O).

vLLM serves ``/v1/messages`` by translating each request to a chat completion request
(``AnthropicServingMessages.to_chat_completion_request`` in ``vllm/entrypoints/anthropic/serving.py``) and the
answer back. kvtether does the same translation in the gateway, so a Messages turn goes through the chat path
it already pins, guards and splits into P/D legs — and it follows vLLM's rules (0.32–0.34) exactly, so the
chat request it sends renders the same prompt vLLM's own ``/v1/messages`` would. The rules that matter for
that, all from vLLM:

- ``system``: a string as is; a list of blocks → the texts of its ``text`` blocks joined with ``""``, blocks
  whose text starts with ``x-anthropic-billing-header`` (Claude Code's per-request attribution, which would
  change the prompt from token 0 every turn) left out. Messages with role ``system`` (Claude Code's per-turn
  reminders) stay where they are as chat system messages, or are appended to the leading system text when
  the served template needs system-first ordering (``merge_inline_system``; vLLM probes its template for it).
- A message with string content keeps it. A list of blocks becomes one chat message: ``text`` blocks →
  content (a plain string when it is the only part, else text parts), ``image`` → ``image_url`` parts (a data
  URI for base64), ``thinking`` → ``reasoning`` (joined), ``redacted_thinking`` dropped, ``tool_use`` →
  ``tool_calls`` with ``arguments = json.dumps(input)`` (the default separators and ``ensure_ascii=True``: the
  bytes vLLM renders), and each user ``tool_result`` → a ``role: "tool"`` message appended *before* the user
  message it came in (its text parts joined with ``"\\n"``; its images → a user message of ``image_url`` parts
  after it; ``is_error`` is not rendered — vLLM drops it). A user message left with no content is dropped.
- A ``tool_result`` in an assistant message → text ``"Tool result: " + str(content)``; ``tool_reference``
  blocks → expanded inside tool results only; ``tool_addition``/``tool_removal`` (system-role messages
  only) → applied to the tool list: all as vLLM (see the helpers below).

The Anthropic request fields, and what becomes of each:

=====================  ===========  =====================================================================
field                  treatment    how
=====================  ===========  =====================================================================
model                  honoured     ``model``
max_tokens             honoured     ``max_tokens`` (an integer ≥ 1, required; not for count_tokens)
messages               honoured     translated as above
system                 honoured     leading system message; billing-header blocks stripped
stop_sequences         honoured     ``stop``
temperature, top_p,    honoured     copied
top_k
stream                 honoured     ``stream`` (+ ``stream_options: {include_usage, continuous_usage_stats}``
                                    when true, as vLLM sets them: usage reaches ``message_start`` and the
                                    final ``message_delta``)
tools                  honoured     custom tools → function tools (``input_schema`` → ``parameters``, a
                                    missing schema ``type`` set to ``"object"``; ``strict``,
                                    ``defer_loading`` kept)
  Anthropic-defined    refused or   a tool with a versioned ``type`` and no ``input_schema``: the server
  tools                dropped      tools (``web_search_*``, ``web_fetch_*``, ``code_execution_*``,
                                    ``tool_search_tool_*``, ``mcp_toolset``) and the client-run tools the
                                    model knows natively (``bash_*``, ``text_editor_*``, ``computer_*``,
                                    ``memory_*``), none of which vLLM translates: :func:`to_chat` refuses
                                    them (400 naming the tool, as vLLM 0.34 does); :func:`translate` with
                                    ``hosted_tools="drop"`` (the gateway's default) leaves them out and
                                    reports their types (a ``tool_choice`` naming one stays a 400). Any
                                    other ``type`` but ``"custom"`` is a 400 either way
tool_choice            honoured     auto → ``"auto"``, any → ``"required"``, tool → named function,
                                    none → ``"none"``; ``disable_parallel_tool_use`` →
                                    ``parallel_tool_calls``; ``"auto"`` when tools are given without it
thinking               honoured     enabled → ``thinking_token_budget`` (``budget_tokens`` ≥ 1024 and <
                                    ``max_tokens``); disabled / between_tools → ``reasoning_effort`` = the
                                    served model's disabled-thinking effort (``"none"`` or ``"low"``, an
                                    argument: vLLM probes its template for it); adaptive → nothing;
                                    ``display`` ignored (reasoning is always returned)
output_config          honoured     ``effort`` → ``reasoning_effort`` (thinking disabled overrides it);
                                    ``format`` (json_schema) → ``response_format``
metadata               ignored      accepted (an object) and not sent; the gateway reads session identity
                                    from headers
cache_control          ignored      on any block or tool: vLLM's prefix caching is automatic
context_management     ignored      as vLLM: no server-side context editing, the history renders as sent
container              ignored      as vLLM: it only serves Anthropic's code-execution tool, refused above
service_tier           ignored      as vLLM: there is one tier
mcp_servers            refused      when non-empty: the MCP connector runs tools on Anthropic's side, which
                                    nothing here does (vLLM ignores the field silently; a request that
                                    expects those tools would get a model that cannot see them)
kv_transfer_params     refused      the gateway sets it per leg
chat_template_kwargs,  honoured     vLLM extensions of its Messages request, passed to the chat request
cache_salt,
vllm_xargs,
min_tokens,
watermarking
other fields           ignored      as vLLM (its request model ignores unknown fields)
=====================  ===========  =====================================================================

Where this deliberately differs from vLLM, it is on the side of a clear error or a well-formed answer, never
of a different prompt: required fields of a block (a ``tool_use`` id, a ``tool_result``'s ``tool_use_id``)
must be there (vLLM invents a time-based id, which would make the same history render differently each
turn); ``tool_use`` only in assistant messages (the chat API refuses tool calls on anything else);
unparseable tool arguments become ``input: {}`` (vLLM answers 500); the first stream chunk's content is
translated (vLLM skips that chunk's delta); ``message_delta`` is also sent at ``[DONE]`` when no usage chunk
came; signatures of thinking blocks are a hash of their text (vLLM: a random uuid — either way nothing
checks them, and a hash keeps the translation pure).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from http import HTTPStatus
from typing import Any, Final

from kvtether.sdk.apis.common import HostedTools, Translation, effort_in_template_kwargs, once

Event = tuple[str, dict[str, Any]]

BILLING_HEADER_PREFIX: Final = "x-anthropic-billing-header"
# Anthropic's effort levels (vLLM's AnthropicEffort), and what thinking.type=disabled may map to.
EFFORTS: Final = ("low", "medium", "high", "xhigh", "max")
DISABLED_THINKING_EFFORTS: Final = ("none", *EFFORTS)
# Content block types vLLM's AnthropicContentBlock accepts; any other is a 400 there too.
BLOCK_TYPES: Final = ("text", "image", "tool_use", "tool_result", "tool_reference", "thinking",
                      "redacted_thinking", "tool_addition", "tool_removal")
_TOOL_CHANGES: Final = ("tool_addition", "tool_removal")
# Anthropic-defined tools (a versioned type, no input_schema). Anthropic runs the server tools (web search and
# fetch, code execution, tool search, MCP toolsets); bash, text_editor, computer and memory run in the client,
# but the model knows their schemas natively, so no chat template can show them to another model. vLLM
# translates none of them (0.34 refuses every one).
_ANTHROPIC_DEFINED: Final = re.compile(r"(web_search|web_fetch|code_execution|computer|bash|text_editor|memory"
                                       r"|tool_search_tool_regex|tool_search_tool_bm25)_[0-9]{8}|mcp_toolset")
# vLLM's Anthropic stop-reason vocabulary, keyed by the chat finish reason it maps from.
STOP_REASONS: Final = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}

# HTTP status → Anthropic error.type (vLLM 0.34's translate_error_type, plus 500 and Anthropic's own 529).
ERROR_TYPES: Final[Mapping[int, str]] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


class MessagesError(Exception):
    """A request the Messages API refuses, with the HTTP status and Anthropic ``error.type`` to answer it with."""

    def __init__(self, status: int, type: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.type = type
        self.message = message

    def body(self) -> dict[str, Any]:
        return {"type": "error", "error": {"type": self.type, "message": self.message}}


def _invalid(message: str) -> MessagesError:
    return MessagesError(400, "invalid_request_error", message)


# ---------------------------------------------------------------------------------------------------------
# Errors


def error_type(status: int) -> str:
    """Anthropic's ``error.type`` for an HTTP status: other 4xx are invalid requests, other 5xx API errors."""
    known = ERROR_TYPES.get(status)
    if known is not None:
        return known
    return "api_error" if status >= 500 else "invalid_request_error"


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def from_openai_error(status: int, openai_error_body: Any) -> dict[str, Any]:
    """The gateway's (or vLLM's) OpenAI-shaped error — ``{"error": {"message", "type", …}}``, or the flat
    ``{"object": "error", "message", …}`` older vLLM answers with — in Anthropic's shape. The type follows the
    status, as vLLM 0.34 does, since OpenAI's type names (``service_unavailable``…) mean nothing to an
    Anthropic SDK, which dispatches on ``error.type``."""
    message: Any = None
    if isinstance(openai_error_body, Mapping):
        inner = openai_error_body.get("error")
        if isinstance(inner, Mapping):
            message = inner.get("message")
        elif isinstance(inner, str):
            message = inner
        if message is None:
            message = openai_error_body.get("message")
    elif isinstance(openai_error_body, str | bytes):
        text = openai_error_body.decode(errors="replace") if isinstance(openai_error_body, bytes) \
            else openai_error_body
        try:
            parsed = json.loads(text)
        except ValueError:
            parsed = None
        # An error body not parsed yet: read it as JSON; anything else is the message itself.
        return from_openai_error(status, parsed) if isinstance(parsed, Mapping) else error_body(status, text or
                                                                                               _phrase(status))
    if not isinstance(message, str) or not message:
        message = _phrase(status)
    return error_body(status, message)


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return f"upstream error (HTTP {status})"


# ---------------------------------------------------------------------------------------------------------
# Request: Messages → chat


def to_chat(body: Mapping[str, Any], *, merge_inline_system: bool = False,
            disabled_thinking_effort: str = "none") -> dict[str, Any]:
    """The chat completion request body for an Anthropic Messages request body.

    ``merge_inline_system``: the served chat template needs system-first ordering (vLLM decides it by
    rendering a probe conversation through the template at start-up). ``disabled_thinking_effort``: what
    ``thinking.type: disabled`` maps to on the served model (vLLM's ``--anthropic-disabled-thinking-effort``;
    its ``auto`` probes the template and picks ``"none"`` or ``"low"``). P and D must agree on both, so they
    are the caller's to resolve once, not this module's to guess.

    Raises :class:`MessagesError` (400) naming the field of a request vLLM would refuse, or this gateway does;
    an Anthropic-defined tool is refused, as vLLM refuses it.
    """
    return _translate(body, count=False, merge_inline_system=merge_inline_system,
                      disabled_thinking_effort=disabled_thinking_effort, hosted_tools="refuse").chat


def translate(body: Mapping[str, Any], *, hosted_tools: HostedTools = "refuse", merge_inline_system: bool = False,
              disabled_thinking_effort: str = "none") -> Translation:
    """:func:`to_chat`, with a choice of what becomes of Anthropic-defined tools: ``"refuse"`` (400) or
    ``"drop"`` (left out of the turn, their types reported in ``dropped``)."""
    return _translate(body, count=False, merge_inline_system=merge_inline_system,
                      disabled_thinking_effort=disabled_thinking_effort, hosted_tools=hosted_tools)


def count_tokens_body(body: Mapping[str, Any], *, merge_inline_system: bool = False,
                      disabled_thinking_effort: str = "none", hosted_tools: HostedTools = "refuse"
                      ) -> dict[str, Any]:
    """The chat body to tokenize for ``/v1/messages/count_tokens``: the same translation without the sampling
    fields (no ``max_tokens`` needed, none sent). vLLM's chat request turns ``reasoning_effort`` into the
    template kwargs ``reasoning_effort`` and ``enable_thinking``; ``/tokenize`` has no such field, so they are
    also folded into ``chat_template_kwargs`` here — the count is then the same through either endpoint."""
    out = _translate(body, count=True, merge_inline_system=merge_inline_system,
                     disabled_thinking_effort=disabled_thinking_effort, hosted_tools=hosted_tools).chat
    effort_in_template_kwargs(out, out.get("reasoning_effort"))
    return out


def is_anthropic_defined(tool: Any) -> bool:
    """Whether a tool is one of Anthropic's own (server tools, and the client tools the model knows natively)."""
    kind = tool.get("type") if isinstance(tool, Mapping) else None
    return isinstance(kind, str) and _ANTHROPIC_DEFINED.fullmatch(kind) is not None


def _translate(body: Mapping[str, Any], *, count: bool, merge_inline_system: bool,
               disabled_thinking_effort: str, hosted_tools: HostedTools) -> Translation:
    if not isinstance(body, Mapping):
        raise _invalid("the request body must be a JSON object")
    if disabled_thinking_effort not in DISABLED_THINKING_EFFORTS:
        raise ValueError(f"disabled_thinking_effort must be one of {DISABLED_THINKING_EFFORTS}")
    _refuse_unserved(body)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _invalid("model: required, a non-empty string")
    max_tokens = None if count else _max_tokens(body.get("max_tokens"))
    drop = hosted_tools == "drop"
    messages = _check_messages(body.get("messages"), drop_hosted=drop)
    system = _check_system(body.get("system"))
    declared, dropped = _check_tools(body.get("tools"), drop_hosted=drop)
    tools = _resolve_tools(declared, messages, dropped)
    tool_choice = _check_tool_choice(body.get("tool_choice"))
    thinking = _check_thinking(body.get("thinking"), max_tokens)
    effort, response_format = _check_output_config(body.get("output_config"))

    chat_messages: list[dict[str, Any]] = []
    _convert_system(system, messages, chat_messages, merge_inline_system=merge_inline_system)
    _convert_messages(messages, chat_messages, merge_inline_system=merge_inline_system)

    out: dict[str, Any] = {"model": model, "messages": chat_messages}
    if not count:
        out["max_tokens"] = max_tokens
        _copy_sampling(body, out)
        stream = body.get("stream")
        if stream is not None and not isinstance(stream, bool):
            raise _invalid("stream: must be a boolean")
        out["stream"] = bool(stream)
        if stream:
            out["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, Mapping):
            raise _invalid("chat_template_kwargs: must be an object")
        out["chat_template_kwargs"] = dict(kwargs)
    if response_format is not None:
        out["response_format"] = response_format
    # vLLM's order: output_config's effort first, then thinking (disabled overrides the effort).
    if effort is not None:
        out["reasoning_effort"] = effort
    if thinking is not None:
        kind = thinking["type"]
        if kind in ("disabled", "between_tools"):
            out["reasoning_effort"] = disabled_thinking_effort
        elif kind == "enabled" and not count:
            out["thinking_token_budget"] = thinking["budget_tokens"]
    _convert_tools(tools, tool_choice, out, dropped)
    return Translation(out, once([str(t.get("type")) for t in dropped]))


def _refuse_unserved(body: Mapping[str, Any]) -> None:
    if body.get("mcp_servers"):
        raise _invalid("mcp_servers: the MCP connector (tools run on the API's side) is not served here; "
                       "declare the tools in `tools` and run them in the client")
    if "kv_transfer_params" in body:
        raise _invalid("kv_transfer_params: set by the gateway, not by clients")


def _max_tokens(value: Any) -> int:
    if value is None:
        raise _invalid("max_tokens: required, an integer >= 1")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _invalid("max_tokens: must be an integer >= 1")
    return value


def _copy_sampling(body: Mapping[str, Any], out: dict[str, Any]) -> None:
    stop = body.get("stop_sequences")
    if stop is not None:
        if not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
            raise _invalid("stop_sequences: must be a list of strings")
        out["stop"] = list(stop)
    for name in ("temperature", "top_p"):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise _invalid(f"{name}: must be a number")
        out[name] = value
    for name, low in (("top_k", -1), ("min_tokens", 0)):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise _invalid(f"{name}: must be an integer >= {low}")
        if name == "min_tokens" and value == 0:
            continue  # vLLM's default: the same request without it
        out[name] = value
    salt = body.get("cache_salt")
    if salt is not None:
        if not (isinstance(salt, str) and 0 < len(salt) <= 1024):
            raise _invalid("cache_salt: must be a string of 1-1024 characters")
        out["cache_salt"] = salt
    xargs = body.get("vllm_xargs")
    if xargs is not None:
        if not isinstance(xargs, Mapping):
            raise _invalid("vllm_xargs: must be an object")
        out["vllm_xargs"] = dict(xargs)
    watermarking = body.get("watermarking")
    if watermarking is not None:
        if not isinstance(watermarking, bool):
            raise _invalid("watermarking: must be a boolean")
        out["watermarking"] = watermarking


# --- validation of the request's shape (every message names the field) -----------------------------------


def _check_messages(messages: Any, *, drop_hosted: bool = False) -> list[Mapping[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise _invalid("messages: required, a non-empty list of {role, content}")
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, Mapping):
            raise _invalid(f"{where}: must be an object with role and content")
        role = msg.get("role")
        # vLLM accepts role "system" inside messages too (Claude Code's per-turn reminders).
        if role not in ("user", "assistant", "system"):
            raise _invalid(f"{where}.role: must be \"user\" or \"assistant\" (or \"system\"), got {role!r}")
        content = msg.get("content")
        if isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise _invalid(f"{where}.content: required, a string or a list of content blocks")
        for j, block in enumerate(content):
            _check_block(block, f"{where}.content[{j}]", role=role, drop_hosted=drop_hosted)
    return messages


def _check_system(system: Any) -> str | list[Mapping[str, Any]] | None:
    if system is None or isinstance(system, str):
        return system
    if not isinstance(system, list):
        raise _invalid("system: must be a string or a list of content blocks")
    for j, block in enumerate(system):
        _check_block(block, f"system[{j}]", role="top-level system")
    return system


def _check_block(block: Any, where: str, *, role: str, drop_hosted: bool = False) -> None:
    if not isinstance(block, Mapping):
        raise _invalid(f"{where}: must be a content block object with a type")
    kind = block.get("type")
    if kind not in BLOCK_TYPES:
        raise _invalid(f"{where}.type: {kind!r} is not a content block type served here "
                       f"(served: {', '.join(BLOCK_TYPES)})")
    if kind == "text":
        _optional_str(block, "text", where)
    elif kind == "image":
        source = block.get("source")
        if not isinstance(source, Mapping):
            raise _invalid(f"{where}.source: required for an image block, an object")
        if source.get("type", "base64") not in ("base64", "url"):
            raise _invalid(f"{where}.source.type: {source.get('type')!r} is not served (base64 or url)")
    elif kind == "thinking":
        if not isinstance(block.get("thinking"), str):
            raise _invalid(f"{where}.thinking: required for a thinking block, a string")
    elif kind == "tool_use":
        if role != "assistant":
            # vLLM would hang tool_calls on a user message, which the chat API then refuses less helpfully.
            raise _invalid(f"{where}: tool_use blocks belong in assistant messages")
        for key in ("id", "name"):
            if not isinstance(block.get(key), str) or not block[key]:
                raise _invalid(f"{where}.{key}: required for a tool_use block, a non-empty string")
        if block.get("input") is not None and not isinstance(block["input"], Mapping):
            raise _invalid(f"{where}.input: must be an object")
    elif kind == "tool_result":
        if not isinstance(block.get("tool_use_id"), str) or not block["tool_use_id"]:
            raise _invalid(f"{where}.tool_use_id: required for a tool_result block, a non-empty string")
        content = block.get("content")
        if content is not None and not isinstance(content, str | list):
            raise _invalid(f"{where}.content: must be a string or a list of content blocks")
        if isinstance(content, list):
            for k, item in enumerate(content):
                if not isinstance(item, Mapping):
                    raise _invalid(f"{where}.content[{k}]: must be a content block object")
        if block.get("is_error") is not None and not isinstance(block["is_error"], bool):
            raise _invalid(f"{where}.is_error: must be a boolean")
    elif kind in _TOOL_CHANGES:
        if role != "system":
            raise _invalid(f"{where}: {kind} blocks are only allowed in messages with role \"system\"")
        tool = block.get("tool")
        if not isinstance(tool, Mapping):
            raise _invalid(f"{where}.tool: required for a {kind} block, an object")
        if tool.get("type") == "tool_reference":
            if not isinstance(tool.get("name"), str):
                raise _invalid(f"{where}.tool.name: required, a string")
        elif tool.get("type") == "tool_definition" and kind == "tool_addition":
            if not (drop_hosted and is_anthropic_defined(tool.get("definition"))):
                _check_tool(tool.get("definition"), f"{where}.tool.definition")
        else:
            allowed = "tool_reference" if kind == "tool_removal" else "tool_reference or tool_definition"
            raise _invalid(f"{where}.tool.type: must be {allowed}")


def _optional_str(block: Mapping[str, Any], key: str, where: str) -> None:
    if block.get(key) is not None and not isinstance(block[key], str):
        raise _invalid(f"{where}.{key}: must be a string")


def _check_tools(tools: Any, *, drop_hosted: bool = False
                 ) -> tuple[list[Mapping[str, Any]] | None, list[Mapping[str, Any]]]:
    """The declared tools, checked; with ``drop_hosted``, without the Anthropic-defined ones (the second list)."""
    if tools is None:
        return None, []
    if not isinstance(tools, list):
        raise _invalid("tools: must be a list of tools")
    kept: list[Mapping[str, Any]] = []
    dropped: list[Mapping[str, Any]] = []
    for i, tool in enumerate(tools):
        if drop_hosted and is_anthropic_defined(tool):
            dropped.append(tool)
        else:
            _check_tool(tool, f"tools[{i}]")
            kept.append(tool)
    return kept, dropped


def _check_tool(tool: Any, where: str) -> None:
    if not isinstance(tool, Mapping):
        raise _invalid(f"{where}: must be a tool object {{name, description?, input_schema}}")
    kind = tool.get("type")
    name = tool.get("name")
    if kind not in (None, "custom"):
        # Anthropic-defined tools carry a versioned type and no input_schema; nothing here runs them.
        raise _invalid(f"{where}: tool {name!r} has type {kind!r}, an Anthropic-defined or server tool, which is "
                       "not served here; only custom tools with an input_schema are")
    if not isinstance(name, str) or not name:
        raise _invalid(f"{where}.name: required, a non-empty string")
    if not isinstance(tool.get("input_schema"), Mapping):
        raise _invalid(f"{where}.input_schema: required, an object (a JSON schema)")
    if tool.get("description") is not None and not isinstance(tool["description"], str):
        raise _invalid(f"{where}.description: must be a string")
    for flag in ("strict", "defer_loading"):
        if tool.get(flag) is not None and not isinstance(tool[flag], bool):
            raise _invalid(f"{where}.{flag}: must be a boolean")


def _check_tool_choice(choice: Any) -> Mapping[str, Any] | None:
    if choice is None:
        return None
    if not isinstance(choice, Mapping):
        raise _invalid("tool_choice: must be an object {type: auto|any|tool|none}")
    kind = choice.get("type")
    if kind not in ("auto", "any", "tool", "none"):
        raise _invalid(f"tool_choice.type: must be auto, any, tool or none, got {kind!r}")
    if kind == "tool" and (not isinstance(choice.get("name"), str) or not choice["name"]):
        raise _invalid("tool_choice.name: required when type is \"tool\"")
    flag = choice.get("disable_parallel_tool_use")
    if flag is not None and not isinstance(flag, bool):
        raise _invalid("tool_choice.disable_parallel_tool_use: must be a boolean")
    return choice


def _check_thinking(thinking: Any, max_tokens: int | None) -> Mapping[str, Any] | None:
    if thinking is None:
        return None
    if not isinstance(thinking, Mapping):
        raise _invalid("thinking: must be an object {type: enabled|disabled|adaptive|between_tools}")
    kind = thinking.get("type")
    if kind not in ("enabled", "disabled", "adaptive", "between_tools"):
        raise _invalid(f"thinking.type: must be enabled, disabled, adaptive or between_tools, got {kind!r}")
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1024:
            raise _invalid("thinking.budget_tokens: required when thinking is enabled, an integer >= 1024")
        if max_tokens is not None and budget >= max_tokens:
            raise _invalid("thinking.budget_tokens: must be less than max_tokens")
    return thinking


def _check_output_config(config: Any) -> tuple[str | None, dict[str, Any] | None]:
    """(reasoning effort, response_format) of ``output_config``."""
    if config is None:
        return None, None
    if not isinstance(config, Mapping):
        raise _invalid("output_config: must be an object")
    effort = config.get("effort")
    if effort is not None and effort not in EFFORTS:
        raise _invalid(f"output_config.effort: must be one of {', '.join(EFFORTS)}, got {effort!r}")
    fmt = config.get("format")
    response_format = None
    if fmt is not None:
        if not isinstance(fmt, Mapping) or fmt.get("type", "json_schema") != "json_schema":
            raise _invalid("output_config.format: must be {type: \"json_schema\", schema}")
        schema = fmt.get("schema")
        if schema is not None and not isinstance(schema, Mapping):
            raise _invalid("output_config.format.schema: must be an object")
        if schema:  # vLLM: a format without a schema constrains nothing
            response_format = {"type": "json_schema", "json_schema": {"name": "json_schema", "schema": schema}}
    return effort, response_format


# --- conversion (vLLM's rules; comments say where a rule looks odd but is kept for the prompt's sake) -----


def _system_block_texts(blocks: Sequence[Mapping[str, Any]]) -> list[str]:
    return [b["text"] for b in blocks
            if b.get("type") == "text" and b.get("text") and not b["text"].startswith(BILLING_HEADER_PREFIX)]


def _inline_system_text(msg: Mapping[str, Any]) -> str | None:
    content = msg["content"]
    if isinstance(content, str):
        # Unlike the top-level string (kept whole), an inline system string is dropped when it is the header.
        return None if content.startswith(BILLING_HEADER_PREFIX) else content
    parts = _system_block_texts(content)
    return "".join(parts) if parts else None


def _convert_system(system: str | list[Mapping[str, Any]] | None, messages: Sequence[Mapping[str, Any]],
                    out: list[dict[str, Any]], *, merge_inline_system: bool) -> None:
    parts: list[str] = []
    if isinstance(system, str):
        if system:
            parts.append(system)
    elif system:
        parts.extend(_system_block_texts(system))
    if merge_inline_system:
        for msg in messages:
            if msg["role"] == "system":
                text = _inline_system_text(msg)
                if text:
                    parts.append(text)
    if parts:
        out.append({"role": "system", "content": "".join(parts)})


def _convert_messages(messages: Sequence[Mapping[str, Any]], out: list[dict[str, Any]], *,
                      merge_inline_system: bool) -> None:
    for msg in messages:
        role = msg["role"]
        if role == "system":
            if not merge_inline_system:
                text = _inline_system_text(msg)
                if text:
                    out.append({"role": "system", "content": text})
            continue
        chat: dict[str, Any] = {"role": role}
        content = msg["content"]
        if isinstance(content, str):
            chat["content"] = content
        else:
            _convert_blocks(content, role, chat, out)
        # A user message whose blocks were all tool results (now tool messages) has nothing left to say.
        if not (role == "user" and "content" not in chat):
            out.append(chat)


def _convert_blocks(blocks: Sequence[Mapping[str, Any]], role: str, chat: dict[str, Any],
                    out: list[dict[str, Any]]) -> None:
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for block in blocks:
        kind = block["type"]
        if kind == "text":
            if block.get("text"):  # vLLM drops empty text blocks
                parts.append({"type": "text", "text": block["text"]})
        elif kind == "image":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block["source"])}})
        elif kind == "thinking":
            reasoning.append(block["thinking"])
        elif kind == "tool_use":
            calls.append({
                "id": block["id"],
                "type": "function",
                # json.dumps' defaults — ", " / ": " and \\uXXXX escapes — are the bytes vLLM renders.
                "function": {"name": block["name"], "arguments": json.dumps(block.get("input") or {})},
            })
        elif kind == "tool_result":
            if role == "user":
                _convert_tool_result(block, out)
            else:
                # vLLM renders a tool_result outside a user message as text, with Python's str() of its
                # content (a list's repr, quotes and all): odd, but it is the prompt vLLM builds.
                content = block.get("content")
                parts.append({"type": "text", "text": f"Tool result: {str(content) if content else ''}"})
        # redacted_thinking (opaque), tool_reference (expanded only inside tool results), tool_addition and
        # tool_removal (applied to the tool list): nothing in the message.
    # vLLM's key order, so the body's bytes (hashed by the guard) match a re-translation of the same history.
    if reasoning:
        chat["reasoning"] = "".join(reasoning)
    if calls:
        chat["tool_calls"] = calls
    if parts:
        if len(parts) == 1 and parts[0]["type"] == "text":
            chat["content"] = parts[0]["text"]
        else:
            chat["content"] = parts


def _image_url(source: Mapping[str, Any]) -> str:
    if source.get("type") == "url":
        return str(source.get("url", ""))
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def _convert_tool_result(block: Mapping[str, Any], out: list[dict[str, Any]]) -> None:
    content = block.get("content")
    text = ""
    images: list[str] = []
    references: list[dict[str, Any]] = []
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts: list[str] = []
        for item in content:
            kind = item.get("type")
            if kind == "text":
                texts.append(item.get("text", ""))
            elif kind == "image":
                images.append(_image_url(item.get("source") or {}))
            elif kind == "tool_reference":
                name = item.get("tool_name") or item.get("name")
                if name:
                    references.append({"type": "tool_reference", "name": name})
        text = "\n".join(texts)
    tool_content: str | list[dict[str, Any]] = text
    if references:
        # vLLM 0.34: one tool message, the references first (templates that expand them read the first part).
        tool_content = [*references, *([{"type": "text", "text": text}] if text else [])]
    out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": tool_content})
    if images:
        out.append({"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}} for u in images]})


def _resolve_tools(tools: list[Mapping[str, Any]] | None, messages: Sequence[Mapping[str, Any]],
                   dropped: list[Mapping[str, Any]]) -> list[Mapping[str, Any]] | None:
    """The tools in effect at the end of the conversation, after its tool_addition / tool_removal blocks
    (chat templates see one tool list): added by reference → no longer deferred, added by value → declared,
    removed → gone. An Anthropic-defined tool added by value joins ``dropped`` (only there when they are
    dropped: refused otherwise), and changes that name a dropped tool change nothing."""
    changes = [b for m in messages if not isinstance(m["content"], str)
               for b in m["content"] if b.get("type") in _TOOL_CHANGES]
    if not changes:
        return tools
    by_name: dict[str, Mapping[str, Any]] = {t["name"]: t for t in tools or []}
    removed: set[str] = set()
    for block in changes:
        change = block["tool"]
        if change["type"] == "tool_definition" and is_anthropic_defined(change["definition"]):
            dropped.append(change["definition"])
            continue
        if change["type"] == "tool_definition":
            name = change["definition"]["name"]
            by_name[name] = change["definition"]
        else:
            name = change["name"]
            if name not in by_name and any(t.get("name") == name for t in dropped):
                continue
            if name not in by_name:
                raise _invalid(f"{block['type']} references tool {name!r}, which is not declared in tools")
            if block["type"] == "tool_addition":
                by_name[name] = {**by_name[name], "defer_loading": None}
        if block["type"] == "tool_removal":
            removed.add(name)
        else:
            removed.discard(name)
    return [t for name, t in by_name.items() if name not in removed]


def _convert_tools(tools: list[Mapping[str, Any]] | None, choice: Mapping[str, Any] | None,
                   out: dict[str, Any], dropped: Sequence[Mapping[str, Any]] = ()) -> None:
    if choice is not None:
        out["parallel_tool_calls"] = not choice.get("disable_parallel_tool_use")
    if dropped:
        _check_choice_after_drop(choice, dropped, has_tools=bool(tools))
    if not tools:
        # vLLM renders no tool choice without tools; the chat API refuses one (and an empty tool list) outright.
        return
    converted = []
    for tool in tools:
        schema = dict(tool["input_schema"])
        if "type" not in schema:
            schema["type"] = "object"  # vLLM's default; appended last, as its validator does
        function: dict[str, Any] = {"name": tool["name"], "description": tool.get("description"),
                                    "parameters": schema}
        for flag in ("strict", "defer_loading"):
            if tool.get(flag) is not None:
                function[flag] = tool[flag]
        converted.append({"type": "function", "function": function})
    out["tools"] = converted
    kind = choice.get("type") if choice is not None else "auto"
    if kind == "tool" and choice is not None:
        name = choice["name"]
        if not any(t["name"] == name for t in tools):
            raise _invalid(f"tool_choice.name: {name!r} is not one of the tools")
        out["tool_choice"] = {"type": "function", "function": {"name": name}}
    else:
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[str(kind)]


def _check_choice_after_drop(choice: Mapping[str, Any] | None, dropped: Sequence[Mapping[str, Any]], *,
                             has_tools: bool) -> None:
    """A tool_choice that cannot hold once the Anthropic-defined tools are gone is a 400: one naming such a
    tool (the client asked for exactly the call the model cannot make), and ``any`` when only such tools were
    given."""
    kind = choice.get("type") if choice is not None else None
    if kind == "tool" and choice is not None:
        tool = next((t for t in dropped if t.get("name") == choice["name"]), None)
        if tool is not None:
            raise _invalid(f"tool_choice.name: {choice['name']!r} is the Anthropic-defined tool "
                           f"{tool.get('type')!r}, which the model behind this gateway cannot call (the gateway "
                           "leaves such tools out of the turn); name a custom tool, or use auto")
    if kind == "any" and not has_tools:
        types = ", ".join(once([str(t.get("type")) for t in dropped]))
        raise _invalid(f"tool_choice: \"any\" needs a tool, but every tool given is an Anthropic-defined tool the "
                       f"model behind this gateway cannot call ({types}; left out of the turn): give a custom "
                       "tool, or use auto")


# ---------------------------------------------------------------------------------------------------------
# Response: chat → Messages


def message_id(chat_id: Any) -> str:
    """``msg_…`` from a chat completion id (``chatcmpl-abc`` → ``msg_abc``): the same answer, the same id."""
    raw = chat_id if isinstance(chat_id, str) and chat_id else "unknown"
    if raw.startswith("msg_"):
        return raw
    for prefix in ("chatcmpl-", "chatcmpl_", "cmpl-"):
        if raw.startswith(prefix) and len(raw) > len(prefix):
            return "msg_" + raw[len(prefix):]
    return "msg_" + raw


def thinking_signature(thinking: str) -> str:
    """The signature of a thinking block. vLLM fabricates one (a random uuid hex); nothing on this side ever
    checks it, so a hash of the text serves as well and keeps equal answers equal."""
    return hashlib.sha256(thinking.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def usage(chat_usage: Any) -> dict[str, int]:
    """Anthropic usage from chat usage. Anthropic counts ``input_tokens`` *besides* the cached ones, vLLM's
    ``prompt_tokens`` is the total: input = prompt − cache read − cache creation (as vLLM computes it)."""
    if not isinstance(chat_usage, Mapping):
        return {"input_tokens": 0, "output_tokens": 0}
    out: dict[str, int] = {"input_tokens": 0, "output_tokens": _int(chat_usage.get("completion_tokens"))}
    prompt = _int(chat_usage.get("prompt_tokens"))
    details = chat_usage.get("prompt_tokens_details")
    if isinstance(details, Mapping):
        cached = details.get("cached_tokens")
        if isinstance(cached, int) and not isinstance(cached, bool):
            prompt -= cached
            out["cache_read_input_tokens"] = cached
        created = details.get("created_cache_tokens")
        if isinstance(created, int) and not isinstance(created, bool):
            prompt -= created
            out["cache_creation_input_tokens"] = created
    out["input_tokens"] = max(0, prompt)
    return out


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def stop_reason(finish_reason: Any, matched_stop: Any, *, tool_used: bool,
                tool_complete: bool) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) as vLLM maps them: ``max_tokens`` always wins; complete tool calls are
    ``tool_use``; a matched stop string (vLLM's ``stop_reason`` when it is a str — an int is a stop token)
    is ``stop_sequence``, unless the calls are complete (a call it cut short must not run); then
    ``tool_use`` if a tool was called (a forced tool call finishes with ``stop``), else ``end_turn``."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason not in ("stop", "tool_calls"):
        return None, None
    if tool_complete:
        return "tool_use", None
    if isinstance(matched_stop, str):
        return "stop_sequence", matched_stop
    if finish_reason == "tool_calls" or tool_used:
        return "tool_use", None
    return "end_turn", None


def _function(call: Mapping[str, Any]) -> Mapping[str, Any]:
    fn = call.get("function")
    return fn if isinstance(fn, Mapping) else {}


def _tool_input(arguments: Any) -> dict[str, Any]:
    if isinstance(arguments, Mapping):
        return dict(arguments)
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return {}
        if isinstance(parsed, dict):
            return parsed
    return {}


def from_chat(chat_response: Mapping[str, Any], model: str) -> dict[str, Any]:
    """An Anthropic Messages response for a non-streamed chat completion (its first choice); ``model`` is the
    name to report (the one the client asked for)."""
    choices = chat_response.get("choices")
    choice: Mapping[str, Any] = choices[0] if isinstance(choices, list) and choices \
        and isinstance(choices[0], Mapping) else {}
    message = choice.get("message")
    if not isinstance(message, Mapping):
        message = {}
    content: list[dict[str, Any]] = []
    reasoning = message.get("reasoning")
    if reasoning is None:
        reasoning = message.get("reasoning_content")
    if isinstance(reasoning, str) and reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": thinking_signature(reasoning)})
    text = message.get("content")
    if isinstance(text, str) and text:
        content.append({"type": "text", "text": text})
    calls = [c for c in message.get("tool_calls") or () if isinstance(c, Mapping)]
    for call in calls:
        fn = _function(call)
        content.append({"type": "tool_use", "id": str(call.get("id") or ""), "name": str(fn.get("name") or ""),
                        "input": _tool_input(fn.get("arguments"))})
    if not content:
        # Anthropic's shape of an empty answer is one empty text block (strict clients read content[0]).
        content.append({"type": "text", "text": ""})
    last_args = _function(calls[-1]).get("arguments") if calls else None
    reason, sequence = stop_reason(
        choice.get("finish_reason"), choice.get("stop_reason"), tool_used=bool(calls),
        tool_complete=bool(calls) and (isinstance(last_args, Mapping)
                                       or (isinstance(last_args, str) and _parses(last_args))))
    return {
        "id": message_id(chat_response.get("id")),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(chat_response.get("usage")),
    }


# ---------------------------------------------------------------------------------------------------------
# Streams: chat chunks → Messages events


def sse(event: str, data: Mapping[str, Any]) -> bytes:
    """One server-sent event as Anthropic (and vLLM) frame them."""
    payload = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    # A lone surrogate (json.loads lets "\ud800" through) cannot be UTF-8: replaced, not a broken stream.
    return f"event: {event}\ndata: {payload}\n\n".encode("utf-8", "replace")


def error_event(message: str, status: int = 500) -> Event:
    """The event a stream that already started ends with when its upstream breaks."""
    return "error", error_body(status, message)


class StreamTranslator:
    """Chat Completions stream chunks (parsed ``data:`` payloads) → Anthropic Messages stream events.

    ``feed`` each chunk, ``close`` at ``[DONE]`` (or ``fail`` when the upstream breaks); each returns the
    ``(event name, data)`` pairs to send, in order (:func:`sse` frames them). Blocks follow vLLM's converter:
    one open block at a time, a new one whenever the kind changes; every tool call its own ``tool_use`` block
    (parallel calls one after another, as the chat stream sends them); a thinking block gets its
    ``signature_delta`` just before it stops; text that arrives while a tool call is open is held and sent as
    a text block after it. ``message_delta`` goes out at the usage-only chunk that ends a stream with
    ``include_usage``, or at ``close`` when there was none.
    """

    def __init__(self, model: str, *, message_id: str | None = None) -> None:
        self.model = model
        self._id = message_id
        self._started = False
        self._finished = False  # message_delta sent
        self._closed = False
        self._next_index = 0
        self._block: str | None = None  # type of the open block
        self._block_index = 0
        self._thinking: list[str] = []
        self._tool_id: str | None = None  # id of the open tool_use block
        self._tool_ids: dict[int, str] = {}  # chat tool-call index → id
        self._pending_text: list[str] = []
        self._finish_reason: Any = None
        self._matched_stop: Any = None
        self._tool_used = False
        self._last_tool_args: list[str] = []
        self._usage: Any = None

    def feed(self, chunk: Mapping[str, Any]) -> list[Event]:
        if self._closed or self._finished:
            return []
        events: list[Event] = []
        chunk_usage = chunk.get("usage")
        if isinstance(chunk_usage, Mapping):
            self._usage = chunk_usage
        if not self._started:
            events.append(self._message_start(chunk.get("id")))
        choices = chunk.get("choices")
        if not choices:
            # The usage-only chunk that stream_options.include_usage ends a stream with.
            if isinstance(chunk_usage, Mapping):
                events += self._message_delta()
            return events
        choice = next((c for c in choices if isinstance(c, Mapping) and c.get("index", 0) == 0), None)
        if choice is None:
            return events
        if choice.get("finish_reason") is not None:
            self._finish_reason = choice["finish_reason"]
            self._matched_stop = choice.get("stop_reason")
        delta = choice.get("delta")
        if not isinstance(delta, Mapping):
            return events
        reasoning = delta.get("reasoning")
        if reasoning is None:
            reasoning = delta.get("reasoning_content")
        if isinstance(reasoning, str) and reasoning:
            if self._block != "thinking":
                events += self._stop_and_flush()
                events.append(self._start({"type": "thinking", "thinking": ""}))
            self._thinking.append(reasoning)
            events.append(self._delta({"type": "thinking_delta", "thinking": reasoning}))
        text = delta.get("content")
        if isinstance(text, str) and text:
            if self._block == "tool_use":
                self._pending_text.append(text)
            else:
                if self._block != "text":
                    events += self._stop_and_flush()
                    events.append(self._start({"type": "text", "text": ""}))
                events.append(self._delta({"type": "text_delta", "text": text}))
        for call in delta.get("tool_calls") or ():
            if isinstance(call, Mapping):
                events += self._tool_call(call)
        return events

    def close(self) -> list[Event]:
        """The events after the stream's last chunk (``[DONE]``): the open block stopped, ``message_delta``
        if the usage chunk did not already send it, ``message_stop``."""
        if self._closed:
            return []
        events: list[Event] = []
        if not self._started:
            events.append(self._message_start(None))
        if not self._finished:
            events += self._message_delta()
        events.append(("message_stop", {"type": "message_stop"}))
        self._closed = True
        return events

    def fail(self, message: str, status: int = 500) -> list[Event]:
        """The events that end a stream whose upstream broke: the open block stopped (as vLLM 0.34 does, so
        a client's block bookkeeping stays consistent), then an ``error`` event."""
        if self._closed:
            return []
        events = self._stop_block()
        events.append(error_event(message, status))
        self._closed = True
        return events

    # --- internals ---

    def _message_start(self, chat_id: Any) -> Event:
        self._started = True
        if self._id is None:
            self._id = message_id(chat_id)
        return "message_start", {"type": "message_start", "message": {
            "id": self._id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": usage(self._usage)}}

    def _message_delta(self) -> list[Event]:
        events = self._stop_and_flush()
        complete = self._tool_used and _parses("".join(self._last_tool_args))
        reason, sequence = stop_reason(self._finish_reason or "stop", self._matched_stop,
                                       tool_used=self._tool_used, tool_complete=complete)
        events.append(("message_delta", {"type": "message_delta",
                                         "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                         "usage": usage(self._usage)}))
        self._finished = True
        return events

    def _start(self, block: dict[str, Any]) -> Event:
        self._block = block["type"]
        self._block_index = self._next_index
        self._tool_id = block.get("id") if block["type"] == "tool_use" else None
        self._thinking = []
        return "content_block_start", {"type": "content_block_start", "index": self._block_index,
                                       "content_block": block}

    def _delta(self, delta: dict[str, Any]) -> Event:
        return "content_block_delta", {"type": "content_block_delta", "index": self._block_index, "delta": delta}

    def _stop_block(self) -> list[Event]:
        if self._block is None:
            return []
        events: list[Event] = []
        if self._block == "thinking":
            signature = thinking_signature("".join(self._thinking))
            events.append(self._delta({"type": "signature_delta", "signature": signature}))
        events.append(("content_block_stop", {"type": "content_block_stop", "index": self._block_index}))
        self._block = None
        self._tool_id = None
        self._next_index += 1
        return events

    def _stop_and_flush(self) -> list[Event]:
        events = self._stop_block()
        if self._pending_text:
            text = "".join(self._pending_text)
            self._pending_text = []
            events.append(self._start({"type": "text", "text": ""}))
            events.append(self._delta({"type": "text_delta", "text": text}))
            events += self._stop_block()
        return events

    def _tool_call(self, call: Mapping[str, Any]) -> list[Event]:
        events: list[Event] = []
        index = call.get("index", 0)
        fn = _function(call)
        arguments = fn.get("arguments")
        call_id = call.get("id")
        if isinstance(call_id, str) and call_id:
            self._tool_ids[index] = call_id
            name = fn.get("name")
            # A new block for a new call that has its name (a chunk may carry the id before the name).
            if self._tool_id != call_id and isinstance(name, str):
                events += self._stop_and_flush()
                self._tool_used = True
                self._last_tool_args = []
                events.append(self._start({"type": "tool_use", "id": call_id, "name": name, "input": {}}))
        else:
            call_id = self._tool_ids.get(index)
        # Argument fragments go to the call's block while it is the open one (vLLM's rule: the chat stream
        # finishes one call's arguments before the next call starts).
        if isinstance(arguments, str) and arguments and call_id is not None and self._tool_id == call_id:
            self._last_tool_args.append(arguments)
            events.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
        return events
