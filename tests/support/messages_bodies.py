"""Anthropic Messages request bodies the protocol tests share: one shaped like Claude Code's (with the tools'
schemas and the image it carries) and a server tool (web search)."""

from __future__ import annotations

import json
from typing import Any

PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGNgYGD4DwABBAEAwS2OUAAAAABJRU5ErkJggg=="
READ_SCHEMA = {"type": "object", "properties": {"file_path": {"type": "string"}}, "required": ["file_path"]}
# No "type": vLLM's tool model adds "type": "object", last.
BASH_SCHEMA = {"properties": {"command": {"type": "string"}, "description": {"type": "string"}},
               "required": ["command"]}
GLOB_SCHEMA = {"type": "object", "properties": {"pattern": {"type": "string"}}, "required": ["pattern"]}


def claude_code_request() -> dict[str, Any]:
    """Shaped like Claude Code 2.1's requests (docs/agent-apis.md): a billing-header system block, later
    blocks with cache_control, context_management/output_config/metadata, streamed, and a history with a
    tool loop, parallel tool calls, thinking and redacted thinking, an image and multi-part text."""
    return {
        "model": "claude-sonnet-4-5",
        "max_tokens": 32000,
        "stream": True,
        "metadata": {"user_id": json.dumps({"device_id": "d1", "account_uuid": "", "session_id": "5b6c"})},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "thinking": {"type": "enabled", "budget_tokens": 31999},
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.328.e4f; cc_entrypoint=sdk-cli;"},
            {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude.",
             "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "\nYou are an interactive CLI tool.", "cache_control": {"type": "ephemeral"}},
        ],
        "tools": [
            {"name": "Read", "description": "Reads a file.", "input_schema": READ_SCHEMA},
            {"name": "Bash", "description": "Runs a command.", "input_schema": BASH_SCHEMA},
            {"name": "Glob", "description": "Finds files.", "input_schema": GLOB_SCHEMA,
             "cache_control": {"type": "ephemeral"}},
        ],
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "<system-reminder>\nBe brief.\n</system-reminder>"},
                {"type": "text", "text": "What does main.py do? Here is a screenshot.",
                 "cache_control": {"type": "ephemeral"}},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
            ]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "I should read main.py.", "signature": "EqQBCgIYAhIM"},
                {"type": "text", "text": "Let me read it."},
                {"type": "tool_use", "id": "toolu_01", "name": "Read", "input": {"file_path": "/src/main.py"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_01",
                 "content": [{"type": "text", "text": "     1\tprint('héllo')"}]},
            ]},
            {"role": "assistant", "content": [
                {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix/LafPsn4aDFIT"},
                {"type": "tool_use", "id": "toolu_02", "name": "Bash",
                 "input": {"command": "echo héllo", "description": "Say hello"}},
                {"type": "tool_use", "id": "toolu_03", "name": "Glob", "input": {"pattern": "**/*.py"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_02", "content": "héllo", "is_error": False},
                {"type": "tool_result", "tool_use_id": "toolu_03", "content": "Error: no match", "is_error": True},
                {"type": "text", "text": "Thanks — now summarise.", "cache_control": {"type": "ephemeral"}},
            ]},
        ],
    }


WEB_SEARCH = {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}
