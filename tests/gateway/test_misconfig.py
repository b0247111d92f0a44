"""Configurations a newcomer gets wrong: each error names the setting, the value and the fix."""

from __future__ import annotations

import httpx
import pytest
from kvtether.cli.simstack import sim_stack
from kvtether.gateway.config import ConfigError, GatewayConfig, load_config
from kvtether.gateway.shell.app import create_app
from kvtether.gateway.shell.server import serve_gateway

from tests.support.sim_rig import LIMITS, stack_spec


def test_a_node_url_ending_in_v1_is_refused_with_the_root_url_to_give() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, prefill=["http://127.0.0.1:8100/v1"], decode=["http://127.0.0.1:8101"])
    assert "prefill" in str(err.value) and "'http://127.0.0.1:8100'" in str(err.value) and "/v1" in str(err.value)
    with pytest.raises(ConfigError, match="decode"):
        load_config(None, prefill=["http://127.0.0.1:8100"], decode=["http://127.0.0.1:8101/v1/"])


def test_a_missing_decode_node_names_both_ways_out() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, prefill=["http://127.0.0.1:8100"])
    assert "--decode URL" in str(err.value) and "--aggregated URL" in str(err.value)


@pytest.mark.anyio
async def test_a_kvtether_gateway_given_as_a_node_is_taken_out_with_a_reason() -> None:
    # The inner gateway is a simulated stack's; the outer one, misconfigured, is the subject.
    async with sim_stack(stack_spec(), GatewayConfig().policy, gateway={"metrics_poll_interval_s": 0.5},
                         calibrated=False) as inner, httpx.AsyncClient(timeout=30, limits=LIMITS) as client:
        outer = load_config(None, prefill=[inner.url], decode=inner.urls["decode"], metrics_poll_interval_s=0.5)
        async with serve_gateway(outer, app=create_app(outer)) as url:
            ready = await client.get(f"{url}/ready")
            assert ready.status_code == 503
            [p] = [n for n in ready.json()["nodes"] if n["role"] == "prefill"]
            assert not p["healthy"] and "is a kvtether gateway, not a vLLM server" in p["last_error"]


@pytest.mark.anyio
async def test_each_turn_logs_one_info_line_and_node_polls_stay_quiet(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from kvtether.gateway.shell.server import quiet_upstream_client

    from tests.support.gateway_agent import chat, first_messages, request_body
    from tests.support.sim_rig import rig

    quiet_upstream_client("info")
    assert logging.getLogger("httpx").getEffectiveLevel() == logging.WARNING
    caplog.set_level(logging.INFO)
    async with rig() as r:
        await chat(r.client, r.url, request_body(first_messages(80), stream=False), {"x-session-id": "logged"})
    turns = [rec.getMessage() for rec in caplog.records if rec.name == "kvtether.gateway.turn.remember"]
    assert turns == [next(t for t in turns if t.startswith("turn 0 of logged: none on "))]
    assert not [rec for rec in caplog.records if rec.name.startswith("httpx") and rec.levelno < logging.WARNING]
