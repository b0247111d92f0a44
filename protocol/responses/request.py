"""OpenAI Responses ↔ the gateway's internal Chat Completions: a pure translation (no I/O).

vLLM renders a ``/v1/responses`` request by turning its items into chat messages
(``construct_input_messages`` in ``vllm/entrypoints/openai/responses/utils.py``) and running the chat
template on them. kvtether does the same translation at its edge, so a Responses turn goes through the chat
path it already pins, guards and splits into P/D legs, and the chat request it sends renders the prompt vLLM's
own ``/v1/responses`` would (0.32–0.34). The rules, all from vLLM:

- ``instructions`` → a leading system message (the current request's only: a chain's earlier instructions do
  not carry over, as OpenAI specifies and vLLM does).
- A string ``input`` → one user message. Items, in order:
  a message with a role (``user``, ``system``, ``developer``) → that message (``input_text`` parts become
  ``text`` parts, which vLLM renders the same; ``input_image`` → ``image_url``);
  an assistant message → its first part's text as ``content``;
  ``reasoning`` → ``reasoning`` on the assistant message: ``content[0].text``, else ``summary[0].text``;
  ``function_call`` → a tool call (a namespaced one named ``<namespace>__<name>``);
  ``custom_tool_call`` → a tool call whose arguments are ``{"input": <payload>}`` (``ensure_ascii=False``);
  ``function_call_output`` / ``custom_tool_call_output`` → a ``tool`` message (a ``function_call_output`` without
  a ``call_id``, which the spec allows and vLLM does not, gets one by the gateway's rule: :func:`tool_result_id`).
  Reasoning, text and tool calls that follow one another merge into one assistant message as vLLM merges them
  (a field is only filled if still empty, tool calls append), so one answer's items become one message again.
- Tools: ``function`` → a chat function tool; ``namespace`` → its functions, flattened to
  ``<namespace>__<name>``; ``custom`` (freeform text; a grammar is refused, as vLLM refuses it) → a function
  taking one string ``input``. Hosted and built-in
  tools (``web_search``, ``file_search``, ``code_interpreter``, ``computer_use``, ``image_generation``,
  ``local_shell``, ``mcp``…) have no model-side form here: :func:`to_chat` refuses them with a 400 that names
  them, as the simulator's vLLM does; :func:`translate` with ``hosted_tools="drop"`` (the gateway's default)
  leaves them out of the turn and reports which (a ``tool_choice`` that names one stays a 400).
- ``reasoning.effort`` → the chat template's ``reasoning_effort`` and ``enable_thinking`` (unless the request's
  ``chat_template_kwargs`` set it), merged as vLLM's ``build_chat_params`` merges them.
- A last item that is an assistant message or reasoning still ``in_progress``/``incomplete`` is continued
  (``continue_final_message``), as vLLM does.

Reasoning the gateway answered goes out, when the request ``include``s ``reasoning.encrypted_content``, with an
``encrypted_content`` the gateway signs (``ReasoningSeal``): a stateless client (Codex sends ``store: false``
and resends every item) hands it back on the next turn, and the gateway reads the exact reasoning text the
model produced from it, so the next prompt re-renders the very tokens the decode node holds. Content it did
not sign is refused (vLLM refuses all of it).

The Responses state (``store``, ``previous_response_id``, ``conversation``) is not here: the HTTP side
(``gateway/api/responses/lowering.py``) resolves a chain into the ``history`` messages :func:`to_chat` prepends.

A lenient translation (:func:`translate` with ``lenient=True``) is for a request some server already took,
written as the chat turn it stands for (the SDK's recorder): it refuses nothing, leaves out each piece a strict
one refuses (an item, a content part, a tool, the ``tool_choice``, a malformed field), drops hosted tools and
reads reasoning in this gateway's seal without the key. Whatever it keeps becomes exactly what the gateway sends.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, Final

from kvtether.protocol.common import HostedTools, Translation, leave_out_refused, once, refuse
from kvtether.protocol.responses import items as I
from kvtether.protocol.responses.common import (
    CUSTOM_TOOL_INPUT_KEY,
    ReasoningSeal,
    ResponsesError,
    encode_custom_input,
    flat_name,
    invalid,
)
from kvtether.protocol.wire import KV_FIELD

# Request fields with no counterpart the gateway can serve, and why (a 400 names the field and the reason).
UNSERVED_FIELDS: dict[str, str] = {
    "background": "background responses are not served (the gateway streams or waits)",
    "prompt": "prompt templates are not served",
}
# Fields accepted and echoed, without effect: OpenAI-only service knobs.
IGNORED_FIELDS = ("service_tier", "safety_identifier", "prompt_cache_retention", "client_metadata",
                  "max_tool_calls", "store", "prompt_cache_options", "moderation", "access_programs", "image",
                  "stream_options", "background_options", "context_management")
# Sampling fields copied to the chat request as they are (vLLM's Responses request has the same ones).
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
             "repetition_penalty", "seed", "stop", "logit_bias", "user", "parallel_tool_calls",
             "skip_special_tokens", "include_stop_str_in_output", "cache_salt", "chat_template_kwargs",
             "include_reasoning")
# Request fields the translation (or the gateway's Responses state) reads.
HONOURED_FIELDS = ("model", "input", "instructions", "stream", "max_output_tokens", "tools", "tool_choice",
                   "reasoning", "text", "include", "top_logprobs", "previous_response_id", "conversation",
                   "prompt_cache_key", "truncation", "metadata", *_SAMPLING)
FUNCTION_TOOL_TYPES = ("function", "namespace", "custom")
# Hosted and built-in tools. OpenAI runs web_search, file_search, code_interpreter, image_generation and remote
# mcp servers; computer_use, local_shell, shell and apply_patch run in the client, but the model calls them
# natively, with no schema a chat template could show it. None has a form the model behind vLLM can call.
# tool_search (deferred loading, run by the server or the client) and programmatic_tool_calling (code the API
# runs to call tools) have no chat form either.
HOSTED_TOOL_TYPES: Final = frozenset({"file_search", "code_interpreter", "computer_use_preview", "computer_use",
                                      "computer", "image_generation", "mcp", "local_shell", "shell", "apply_patch",
                                      "tool_search", "programmatic_tool_calling"})
_WEB_SEARCH: Final = re.compile(r"web_search(_preview)?(_[0-9]{4}_[0-9]{2}_[0-9]{2})?")


def is_hosted_tool(kind: Any) -> bool:
    """Whether a tool (or tool_choice) ``type`` names a hosted or built-in tool."""
    return isinstance(kind, str) and (kind in HOSTED_TOOL_TYPES or _WEB_SEARCH.fullmatch(kind) is not None)

# ---------------------------------------------------------------------------------------------------------
# Request: Responses → chat


def to_chat(body: Mapping[str, Any], *, seal: ReasoningSeal | None, history: Sequence[Mapping[str, Any]] = ()
            ) -> dict[str, Any]:
    """The chat completion request for a Responses request; ``history``: the chat messages of the chain it
    continues (``previous_response_id`` / ``conversation``), put between its instructions and its input. A
    hosted tool is refused (400): the model cannot call it (vLLM's own /v1/responses leaves it out of the prompt
    without a word)."""
    return translate(body, seal=seal, history=history).chat


def translate(body: Mapping[str, Any], *, seal: ReasoningSeal | None = None,
              history: Sequence[Mapping[str, Any]] = (), hosted_tools: HostedTools = "refuse",
              bookkeeping: I.BookkeepingItems = "refuse", lenient: bool = False) -> Translation:
    """:func:`to_chat`, with a choice of what becomes of hosted tools: ``"refuse"`` (400) or ``"drop"`` (left
    out of the turn, their types reported in ``dropped``); and of bookkeeping input items (``items.py``): the
    same choice, their types reported in ``left_out``. Without a ``seal``, no encrypted reasoning verifies.

    ``lenient``: for a request some server already took, to be written as the chat turn it stands for (the
    SDK's recorder). Nothing is refused: each piece a strict translation refuses (a field, an item, a content
    part, a tool, the tool_choice) is left out, hosted tools are dropped, and reasoning in this gateway's seal
    is read without the key. What is kept becomes exactly what the gateway sends."""
    if lenient:
        hosted_tools = bookkeeping = "drop"
    else:
        _check_served(body)
    messages: list[dict[str, Any]] = []
    left_out: list[str] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    messages += [dict(m) for m in history if m.get("role") != "system"]
    raw_input = body.get("input")
    if isinstance(raw_input, str):
        messages.append({"role": "user", "content": raw_input})
    elif isinstance(raw_input, list):
        messages += input_messages(raw_input, seal, lenient=lenient, before=messages, bookkeeping=bookkeeping,
                                   left_out=left_out)
    if not messages:
        refuse(invalid("`input` holds no message", "input"), lenient)
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    for name in _SAMPLING:
        if body.get(name) is not None:
            chat[name] = body[name]
    limit = body.get("max_output_tokens")
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            refuse(invalid("`max_output_tokens` must be an integer >= 1", "max_output_tokens"), lenient)
        else:
            chat["max_tokens"] = limit
    dropped = _add_tools(chat, body.get("tools"), body.get("tool_choice"), hosted_tools, lenient)
    kwargs = leave_out_refused(lenient, template_kwargs, body)
    if kwargs is not None:
        chat["chat_template_kwargs"] = kwargs
    if continues_final_message(raw_input):
        chat["add_generation_prompt"] = False
        chat["continue_final_message"] = True
    response_format = leave_out_refused(lenient, _response_format, body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    include = body.get("include") or ()
    if not isinstance(include, list | tuple):
        refuse(invalid("`include` must be an array of strings", "include"), lenient)
        include = ()  # leniently, a malformed include asks for nothing
    if body.get("top_logprobs") and "message.output_text.logprobs" in include:
        chat["logprobs"] = True
        chat["top_logprobs"] = body["top_logprobs"]
    if body.get("stream") is True:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    elif body.get("stream") not in (None, False):
        refuse(invalid("`stream` must be a boolean", "stream"), lenient)
    return Translation(chat, dropped, once(left_out))


def _check_served(body: Mapping[str, Any]) -> None:
    """The request-wide refusals, in the order they are checked: fields the gateway owns or does not serve, the
    model, and the shape of ``instructions`` and ``input``."""
    if KV_FIELD in body:
        raise ResponsesError(400, f"{KV_FIELD} is set by the gateway, not by clients", KV_FIELD, "forbidden_parameter")
    for name, why in UNSERVED_FIELDS.items():
        if body.get(name):
            raise invalid(f"`{name}`: {why}", name)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("you must provide a model parameter", "model")
    truncation = body.get("truncation")
    if truncation not in (None, "disabled"):
        raise invalid("`truncation` other than \"disabled\" is not served: the gateway never drops history "
                      "(it would change the prompt the decode node holds)", "truncation")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise invalid("`instructions` must be a string", "instructions")
    if not isinstance(body.get("input"), str | list):
        raise invalid("`input` must be a string or a list of items", "input")


def _add_tools(chat: dict[str, Any], tools: Any, choice: Any, hosted_tools: HostedTools,
               lenient: bool) -> tuple[str, ...]:
    """The request's tools and tool_choice on the chat request; the hosted tool types dropped."""
    if not tools:
        return ()
    dropped: tuple[str, ...] = ()
    if hosted_tools == "drop":
        tools, dropped = without_hosted_tools(tools)
    converted = chat_tools(tools, lenient=lenient)
    if hosted_tools == "drop":
        try:
            check_choice_after_drop(choice, dropped, has_tools=bool(converted))
        except ResponsesError as e:
            refuse(e, lenient)
            choice = None
    if not converted and (dropped or lenient):
        return dropped  # no tools left: none sent (the chat API refuses an empty list), nor a tool_choice
    chat["tools"] = converted
    if choice is not None:
        tool_choice = leave_out_refused(lenient, chat_tool_choice, choice)
        if tool_choice is not None:
            chat["tool_choice"] = tool_choice
    return dropped


def without_hosted_tools(tools: Any) -> tuple[Any, tuple[str, ...]]:
    """The tools without the hosted ones, and the hosted types left out (a non-list is returned as it is, for
    :func:`chat_tools` to refuse)."""
    if not isinstance(tools, list):
        return tools, ()
    kept = [t for t in tools if not (isinstance(t, Mapping) and is_hosted_tool(t.get("type")))]
    return kept, once([t["type"] for t in tools if isinstance(t, Mapping) and is_hosted_tool(t.get("type"))])


def check_choice_after_drop(choice: Any, dropped: Sequence[str], *, has_tools: bool) -> None:
    """A tool_choice that cannot hold once the hosted tools are gone is a 400: one that names a hosted tool
    (the client asked for exactly the call the model cannot make), and one that needs a tool when only hosted
    ones were given."""
    kind = choice.get("type") if isinstance(choice, Mapping) else None
    if is_hosted_tool(kind):
        raise invalid(f"`tool_choice` names the hosted tool `{kind}`, which the model behind this gateway cannot "
                      "call (the gateway leaves hosted tools out of the turn); name a function tool, or use auto",
                      "tool_choice")
    if has_tools or not dropped or choice in (None, "auto", "none"):
        return
    raise invalid(f"`tool_choice` needs a tool, but every tool given is a hosted tool the model behind this "
                  f"gateway cannot call ({', '.join(dropped)}; left out of the turn): give a function tool, or "
                  "use auto", "tool_choice")


def input_messages(items: Sequence[Any], seal: ReasoningSeal | None, *, lenient: bool = False,
                   before: Sequence[Mapping[str, Any]] = (), bookkeeping: I.BookkeepingItems = "refuse",
                   left_out: list[str] | None = None) -> list[dict[str, Any]]:
    """Chat messages for Responses input (or output) items, merged as vLLM merges them; ``lenient``: an item
    (or a content part) that would be refused is left out. ``before``: the chat messages the items follow (a
    chain's history), which a tool result without a ``call_id`` may answer (:func:`tool_result_id`).
    ``bookkeeping``: what becomes of bookkeeping items (``items.py``); those left out are added to
    ``left_out``."""
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        try:
            if not isinstance(item, Mapping):
                raise invalid(f"{where} must be an object", where)
            kind = _item_type(item)
            if not isinstance(kind, str | None):
                raise invalid(f"{where}.type must be a string", f"{where}.type")
            if kind in I.BOOKKEEPING_ITEMS:
                if bookkeeping == "drop" or lenient:
                    if left_out is not None:
                        left_out.append(kind)
                    continue
                raise invalid(f"{where}: `{kind}` items are client bookkeeping ({I.BOOKKEEPING_ITEMS[kind]}); this "
                              "gateway refuses them (bookkeeping_items = \"refuse\"): leave the item out", where)
            why = I.refusal(kind) if kind is not None else None
            if why is not None:
                raise invalid(f"{where}: input items of type `{kind}` are not served: {why}", where)
            message = _message_for(item, out, before, seal, where, lenient)
        except ResponsesError as e:
            refuse(e, lenient)  # _message_for refuses an item before it merges anything of it
            continue
        if message is not None:
            out.append(message)
    return out


def _item_type(item: Mapping[str, Any]) -> Any:
    """An item's type; an ``item_reference`` may come without one (just its ``id``)."""
    kind = item.get("type")
    if kind is None and item.get("role") is None and isinstance(item.get("id"), str):
        return "item_reference"
    return kind


def _message_for(item: Mapping[str, Any], out: list[dict[str, Any]], before: Sequence[Mapping[str, Any]],
                 seal: ReasoningSeal | None, where: str, lenient: bool) -> dict[str, Any] | None:
    """A new chat message for one item, or None when it was merged into the last of ``out`` (vLLM's
    ``_construct_message_from_response_item``)."""
    prev = out[-1] if out else None
    assistant = prev if prev is not None and prev.get("role") == "assistant" else None
    kind = item.get("type")
    call = _tool_call_for(item, where)
    if call is not None:
        if assistant is not None:
            assistant.setdefault("tool_calls", []).append(call)
            return None
        return {"role": "assistant", "tool_calls": [call]}
    if kind == "reasoning":
        text = _reasoning_text(item, seal, where, lenient)
        if assistant is not None and assistant.get("reasoning") is None:
            assistant["reasoning"] = text
            return None
        return {"role": "assistant", "reasoning": text}
    if kind in ("function_call_output", "custom_tool_call_output"):
        call_id = item.get("call_id")
        if call_id is None and kind == "function_call_output":
            call_id = tool_result_id(item, [*before, *out])
        if not isinstance(call_id, str):
            raise invalid(f"{where}.call_id must be a string: the id of the {kind.removesuffix('_output')} "
                          "it answers", f"{where}.call_id")
        return {"role": "tool", "content": _tool_output(item.get("output"), where, lenient), "tool_call_id": call_id}
    role = item.get("role")
    if kind not in (None, "message") or role is None:
        raise invalid(f"{where}: `{kind}` is not a Responses input item type this gateway knows (it serves "
                      f"{', '.join(sorted(I.LOWERED_ITEMS))}; docs/agent-apis.md lists what becomes of the "
                      "others)", where)
    if role == "assistant":
        text = _assistant_text(item.get("content"), where)
        if assistant is not None and assistant.get("content") is None:
            assistant["content"] = text
            return None
        return {"role": "assistant", "content": text}
    if role not in ("user", "system", "developer"):
        raise invalid(f"{where}.role must be user, assistant, system or developer", f"{where}.role")
    return {"role": role, "content": _user_content(item.get("content"), where, lenient)}


def tool_result_id(item: Mapping[str, Any], earlier: Sequence[Mapping[str, Any]]) -> str:
    """The ``tool_call_id`` of a ``function_call_output`` that names no ``call_id`` (the spec makes it optional;
    Codex sends its goal tools' results so, naming the tool by ``name`` and ``namespace``). vLLM has no rule for
    it (its request model requires the id); the gateway's, which looks only at what comes before the item, so an
    item lowers to the same message on every turn that resends it and the history's tokens stay put:

    1. the id of the first call, in the nearest earlier assistant message that has one, of the tool the item names
       (``<namespace>__<name>``, as calls are named) that no earlier tool message answers;
    2. else ``call_`` and 24 hex digits of a SHA-256: of the item's own ``id`` when it has one (clients resend
       it unchanged), else of its name, namespace and output and its position among the messages before it."""
    name = item.get("name")
    namespace = item.get("namespace")
    if isinstance(name, str) and name:
        tool = flat_name(namespace, name) if isinstance(namespace, str) and namespace else name
        answered = {m.get("tool_call_id") for m in earlier if m.get("role") == "tool"}
        for message in reversed(earlier):
            if message.get("role") != "assistant":
                continue
            for call in message.get("tool_calls") or ():
                fn = call.get("function") if isinstance(call, Mapping) else None
                if isinstance(fn, Mapping) and fn.get("name") == tool and call.get("id") not in answered \
                        and isinstance(call.get("id"), str):
                    return str(call["id"])
    own = item.get("id")
    basis = json.dumps(["id", own] if isinstance(own, str) and own else
                       ["item", namespace, name, item.get("output"), len(earlier)],
                       ensure_ascii=False, sort_keys=True, separators=(",", ":"), default=str)
    return "call_" + hashlib.sha256(basis.encode("utf-8", "surrogatepass")).hexdigest()[:24]


def _tool_call_for(item: Mapping[str, Any], where: str) -> dict[str, Any] | None:
    kind = item.get("type")
    if kind not in ("function_call", "custom_tool_call"):
        return None
    call_id, name = item.get("call_id"), item.get("name")
    if not isinstance(call_id, str) or not isinstance(name, str) or not name:
        raise invalid(f"{where} needs a call_id and a name", where)
    if kind == "function_call":
        arguments = item.get("arguments")
        if not isinstance(arguments, str):
            raise invalid(f"{where}.arguments must be a string", f"{where}.arguments")
    else:
        payload = item.get("input")
        arguments = encode_custom_input(payload if isinstance(payload, str) else "")
    namespace = item.get("namespace")
    if isinstance(namespace, str) and namespace:
        name = flat_name(namespace, name)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _reasoning_text(item: Mapping[str, Any], seal: ReasoningSeal | None, where: str, lenient: bool) -> str:
    sealed = item.get("encrypted_content")
    if sealed:
        # Lenient: the text this gateway's seal holds, unverified; foreign content falls back to the parts.
        text = ReasoningSeal.read(sealed) if lenient else _opened(sealed, seal, where)
        if text is not None:
            return text
    for field in ("content", "summary"):
        parts = item.get(field)
        if isinstance(parts, list) and parts:
            first = parts[0]
            if isinstance(first, Mapping) and isinstance(first.get("text"), str):
                return str(first["text"])
            raise invalid(f"{where}.{field}[0].text must be a string", f"{where}.{field}")
    return ""


def _opened(sealed: Any, seal: ReasoningSeal | None, where: str) -> str:
    if not isinstance(sealed, str):
        raise invalid(f"{where}.encrypted_content must be a string", f"{where}.encrypted_content")
    text = seal.open(sealed) if seal is not None else None
    if text is None:
        raise invalid(f"{where}.encrypted_content was not issued by this gateway (its key does not verify "
                      "it); send the reasoning's content instead, or leave the item out",
                      f"{where}.encrypted_content")
    return text


def _assistant_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and isinstance(content[0], Mapping):
        text = content[0].get("text")
        if isinstance(text, str):
            return text
        if content[0].get("type") == "refusal" and isinstance(content[0].get("refusal"), str):
            return str(content[0]["refusal"])
    raise invalid(f"{where}.content must be a string or a list of output_text parts", f"{where}.content")


def _user_content(content: Any, where: str, lenient: bool) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where}.content must be a string or a list of parts", f"{where}.content")
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in ("input_text", "text", "output_text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            image: dict[str, Any] = {"url": part["image_url"]}
            if isinstance(part.get("detail"), str) and part["detail"] != "auto":
                image["detail"] = part["detail"]
            parts.append({"type": "image_url", "image_url": image})
        elif kind == "input_image":
            refuse(invalid(f"{where}.content[{j}]: {I.IMAGE_WITHOUT_URL}", f"{where}.content"), lenient)
        elif isinstance(kind, str) and kind in I.REFUSED_PARTS:
            refuse(invalid(f"{where}.content[{j}]: parts of type `{kind}` are not served: {I.REFUSED_PARTS[kind]}",
                           f"{where}.content"), lenient)
        else:
            refuse(invalid(f"{where}.content[{j}]: parts of type `{kind}` are not served (input_text and "
                           "input_image with an image_url are)", f"{where}.content"), lenient)
    return parts


def _tool_output(output: Any, where: str, lenient: bool) -> str | list[dict[str, Any]]:
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        return _user_content(output, f"{where}.output", lenient)
    raise invalid(f"{where}.output must be a string or a list of parts", f"{where}.output")


def _custom_parameters() -> dict[str, Any]:
    return {"type": "object",
            "properties": {CUSTOM_TOOL_INPUT_KEY: {"type": "string",
                                                   "description": "The freeform text payload for this tool."}},
            "required": [CUSTOM_TOOL_INPUT_KEY], "additionalProperties": False}


def chat_tools(tools: Any, *, lenient: bool = False) -> list[dict[str, Any]]:
    """Chat function tools for Responses tools, in request order (vLLM's ``get_function_tools``); ``lenient``:
    a tool that would be refused is left out."""
    if not isinstance(tools, list):
        refuse(invalid("`tools` must be a list", "tools"), lenient)
        return []
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        out += leave_out_refused(lenient, _chat_tools_for, tool, f"tools[{i}]") or []
    return out


def _chat_tools_for(tool: Any, where: str) -> list[dict[str, Any]]:
    """The chat function tools one Responses tool stands for (a namespace's functions, flattened)."""
    kind = tool.get("type") if isinstance(tool, Mapping) else None
    if kind == "function":
        return [_function_tool(tool, tool.get("name"), where)]
    if kind == "custom":
        fmt = tool.get("format")
        if isinstance(fmt, Mapping) and fmt.get("type") == "grammar":
            # vLLM refuses these too: nothing would hold the model to the grammar.
            raise invalid(f"{where}: custom tools with a grammar format are not served; only free-form "
                          "text custom tools are", where)
        return [_function_tool({"description": tool.get("description"), "parameters": _custom_parameters()},
                               tool.get("name"), where)]
    if kind == "namespace":
        namespace, members = tool.get("name"), tool.get("tools")
        if not isinstance(namespace, str) or not isinstance(members, list):
            raise invalid(f"{where}: a namespace needs a name and a list of tools", where)
        out: list[dict[str, Any]] = []
        for j, member in enumerate(members):
            member_kind = member.get("type") if isinstance(member, Mapping) else None
            if member_kind not in ("function", "custom"):
                raise invalid(f"{where}.tools[{j}]: a namespace holds function and custom tools, not "
                              f"`{member_kind}`", f"{where}.tools")
            name = member.get("name")
            out += _chat_tools_for({**member, "name": flat_name(namespace, name) if isinstance(name, str) else None},
                                   f"{where}.tools[{j}]")
        return out
    if is_hosted_tool(kind):
        raise invalid(f"{where}: tools of type `{kind}` are not served: they are hosted or built-in tools "
                      "the model cannot call through a chat template (only function, custom and namespace "
                      "tools are). Turn the tool off in the client (e.g. Codex: web_search = "
                      "\"disabled\")", where)
    raise invalid(f"{where}: `{kind}` is not a Responses tool type this gateway knows (it serves function, custom "
                  "and namespace tools, and leaves hosted ones out): declare the tool as a function tool", where)


def _function_tool(tool: Mapping[str, Any], name: Any, where: str) -> dict[str, Any]:
    if not isinstance(name, str) or not name:
        raise invalid(f"{where}.name must be a non-empty string", f"{where}.name")
    parameters = tool.get("parameters")
    if parameters is not None and not isinstance(parameters, Mapping):
        raise invalid(f"{where}.parameters must be an object", f"{where}.parameters")
    # The keys vLLM's FunctionDefinition dumps (strict and defer_loading are None unless sent).
    fn: dict[str, Any] = {"name": name, "description": tool.get("description"), "parameters": parameters}
    for key in ("strict", "defer_loading"):
        if tool.get(key) is not None:
            fn[key] = tool[key]
    return {"type": "function", "function": fn}


def chat_tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, Mapping) and choice.get("type") in ("function", "custom"):
        name = choice.get("name")
        if isinstance(name, str) and name:
            namespace = choice.get("namespace")
            if isinstance(namespace, str) and namespace:
                name = flat_name(namespace, name)
            return {"type": "function", "function": {"name": name}}
    raise invalid("`tool_choice` must be auto, none, required or {type: function, name}", "tool_choice")


def template_kwargs(body: Mapping[str, Any]) -> dict[str, Any] | None:
    """The chat template's kwargs as vLLM's ``ResponsesRequest.build_chat_params`` merges them: the request's
    own, then ``reasoning_effort`` and (unless the request set it) ``enable_thinking``; None and "auto" values
    of the additions do not override."""
    user = body.get("chat_template_kwargs")
    if user is not None and not isinstance(user, Mapping):
        raise invalid("`chat_template_kwargs` must be an object", "chat_template_kwargs")
    reasoning = body.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, Mapping):
        raise invalid("`reasoning` must be an object", "reasoning")
    effort = reasoning.get("effort") if reasoning else None
    if effort is None:
        return dict(user) if user is not None else None
    extra: dict[str, Any] = {"reasoning_effort": effort}
    if "enable_thinking" not in (user or {}):
        extra["enable_thinking"] = effort != "none"
    return {**(user or {}), **{k: v for k, v in extra.items() if v not in (None, "auto")}}


def continues_final_message(raw_input: Any) -> bool:
    """vLLM's ``should_continue_final_message``: the last item is a partial assistant message or reasoning."""
    if not isinstance(raw_input, list) or not raw_input or not isinstance(raw_input[-1], Mapping):
        return False
    last = raw_input[-1]
    if last.get("type", "message") not in ("message", "reasoning"):
        return False
    if last.get("type", "message") == "message" and last.get("role") != "assistant":
        return False
    return last.get("status") in ("in_progress", "incomplete")


def _response_format(text: Any) -> dict[str, Any] | None:
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, Mapping) else None
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, Mapping) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema" and isinstance(fmt.get("schema"), Mapping):
        schema: dict[str, Any] = {"name": fmt.get("name") or "response", "schema": fmt["schema"]}
        if fmt.get("strict") is not None:
            schema["strict"] = fmt["strict"]
        return {"type": "json_schema", "json_schema": schema}
    raise invalid("`text.format` must be text, json_object or json_schema with a schema", "text.format")


