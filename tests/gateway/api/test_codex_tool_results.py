"""Codex's own tool results through the gateway on the simulator: after the model calls one of Codex's goal tools,
Codex adds to its history a ``function_call_output`` with no ``call_id`` (it names the tool by ``name`` and
``namespace`` instead, as the current Responses spec allows) and resends it on every later turn. The session keeps
working turn after turn, each turn answered as the oracle answers the same turn sent as chat, and later turns reuse
the history the decode node holds."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.gateway_agent import tool_result
from tests.support.gateway_responses import (
    CODEX_HEADERS,
    TOOLS,
    check_codex_session,
    codex_body,
    comparable,
    follow_up,
    oracle,
    send,
)
from tests.support.sim_rig import metric, rig

pytestmark = pytest.mark.anyio

GOAL_TOOLS = {"type": "namespace", "name": "agent", "description": "Goal tools",
              "tools": [{"type": "function", "name": "goal_objective", "description": "Set the goal",
                         "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}]}


def goal_result(n: int) -> dict[str, Any]:
    """The item as Codex 0.169 sends it: an id of its own, the tool's name and namespace, no call_id."""
    return {"type": "function_call_output", "id": f"fco_{n:04d}", "name": "goal_objective", "namespace": "agent",
            "output": f"Goal {n}: " + tool_result(f"goal{n}", 30)}


async def test_a_codex_session_with_call_id_less_tool_results_keeps_working_and_reuses() -> None:
    async with rig(sim={"decoder_kv_blocks_ttl": 1e9}) as r:
        seal = r.gw.responses.seal
        items: list[dict[str, Any]] = [
            {"type": "message", "role": "developer",
             "content": [{"type": "input_text", "text": "Sandbox: read-only. " + tool_result("dev", 40)}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Fix the build."}]},
            # A goal call the model made earlier, answered by Codex without a call_id.
            {"type": "function_call", "id": "fc_goal", "call_id": "call_goal", "name": "goal_objective",
             "namespace": "agent", "arguments": "{\"path\": \"build\"}"},
            goal_result(0)]
        sources, reused, prompts, called = [], [], [], []
        for turn in range(6):
            body = {**codex_body(items, stream=turn % 2 == 1), "tools": [*TOOLS, GOAL_TOOLS]}
            got, headers = await send(r, body, CODEX_HEADERS)
            assert comparable(got) == comparable(await oracle(r, body, seal)), f"turn {turn} differs from the oracle"
            sources.append(headers.get("x-kvtether-reuse-source"))
            reused.append(int(headers.get("x-kvtether-reuse-tokens") or 0))
            prompts.append(got["usage"]["input_tokens"])
            called.append(any(i["type"] == "function_call" for i in got["output"]))
            # Codex adds its own goal result after the answer: the history carries one more such item each turn.
            following = follow_up(items, got, turn)
            cut = len(items) + len(got["output"])
            items = [*following[:cut], goal_result(turn + 1), *following[cut:]]
        assert sum(1 for i in items if i["type"] == "function_call_output" and "call_id" not in i) == 7
        # Every later turn resends them all and reuses the history: at least the previous turn's prompt after a
        # tool call (P pulls the answer from D), and never nothing.
        await check_codex_session(r, reused, prompts, called, sources)
        assert await metric(r.client, r.url, "kvtether_requests_total", route="responses", status="4xx") == 0
