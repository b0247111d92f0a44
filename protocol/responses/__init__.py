"""OpenAI Responses in chat-completions terms, by vLLM's rules: ``request`` checks a request and lowers it to a
chat request (the rules are in its docstring), ``answer`` raises a whole chat answer to a Responses object,
``stream`` a chat stream to Responses events; ``common`` holds what they share. The names callers use are
re-exported here."""

from kvtether.protocol.responses.answer import (
    Usage,
    chat_answer,
    chat_finish_reason,
    conversation_id,
    from_chat,
    output_text,
    read_usage,
    response_id,
    skeleton,
)
from kvtether.protocol.responses.common import ENCRYPTED_REASONING, ReasoningSeal, ResponsesError
from kvtether.protocol.responses.request import HOSTED_TOOL_TYPES, input_messages, is_hosted_tool, to_chat, translate
from kvtether.protocol.responses.stream import StreamTranslator, error_event, sse

__all__ = [
    "ENCRYPTED_REASONING",
    "HOSTED_TOOL_TYPES",
    "ReasoningSeal",
    "ResponsesError",
    "StreamTranslator",
    "Usage",
    "chat_answer",
    "chat_finish_reason",
    "conversation_id",
    "error_event",
    "from_chat",
    "input_messages",
    "is_hosted_tool",
    "output_text",
    "read_usage",
    "response_id",
    "skeleton",
    "sse",
    "to_chat",
    "translate",
]
