"""ChatML / Qwen3-like chat template, written in Python instead of Jinja.

Tool calls are written in one of two formats, the served model's (vLLM's ``--tool-call-parser``):
``hermes`` (Qwen3: a JSON object with ``name`` and ``arguments`` inside ``<tool_call>``) or ``glm47``
(GLM-4.7 / GLM-5: ``<tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value>...</tool_call>``). The
format decides how many tokens a streamed call takes before its function name is known (the parser's
hold-back before the first delta): ~12 for hermes, the name plus one for glm47.

Two Qwen3 behaviours matter to kvtether and are kept on purpose:

* an assistant turn's reasoning is rendered only for turns after the last user message and dropped
  before it, so a history that was a token prefix of the next prompt stops being one as soon as the
  user speaks again (the most common non-prefix history in agent loops);
* an assistant message renders to exactly the text the model generated for it (``<think>`` block,
  content, ``<tool_call>`` blocks), so an unedited history re-tokenizes to the held tokens.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from kvtether.sim.tokenizer import (
    ARG_KEY_END,
    ARG_KEY_START,
    ARG_VALUE_END,
    ARG_VALUE_START,
    IM_END,
    IM_START,
    THINK_END,
    THINK_START,
    TOOL_CALL_END,
    TOOL_CALL_START,
    TOOL_RESPONSE_END,
    TOOL_RESPONSE_START,
)


class TemplateError(ValueError):
    """The messages cannot be rendered (a 400 for the client)."""


def content_text(content: Any) -> str:
    """OpenAI content is a string, null, or a list of parts; only text parts reach this model."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out: list[str] = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "text":
                out.append(str(part.get("text", "")))
            elif isinstance(part, str):
                out.append(part)
            else:
                raise TemplateError("only text content parts are supported")
        return "".join(out)
    raise TemplateError("message content must be a string, a list of parts, or null")


HERMES = "hermes"
GLM47 = "glm47"
TOOL_FORMATS = (HERMES, GLM47)


def glm47_value_text(value: Any) -> str:
    """An argument value inside <arg_value>: strings as they are, anything else as JSON (GLM's template:
    ``v if v is string else v | tojson``)."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def render_tool_call(name: str, arguments: str, tool_format: str = HERMES) -> str:
    """One tool call as the model writes it. hermes: `arguments` (a JSON text) is inserted verbatim; glm47:
    it must be a JSON object, written as key/value pairs (as vLLM hands GLM's template a parsed dict)."""
    if tool_format == GLM47:
        try:
            args = json.loads(arguments)
        except ValueError as e:
            raise TemplateError(f"tool call arguments of {name!r} are not valid JSON") from e
        if not isinstance(args, Mapping):
            raise TemplateError(f"tool call arguments of {name!r} must be a JSON object")
        pairs = "".join(
            f"{ARG_KEY_START}{k}{ARG_KEY_END}{ARG_VALUE_START}{glm47_value_text(v)}{ARG_VALUE_END}"
            for k, v in args.items()
        )
        return f"{TOOL_CALL_START}{name}{pairs}{TOOL_CALL_END}"
    head = json.dumps(name, ensure_ascii=False)
    return f'{TOOL_CALL_START}\n{{"name": {head}, "arguments": {arguments}}}\n{TOOL_CALL_END}'


def render_reasoning(reasoning: str) -> str:
    return f"{THINK_START}\n{reasoning.strip(chr(10))}\n{THINK_END}\n\n"


def render_assistant_body(
    content: str, reasoning: str | None, tool_calls: Sequence[tuple[str, str]], tool_format: str = HERMES
) -> str:
    """Everything between ``<|im_start|>assistant\\n`` and ``<|im_end|>``: the model generates exactly this."""
    out = render_reasoning(reasoning) if reasoning else ""
    out += content
    for i, (name, arguments) in enumerate(tool_calls):
        if i > 0 or content:
            out += "\n"
        out += render_tool_call(name, arguments, tool_format)
    return out


def _tools_block(tools: Sequence[Any], tool_format: str = HERMES) -> str:
    lines = [
        "# Tools",
        "",
        "You may call one or more functions to assist with the user query.",
        "",
        "You are provided with function signatures within <tools></tools> XML tags:",
        "<tools>",
    ]
    for tool in tools:
        lines.append(json.dumps(tool, ensure_ascii=False))
    lines += [
        "</tools>",
        "",
    ]
    if tool_format == GLM47:
        lines += [
            "For each function call, output the function name and arguments within the following XML format:",
            "<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value>"
            "<arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call>",
        ]
        return "\n".join(lines)
    lines += [
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:",
        "<tool_call>",
        '{"name": <function-name>, "arguments": <args-json-object>}',
        "</tool_call>",
    ]
    # The literal tags above are plain text in the tools block of Qwen3's template too; they are
    # tokenized as special tokens there as well.
    return "\n".join(lines)


def _tool_call_parts(message: Mapping[str, Any]) -> list[tuple[str, str]]:
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        raise TemplateError("tool_calls must be a list")
    parts: list[tuple[str, str]] = []
    for call in calls:
        if not isinstance(call, Mapping):
            raise TemplateError("each tool call must be an object")
        fn = call.get("function", call)
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise TemplateError("a tool call needs function.name")
        args = fn.get("arguments")
        if not args:
            # vLLM renders missing, null or empty arguments as {} (chat_utils: "if arguments is None or empty
            # string, set to {}"): a streamed call cut off after its name comes back so, and is resent.
            args = "{}"
        elif not isinstance(args, str):
            # Some clients send the arguments as an object; render it the way the parser would return it.
            args = json.dumps(args, ensure_ascii=False)
        parts.append((fn["name"], args))
    return parts


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Any] | None = None,
    add_generation_prompt: bool = True,
    enable_thinking: bool = False,
    tool_format: str = HERMES,
) -> str:
    """Render a conversation to the prompt text (ChatML with Qwen3's tools and reasoning rules; tool calls
    in `tool_format`)."""
    if tool_format not in TOOL_FORMATS:
        raise ValueError(f"tool_format must be one of {TOOL_FORMATS}, got {tool_format!r}")
    if not isinstance(messages, Sequence) or not messages:
        raise TemplateError("messages must be a non-empty list")
    for m in messages:
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise TemplateError("each message needs a string role")
    out: list[str] = []
    first = messages[0]
    rest = list(messages)
    if tools:
        system = content_text(first.get("content")) if first["role"] == "system" else ""
        if first["role"] == "system":
            rest = rest[1:]
        head = (system + "\n\n") if system else ""
        out.append(f"{IM_START}system\n{head}{_tools_block(tools, tool_format)}{IM_END}\n")
    last_user = max((i for i, m in enumerate(rest) if m["role"] == "user"), default=-1)
    i = 0
    while i < len(rest):
        m = rest[i]
        role = m["role"]
        if role == "assistant":
            reasoning = m.get("reasoning_content") or m.get("reasoning")
            keep = isinstance(reasoning, str) and reasoning.strip("\n") != "" and i > last_user
            body = render_assistant_body(
                content_text(m.get("content")), reasoning if keep else None, _tool_call_parts(m), tool_format
            )
            out.append(f"{IM_START}assistant\n{body}{IM_END}\n")
        elif role == "tool":
            # Consecutive tool results share one user turn, as in Qwen3.
            chunk = [f"{IM_START}user"]
            while i < len(rest) and rest[i]["role"] == "tool":
                chunk.append(f"\n{TOOL_RESPONSE_START}\n{content_text(rest[i].get('content'))}\n{TOOL_RESPONSE_END}")
                i += 1
            out.append("".join(chunk) + f"{IM_END}\n")
            continue
        elif role in ("system", "user", "developer"):
            out.append(f"{IM_START}{role}\n{content_text(m.get('content'))}{IM_END}\n")
        else:
            raise TemplateError(f"unknown role {role!r}")
        i += 1
    if add_generation_prompt:
        # enable_thinking does not change the prompt here (the model decides whether to open <think>),
        # unlike Qwen3, which pre-fills an empty think block when it is off.
        out.append(f"{IM_START}assistant\n")
    return "".join(out)
