"""The wire contract the gateway, the simulator and the SDK share, and nothing that runs.

- ``responses`` and ``messages``: the OpenAI Responses and Anthropic Messages APIs in chat-completions terms, by
  vLLM's own rules. Each is a pure translation in three parts: ``request`` (the checks, and a request → a chat
  request), ``answer`` (a whole chat answer → the API's answer) and ``stream`` (a chat stream → the API's event
  stream). The gateway serves these APIs on its chat path with them, and the simulator serves them as vLLM does.
- ``common``: what both translations share.
- ``contract``: the session headers and the prefix-hash chain that the SDK stamps and the gateway recomputes.
- ``wire``: what the gateway sends a vLLM node and the simulator answers as one, beyond the chat API.

Imports point one way: the gateway, the simulator and the SDK import this package; it imports none of them.
"""
