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

A lenient translation (:func:`translate` with ``lenient=True``) is for a request some server already took,
written as the chat turn it stands for (the SDK's recorder): it refuses nothing, leaves out each piece a strict
one refuses (a message, a block, a tool, a malformed field, a ``tool_choice`` that cannot hold) and drops
Anthropic-defined tools; ``model`` and ``max_tokens`` may be missing. Whatever it keeps becomes exactly what the
gateway sends.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, Final

from kvtether.protocol.common import (
    HostedTools,
    Translation,
    effort_in_template_kwargs,
    leave_out_refused,
    once,
    passes,
    refuse,
)
from kvtether.protocol.messages.common import BILLING_HEADER_PREFIX, MessagesError, invalid
from kvtether.protocol.wire import KV_FIELD

# Request fields: read by the translation, and accepted without effect (vLLM ignores them too, or they are
# Anthropic's service knobs). ``mcp_servers`` (refused when non-empty) and ``kv_transfer_params`` are checked.
HONOURED_FIELDS: Final = ("model", "max_tokens", "messages", "system", "stop_sequences", "temperature", "top_p",
                          "top_k", "stream", "tools", "tool_choice", "thinking", "output_config",
                          "chat_template_kwargs", "cache_salt", "vllm_xargs", "min_tokens", "watermarking")
IGNORED_FIELDS: Final = ("metadata", "cache_control", "context_management", "container", "service_tier",
                         "diagnostics", "inference_geo", "speed", "user_profile_id", "workspace_id")
# Anthropic's effort levels (vLLM's AnthropicEffort), and what thinking.type=disabled may map to.
EFFORTS: Final = ("low", "medium", "high", "xhigh", "max")
DISABLED_THINKING_EFFORTS: Final = ("none", *EFFORTS)
# Content block types vLLM's AnthropicContentBlock accepts; any other is a 400 there too.
BLOCK_TYPES: Final = ("text", "image", "tool_use", "tool_result", "tool_reference", "thinking",
                      "redacted_thinking", "tool_addition", "tool_removal")
_TOOL_CHANGES: Final = ("tool_addition", "tool_removal")
_SERVER_RESULT = ("the result of an Anthropic server tool, which the model behind this gateway cannot call (such "
                  "tools are left out of the turn): send what it found as a text block, or leave the block out")
# Content block types the Messages spec defines (the installed ``anthropic`` package's ``ContentBlockParam``) that
# nothing here lowers, and what to send instead (tests/protocol/test_spec_coverage.py keeps the sets whole).
REFUSED_BLOCKS: Final[dict[str, str]] = {
    "document": "documents are not served (the model behind this gateway reads text and images): send the "
                "document's text as a text block",
    "search_result": "search results are not served as blocks: send their text as a text block",
    "container_upload": "container uploads serve Anthropic's code execution, which is not served here: leave "
                        "the block out",
    "server_tool_use": "a call of an Anthropic server tool, which the model behind this gateway cannot make "
                       "(such tools are left out of the turn): declare a custom tool and send its calls as "
                       "tool_use blocks, or leave the block out",
    **{kind: _SERVER_RESULT for kind in (
        "web_search_tool_result", "web_fetch_tool_result", "code_execution_tool_result",
        "bash_code_execution_tool_result", "text_editor_code_execution_tool_result", "tool_search_tool_result")},
}
# Blocks of a tool_result's content: lowered as vLLM lowers them (text, image, tool_reference), or refused.
TOOL_RESULT_BLOCKS: Final = ("text", "image", "tool_reference")
REFUSED_TOOL_RESULT_BLOCKS: Final[dict[str, str]] = {
    "document": REFUSED_BLOCKS["document"],
    "search_result": REFUSED_BLOCKS["search_result"],
    "browser_state": "browser state serves Anthropic's browser toolset, which is not served here: send the "
                     "state the model should see as a text block",
}
# Anthropic-defined tools (a versioned type, no input_schema). Anthropic runs the server tools (web search and
# fetch, code execution, tool search, MCP toolsets); bash, text_editor, computer and memory run in the client,
# but the model knows their schemas natively, so no chat template can show them to another model. vLLM
# translates none of them (0.34 refuses every one).
_ANTHROPIC_DEFINED: Final = re.compile(r"(web_search|web_fetch|code_execution|computer|bash|text_editor|memory"
                                       r"|tool_search_tool_regex|tool_search_tool_bm25|browser_toolset"
                                       r"|computer_toolset)_[0-9]{8}|mcp_toolset|tool_search_tool_(regex|bm25)")


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
              disabled_thinking_effort: str = "none", lenient: bool = False,
              unreadable_results: HostedTools = "refuse") -> Translation:
    """:func:`to_chat`, with a choice of what becomes of Anthropic-defined tools: ``"refuse"`` (400) or
    ``"drop"`` (left out of the turn, their types reported in ``dropped``).

    ``unreadable_results``: what becomes of a tool result's blocks that no model behind vLLM reads (a document, a
    search result, browser state: Claude Code's read of a PDF, say): ``"refuse"`` (400, naming the block and what
    to send instead) or ``"drop"`` (left out, as vLLM's own translation leaves them out, their types reported in
    ``left_out``). A client resends its history every turn, so a refusal there would end the session.

    ``lenient``: for a request some server already took, to be written as the chat turn it stands for (the
    SDK's recorder). Nothing is refused: each piece a strict translation refuses (a message, a block, a tool,
    a field, the tool_choice) is left out and Anthropic-defined tools are dropped. What is kept becomes exactly
    what the gateway sends."""
    left_out: tuple[str, ...] = ()
    if unreadable_results == "drop" or lenient:
        body, left_out = _without_unreadable_results(body)
    translation = _translate(body, count=False, merge_inline_system=merge_inline_system,
                             disabled_thinking_effort=disabled_thinking_effort,
                             hosted_tools="drop" if lenient else hosted_tools, lenient=lenient)
    return Translation(translation.chat, translation.dropped, left_out)


def _without_unreadable_results(body: Mapping[str, Any]) -> tuple[Mapping[str, Any], tuple[str, ...]]:
    """`body` without the blocks of its tool results that no model behind vLLM reads, and their types (each once,
    in order). A malformed body is left as it is, for the checks to refuse."""
    messages = body.get("messages") if isinstance(body, Mapping) else None
    if not isinstance(messages, list):
        return body, ()
    seen: list[str] = []
    kept_messages: list[Any] = []
    for msg in messages:
        content = msg.get("content") if isinstance(msg, Mapping) else None
        if not isinstance(content, list):
            kept_messages.append(msg)
            continue
        blocks: list[Any] = []
        for block in content:
            inner = block.get("content") if isinstance(block, Mapping) and block.get("type") == "tool_result" \
                else None
            if isinstance(inner, list):
                gone = [b for b in inner if isinstance(b, Mapping) and b.get("type") in REFUSED_TOOL_RESULT_BLOCKS]
                seen += [str(b["type"]) for b in gone]
                if gone:
                    block = {**block, "content": [b for b in inner if not any(b is g for g in gone)]}
            blocks.append(block)
        kept_messages.append({**msg, "content": blocks})
    if not seen:
        return body, ()
    return {**body, "messages": kept_messages}, tuple(dict.fromkeys(seen))


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
               disabled_thinking_effort: str, hosted_tools: HostedTools, lenient: bool = False) -> Translation:
    if not isinstance(body, Mapping):
        raise invalid("the request body must be a JSON object")
    if disabled_thinking_effort not in DISABLED_THINKING_EFFORTS:
        raise ValueError(f"disabled_thinking_effort must be one of {DISABLED_THINKING_EFFORTS}")
    if not lenient:
        _refuse_unserved(body)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        refuse(invalid("model: required, a non-empty string"), lenient)
    max_tokens = None if count else _max_tokens(body.get("max_tokens"), lenient)
    drop = hosted_tools == "drop"
    messages = _check_messages(body.get("messages"), drop_hosted=drop, lenient=lenient)
    system = _check_system(body.get("system"), lenient)
    declared, dropped = _check_tools(body.get("tools"), drop_hosted=drop, lenient=lenient)
    tools = _resolve_tools(declared, messages, dropped, lenient)
    tool_choice = leave_out_refused(lenient, _check_tool_choice, body.get("tool_choice"))
    thinking = leave_out_refused(lenient, _check_thinking, body.get("thinking"), max_tokens)
    effort, response_format = leave_out_refused(lenient, _check_output_config, body.get("output_config")) \
        or (None, None)

    chat_messages: list[dict[str, Any]] = []
    _convert_system(system, messages, chat_messages, merge_inline_system=merge_inline_system)
    _convert_messages(messages, chat_messages, merge_inline_system=merge_inline_system)

    out: dict[str, Any] = {"model": model, "messages": chat_messages}
    if not count:
        if max_tokens is not None:
            out["max_tokens"] = max_tokens
        _copy_sampling(body, out, lenient)
        stream = body.get("stream")
        if stream is not None and not isinstance(stream, bool):
            refuse(invalid("stream: must be a boolean"), lenient)
            stream = None
        out["stream"] = bool(stream)
        if stream:
            out["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    kwargs = body.get("chat_template_kwargs")
    if isinstance(kwargs, Mapping):
        out["chat_template_kwargs"] = dict(kwargs)
    elif kwargs is not None:
        refuse(invalid("chat_template_kwargs: must be an object"), lenient)
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
    _convert_tools(tools, tool_choice, out, dropped, lenient)
    return Translation(out, once([str(t.get("type")) for t in dropped]))


def _refuse_unserved(body: Mapping[str, Any]) -> None:
    if body.get("mcp_servers"):
        raise invalid("mcp_servers: the MCP connector (tools run on the API's side) is not served here; "
                      "declare the tools in `tools` and run them in the client")
    if KV_FIELD in body:
        raise invalid(f"{KV_FIELD}: set by the gateway, not by clients")


def _max_tokens(value: Any, lenient: bool) -> int | None:
    if value is None:
        refuse(invalid("max_tokens: required, an integer >= 1"), lenient)
    elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
        refuse(invalid("max_tokens: must be an integer >= 1"), lenient)
    else:
        return value
    return None


def _copy_sampling(body: Mapping[str, Any], out: dict[str, Any], lenient: bool) -> None:
    """The sampling fields, each checked (lenient: a refused one is left out)."""
    stop = body.get("stop_sequences")
    if stop is not None:
        if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
            out["stop"] = list(stop)
        else:
            refuse(invalid("stop_sequences: must be a list of strings"), lenient)
    for name in ("temperature", "top_p"):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            refuse(invalid(f"{name}: must be a number"), lenient)
        else:
            out[name] = value
    for name, low in (("top_k", -1), ("min_tokens", 0)):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            refuse(invalid(f"{name}: must be an integer >= {low}"), lenient)
        elif not (name == "min_tokens" and value == 0):  # vLLM's default: the same request without it
            out[name] = value
    salt = body.get("cache_salt")
    if salt is not None:
        if isinstance(salt, str) and 0 < len(salt) <= 1024:
            out["cache_salt"] = salt
        else:
            refuse(invalid("cache_salt: must be a string of 1-1024 characters"), lenient)
    xargs = body.get("vllm_xargs")
    if xargs is not None:
        if isinstance(xargs, Mapping):
            out["vllm_xargs"] = dict(xargs)
        else:
            refuse(invalid("vllm_xargs: must be an object"), lenient)
    watermarking = body.get("watermarking")
    if watermarking is not None:
        if isinstance(watermarking, bool):
            out["watermarking"] = watermarking
        else:
            refuse(invalid("watermarking: must be a boolean"), lenient)


# --- validation of the request's shape (every message names the field) -----------------------------------


def _check_messages(messages: Any, *, drop_hosted: bool = False, lenient: bool = False) -> list[Mapping[str, Any]]:
    """The messages, checked; lenient: without those that would be refused, and the others without the blocks
    that would be."""
    if not isinstance(messages, list) or not messages:
        refuse(invalid("messages: required, a non-empty list of {role, content}"), lenient)
        return []
    kept = (leave_out_refused(lenient, _check_message, msg, f"messages[{i}]", drop_hosted, lenient)
            for i, msg in enumerate(messages))
    return [msg for msg in kept if msg is not None]


def _check_message(msg: Any, where: str, drop_hosted: bool, lenient: bool) -> Mapping[str, Any]:
    if not isinstance(msg, Mapping):
        raise invalid(f"{where}: must be an object with role and content")
    role = msg.get("role")
    # vLLM accepts role "system" inside messages too (Claude Code's per-turn reminders).
    if role not in ("user", "assistant", "system"):
        raise invalid(f"{where}.role: must be \"user\" or \"assistant\" (or \"system\"), got {role!r}")
    content = msg.get("content")
    if isinstance(content, str):
        return msg
    if not isinstance(content, list):
        raise invalid(f"{where}.content: required, a string or a list of content blocks")
    blocks = [block for j, block in enumerate(content)
              if passes(lenient, _check_block, block, f"{where}.content[{j}]", role=role, drop_hosted=drop_hosted)]
    return msg if len(blocks) == len(content) else {**msg, "content": blocks}


def _check_system(system: Any, lenient: bool = False) -> str | list[Mapping[str, Any]] | None:
    if system is None or isinstance(system, str):
        return system
    if not isinstance(system, list):
        refuse(invalid("system: must be a string or a list of content blocks"), lenient)
        return None
    return [block for j, block in enumerate(system)
            if passes(lenient, _check_block, block, f"system[{j}]", role="top-level system")]


def _check_block(block: Any, where: str, *, role: str, drop_hosted: bool = False) -> None:
    if not isinstance(block, Mapping):
        raise invalid(f"{where}: must be a content block object with a type")
    kind = block.get("type")
    if isinstance(kind, str) and kind in REFUSED_BLOCKS:
        raise invalid(f"{where}.type: {kind} blocks are not served: {REFUSED_BLOCKS[kind]}")
    if kind not in BLOCK_TYPES:
        raise invalid(f"{where}.type: {kind!r} is not a content block type served here "
                      f"(served: {', '.join(BLOCK_TYPES)})")
    if kind == "text":
        _optional_str(block, "text", where)
    elif kind == "image":
        source = block.get("source")
        if not isinstance(source, Mapping):
            raise invalid(f"{where}.source: required for an image block, an object")
        if source.get("type", "base64") not in ("base64", "url"):
            raise invalid(f"{where}.source.type: {source.get('type')!r} is not served (base64 or url)")
    elif kind == "thinking":
        if not isinstance(block.get("thinking"), str):
            raise invalid(f"{where}.thinking: required for a thinking block, a string")
    elif kind == "tool_use":
        if role != "assistant":
            # vLLM would hang tool_calls on a user message, which the chat API then refuses less helpfully.
            raise invalid(f"{where}: tool_use blocks belong in assistant messages")
        for key in ("id", "name"):
            if not isinstance(block.get(key), str) or not block[key]:
                raise invalid(f"{where}.{key}: required for a tool_use block, a non-empty string")
        if block.get("input") is not None and not isinstance(block["input"], Mapping):
            raise invalid(f"{where}.input: must be an object")
    elif kind == "tool_result":
        if not isinstance(block.get("tool_use_id"), str) or not block["tool_use_id"]:
            raise invalid(f"{where}.tool_use_id: required for a tool_result block, a non-empty string")
        content = block.get("content")
        if content is not None and not isinstance(content, str | list):
            raise invalid(f"{where}.content: must be a string or a list of content blocks")
        if isinstance(content, list):
            for k, item in enumerate(content):
                if not isinstance(item, Mapping):
                    raise invalid(f"{where}.content[{k}]: must be a content block object")
                inner = item.get("type")
                if isinstance(inner, str) and inner in REFUSED_TOOL_RESULT_BLOCKS:
                    raise invalid(f"{where}.content[{k}].type: {inner} blocks in a tool result are not served: "
                                  f"{REFUSED_TOOL_RESULT_BLOCKS[inner]}")
                if inner not in TOOL_RESULT_BLOCKS:
                    raise invalid(f"{where}.content[{k}].type: {inner!r} is not a tool result block type served "
                                  f"here (served: {', '.join(TOOL_RESULT_BLOCKS)})")
        if block.get("is_error") is not None and not isinstance(block["is_error"], bool):
            raise invalid(f"{where}.is_error: must be a boolean")
    elif kind in _TOOL_CHANGES:
        if role != "system":
            raise invalid(f"{where}: {kind} blocks are only allowed in messages with role \"system\"")
        tool = block.get("tool")
        if not isinstance(tool, Mapping):
            raise invalid(f"{where}.tool: required for a {kind} block, an object")
        if tool.get("type") == "tool_reference":
            if not isinstance(tool.get("name"), str):
                raise invalid(f"{where}.tool.name: required, a string")
        elif tool.get("type") == "tool_definition" and kind == "tool_addition":
            if not (drop_hosted and is_anthropic_defined(tool.get("definition"))):
                _check_tool(tool.get("definition"), f"{where}.tool.definition")
        else:
            allowed = "tool_reference" if kind == "tool_removal" else "tool_reference or tool_definition"
            raise invalid(f"{where}.tool.type: must be {allowed}")


def _optional_str(block: Mapping[str, Any], key: str, where: str) -> None:
    if block.get(key) is not None and not isinstance(block[key], str):
        raise invalid(f"{where}.{key}: must be a string")


def _check_tools(tools: Any, *, drop_hosted: bool = False, lenient: bool = False
                 ) -> tuple[list[Mapping[str, Any]] | None, list[Mapping[str, Any]]]:
    """The declared tools, checked (lenient: without those that would be refused); with ``drop_hosted``,
    without the Anthropic-defined ones (the second list)."""
    if tools is None:
        return None, []
    if not isinstance(tools, list):
        refuse(invalid("tools: must be a list of tools"), lenient)
        return None, []
    kept: list[Mapping[str, Any]] = []
    dropped: list[Mapping[str, Any]] = []
    for i, tool in enumerate(tools):
        if drop_hosted and is_anthropic_defined(tool):
            dropped.append(tool)
        elif passes(lenient, _check_tool, tool, f"tools[{i}]"):
            kept.append(tool)
    return kept, dropped


def _check_tool(tool: Any, where: str) -> None:
    if not isinstance(tool, Mapping):
        raise invalid(f"{where}: must be a tool object {{name, description?, input_schema}}")
    kind = tool.get("type")
    name = tool.get("name")
    if kind not in (None, "custom"):
        # Anthropic-defined tools carry a versioned type and no input_schema; nothing here runs them.
        raise invalid(f"{where}: tool {name!r} has type {kind!r}, an Anthropic-defined or server tool, which is "
                      "not served here; only custom tools with an input_schema are")
    if not isinstance(name, str) or not name:
        raise invalid(f"{where}.name: required, a non-empty string")
    if not isinstance(tool.get("input_schema"), Mapping):
        raise invalid(f"{where}.input_schema: required, an object (a JSON schema)")
    if tool.get("description") is not None and not isinstance(tool["description"], str):
        raise invalid(f"{where}.description: must be a string")
    for flag in ("strict", "defer_loading"):
        if tool.get(flag) is not None and not isinstance(tool[flag], bool):
            raise invalid(f"{where}.{flag}: must be a boolean")


def _check_tool_choice(choice: Any) -> Mapping[str, Any] | None:
    if choice is None:
        return None
    if not isinstance(choice, Mapping):
        raise invalid("tool_choice: must be an object {type: auto|any|tool|none}")
    kind = choice.get("type")
    if kind not in ("auto", "any", "tool", "none"):
        raise invalid(f"tool_choice.type: must be auto, any, tool or none, got {kind!r}")
    if kind == "tool" and (not isinstance(choice.get("name"), str) or not choice["name"]):
        raise invalid("tool_choice.name: required when type is \"tool\"")
    flag = choice.get("disable_parallel_tool_use")
    if flag is not None and not isinstance(flag, bool):
        raise invalid("tool_choice.disable_parallel_tool_use: must be a boolean")
    return choice


def _check_thinking(thinking: Any, max_tokens: int | None) -> Mapping[str, Any] | None:
    if thinking is None:
        return None
    if not isinstance(thinking, Mapping):
        raise invalid("thinking: must be an object {type: enabled|disabled|adaptive|between_tools}")
    kind = thinking.get("type")
    if kind not in ("enabled", "disabled", "adaptive", "between_tools"):
        raise invalid(f"thinking.type: must be enabled, disabled, adaptive or between_tools, got {kind!r}")
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1024:
            raise invalid("thinking.budget_tokens: required when thinking is enabled, an integer >= 1024")
        if max_tokens is not None and budget >= max_tokens:
            raise invalid("thinking.budget_tokens: must be less than max_tokens")
    return thinking


def _check_output_config(config: Any) -> tuple[str | None, dict[str, Any] | None]:
    """(reasoning effort, response_format) of ``output_config``."""
    if config is None:
        return None, None
    if not isinstance(config, Mapping):
        raise invalid("output_config: must be an object")
    effort = config.get("effort")
    if effort is not None and effort not in EFFORTS:
        raise invalid(f"output_config.effort: must be one of {', '.join(EFFORTS)}, got {effort!r}")
    fmt = config.get("format")
    response_format = None
    if fmt is not None:
        if not isinstance(fmt, Mapping) or fmt.get("type", "json_schema") != "json_schema":
            raise invalid("output_config.format: must be {type: \"json_schema\", schema}")
        schema = fmt.get("schema")
        if schema is not None and not isinstance(schema, Mapping):
            raise invalid("output_config.format.schema: must be an object")
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
                   dropped: list[Mapping[str, Any]], lenient: bool = False) -> list[Mapping[str, Any]] | None:
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
                refuse(invalid(f"{block['type']} references tool {name!r}, which is not declared in tools"), lenient)
                continue
            if block["type"] == "tool_addition":
                by_name[name] = {**by_name[name], "defer_loading": None}
        if block["type"] == "tool_removal":
            removed.add(name)
        else:
            removed.discard(name)
    return [t for name, t in by_name.items() if name not in removed]


def _convert_tools(tools: list[Mapping[str, Any]] | None, choice: Mapping[str, Any] | None,
                   out: dict[str, Any], dropped: Sequence[Mapping[str, Any]] = (), lenient: bool = False) -> None:
    if choice is not None:
        out["parallel_tool_calls"] = not choice.get("disable_parallel_tool_use")
    if dropped:
        try:
            _check_choice_after_drop(choice, dropped, has_tools=bool(tools))
        except MessagesError as e:
            refuse(e, lenient)
            choice = None
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
        if any(t["name"] == name for t in tools):
            out["tool_choice"] = {"type": "function", "function": {"name": name}}
            return
        refuse(invalid(f"tool_choice.name: {name!r} is not one of the tools"), lenient)
        kind = "auto"
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
            raise invalid(f"tool_choice.name: {choice['name']!r} is the Anthropic-defined tool "
                          f"{tool.get('type')!r}, which the model behind this gateway cannot call (the gateway "
                          "leaves such tools out of the turn); name a custom tool, or use auto")
    if kind == "any" and not has_tools:
        types = ", ".join(once([str(t.get("type")) for t in dropped]))
        raise invalid(f"tool_choice: \"any\" needs a tool, but every tool given is an Anthropic-defined tool the "
                      f"model behind this gateway cannot call ({types}; left out of the turn): give a custom "
                      "tool, or use auto")
