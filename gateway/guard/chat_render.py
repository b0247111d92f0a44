"""A chat ``/tokenize`` request as vLLM renders it, for the guard's local tokenizer (pure, no I/O).

vLLM does not hand the client's messages to the chat template as they come: it normalizes the tools (the
schema's fields only, ``description``/``parameters`` kept as null), rebuilds each message (text parts joined
by a newline for a template that reads ``content`` as a string, kept as ``{"type": "text"}`` parts for one
that loops over it; a tool result's parts joined; ``reasoning`` copied as ``reasoning_content`` too; tool-call
arguments parsed into objects), merges the template arguments (``None`` and ``"auto"`` dropped, unknown names
filtered), and renders with ``tokenize=False`` before tokenizing the text without special tokens. This module
does the same for text-only requests, following vLLM 0.32's ``renderers/chat_utils.py`` and
``renderers/hf.py``; anything it does not reproduce (media parts, a request-level template, ...) raises
:class:`Unsupported`, and the gateway asks the engine's ``/tokenize`` instead.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterator, Mapping
from typing import Any

import jinja2
import jinja2.meta
import jinja2.nodes

# Content part types vLLM renders as text, and the field that holds each one's text.
_TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
               "thinking": "thinking"}
# The fields vLLM knows on any content part; the others a text part keeps in "openai" content format.
_KNOWN_PART_FIELDS = frozenset({
    "audio_embeds", "audio_url", "closed", "data", "file", "image_embeds", "image_pil", "image_url",
    "input_audio", "name", "prompt_cache_breakpoint", "refusal", "text", "thinking", "type", "uuid",
    "video_embeds", "video_url"})
_BILLING_HEADER = "x-anthropic-billing-header"


class Unsupported(ValueError):
    """A request the local renderer does not reproduce exactly: the engine's /tokenize decides."""


def tools_for_template(tools: Any) -> list[dict[str, Any]] | None:
    """The tools as vLLM dumps its ``ChatCompletionToolsParam``: known fields only, ``strict`` and
    ``defer_loading`` only when set, a tool's ``defer_loading`` copied into its function."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise Unsupported("tools must be a list")
    out = []
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or tool.get("type", "function") != "function":
            raise Unsupported("a tool must be a function")
        name, description, parameters = fn.get("name"), fn.get("description"), fn.get("parameters")
        if not isinstance(name, str) or not isinstance(description, str | None) or \
                not isinstance(parameters, dict | None):
            raise Unsupported("a tool's name, description or parameters has an unexpected type")
        defer = tool.get("defer_loading")
        f: dict[str, Any] = {"name": name, "description": description, "parameters": parameters}
        own_defer = fn.get("defer_loading")
        for key, value in (("strict", fn.get("strict")), ("defer_loading", own_defer if own_defer is not None
                                                                    else defer)):
            if value is not None:
                f[key] = value
        out.append({"type": "function", "function": f, **({"defer_loading": defer} if defer is not None else {})})
    return out


def conversation(messages: Any, content_format: str) -> list[dict[str, Any]]:
    """The messages as vLLM passes them to the chat template (``parse_chat_messages``, text only)."""
    if not isinstance(messages, list) or not all(isinstance(m, Mapping) for m in messages):
        raise Unsupported("messages must be a list of objects")
    out = [_message(m, content_format) for m in messages]
    for message in out:
        _parse_tool_arguments(message)
    return out


def developer_as_system(messages: list[dict[str, Any]], template: str) -> list[dict[str, Any]]:
    """For a template that does not know the developer role: developer messages become system ones, and all
    system messages merge into one at the start (vLLM's ``_convert_developer_to_system`` and
    ``_consolidate_system_messages``)."""
    if not any(m["role"] == "developer" for m in messages) or '"developer"' in template or \
            "'developer'" in template:
        return messages
    converted = [{k: v for k, v in m.items() if k != "tools"} | {"role": "system"} if m["role"] == "developer" else m
                 for m in messages]
    systems = [i for i, m in enumerate(converted) if m["role"] == "system"]
    if not systems or systems == [0]:
        return converted
    texts = []
    for i in systems:
        content = converted[i].get("content", "")
        if isinstance(content, list):
            content = "\n".join(str(p["text"]) if isinstance(p, dict) else p for p in content
                                if isinstance(p, str) or (isinstance(p, dict) and "text" in p))
        if content:
            texts.append(content)
    return [{"role": "system", "content": "\n\n".join(texts)}, *(m for m in converted if m["role"] != "system")]


def _message(message: Mapping[str, Any], content_format: str) -> dict[str, Any]:
    role = message.get("role")
    if not isinstance(role, str):
        raise Unsupported("a message without a role")
    content = message.get("content")
    parts: list[Any] = [] if content is None else [content] if isinstance(content, str) else content
    if not isinstance(parts, list):
        raise Unsupported("content must be a string or a list of parts")
    if role == "system":
        parts = _strip_billing_header(parts)
    texts = [t for t in (_part(p, content_format == "openai") for p in parts) if t is not None]
    out: dict[str, Any] = {"role": role,
                           "content": texts if content_format == "openai" else "\n".join(texts)}
    if role == "assistant":
        if message.get("tool_calls") is not None:
            out["tool_calls"] = [dict(c) if isinstance(c, Mapping) else c for c in message["tool_calls"]]
        if message.get("reasoning") is not None:
            out["reasoning"] = out["reasoning_content"] = message["reasoning"]
    elif role == "tool":
        if "tool_call_id" in message:
            out["tool_call_id"] = message["tool_call_id"]
        if isinstance(out["content"], list):  # most templates read a tool result as a string
            out["content"] = "\n".join(p.get("text", "") for p in out["content"])
    if isinstance(message.get("name"), str):
        out["name"] = message["name"]
    if isinstance(message.get("task"), str):
        out["task"] = message["task"]
    if role == "developer":
        out["tools"] = message.get("tools")
    return out


def _part(part: Any, wrap: bool) -> Any:
    if isinstance(part, str):
        return {"type": "text", "text": part} if wrap else part
    if not isinstance(part, Mapping) or part.get("uuid") is not None:
        raise Unsupported("a content part vLLM would not render as text")
    kind = part.get("type")
    field = _TEXT_PARTS.get(kind) if isinstance(kind, str) else None
    if field is None:
        raise Unsupported(f"content part {kind!r} is not text")
    text = part.get(field)
    if text is None and kind in ("text", "refusal"):
        return None  # vLLM skips an empty text part
    if not isinstance(text, str):
        raise Unsupported("a text part without its text")
    if not wrap:
        return text
    return {"type": "text", "text": text, **{k: v for k, v in part.items() if k not in _KNOWN_PART_FIELDS}}


def _strip_billing_header(parts: list[Any]) -> list[Any]:
    # vLLM drops this header line from system text (its value changes every request).
    out = []
    for part in parts:
        text = part if isinstance(part, str) else part.get("text") if isinstance(part, Mapping) and \
            part.get("type") == "text" else None
        if not (isinstance(text, str) and text.startswith(_BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def _parse_tool_arguments(message: dict[str, Any]) -> None:
    """Tool-call arguments as objects, as templates expect them (invalid or non-object JSON -> {})."""
    calls = message.get("tool_calls")
    if message["role"] != "assistant" or not isinstance(calls, list):
        return
    if not calls:
        del message["tool_calls"]
        return
    for i, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or call.get("type", "function") != "function":
            raise Unsupported("a tool call that is not a function")
        args = fn.get("arguments")
        if args and isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                args = None
        # In the order vLLM's request validation leaves the keys (the OpenAI types' field order, then the
        # rest): a template that writes a call as JSON writes them in this order.
        function = {"arguments": args if isinstance(args, dict) else {}, **({"name": fn["name"]} if "name" in fn
                                                                         else {})}
        call_out = {k: call[k] for k in ("id",) if k in call}
        call_out["function"] = function | {k: v for k, v in fn.items() if k not in function}
        call_out |= {k: call[k] for k in ("type",) if k in call}
        calls[i] = call_out | {k: v for k, v in call.items() if k not in call_out}


def template_kwargs(payload: Mapping[str, Any], tools: list[dict[str, Any]] | None) -> dict[str, Any]:
    """vLLM's template arguments for a /tokenize chat request, before filtering by name: the request's
    ``chat_template_kwargs`` (None and "auto" dropped), ``add_generation_prompt``, ``continue_final_message``."""
    if payload.get("chat_template") is not None:
        raise Unsupported("a request-level chat template")
    agp = payload.get("add_generation_prompt", True)
    cfm = payload.get("continue_final_message", False)
    if agp and cfm:
        raise Unsupported("add_generation_prompt and continue_final_message together")
    given = payload.get("chat_template_kwargs") or {}
    if not isinstance(given, Mapping):
        raise Unsupported("chat_template_kwargs must be an object")
    request = {**given, "add_generation_prompt": agp, "continue_final_message": cfm}
    kwargs: dict[str, Any] = {"tokenize": False, **({"tools": tools} if tools is not None else {})}
    kwargs.update({k: v for k, v in request.items() if v is not None and not (isinstance(v, str) and v == "auto")})
    if kwargs.pop("tokenize") is not False or "chat_template" in kwargs:
        raise Unsupported("tokenize or chat_template among the template arguments")
    return kwargs


def accepted(kwargs: dict[str, Any], template_vars: frozenset[str], base_params: frozenset[str]) -> dict[str, Any]:
    """The arguments vLLM passes on: those the template reads or ``apply_chat_template`` names."""
    ok = (template_vars | base_params) - {"chat_template", "tokenize"}
    return {k: v for k, v in kwargs.items() if k in ok}


def template_variables(env: jinja2.Environment, template: str) -> frozenset[str]:
    return frozenset(jinja2.meta.find_undeclared_variables(env.parse(template)))


def content_format(env: jinja2.Environment, template: str) -> str:
    """"openai" when the template loops over a message's content (parts stay objects), else "string" (text
    parts joined): vLLM's ``_detect_content_format`` over the template's syntax tree."""
    try:
        root = env.parse(template)
        next(_content_loops(root))
    except StopIteration:
        return "string"
    except Exception:
        return "string"  # vLLM's default when the template cannot be parsed
    return "openai"


def _is_var(node: jinja2.nodes.Node, name: str) -> bool:
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == name


def _is_attr(node: jinja2.nodes.Node, name: str, key: str) -> bool:
    if isinstance(node, jinja2.nodes.Getitem):
        return _is_var(node.node, name) and isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == key
    return isinstance(node, jinja2.nodes.Getattr) and _is_var(node.node, name) and node.attr == key


def _is_access(node: jinja2.nodes.Node, name: str, key: str | None = None) -> bool:
    if isinstance(node, jinja2.nodes.Filter):
        return node.node is not None and _is_access(node.node, name, key)
    if isinstance(node, jinja2.nodes.Test):
        return _is_access(node.node, name, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _is_access(node.node, name, key)
    return _is_attr(node, name, key) if key else _is_var(node, name)


def _aliases(root: jinja2.nodes.Node, name: str) -> list[str]:
    """`name` and every variable assigned from it (or its elements), transitively."""
    out, todo = [name], deque([name])
    while todo:
        current = todo.popleft()
        for assign in root.find_all(jinja2.nodes.Assign):
            if _is_access(assign.node, current) and isinstance(assign.target, jinja2.nodes.Name):
                out.append(assign.target.name)
                if assign.target.name != current:
                    todo.append(assign.target.name)
    return out


def _message_vars(root: jinja2.nodes.Node) -> list[str]:
    names = _aliases(root, "messages")
    out = []
    for loop in root.find_all(jinja2.nodes.For):
        if any(_is_access(loop.iter, n) for n in names) and isinstance(loop.target, jinja2.nodes.Name):
            out.append(loop.target.name)
    return out


def _content_loops(root: jinja2.nodes.Node) -> Iterator[jinja2.nodes.For]:
    """Loops over a message's content, directly, through a macro parameter that receives it, or over a
    variable named ``content`` outside macros."""
    messages = _message_vars(root)
    by_loop: dict[int, set[str]] = {}
    in_macros: set[int] = set()
    for macro in root.find_all(jinja2.nodes.Macro):
        names = {a.name for a in macro.args}
        params: set[str] = set()
        for call in root.find_all(jinja2.nodes.Call):
            if not (isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(macro.args) and any(_is_access(arg, m, "content") for m in messages):
                    params.add(macro.args[i].name)
            for kw in call.kwargs:
                if kw.key in names and any(_is_access(kw.value, m, "content") for m in messages):
                    params.add(kw.key)
        for loop in macro.find_all(jinja2.nodes.For):
            in_macros.add(id(loop))
            if params:
                by_loop[id(loop)] = params
    for loop in root.find_all(jinja2.nodes.For):
        it = loop.iter
        named = it.name if isinstance(it, jinja2.nodes.Name) else None
        if any(_is_access(it, m, "content") for m in messages) or (named is not None and (
                named in by_loop.get(id(loop), ()) or (id(loop) not in in_macros and named == "content"))):
            yield loop
