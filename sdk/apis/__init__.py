"""The agent APIs in chat-completions terms, by vLLM's own rules: OpenAI Responses (``responses``) and Anthropic
Messages (``messages``), each a pure translation of a request to a chat request and of a chat answer (whole or
streamed) back. One implementation, shared by the gateway (which serves these APIs on its chat path), the
simulator (which serves them as vLLM does) and the SDK."""
