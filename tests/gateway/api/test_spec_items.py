"""Every Responses input item type and Messages content block type the installed packages define, through the
gateway on the simulator: answered (200) or refused with a 400 in the API's shape that names it, never a 5xx.
Client bookkeeping items are left out by default, and the answer, a metric and one warning per session say so;
with ``bookkeeping_items = "refuse"`` they are a 400."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from anthropic.types import content_block_param
from hypothesis import Phase, find, settings
from kvtether.gateway import telemetry as T
from kvtether.gateway.config import ConfigError, load_config
from kvtether.protocol.messages import request as MR
from kvtether.protocol.responses import items as I
from openai.types.responses import response_input_item_param

from tests.support import gateway_responses as GR
from tests.support import spec_types as S
from tests.support.gateway_agent import MODEL, tool_result
from tests.support.sim_rig import metric, rig

pytestmark = pytest.mark.anyio

HOSTED_LOG = "kvtether.gateway.api.hosted"
USER = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Fix it."}]}
MCP_LIST = {"type": "mcp_list_tools", "id": "mcpl_1", "server_label": "docs", "tools": []}
APPROVAL = {"type": "mcp_approval_response", "approval_request_id": "mcpr_1", "approve": True}


def example(member: Any) -> dict[str, Any]:
    """One value of a spec type, the same on every run: the smallest (shrunk). Without hypothesis's explain phase,
    which only annotates a failing test's report and cost these tests 20 s of CPU on examples that fail nothing."""
    return find(S.of(member), lambda _: True,
                settings=settings(database=None, derandomize=True, phases=[Phase.generate, Phase.shrink]))


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == HOSTED_LOG and r.levelno == logging.WARNING]


async def test_every_responses_input_item_type_is_answered_or_refused_by_name() -> None:
    async with rig() as r:
        for member in S.members(response_input_item_param.ResponseInputItemParam):
            item = example(member)
            kind = item.get("type") or "item_reference"
            body = {"model": MODEL, "input": [USER, item], "max_output_tokens": 8}
            resp = await r.client.post(f"{r.url}/v1/responses", json=body)
            assert resp.status_code < 500, (kind, resp.text)
            if kind in I.REFUSED_ITEMS:
                err = resp.json()["error"]
                assert resp.status_code == 400 and f"`{kind}`" in err["message"] and err["param"] == "input[1]"
            elif kind in I.BOOKKEEPING_ITEMS:
                assert resp.status_code == 200 and resp.headers[T.HEADER_DROPPED_ITEMS] == kind, resp.text
            else:
                assert resp.status_code in (200, 400), resp.text
                if resp.status_code == 400:  # a value the chat path cannot take: named
                    assert resp.json()["error"]["param"].startswith("input[1]"), resp.text


async def test_every_messages_content_block_type_is_answered_or_refused_by_name() -> None:
    async with rig() as r:
        for member in S.members(content_block_param.ContentBlockParam):
            block = example(member)
            role = "assistant" if block["type"] in ("tool_use", "thinking", "redacted_thinking") else "user"
            messages = [{"role": "user", "content": "hi"}, {"role": role, "content": [block]},
                        {"role": "user", "content": "go on"}]
            resp = await r.client.post(f"{r.url}/v1/messages", json={"model": MODEL, "max_tokens": 8,
                                                                      "messages": messages})
            assert resp.status_code < 500, (block, resp.text)
            if block["type"] in MR.REFUSED_BLOCKS:
                err = resp.json()["error"]
                assert resp.status_code == 400 and err["type"] == "invalid_request_error"
                assert block["type"] in err["message"] and "messages[1].content[0]" in err["message"]


async def test_bookkeeping_items_are_left_out_and_said_so_once_per_session(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=HOSTED_LOG)
    async with rig(sim={"decoder_kv_blocks_ttl": 1e9}) as r:
        seal = r.gw.responses.seal
        items: list[dict[str, Any]] = [USER, MCP_LIST, APPROVAL]
        sources = []
        for turn in range(3):
            body = GR.codex_body(items, stream=turn == 1)
            got, headers = await GR.send(r, body, GR.CODEX_HEADERS)
            assert headers[T.HEADER_DROPPED_ITEMS] == "mcp_list_tools,mcp_approval_response"
            # The turn is the one without them: the model never saw them.
            without = [i for i in body["input"] if i["type"] not in I.BOOKKEEPING_ITEMS]
            want = await GR.oracle(r, {**body, "input": without}, seal)
            assert GR.comparable(got) == GR.comparable(want), f"turn {turn} differs from the oracle"
            sources.append(headers.get("x-kvtether-reuse-source"))
            items = GR.follow_up(items, got, turn)
        assert all(s in ("decode_pull", "prefill_cache") for s in sources[1:]), sources
        for kind in ("mcp_list_tools", "mcp_approval_response"):
            assert await metric(r.client, r.url, T.M_DROPPED_ITEMS, type=kind) == 3
        assert await metric(r.client, r.url, T.M_DROPPED_ITEMS, type="web_search_call") == 0
        [line] = warnings(caplog)
        assert "codex-thread-1" in line and "mcp_list_tools, mcp_approval_response" in line and "refuse" in line
        # The stored input keeps what the client sent; a turn without such items says nothing.
        _, headers = await GR.send(r, {"model": MODEL, "input": "hi " + tool_result("b", 5), "max_output_tokens": 8},
                                   GR.CODEX_HEADERS)
        assert T.HEADER_DROPPED_ITEMS not in headers and len(warnings(caplog)) == 1


async def test_bookkeeping_items_are_refused_when_the_operator_says_so() -> None:
    async with rig(bookkeeping_items="refuse") as r:
        resp = await r.client.post(f"{r.url}/v1/responses", json={"model": MODEL, "input": [USER, MCP_LIST]})
        err = resp.json()["error"]
        assert resp.status_code == 400 and err["param"] == "input[1]"
        assert "`mcp_list_tools`" in err["message"] and "bookkeeping" in err["message"]
        assert T.HEADER_DROPPED_ITEMS not in resp.headers
        assert await metric(r.client, r.url, T.M_DROPPED_ITEMS, type="mcp_list_tools") == 0


def test_the_setting_takes_drop_or_refuse_and_the_metric_knows_every_bookkeeping_type() -> None:
    nodes = {"prefill": ["http://p:1"], "decode": ["http://d:1"]}
    assert load_config(None, **nodes).bookkeeping_items == "drop"
    assert load_config(None, bookkeeping_items="refuse", **nodes).bookkeeping_items == "refuse"
    with pytest.raises(ConfigError, match="bookkeeping_items"):
        load_config(None, bookkeeping_items="ignore", **nodes)
    assert set(T.DROPPED_ITEM_TYPES) == set(I.BOOKKEEPING_ITEMS) | set(MR.REFUSED_TOOL_RESULT_BLOCKS)


async def test_a_pdf_in_a_claude_code_tool_result_is_left_out_and_the_session_goes_on() -> None:
    """Claude Code's read of a PDF is a document block in a tool result, resent on every later turn: left out
    (bookkeeping_items = "drop", the default), said in the header and the metric, and the turns keep answering;
    "refuse" answers 400 naming it."""
    pdf = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0x"}}
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "read the report"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Read",
                                           "input": {"file_path": "report.pdf"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "PDF file read"}, pdf]}]}]
    async with rig() as r:
        for turn in range(2):
            resp = await r.client.post(f"{r.url}/v1/messages", json={"model": MODEL, "max_tokens": 8,
                                                                      "messages": messages},
                                       headers={"x-session-id": "claude-pdf"})
            assert resp.status_code == 200, resp.text
            assert resp.headers[T.HEADER_DROPPED_ITEMS] == "document"
            messages = [*messages, {"role": "assistant", "content": resp.json()["content"]},
                        {"role": "user", "content": f"and then {turn}"}]
        assert await metric(r.client, r.url, T.M_DROPPED_ITEMS, type="document") == 2
    async with rig(bookkeeping_items="refuse") as r:
        resp = await r.client.post(f"{r.url}/v1/messages", json={"model": MODEL, "max_tokens": 8,
                                                                  "messages": messages[:3]})
        assert resp.status_code == 400 and "document" in resp.json()["error"]["message"]
