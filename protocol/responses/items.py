"""What becomes of each input item type, content part and tool type the OpenAI Responses spec defines (the
installed ``openai`` package's ``ResponseInputItemParam``, ``ResponseInputContentParam``,
``ResponseFunctionCallOutputItemParam`` and ``ToolParam`` unions; tests/protocol/test_spec_coverage.py keeps
these sets equal to the package's, so a release that adds a type fails a test until it is placed here on purpose).

Every type is one of:

- **lowered**: into the chat path (``request.py``);
- **bookkeeping** (items only): client bookkeeping the model behind vLLM cannot use and that carries nothing it
  needs. Left out of the turn by default (``bookkeeping_items = "drop"``: the answer's header, a metric and one
  warning per session say so), a 400 naming it with ``"refuse"``;
- **refused**: a 400 naming the type and what to send instead (the model behind vLLM cannot read it, and
  leaving it out would change what the model knows);
- **hosted** (tools only): dropped or refused by ``hosted_tools`` (``request.py``).
"""

from __future__ import annotations

from typing import Final, Literal

# What a translation does with a bookkeeping item: leave it out and report it, or refuse it (400).
BookkeepingItems = Literal["drop", "refuse"]
BOOKKEEPING_CHOICES: Final[tuple[BookkeepingItems, ...]] = ("drop", "refuse")

LOWERED_ITEMS: Final = frozenset({"message", "reasoning", "function_call", "function_call_output",
                                  "custom_tool_call", "custom_tool_call_output"})

# Item type → why the model needs nothing of it (a warning says it).
BOOKKEEPING_ITEMS: Final[dict[str, str]] = {
    "mcp_list_tools": "a hosted MCP server's tool listing (hosted MCP tools are left out of the turn)",
    "mcp_approval_request": "an approval request of a hosted MCP call, which the model behind this gateway "
                            "cannot make",
    "mcp_approval_response": "an approval of a hosted MCP call, which the model behind this gateway cannot make",
    "web_search_call": "the record of a hosted web search (what it found reached the model through the answer's "
                       "text, which stays)",
}

_HOSTED_CALL = ("a call of a hosted or built-in tool, which the model behind this gateway cannot make (such "
                "tools are left out of the turn): declare the tool as a function or custom tool and send its "
                "calls as function_call / function_call_output items, or leave the item out")
# Item type → what to send instead (the 400's message).
REFUSED_ITEMS: Final[dict[str, str]] = {
    "item_reference": "items by reference are not served (the gateway keeps no items by id but its stored "
                      "responses): send the item itself, or chain with previous_response_id",
    "compaction": "a compaction's encrypted_content was issued by another server and cannot be read here: send "
                  "the history it stands for",
    "compaction_trigger": "compaction is not served (the gateway never changes the history, which the decode "
                          "node holds): send the history, shortened by the client if it must be",
    "configuration_update": "configuration updates inside the input are not served: set `reasoning` and `text` "
                            "on the request",
    "additional_tools": "tools added inside the input are not served (a chat template shows one tool list): "
                        "declare them in the request's `tools`",
    "tool_search_call": "tool search has no chat form: declare the tools in the request's `tools` (without "
                        "defer_loading)",
    "tool_search_output": "tool search has no chat form: declare the tools it loaded in the request's `tools`",
    "program": "programmatic tool calling is not served: send the calls the program made as function_call "
               "items",
    "program_output": "programmatic tool calling is not served: send the results as function_call_output items",
    **{kind: _HOSTED_CALL for kind in (
        "file_search_call", "computer_call", "computer_call_output", "image_generation_call",
        "code_interpreter_call", "local_shell_call", "local_shell_call_output", "shell_call", "shell_call_output",
        "apply_patch_call", "apply_patch_call_output", "mcp_call")},
}

# Content parts of messages and of tool results (``function_call_output.output`` as a list).
LOWERED_PARTS: Final = frozenset({"input_text", "input_image"})
REFUSED_PARTS: Final[dict[str, str]] = {
    "input_file": "files are not served (the model behind this gateway reads text and images): send the file's "
                  "text as an input_text part",
}
# input_image is lowered when it has an image_url; one with only a file_id is refused.
IMAGE_WITHOUT_URL: Final = ("an input_image with only a file_id is not served (the gateway holds no files): send "
                            "its image_url (a URL or a data: URI)")
# Parts of an assistant message handed back (``ResponseOutputMessageParam.content``).
ASSISTANT_PARTS: Final = frozenset({"output_text", "refusal"})

LOWERED_TOOLS: Final = frozenset({"function", "custom", "namespace"})

# Fields the spec defines on lowered items and tools that have no chat form and change nothing the model sees:
# accepted and not sent (docs/agent-apis.md lists them). ``prompt_cache_breakpoint`` is OpenAI's cache hint on
# a content part (vLLM's prefix caching is automatic).
UNRENDERED_FIELDS: Final = ("id", "status", "phase", "caller", "async", "allowed_callers", "output_schema",
                            "prompt_cache_breakpoint")
# The fields of each lowered item, part and tool the translation reads.
READ_FIELDS: Final[dict[str, frozenset[str]]] = {
    "message": frozenset({"type", "role", "content", "status"}),
    "reasoning": frozenset({"type", "content", "summary", "encrypted_content", "status"}),
    "function_call": frozenset({"type", "call_id", "name", "namespace", "arguments"}),
    "function_call_output": frozenset({"type", "call_id", "name", "namespace", "output", "id"}),
    "custom_tool_call": frozenset({"type", "call_id", "name", "namespace", "input"}),
    "custom_tool_call_output": frozenset({"type", "call_id", "output"}),
    "input_text": frozenset({"type", "text"}),
    "input_image": frozenset({"type", "image_url", "detail", "file_id"}),
    "output_text": frozenset({"type", "text", "annotations", "logprobs"}),
    "refusal": frozenset({"type", "refusal"}),
    "tool:function": frozenset({"type", "name", "description", "parameters", "strict", "defer_loading"}),
    "tool:custom": frozenset({"type", "name", "description", "format", "defer_loading"}),
    "tool:namespace": frozenset({"type", "name", "description", "tools"}),
}


def refusal(kind: str) -> str | None:
    """Why an item type is refused and what to send instead; None for a type not refused."""
    return REFUSED_ITEMS.get(kind)
