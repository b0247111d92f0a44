"""Anthropic Messages in chat-completions terms, by vLLM's rules: ``request`` checks a request and lowers it to a
chat request (the field table is in its docstring), ``answer`` raises a whole chat answer to a Messages answer,
``stream`` a chat stream to Messages events; ``common`` holds what they share (Anthropic's errors). The names
callers use are re-exported here."""

from kvtether.protocol.messages.answer import chat_answer, chat_finish_reason, from_chat, thinking_signature
from kvtether.protocol.messages.common import MessagesError, error_body, from_openai_error
from kvtether.protocol.messages.request import count_tokens_body, is_anthropic_defined, to_chat, translate
from kvtether.protocol.messages.stream import StreamTranslator, error_event, sse

__all__ = [
    "MessagesError",
    "StreamTranslator",
    "chat_answer",
    "chat_finish_reason",
    "count_tokens_body",
    "error_body",
    "error_event",
    "from_chat",
    "from_openai_error",
    "is_anthropic_defined",
    "sse",
    "thinking_signature",
    "to_chat",
    "translate",
]
