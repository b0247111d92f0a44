"""Hosted tools on /v1/responses and /v1/messages through the gateway on the simulator: dropped by default (the
turn is the one the client's other tools alone make, and the answer, the metric and the log say what was left
out), refused with ``hosted_tools = "refuse"``; a tool_choice that names one is a 400 in the API's own shape."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from kvtether.gateway import telemetry as T
from kvtether.gateway.api.hosted import DroppedTools
from kvtether.gateway.config import ConfigError, load_config
from prometheus_client import CollectorRegistry, Counter

from tests.support import gateway_messages as GM
from tests.support import gateway_responses as GR
from tests.support.gateway_agent import MODEL, tool_result
from tests.support.sim_rig import Rig, metric, rig

pytestmark = pytest.mark.anyio

HOSTED_LOG = "kvtether.gateway.api.hosted"
WEB_SEARCH = {"type": "web_search", "external_web_access": False}  # as Codex sends it
FILE_SEARCH = {"type": "file_search", "vector_store_ids": ["vs_1"]}
SERVER_SEARCH = {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}
OPENAI_ERROR = {"message", "type", "param", "code"}


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == HOSTED_LOG and r.levelno == logging.WARNING]


async def dropped(r: Rig, kind: str) -> float:
    return await metric(r.client, r.url, T.M_DROPPED_TOOLS, type=kind)


async def test_responses_drop_hosted_tools_by_default_and_say_so(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=HOSTED_LOG)
    async with rig() as r:
        seal = r.gw.responses.seal
        items: list[dict[str, Any]] = [{"type": "message", "role": "user",
                                        "content": [{"type": "input_text", "text": "Fix the build."}]}]
        assert await dropped(r, "web_search") == 0
        for turn in range(2):
            body = {**GR.codex_body(items, stream=turn == 1), "tools": [*GR.TOOLS, WEB_SEARCH, FILE_SEARCH]}
            got, headers = await GR.send(r, body, GR.CODEX_HEADERS)
            assert headers[T.HEADER_DROPPED_TOOLS] == "web_search,file_search"
            # The turn is exactly the one without them: the model never saw them.
            want = await GR.oracle(r, {**body, "tools": GR.TOOLS}, seal)
            assert GR.comparable(got) == GR.comparable(want), f"turn {turn} differs from the oracle"
            items = GR.follow_up(items, got, turn)
        assert (await dropped(r, "web_search"), await dropped(r, "file_search")) == (2, 2)
        # Two turns of one session: one warning, naming the session and the tools.
        [line] = warnings(caplog)
        assert "codex-thread-1" in line and "web_search, file_search" in line and "refuse" in line
        # A turn without hosted tools says nothing.
        _, headers = await GR.send(r, GR.codex_body(items, stream=False), GR.CODEX_HEADERS)
        assert T.HEADER_DROPPED_TOOLS not in headers and len(warnings(caplog)) == 1
        # Another session is warned about once too.
        other = {"thread-id": "codex-thread-2", "session-id": "codex-thread-2"}
        for _ in range(2):
            await GR.send(r, {"model": MODEL, "input": "hi", "max_output_tokens": 8,
                              "tools": [{"type": "web_search_preview"}]}, other)
        assert len(warnings(caplog)) == 2 and "codex-thread-2" in warnings(caplog)[1]
        assert await dropped(r, "web_search") == 4


async def test_messages_drop_server_tools_by_default_and_say_so(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=HOSTED_LOG)
    async with rig() as r:
        headers = {"x-claude-code-session-id": "cc-hosted", "x-api-key": "any"}
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Look it up. " + tool_result("h", 30)}]
        fetch = {"type": "web_fetch_20250910", "name": "web_fetch"}
        for turn in range(2):
            body = {**GM.request(messages, turn, stream=turn == 1), "tools": [SERVER_SEARCH, *GM.TOOLS, fetch]}
            got, resp_headers = await GM.send(r, body, headers)
            assert resp_headers[T.HEADER_DROPPED_TOOLS] == "web_search_20250305,web_fetch_20250910"
            want = await GM.oracle(r, {**body, "tools": GM.TOOLS})
            assert GM.comparable(got) == GM.comparable(want), f"turn {turn} differs from the oracle"
            messages = GM.follow_up(messages, got, turn)
        assert (await dropped(r, "web_search"), await dropped(r, "web_fetch")) == (2, 2)
        [line] = warnings(caplog)
        assert "cc-hosted" in line and "web_search_20250305" in line
        # count_tokens counts the prompt the turn renders: without the server tools.
        count = {k: v for k, v in body.items() if k not in ("max_tokens", "stream")}
        with_tools = await r.client.post(f"{r.url}/v1/messages/count_tokens", json=count)
        without = await r.client.post(f"{r.url}/v1/messages/count_tokens", json={**count, "tools": GM.TOOLS})
        assert with_tools.status_code == 200 and with_tools.json() == without.json()


async def test_only_hosted_tools_and_tool_choice_auto_is_a_turn_without_tools() -> None:
    async with rig() as r:
        body = {"model": MODEL, "input": "Say hi. " + tool_result("a", 10), "max_output_tokens": 30,
                "temperature": 0, "tools": [WEB_SEARCH], "tool_choice": "auto"}
        got, headers = await GR.send(r, body)
        assert headers[T.HEADER_DROPPED_TOOLS] == "web_search"
        bare = {k: v for k, v in body.items() if k not in ("tools", "tool_choice")}
        assert GR.comparable(got) == GR.comparable(await GR.oracle(r, bare, r.gw.responses.seal))
        m = {**GM.request([{"role": "user", "content": "Say hi."}], 0, stream=False), "tools": [SERVER_SEARCH],
             "tool_choice": {"type": "auto"}}
        answer, headers = await GM.send(r, m, {})
        assert headers[T.HEADER_DROPPED_TOOLS] == "web_search_20250305"
        assert GM.comparable(answer) == GM.comparable(await GM.oracle(r, {k: v for k, v in m.items()
                                                                         if k not in ("tools", "tool_choice")}))


async def test_a_tool_choice_naming_a_hosted_tool_is_a_400_in_the_apis_shape() -> None:
    async with rig() as r:
        base = {"model": MODEL, "input": "hi", "max_output_tokens": 8}
        for tools, choice in (([*GR.TOOLS, WEB_SEARCH], {"type": "web_search"}),
                              ([FILE_SEARCH], {"type": "file_search"}),
                              ([WEB_SEARCH, FILE_SEARCH], "required")):
            resp = await r.client.post(f"{r.url}/v1/responses", json={**base, "tools": tools, "tool_choice": choice})
            err = resp.json()["error"]
            assert resp.status_code == 400 and set(err) == OPENAI_ERROR, resp.text
            assert err["param"] == "tool_choice" and ("web_search" in err["message"] or "file_search" in err["message"])
            assert T.HEADER_DROPPED_TOOLS not in resp.headers
        m = GM.request([{"role": "user", "content": "hi"}], 0, stream=False)
        for tools, choice in (([SERVER_SEARCH, *GM.TOOLS], {"type": "tool", "name": "web_search"}),
                              ([SERVER_SEARCH], {"type": "any"})):
            for stream in (False, True):
                resp = await r.client.post(f"{r.url}/v1/messages",
                                           json={**m, "stream": stream, "tools": tools, "tool_choice": choice})
                assert resp.status_code == 400, resp.text
                assert resp.json()["type"] == "error" and resp.json()["error"]["type"] == "invalid_request_error"
                assert "web_search_20250305" in resp.json()["error"]["message"]
        # Nothing refused was counted, or became a session.
        assert await dropped(r, "web_search") == 0
        assert (await r.client.get(f"{r.url}/admin/sessions")).json() == []


async def test_refuse_mode_answers_the_old_400(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=HOSTED_LOG)
    async with rig(hosted_tools="refuse") as r:
        body = {"model": MODEL, "input": "hi", "max_output_tokens": 8, "tools": [*GR.TOOLS, WEB_SEARCH]}
        resp = await r.client.post(f"{r.url}/v1/responses", json=body, headers=GR.CODEX_HEADERS)
        err = resp.json()["error"]
        assert resp.status_code == 400 and set(err) == OPENAI_ERROR and err["param"] == "tools[3]"
        assert "web_search" in err["message"] and "not served" in err["message"]
        m = {**GM.request([{"role": "user", "content": "hi"}], 0, stream=False), "tools": [*GM.TOOLS, SERVER_SEARCH]}
        resp = await r.client.post(f"{r.url}/v1/messages", json=m)
        assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"
        message = resp.json()["error"]["message"]
        assert "tools[2]" in message and "web_search_20250305" in message
        count = await r.client.post(f"{r.url}/v1/messages/count_tokens",
                                    json={k: v for k, v in m.items() if k not in ("max_tokens", "stream")})
        assert count.status_code == 400
        assert T.HEADER_DROPPED_TOOLS not in resp.headers and await dropped(r, "web_search") == 0
        assert warnings(caplog) == [] and (await r.client.get(f"{r.url}/admin/sessions")).json() == []
        # Without hosted tools, refuse mode serves the turn as ever.
        ok, _ = await GR.send(r, {**body, "tools": GR.TOOLS})
        assert ok["status"] in ("completed", "incomplete")


def test_the_setting_is_drop_or_refuse(tmp_path: Any) -> None:
    nodes = {"prefill": ["http://p:1"], "decode": ["http://d:1"]}
    assert load_config(None, **nodes).hosted_tools == "drop"
    path = tmp_path / "gateway.toml"
    path.write_text('[gateway]\nhosted_tools = "refuse"\n')
    assert load_config(path, **nodes).hosted_tools == "refuse"
    with pytest.raises(ConfigError, match="hosted_tools must be one of drop, refuse"):
        load_config(None, hosted_tools="ignore", **nodes)
    with pytest.raises(ConfigError, match="hosted_tools must be str"):
        load_config(None, hosted_tools=True, **nodes)


def test_the_warning_memory_is_bounded_and_forgets_the_least_recent_session(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=HOSTED_LOG)
    counter = Counter("dropped", "d", ["type"], registry=CollectorRegistry())
    seen = DroppedTools(counter, capacity=2)
    told = [seen.note(["web_search"], s, "/v1/responses") for s in ("a", "b", "a", "c", "a", "b", None, None)]
    # a, b warned; a again is remembered (and becomes the most recent); c evicts b; b is warned about again.
    assert told == [True, True, False, True, False, True, True, False]
    assert len(warnings(caplog)) == 5
    assert counter.labels("web_search")._value.get() == 8
    assert seen.note([], "z", "/v1/responses") is False
    seen.note(["web_search_preview_2025_03_11", "computer_use_preview", "bash_20250124"], "a", "/v1/messages")
    assert [counter.labels(k)._value.get() for k in ("web_search", "computer_use", "bash")] == [9, 1, 1]


def test_every_type_the_translations_drop_has_its_own_series() -> None:
    from kvtether.gateway.api.hosted import metric_type
    from kvtether.protocol import messages as M
    from kvtether.protocol import responses as R

    kinds = [*R.HOSTED_TOOL_TYPES, "web_search", "web_search_preview", "web_search_2025_08_26",
             "web_fetch_20250910", "code_execution_20250825", "bash_20250124", "text_editor_20250728",
             "computer_20250124", "memory_20250818", "tool_search_tool_regex_20251119",
             "tool_search_tool_bm25_20251119", "mcp_toolset", "browser_toolset_20260801",
             "computer_toolset_20260801", "tool_search_tool_bm25"]
    assert all(R.is_hosted_tool(k) or M.is_anthropic_defined({"type": k}) for k in kinds)
    assert {metric_type(k) for k in kinds} == set(T.DROPPED_TOOL_TYPES)
