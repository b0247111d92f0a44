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
  ``function_call_output`` / ``custom_tool_call_output`` → a ``tool`` message.
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
(``responses_http.py``) resolves a chain into the ``history`` messages :func:`to_chat` prepends.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import uuid
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, Final

from kvtether.sdk.apis.common import HostedTools, Translation, once

Event = tuple[str, dict[str, Any]]

CUSTOM_TOOL_INPUT_KEY = "input"  # vLLM's CUSTOM_TOOL_INPUT_KEY
NAMESPACE_SEPARATOR = "__"  # vLLM's _NAMESPACE_TOOL_SEPARATOR
ENCRYPTED_REASONING = "reasoning.encrypted_content"

# Request fields with no counterpart the gateway can serve, and why (a 400 names the field and the reason).
UNSERVED_FIELDS: dict[str, str] = {
    "background": "background responses are not served (the gateway streams or waits)",
    "prompt": "prompt templates are not served",
}
# Fields accepted and echoed, without effect: OpenAI-only service knobs.
IGNORED_FIELDS = ("service_tier", "safety_identifier", "prompt_cache_retention", "client_metadata",
                  "max_tool_calls", "store")
# Sampling fields copied to the chat request as they are (vLLM's Responses request has the same ones).
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
             "repetition_penalty", "seed", "stop", "logit_bias", "user", "parallel_tool_calls",
             "skip_special_tokens", "include_stop_str_in_output", "cache_salt", "chat_template_kwargs",
             "include_reasoning")
FUNCTION_TOOL_TYPES = ("function", "namespace", "custom")
# Hosted and built-in tools. OpenAI runs web_search, file_search, code_interpreter, image_generation and remote
# mcp servers; computer_use, local_shell, shell and apply_patch run in the client, but the model calls them
# natively, with no schema a chat template could show it. None has a form the model behind vLLM can call.
HOSTED_TOOL_TYPES: Final = frozenset({"file_search", "code_interpreter", "computer_use_preview", "computer_use",
                                      "computer", "image_generation", "mcp", "local_shell", "shell", "apply_patch"})
_WEB_SEARCH: Final = re.compile(r"web_search(_preview)?(_[0-9]{4}_[0-9]{2}_[0-9]{2})?")


def is_hosted_tool(kind: Any) -> bool:
    """Whether a tool (or tool_choice) ``type`` names a hosted or built-in tool."""
    return isinstance(kind, str) and (kind in HOSTED_TOOL_TYPES or _WEB_SEARCH.fullmatch(kind) is not None)


class ResponsesError(Exception):
    """A request the Responses API refuses: HTTP status, message, the offending parameter."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def _invalid(message: str, param: str | None = None) -> ResponsesError:
    return ResponsesError(400, message, param, "invalid_request")


# ---------------------------------------------------------------------------------------------------------
# Reasoning the gateway hands out and reads back


class ReasoningSeal:
    """``encrypted_content`` of a reasoning item: the reasoning text, compressed and signed with the gateway's
    key (HMAC-SHA256). Opaque to the client and verifiable by any replica that shares the key; not secret —
    the same answer carries the text in the item's ``content`` anyway."""

    PREFIX = "kvt1."

    def __init__(self, key: bytes) -> None:
        self._key = key

    def seal(self, text: str) -> str:
        payload = base64.urlsafe_b64encode(zlib.compress(text.encode("utf-8", "surrogatepass"))).decode()
        return f"{self.PREFIX}{payload}.{self._sign(payload)}"

    def open(self, sealed: str) -> str | None:
        """The reasoning text, or None for content this gateway's key did not sign."""
        if not sealed.startswith(self.PREFIX):
            return None
        payload, _, signature = sealed[len(self.PREFIX):].rpartition(".")
        if not payload or not hmac.compare_digest(signature, self._sign(payload)):
            return None
        try:
            return zlib.decompress(base64.urlsafe_b64decode(payload)).decode("utf-8", "surrogatepass")
        except (ValueError, zlib.error):
            return None

    def _sign(self, payload: str) -> str:
        digest = hmac.new(self._key, payload.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest[:24]).decode()


# ---------------------------------------------------------------------------------------------------------
# Request: Responses → chat


def to_chat(body: Mapping[str, Any], *, seal: ReasoningSeal, history: Sequence[Mapping[str, Any]] = ()
            ) -> dict[str, Any]:
    """The chat completion request for a Responses request; ``history``: the chat messages of the chain it
    continues (``previous_response_id`` / ``conversation``), put between its instructions and its input. A
    hosted tool is refused (400), as vLLM refuses it."""
    return translate(body, seal=seal, history=history).chat


def translate(body: Mapping[str, Any], *, seal: ReasoningSeal, history: Sequence[Mapping[str, Any]] = (),
              hosted_tools: HostedTools = "refuse") -> Translation:
    """:func:`to_chat`, with a choice of what becomes of hosted tools: ``"refuse"`` (400) or ``"drop"`` (left
    out of the turn, their types reported in ``dropped``)."""
    if "kv_transfer_params" in body:
        raise ResponsesError(400, "kv_transfer_params is set by the gateway, not by clients", "kv_transfer_params",
                             "forbidden_parameter")
    for name, why in UNSERVED_FIELDS.items():
        if body.get(name):
            raise _invalid(f"`{name}`: {why}", name)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _invalid("you must provide a model parameter", "model")
    truncation = body.get("truncation")
    if truncation not in (None, "disabled"):
        raise _invalid("`truncation` other than \"disabled\" is not served: the gateway never drops history "
                       "(it would change the prompt the decode node holds)", "truncation")
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _invalid("`instructions` must be a string", "instructions")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    messages += [dict(m) for m in history if m.get("role") != "system"]
    raw_input = body.get("input")
    if isinstance(raw_input, str):
        messages.append({"role": "user", "content": raw_input})
    elif isinstance(raw_input, list):
        messages += input_messages(raw_input, seal)
    else:
        raise _invalid("`input` must be a string or a list of items", "input")
    if not messages:
        raise _invalid("`input` holds no message", "input")
    chat: dict[str, Any] = {"model": model, "messages": messages}
    for name in _SAMPLING:
        if body.get(name) is not None:
            chat[name] = body[name]
    limit = body.get("max_output_tokens")
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise _invalid("`max_output_tokens` must be an integer >= 1", "max_output_tokens")
        chat["max_tokens"] = limit
    dropped = _add_tools(chat, body.get("tools"), body.get("tool_choice"), hosted_tools)
    kwargs = template_kwargs(body)
    if kwargs is not None:
        chat["chat_template_kwargs"] = kwargs
    if continues_final_message(raw_input):
        chat["add_generation_prompt"] = False
        chat["continue_final_message"] = True
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    if body.get("top_logprobs") and "message.output_text.logprobs" in (body.get("include") or ()):
        chat["logprobs"] = True
        chat["top_logprobs"] = body["top_logprobs"]
    if body.get("stream") is True:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    elif body.get("stream") not in (None, False):
        raise _invalid("`stream` must be a boolean", "stream")
    return Translation(chat, dropped)


def _add_tools(chat: dict[str, Any], tools: Any, choice: Any, hosted_tools: HostedTools) -> tuple[str, ...]:
    """The request's tools and tool_choice on the chat request; the hosted tool types dropped."""
    if not tools:
        return ()
    dropped: tuple[str, ...] = ()
    if hosted_tools == "drop":
        tools, dropped = without_hosted_tools(tools)
    converted = chat_tools(tools)
    if hosted_tools == "drop":
        check_choice_after_drop(choice, dropped, has_tools=bool(converted))
    if not converted and dropped:
        return dropped  # no tools left: none sent (the chat API refuses an empty list), nor a tool_choice
    chat["tools"] = converted
    if choice is not None:
        chat["tool_choice"] = chat_tool_choice(choice)
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
        raise _invalid(f"`tool_choice` names the hosted tool `{kind}`, which the model behind this gateway cannot "
                       "call (the gateway leaves hosted tools out of the turn); name a function tool, or use auto",
                       "tool_choice")
    if has_tools or not dropped or choice in (None, "auto", "none"):
        return
    raise _invalid(f"`tool_choice` needs a tool, but every tool given is a hosted tool the model behind this "
                   f"gateway cannot call ({', '.join(dropped)}; left out of the turn): give a function tool, or "
                   "use auto", "tool_choice")


def input_messages(items: Sequence[Any], seal: ReasoningSeal) -> list[dict[str, Any]]:
    """Chat messages for Responses input (or output) items, merged as vLLM merges them."""
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, Mapping):
            raise _invalid(f"{where} must be an object", where)
        message = _message_for(item, out[-1] if out else None, seal, where)
        if message is not None:
            out.append(message)
    return out


def _message_for(item: Mapping[str, Any], prev: dict[str, Any] | None, seal: ReasoningSeal,
                 where: str) -> dict[str, Any] | None:
    """A new chat message for one item, or None when it was merged into ``prev`` (vLLM's
    ``_construct_message_from_response_item``)."""
    assistant = prev if prev is not None and prev.get("role") == "assistant" else None
    kind = item.get("type")
    call = _tool_call_for(item, where)
    if call is not None:
        if assistant is not None:
            assistant.setdefault("tool_calls", []).append(call)
            return None
        return {"role": "assistant", "tool_calls": [call]}
    if kind == "reasoning":
        text = _reasoning_text(item, seal, where)
        if assistant is not None and assistant.get("reasoning") is None:
            assistant["reasoning"] = text
            return None
        return {"role": "assistant", "reasoning": text}
    if kind in ("function_call_output", "custom_tool_call_output"):
        call_id = item.get("call_id")
        if not isinstance(call_id, str):
            raise _invalid(f"{where}.call_id must be a string", f"{where}.call_id")
        return {"role": "tool", "content": _tool_output(item.get("output"), where), "tool_call_id": call_id}
    role = item.get("role")
    if kind not in (None, "message") or role is None:
        raise _invalid(f"{where}: input items of type `{kind}` are not served (the gateway serves messages, "
                       "reasoning, function and custom tool calls and their outputs)", where)
    if role == "assistant":
        text = _assistant_text(item.get("content"), where)
        if assistant is not None and assistant.get("content") is None:
            assistant["content"] = text
            return None
        return {"role": "assistant", "content": text}
    if role not in ("user", "system", "developer"):
        raise _invalid(f"{where}.role must be user, assistant, system or developer", f"{where}.role")
    return {"role": role, "content": _user_content(item.get("content"), where)}


def _tool_call_for(item: Mapping[str, Any], where: str) -> dict[str, Any] | None:
    kind = item.get("type")
    if kind not in ("function_call", "custom_tool_call"):
        return None
    call_id, name = item.get("call_id"), item.get("name")
    if not isinstance(call_id, str) or not isinstance(name, str) or not name:
        raise _invalid(f"{where} needs a call_id and a name", where)
    if kind == "function_call":
        arguments = item.get("arguments")
        if not isinstance(arguments, str):
            raise _invalid(f"{where}.arguments must be a string", f"{where}.arguments")
        namespace = item.get("namespace")
        if isinstance(namespace, str) and namespace:
            name = flat_name(namespace, name)
    else:
        payload = item.get("input")
        arguments = encode_custom_input(payload if isinstance(payload, str) else "")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _reasoning_text(item: Mapping[str, Any], seal: ReasoningSeal, where: str) -> str:
    sealed = item.get("encrypted_content")
    if sealed:
        if not isinstance(sealed, str):
            raise _invalid(f"{where}.encrypted_content must be a string", f"{where}.encrypted_content")
        text = seal.open(sealed)
        if text is None:
            raise _invalid(f"{where}.encrypted_content was not issued by this gateway (its key does not verify "
                           "it); send the reasoning's content instead, or leave the item out",
                           f"{where}.encrypted_content")
        return text
    for field in ("content", "summary"):
        parts = item.get(field)
        if isinstance(parts, list) and parts:
            first = parts[0]
            if isinstance(first, Mapping) and isinstance(first.get("text"), str):
                return str(first["text"])
            raise _invalid(f"{where}.{field}[0].text must be a string", f"{where}.{field}")
    return ""


def _assistant_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and isinstance(content[0], Mapping):
        text = content[0].get("text")
        if isinstance(text, str):
            return text
        if content[0].get("type") == "refusal" and isinstance(content[0].get("refusal"), str):
            return str(content[0]["refusal"])
    raise _invalid(f"{where}.content must be a string or a list of output_text parts", f"{where}.content")


def _user_content(content: Any, where: str) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _invalid(f"{where}.content must be a string or a list of parts", f"{where}.content")
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
        else:
            raise _invalid(f"{where}.content[{j}]: parts of type `{kind}` are not served (input_text and "
                           "input_image with an image_url are)", f"{where}.content")
    return parts


def _tool_output(output: Any, where: str) -> str | list[dict[str, Any]]:
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        return _user_content(output, f"{where}.output")
    raise _invalid(f"{where}.output must be a string or a list of parts", f"{where}.output")


def flat_name(namespace: str, name: str) -> str:
    return f"{namespace}{NAMESPACE_SEPARATOR}{name}"


def encode_custom_input(payload: str) -> str:
    """A custom tool call's arguments as vLLM shows them to the model (``encode_custom_tool_input``)."""
    return json.dumps({CUSTOM_TOOL_INPUT_KEY: payload}, ensure_ascii=False)


def decode_custom_input(arguments: str) -> str:
    """The payload of a custom tool call's arguments; bare text passes through (vLLM's rule)."""
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return arguments
    value = parsed.get(CUSTOM_TOOL_INPUT_KEY) if isinstance(parsed, dict) else None
    return value if isinstance(value, str) else arguments


def _custom_parameters() -> dict[str, Any]:
    return {"type": "object",
            "properties": {CUSTOM_TOOL_INPUT_KEY: {"type": "string",
                                                   "description": "The freeform text payload for this tool."}},
            "required": [CUSTOM_TOOL_INPUT_KEY], "additionalProperties": False}


def chat_tools(tools: Any) -> list[dict[str, Any]]:
    """Chat function tools for Responses tools, in request order (vLLM's ``get_function_tools``)."""
    if not isinstance(tools, list):
        raise _invalid("`tools` must be a list", "tools")
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, Mapping) else None
        if kind == "function":
            out.append(_function_tool(tool, tool.get("name"), where))
        elif kind == "custom":
            name = tool.get("name")
            fmt = tool.get("format")
            if isinstance(fmt, Mapping) and fmt.get("type") == "grammar":
                # vLLM refuses these too: nothing would hold the model to the grammar.
                raise _invalid(f"{where}: custom tools with a grammar format are not served; only free-form "
                               "text custom tools are", where)
            out.append(_function_tool({"description": tool.get("description"), "parameters": _custom_parameters()},
                                      name, where))
        elif kind == "namespace":
            namespace, members = tool.get("name"), tool.get("tools")
            if not isinstance(namespace, str) or not isinstance(members, list):
                raise _invalid(f"{where}: a namespace needs a name and a list of tools", where)
            for j, member in enumerate(members):
                if isinstance(member, Mapping) and member.get("type") == "function":
                    name = member.get("name")
                    out.append(_function_tool(member, flat_name(namespace, name) if isinstance(name, str)
                                              else None, f"{where}.tools[{j}]"))
        else:
            raise _invalid(f"{where}: tools of type `{kind}` are not served: they are hosted or built-in tools "
                           "the model cannot call through a chat template (only function, custom and namespace "
                           "tools are). Turn the tool off in the client (e.g. Codex: web_search = "
                           "\"disabled\")", where)
    return out


def _function_tool(tool: Mapping[str, Any], name: Any, where: str) -> dict[str, Any]:
    if not isinstance(name, str) or not name:
        raise _invalid(f"{where}.name must be a non-empty string", f"{where}.name")
    parameters = tool.get("parameters")
    if parameters is not None and not isinstance(parameters, Mapping):
        raise _invalid(f"{where}.parameters must be an object", f"{where}.parameters")
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
    raise _invalid("`tool_choice` must be auto, none, required or {type: function, name}", "tool_choice")


def template_kwargs(body: Mapping[str, Any]) -> dict[str, Any] | None:
    """The chat template's kwargs as vLLM's ``ResponsesRequest.build_chat_params`` merges them: the request's
    own, then ``reasoning_effort`` and (unless the request set it) ``enable_thinking``; None and "auto" values
    of the additions do not override."""
    user = body.get("chat_template_kwargs")
    if user is not None and not isinstance(user, Mapping):
        raise _invalid("`chat_template_kwargs` must be an object", "chat_template_kwargs")
    reasoning = body.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, Mapping):
        raise _invalid("`reasoning` must be an object", "reasoning")
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
    raise _invalid("`text.format` must be text, json_object or json_schema with a schema", "text.format")


# ---------------------------------------------------------------------------------------------------------
# Response: chat → Responses


def response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def skeleton(body: Mapping[str, Any], rid: str, created_at: float, *, previous: str | None = None
             ) -> dict[str, Any]:
    """The response object before its output: what ``response.created`` shows, echoing the request."""
    reasoning = body.get("reasoning") if isinstance(body.get("reasoning"), Mapping) else None
    conversation = body.get("conversation")
    return {
        "id": rid, "object": "response", "created_at": int(created_at), "status": "in_progress",
        "background": False, "error": None, "incomplete_details": None,
        "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
        "max_tool_calls": body.get("max_tool_calls"), "model": body.get("model"), "output": [],
        "parallel_tool_calls": body.get("parallel_tool_calls", True), "previous_response_id": previous,
        "conversation": {"id": conversation_id(conversation)} if conversation is not None else None,
        "reasoning": {"effort": (reasoning or {}).get("effort"), "summary": (reasoning or {}).get("summary")},
        "service_tier": body.get("service_tier", "auto"), "store": body.get("store", True) is not False,
        "temperature": body.get("temperature"), "text": body.get("text") or {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
        "top_logprobs": body.get("top_logprobs"), "top_p": body.get("top_p"),
        "truncation": body.get("truncation", "disabled"), "usage": None, "user": body.get("user"),
        "metadata": body.get("metadata") or {}, "prompt_cache_key": body.get("prompt_cache_key"),
    }


def conversation_id(conversation: Any) -> str | None:
    if isinstance(conversation, str) and conversation:
        return conversation
    if isinstance(conversation, Mapping) and isinstance(conversation.get("id"), str) and conversation["id"]:
        return str(conversation["id"])
    return None


class _Names:
    """Which flat chat tool names are custom tools, and which are namespaced (vLLM's name maps)."""

    def __init__(self, tools: Any) -> None:
        self.custom: set[str] = set()
        self.namespaced: dict[str, tuple[str, str]] = {}
        for tool in tools if isinstance(tools, list) else ():
            if not isinstance(tool, Mapping):
                continue
            if tool.get("type") == "custom" and isinstance(tool.get("name"), str):
                self.custom.add(tool["name"])
            elif tool.get("type") == "namespace" and isinstance(tool.get("name"), str):
                for member in tool.get("tools") or ():
                    if isinstance(member, Mapping) and isinstance(member.get("name"), str):
                        self.namespaced[flat_name(tool["name"], member["name"])] = (tool["name"], member["name"])

    def item(self, call_id: str, name: str, arguments: str, item_id: str) -> dict[str, Any]:
        if name in self.custom:
            return {"type": "custom_tool_call", "id": item_id, "call_id": call_id, "name": name,
                    "input": decode_custom_input(arguments), "status": "completed"}
        namespace, short = self.namespaced.get(name, (None, name))
        out = {"type": "function_call", "id": item_id, "call_id": call_id, "name": short, "arguments": arguments,
               "status": "completed"}
        if namespace is not None:
            out["namespace"] = namespace
        return out


def _item_id(prefix: str, chat_id: Any, n: int) -> str:
    base = chat_id if isinstance(chat_id, str) and chat_id else uuid.uuid4().hex
    return f"{prefix}_{hashlib.sha256(f'{base}:{n}'.encode()).hexdigest()[:32]}"


def reasoning_item(text: str, item_id: str, *, seal: ReasoningSeal | None) -> dict[str, Any]:
    item: dict[str, Any] = {"type": "reasoning", "id": item_id, "summary": [],
                            "content": [{"type": "reasoning_text", "text": text}]}
    if seal is not None:
        item["encrypted_content"] = seal.seal(text)
    return item


def message_item(text: str, item_id: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def usage(chat_usage: Any) -> dict[str, Any] | None:
    if not isinstance(chat_usage, Mapping):
        return None
    prompt, completion = _int(chat_usage.get("prompt_tokens")), _int(chat_usage.get("completion_tokens"))
    pdetails = chat_usage.get("prompt_tokens_details")
    cdetails = chat_usage.get("completion_tokens_details")
    cached = _int(pdetails.get("cached_tokens")) if isinstance(pdetails, Mapping) else 0
    reasoning = _int(cdetails.get("reasoning_tokens")) if isinstance(cdetails, Mapping) else 0
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": _int(chat_usage.get("total_tokens")) or prompt + completion}


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def finish(response: dict[str, Any], finish_reason: Any) -> dict[str, Any]:
    """The response's final status from the chat finish reason: ``length`` is incomplete (max_output_tokens)."""
    if finish_reason == "length":
        response["status"] = "incomplete"
        response["incomplete_details"] = {"reason": "max_output_tokens"}
    else:
        response["status"] = "completed"
    return response


def from_chat(chat: Mapping[str, Any], base: dict[str, Any], *, tools: Any,
              seal: ReasoningSeal | None) -> dict[str, Any]:
    """The Responses object for a non-streamed chat completion (its first choice). ``base``: :func:`skeleton`;
    ``seal``: given when the request asked for ``reasoning.encrypted_content``."""
    choices = chat.get("choices")
    choice: Mapping[str, Any] = choices[0] if isinstance(choices, list) and choices \
        and isinstance(choices[0], Mapping) else {}
    message = choice.get("message") if isinstance(choice.get("message"), Mapping) else {}
    assert isinstance(message, Mapping)
    chat_id = chat.get("id")
    output: list[dict[str, Any]] = []
    reasoning = message.get("reasoning")
    if reasoning is None:
        reasoning = message.get("reasoning_content")
    if isinstance(reasoning, str) and reasoning:
        output.append(reasoning_item(reasoning, _item_id("rs", chat_id, 0), seal=seal))
    text = message.get("content")
    if isinstance(text, str) and text:
        output.append(message_item(text, _item_id("msg", chat_id, 1)))
    names = _Names(tools)
    for n, call in enumerate(message.get("tool_calls") or ()):
        if not isinstance(call, Mapping):
            continue
        fn = call.get("function") if isinstance(call.get("function"), Mapping) else {}
        assert isinstance(fn, Mapping)
        arguments = fn.get("arguments")
        output.append(names.item(str(call.get("id") or f"call_{n}"), str(fn.get("name") or ""),
                                 arguments if isinstance(arguments, str) else json.dumps(arguments or {}),
                                 _item_id("fc", chat_id, 2 + n)))
    response = {**base, "output": output, "usage": usage(chat.get("usage"))}
    return finish(response, choice.get("finish_reason"))


def output_text(response: Mapping[str, Any]) -> str:
    """The SDKs' ``output_text``: every output_text part of the output's messages, joined."""
    return "".join(part.get("text", "") for item in response.get("output") or () if item.get("type") == "message"
                   for part in item.get("content") or () if part.get("type") == "output_text")


# ---------------------------------------------------------------------------------------------------------
# Errors


def error_event(message: str, code: str = "server_error") -> dict[str, Any]:
    return {"type": "error", "code": code, "message": message, "param": None}


# ---------------------------------------------------------------------------------------------------------
# Streams: chat chunks → Responses events


def sse(event: dict[str, Any]) -> bytes:
    """One event as OpenAI (and vLLM) frame Responses streams: ``event:`` line, ``data:`` line, no [DONE]."""
    payload = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {payload}\n\n".encode("utf-8", "replace")


class StreamTranslator:
    """Chat Completions stream chunks (parsed ``data:`` payloads) → Responses stream events, numbered.

    ``response.created`` and ``response.in_progress`` first; then per output item, in the order the chat stream
    produces them: ``output_item.added``, its deltas (``reasoning_text`` / ``output_text`` with their
    ``content_part`` events, ``function_call_arguments``, ``custom_tool_call_input``), its ``.done`` events and
    ``output_item.done``; at the end ``response.completed`` or ``response.incomplete`` with the whole response.
    An item is done when the stream moves to another kind of output (or another tool call), or at the end.
    """

    def __init__(self, base: dict[str, Any], *, tools: Any, seal: ReasoningSeal | None) -> None:
        self.response = dict(base)
        self._seal = seal
        self._names = _Names(tools)
        self._seq = 0
        self._started = False
        self._closed = False
        self._output: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item being streamed
        self._text: list[str] = []
        self._calls: dict[int, dict[str, Any]] = {}  # chat tool-call index → its item being streamed
        self._chat_id: Any = None
        self._finish_reason: Any = None
        self._usage: Any = None

    @property
    def final(self) -> dict[str, Any] | None:
        """The whole response once the stream closed cleanly."""
        return self.response if self._closed and self.response.get("status") in ("completed", "incomplete") \
            else None

    def feed(self, chunk: Mapping[str, Any]) -> list[dict[str, Any]]:
        if self._closed:
            return []
        events = self._start() if not self._started else []
        if self._chat_id is None and chunk.get("id"):
            self._chat_id = chunk["id"]
        if isinstance(chunk.get("usage"), Mapping):
            self._usage = chunk["usage"]
        choices = chunk.get("choices")
        choice = next((c for c in choices or () if isinstance(c, Mapping) and c.get("index", 0) == 0), None)
        if choice is None:
            return events
        if choice.get("finish_reason") is not None:
            self._finish_reason = choice["finish_reason"]
        delta = choice.get("delta")
        if not isinstance(delta, Mapping):
            return events
        reasoning = delta.get("reasoning")
        if reasoning is None:
            reasoning = delta.get("reasoning_content")
        if isinstance(reasoning, str) and reasoning:
            events += self._text_delta("reasoning", reasoning)
        content = delta.get("content")
        if isinstance(content, str) and content:
            events += self._text_delta("message", content)
        for call in delta.get("tool_calls") or ():
            if isinstance(call, Mapping):
                events += self._tool_delta(call)
        return events

    def close(self) -> list[dict[str, Any]]:
        if self._closed:
            return []
        events = self._start() if not self._started else []
        events += self._close_open()
        events += self._close_calls()
        finish(self.response, self._finish_reason)
        self.response["output"] = self._output
        self.response["usage"] = usage(self._usage)
        kind = "response.completed" if self.response["status"] == "completed" else "response.incomplete"
        events.append(self._event(kind, response=self.response))
        self._closed = True
        return events

    def fail(self, message: str) -> list[dict[str, Any]]:
        if self._closed:
            return []
        events = self._start() if not self._started else []
        self.response["status"] = "failed"
        self.response["error"] = {"code": "server_error", "message": message}
        self.response["output"] = self._output
        events.append(self._event("error", **{k: v for k, v in error_event(message).items() if k != "type"}))
        events.append(self._event("response.failed", response=self.response))
        self._closed = True
        return events

    # --- internals ---

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def _start(self) -> list[dict[str, Any]]:
        self._started = True
        snapshot = {**self.response, "output": []}
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def _item_id(self, prefix: str) -> str:
        return _item_id(prefix, self._chat_id, len(self._output) + len(self._calls) + (self._open is not None))

    def _text_delta(self, kind: str, delta: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._open is None or self._open["type"] != kind:
            events += self._close_open()
            events += self._close_calls()
            index = len(self._output)
            if kind == "reasoning":
                item = {"type": "reasoning", "id": self._item_id("rs"), "summary": [], "content": []}
                part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
            else:
                item = message_item("", self._item_id("msg"), "in_progress")
                item["content"] = []
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self._open = {"type": kind, "item": item, "index": index}
            self._text = []
            events.append(self._event("response.output_item.added", output_index=index, item=item))
            events.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                      content_index=0, part=part))
        self._text.append(delta)
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra: dict[str, Any] = {} if kind == "reasoning" else {"logprobs": []}
        events.append(self._event(name, item_id=self._open["item"]["id"], output_index=self._open["index"],
                                  content_index=0, delta=delta, **extra))
        return events

    def _close_open(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        kind, index, item_id = self._open["type"], self._open["index"], self._open["item"]["id"]
        text = "".join(self._text)
        if kind == "reasoning":
            item = reasoning_item(text, item_id, seal=self._seal)
            part: dict[str, Any] = {"type": "reasoning_text", "text": text}
            done = self._event("response.reasoning_text.done", item_id=item_id, output_index=index,
                               content_index=0, text=text)
        else:
            item = message_item(text, item_id)
            part = item["content"][0]
            done = self._event("response.output_text.done", item_id=item_id, output_index=index, content_index=0,
                               text=text, logprobs=[])
        events = [done,
                  self._event("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                              part=part),
                  self._event("response.output_item.done", output_index=index, item=item)]
        self._output.append(item)
        self._open = None
        self._text = []
        return events

    def _tool_delta(self, call: Mapping[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        index = call.get("index", 0)
        fn = call.get("function") if isinstance(call.get("function"), Mapping) else {}
        assert isinstance(fn, Mapping)
        state = self._calls.get(index)
        if state is None:
            name = fn.get("name")
            if not isinstance(name, str) or not name:
                return events  # arguments before the call's name: nothing to attach them to yet
            events += self._close_open()
            output_index = len(self._output) + len(self._calls)
            raw_id = call.get("id")
            call_id = raw_id if isinstance(raw_id, str) and raw_id else f"call_{index}"
            item = self._names.item(call_id, name, "", self._item_id("fc"))
            item["status"] = "in_progress"
            state = {"item": item, "index": output_index, "args": [], "name": name}
            self._calls[index] = state
            events.append(self._event("response.output_item.added", output_index=output_index, item=item))
        arguments = fn.get("arguments")
        if isinstance(arguments, str) and arguments:
            state["args"].append(arguments)
            if state["item"]["type"] == "function_call":
                events.append(self._event("response.function_call_arguments.delta", item_id=state["item"]["id"],
                                          output_index=state["index"], delta=arguments))
        return events

    def _close_calls(self) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for state in sorted(self._calls.values(), key=lambda s: s["index"]):
            arguments = "".join(state["args"])
            streamed = state["item"]
            item = self._names.item(streamed["call_id"], state["name"], arguments, streamed["id"])
            if item["type"] == "function_call":
                events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                          output_index=state["index"], name=item["name"], arguments=arguments))
            else:
                # The payload is only known once the shim's JSON is whole: it goes out as one delta.
                events.append(self._event("response.custom_tool_call_input.delta", item_id=item["id"],
                                          output_index=state["index"], delta=item["input"]))
                events.append(self._event("response.custom_tool_call_input.done", item_id=item["id"],
                                          output_index=state["index"], input=item["input"]))
            events.append(self._event("response.output_item.done", output_index=state["index"], item=item))
            self._output.append(item)
        self._calls = {}
        return events

