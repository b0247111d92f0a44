"""One pool of instances that take both roles (``--node``), through the gateway on the simulator.

The simulator's aggregated nodes are vLLM kv_both instances: one scheduler each for their own decodes and the
prefill legs they serve for others. A session is pinned to one instance; its short turns run there (decode-local),
a long one is prefilled on another instance that pulls the history from the session's, which reads back only the
new part and decodes; every answer equals the oracle's, and the session's handle is released when it ends.
"""

from __future__ import annotations

from typing import Any

import anyio
import httpx
import pytest
from kvtether.cli.simstack import HYBRID, sim_stack
from kvtether.gateway.config import load_config
from kvtether.gateway.shell.app import create_app

from tests.support.gateway_agent import chat, comparable, first_messages, next_messages, request_body
from tests.support.sim_rig import LIMITS, metric, stack_spec

pytestmark = pytest.mark.anyio


async def _requests(client: httpx.AsyncClient, url: str) -> float:
    return await metric(client, url, "vllm:request_success_total")


async def _hits(client: httpx.AsyncClient, url: str) -> float:
    return await metric(client, url, "vllm:prompt_tokens_by_source_total", source="local_cache_hit")


async def _prompt_tokens(client: httpx.AsyncClient, url: str) -> float:
    """Prompt tokens the node took in, computed, from its prefix cache or read from another node."""
    return await metric(client, url, "vllm:prompt_tokens_by_source_total")


async def _p2p(client: httpx.AsyncClient, url: str) -> float:
    return await metric(client, url, "vllm:prompt_tokens_cached_by_source_total", source="p2p")


async def test_a_session_on_a_pool_runs_local_then_disaggregated_then_local_and_its_handle_is_released() -> None:
    spec = stack_spec(aggregated=3, kv_recompute_threshold=4, kv_lease_duration=2.0)
    gateway = {"metrics_poll_interval_s": 0.5, "pool_max_local_suffix_tokens": 256, "min_reuse_tokens": 4,
               "learn_estimates": False,
               # Local turns leave a handle of their whole sequence, so the long turn's prefill reads
               # all of the history the first turn's prefill instance does not already cache.
               "local_turn_handles": False}
    async with sim_stack(spec, HYBRID, gateway=gateway, calibrated=False, oracle=True) as stack:
        cluster, url, oracle = stack.cluster, stack.url, stack.oracle
        assert cluster is not None
        nodes = cluster.aggregated_urls
        async with httpx.AsyncClient(timeout=60, limits=LIMITS) as client:
            ready = (await client.get(f"{url}/ready")).json()
            assert {n["role"] for n in ready["nodes"]} == {"both"} and ready["mode"] == "pd"
            h = {"x-session-id": "pool-1"}
            messages = first_messages(60)
            # (words of the tool result after this turn, how this turn must run)
            plan = [(10, "first"), (10, "decode_local"), (600, "decode_local"), (10, "pull"), (10, "decode_local")]
            home, first_prompt = None, 0
            for turn, (words, expect) in enumerate(plan):
                # Served: took the turn's prompt (a handle's release is a one-token prompt on some other instance).
                before = {u: await _prompt_tokens(client, u) for u in nodes}
                p2p = {u: await _p2p(client, u) for u in nodes}
                hits = {u: await _hits(client, u) for u in nodes}
                body = {**request_body(messages, stream=turn % 2 == 1), "tool_choice": "required"}
                seen: dict[str, str] = {}
                got = await chat(client, url, body, h, response_headers=seen)
                want = await chat(client, oracle, {**body, "stream": False}, clean=False)
                assert comparable(got) == comparable(want), f"turn {turn} differs from the oracle"
                served = {u for u in nodes if await _prompt_tokens(client, u) > before[u] + 100}
                sessions = (await client.get(f"{url}/admin/sessions")).json()
                pinned = sessions[0]["decode"]
                if expect == "first":
                    # Prefilled on one instance, handed to the session's: two instances, never one twice.
                    assert len(served) == 2 and pinned in served
                    home = pinned
                    first_prompt = int(await _prompt_tokens(client, home) - before[home])
                elif expect == "decode_local":
                    assert served == {home}, f"turn {turn}: served by {served}"
                    assert seen["x-kvtether-reuse-source"] == "decode_local"
                else:
                    # Another instance prefilled the turn, without recomputing the history: it read the held part
                    # from the session's instance (the reverse pull), or its own prefix cache still held it (it
                    # prefilled the first turn) and it computed only the rest.
                    assert pinned == home and len(served) == 2 and home in served, (turn, served)
                    (other,) = served - {home}
                    source = seen["x-kvtether-reuse-source"]
                    assert source in ("decode_pull", "prefill_cache"), seen
                    reused = await _p2p(client, other) - p2p[other] + await _hits(client, other) - hits[other]
                    assert reused >= first_prompt // 16 * 16, (source, reused, first_prompt)
                messages = next_messages(messages, got, 60, turn, result_words=words)
            assert home is not None
            assert any(h["kind"] == "retained" for h in cluster.node(home).state()["held"])  # the session's handle
            assert (await client.delete(f"{url}/v1/sessions/pool-1")).status_code == 204
            # The session's handle is released (a one-token read of it by another instance): nothing is held for
            # it on any instance once that read's own lease has run out.
            with anyio.fail_after(20):
                while any(  # noqa: ASYNC110 - the simulated engines' own state, no event
                        h["kind"] == "retained" for u in nodes for h in cluster.node(u).state()["held"]):
                    await anyio.sleep(0.1)


async def test_a_pool_of_one_serves_every_turn_itself() -> None:
    gateway = {"metrics_poll_interval_s": 0.5, "learn_estimates": False, "pool_max_local_suffix_tokens": 256}
    async with sim_stack(stack_spec(aggregated=1, kv_recompute_threshold=4), HYBRID, gateway=gateway,
                         calibrated=False) as stack:
        url, (node,) = stack.url, stack.urls["aggregated"]
        async with httpx.AsyncClient(timeout=60, limits=LIMITS) as client:
            messages: list[dict[str, Any]] = first_messages(61)
            for turn, words in enumerate((10, 600, 10)):
                seen: dict[str, str] = {}
                got = await chat(client, url, request_body(messages, stream=False), {"x-session-id": "alone"},
                                 response_headers=seen)
                assert got.get("content") or got.get("tool_calls"), turn
                messages = next_messages(messages, got, 61, turn, result_words=words)
            assert await _requests(client, node) == 3  # no prefill leg: nowhere else to run one


def test_the_cluster_lists_a_pool_instance_in_both_roles_and_tells_its_prefill_legs_from_its_decodes() -> None:
    from kvtether.gateway.nodes.cluster import Cluster

    cfg = load_config(None, nodes=["http://a:1", "http://b:1"], prefill=["http://p:1"], decode=["http://d:1"])
    cluster = Cluster(cfg, httpx.AsyncClient())
    assert [n.url for n in cluster.role("prefill")] == ["http://p:1", "http://a:1", "http://b:1"]
    assert [n.url for n in cluster.role("decode")] == ["http://d:1", "http://a:1", "http://b:1"]
    a = cluster.node("http://a:1")
    a.running = 3.0
    cluster.begin(a.url, prefill=True)
    cluster.begin(a.url)
    view = cluster.view(0.0)
    for loads in (view.prefill, view.decode):
        load = next(n for n in loads if n.url == a.url)
        assert load.both and load.prefilling == 1.0 and load.decoding == 2.0
    assert not next(n for n in view.decode if n.url == "http://d:1").both
    cluster.end(a.url, prefill=True)
    assert a.prefilling == 0 and a.inflight == 1
    assert cfg.is_bidirectional("http://a:1")


@pytest.mark.parametrize(("settings", "error"), [
    ({"nodes": ["http://a:1"], "decode": ["http://a:1"]}, "more than one of prefill, decode and nodes"),
    ({"nodes": ["http://a:1"], "aggregated": ["http://b:1"]}, "not both"),
    ({"nodes": ["http://a:1/v1"]}, "ends in /v1"),
    ({"nodes": ["http://a:1"], "pool_balance_rel": 0.5}, "pool_balance_rel"),
    ({"nodes": ["http://a:1"], "pool_stall_share": 1.5}, "pool_stall_share"),
])
def test_a_pool_that_cannot_work_is_refused_with_the_field_named(settings: dict[str, Any], error: str) -> None:
    from kvtether.gateway.config import ConfigError

    with pytest.raises(ConfigError, match=error):
        load_config(None, **settings)


def test_a_pool_alone_or_beside_prefill_and_decode_nodes_is_a_pd_cluster() -> None:
    assert load_config(None, nodes=["http://a:1"]).mode == "pd"
    mixed = load_config(None, nodes=["http://a:1"], prefill=["http://p:1"])
    assert mixed.mode == "pd" and mixed.nodes == ["http://a:1"]


@pytest.mark.parametrize(("policy", "pool", "decode"), [("auto", 1.0, 0.15), ("pull", None, None)])
def test_a_pool_instances_answers_get_the_pools_quota_and_a_decode_nodes_its_own(
        policy: str, pool: float | None, decode: float | None) -> None:
    cfg = load_config(None, nodes=["http://a:1"], decode=["http://d:1"], prefill=["http://p:1"], policy=policy)
    sv = create_app(cfg).state.gateway.orchestrator.sv
    assert sv.quota_share("http://a:1") == pool
    assert sv.quota_share("http://d:1") == decode


@pytest.mark.parametrize(("defer_max_s", "outcome"), [(10.0, "cleared"), (0.3, "forced"), (0.0, None)])
async def test_a_turn_that_would_break_a_running_answers_tpot_waits_for_it_to_end(
        defer_max_s: float, outcome: str | None) -> None:
    """A pool of one: session x's answer decodes, its TPOT quota a few ms of stall (its answers have been ~10
    tokens long); session y's follow-up can run only there, and its local prefill (~0.2 s) would break x's
    quota. It waits for x's answer to end (cleared), or runs over the limit when defer_max_s is spent (forced),
    or at once when deferral is off."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import StatusCode

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    gateway = {"metrics_poll_interval_s": 0.5, "learn_estimates": False, "tpot_budget_s": 0.01,
               "seed_prefill_overhead_s": 0.2, "seed_tpot_base_s": 0.001, "seed_tpot_s_per_seq": 1e-4,
               "tuning": {"interference_weight": 0.0}, "defer_max_s": defer_max_s}
    async with sim_stack(stack_spec(aggregated=1, speed=1.0, kv_recompute_threshold=4), HYBRID, gateway=gateway,
                         calibrated=False, tracer_provider=provider) as stack:
        url, app, (node,) = stack.url, stack.app, stack.urls["aggregated"]
        async with httpx.AsyncClient(timeout=60, limits=LIMITS) as client:
            histories = {}
            for s, seed in (("x", 63), ("y", 64)):
                first = first_messages(seed)
                got = await chat(client, url, request_body(first, stream=False, max_tokens=10), {"x-session-id": s})
                histories[s] = next_messages(first, got, seed, 0, result_words=10)
            long_body = {**request_body(histories["x"], stream=True, max_tokens=3000), "min_tokens": 3000,
                         "ignore_eos": True}
            done: dict[str, float] = {}
            async with client.stream("POST", f"{url}/v1/chat/completions", json=long_body,
                                     headers={"x-session-id": "x"}) as resp:
                assert resp.status_code == 200
                lines = resp.aiter_lines()  # kept: a dropped iterator would close the stream
                async for line in lines:  # x's answer is decoding once its first chunk is out
                    if line.startswith("data:"):
                        break
                quotas = [e.quota_s for e in app.state.gateway.orchestrator.learning.exposures[node].values()]
                assert len(quotas) == 1 and quotas[0] < 0.15, quotas

                async def y_turn() -> None:
                    got = await chat(client, url, request_body(histories["y"], stream=False, max_tokens=10),
                                     {"x-session-id": "y"})
                    assert got.get("content") or got.get("tool_calls")
                    done["y"] = anyio.current_time()

                async with anyio.create_task_group() as tg:
                    tg.start_soon(y_turn)
                    await anyio.sleep(1.0)
                    done["x left"] = anyio.current_time()
                    await resp.aclose()  # x's client walks away: its answer ends, and its quota with it
            cleared, forced = [await metric(client, url, "kvtether_deferred_turns_total", outcome=o)
                               for o in ("cleared", "forced")]
            waited = await metric(client, url, "kvtether_deferred_seconds_total")
    plans = [s for s in exporter.get_finished_spans() if s.name == "kvtether.plan"]
    waits = [s for s in plans if (s.attributes or {}).get("kvtether.plan.defers")]
    ran = [s for s in plans if (s.attributes or {}).get("kvtether.plan.deferred_s") and s not in waits]
    # A wait is no error: its spans end unset; the placement that ran carries the whole wait.
    assert all(s.status.status_code is StatusCode.UNSET for s in plans)
    if outcome is None:
        assert not waits and not ran
    else:
        assert waits and len(ran) == 1
        assert (ran[0].attributes or {})["kvtether.plan.deferred_s"] == pytest.approx(waited, abs=0.05)
    if outcome == "cleared":
        # Placed within the limits once x's answer was gone, not before.
        assert (cleared, forced) == (1, 0) and done["y"] > done["x left"] and waited >= 0.9
    elif outcome == "forced":
        assert (cleared, forced) == (0, 1) and done["y"] < done["x left"] and 0.3 <= waited < 0.9
    else:
        assert (cleared, forced, waited) == (0, 0, 0) and done["y"] < done["x left"]


def test_the_gateway_stops_waiting_once_its_waits_seldom_clear_and_counts_the_turns_it_ran_at_once() -> None:
    """The shell keeps the record of how its waits ended (policy/deferral.py): with the rule on
    (``defer_min_clear_rate``), after a run of waits that each ran out forced, a turn that could wait runs at once
    (counted `skipped`), but for one in ``defer_probe_every``; a wait that clears again restores waiting."""
    from kvtether.gateway.policy import NodeLoad, PolicyKnobs, choose
    from kvtether.gateway.policy.placement import HandleAction, Plan

    from tests.support.policy_facts import D0, MOE, P0, history_turn

    cfg = load_config(None, nodes=["http://a:1"], policy="auto", tuning={"defer_min_clear_rate": 0.3})
    placer = create_app(cfg).state.gateway.orchestrator.placer
    short = history_turn(8000, 100, expected_output_tokens=6, running_prefills=((D0, 0.5, 0.5, 0.3, 0),))
    forced = choose(short, D0, (NodeLoad(P0),), (NodeLoad(D0, running=2.0),), MOE,
                    PolicyKnobs(tpot_budget_s=0.025))
    assert forced.forced
    plan = Plan(None, D0, HandleAction.DECODE_LOCAL, 0, forced.reason, decision=forced)
    skipped = placer.sv.metrics.deferred_turns.labels("skipped")
    waits = []
    for _ in range(16):
        waits.append(placer._wait_s(plan, 0.0) > 0.0)
        if waits[-1]:
            placer._deferred(plan, 0.2)  # the wait ran out: placed forced
    assert waits == [True] * 12 + [False, False, False, True]
    assert skipped._value.get() == 3
    cleared = Plan(None, D0, HandleAction.DECODE_LOCAL, 0, "", decision=None)
    placer._deferred(cleared, 0.05)  # the probe's wait cleared
    assert placer._wait_s(plan, 0.0) > 0.0
    assert placer._wait_s(plan, 0.1) > 0.0  # a turn already waiting waits its time out, whatever the record
