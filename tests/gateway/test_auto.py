"""The cost-based "auto" policy through the gateway on the simulator: decode-local, pull, cold.

Short suffixes run on the pinned decode node (no prefill request, D's prefix cache serves the history, no
handle comes back); a suffix over ``max_local_suffix_tokens`` goes through P with a pull; every answer still
equals the aggregated oracle's.
"""

from __future__ import annotations

import time
from typing import Any

import anyio
import httpx
import pytest
from kvtether.cli.simstack import sim_stack
from kvtether.gateway.turn import orchestrator as orchestrator_room
from kvtether.gateway.turn import remember as remember_room

from tests.support.gateway_agent import (
    chat,
    comparable,
    first_messages,
    next_messages,
    request_body,
    short_sessions,
    tool_result,
    turn_until,
)
from tests.support.sim_rig import LIMITS, RIG_SIM, Rig, metric, p2p_tokens, rig, stack_spec
from tests.support.upstream_hooks import on_send

pytestmark = pytest.mark.anyio


async def _oracle_turn(r: Rig, messages: list[dict[str, Any]], t: int,
                       headers: dict[str, str]) -> list[dict[str, Any]]:
    """One turn through the gateway (streamed every other turn), checked against the aggregated oracle; the
    next turn's messages."""
    got = await chat(r.client, r.url, request_body(messages, stream=t % 2 == 0), headers)
    want = await chat(r.client, r.oracle, request_body(messages, stream=False), clean=False)
    assert comparable(got) == comparable(want), f"turn {t} differs from the oracle"
    return next_messages(messages, got, 90, t, result_words=60)


async def _node_total(client: httpx.AsyncClient, urls: list[str], name: str, **labels: str) -> float:
    return sum([await metric(client, u, name, **labels) for u in urls])


async def test_auto_runs_short_suffixes_on_decode_and_long_ones_through_a_pull() -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    # P without prefix caching (as in vLLM's reverse-pull runs): otherwise P's own cache holds the first
    # prompt and a long turn may go cold there instead of pulling (the test below covers that).
    spec = stack_spec(prefill_prefix_caching=False, **RIG_SIM)
    gateway = {"metrics_poll_interval_s": 0.5, "max_local_suffix_tokens": 256, "min_reuse_tokens": 4,
               # Decisions from the seeds only: learned timings would make them depend on the CPU.
               "learn_estimates": False,
               # Local turns unmarked (as on a D that keeps none, or a vLLM 0.32 stream): they return
               # no handle, and the look-ahead counts on the one they did not use.
               "local_turn_handles": False}
    async with sim_stack(spec, "auto", gateway=gateway, calibrated=False, oracle=True,
                         tracer_provider=provider) as stack:
        cluster, url, oracle = stack.cluster, stack.url, stack.oracle
        assert cluster is not None
        async with httpx.AsyncClient(timeout=60, limits=LIMITS) as client:
            p, d = cluster.prefill_urls, cluster.decode_urls
            h = {"x-session-id": "auto-1"}
            messages = first_messages(50)
            # (suffix words of the next turn's tool result, what the turn after it must do)
            # After the long suffix the session's mean suffix is over the local limit, yet the next short turn
            # still runs locally: the handle the pull left stays held on D (a local turn returns none, the
            # gateway keeps the unused one), so the long turn after it pulls that handle's prefix, not cold.
            plan = [(10, "first"), (10, "decode_local"), (10, "decode_local"), (600, "decode_local"),
                    (10, "pull"), (600, "decode_local"), (10, "pull")]
            for turn, (words, expect) in enumerate(plan):
                p_before = await _node_total(client, p, "vllm:request_success_total")
                hits_before = await _node_total(client, d, "vllm:prefix_cache_hits_total")
                local_before = await metric(client, url, "kvtether_ttft_seconds_count", reuse_source="decode_local")
                attached_before = await metric(client, url, "kvtether_handle_outcomes_total", outcome="attached")
                p2p_before = await _node_total(client, p, "vllm:prompt_tokens_cached_by_source_total", source="p2p")
                # Every answer a tool call, so each turn's suffix is the tool result the plan says (a content
                # answer would get a short user follow-up instead).
                body = {**request_body(messages, stream=turn % 2 == 1), "tool_choice": "required"}
                got = await chat(client, url, body, h)
                want = await chat(client, oracle, {**body, "stream": False}, clean=False)
                assert comparable(got) == comparable(want), f"turn {turn} differs from the oracle"
                p_after = await _node_total(client, p, "vllm:request_success_total")
                local_after = await metric(client, url, "kvtether_ttft_seconds_count", reuse_source="decode_local")
                if expect == "decode_local":
                    # No prefill request at all; D served the history from its prefix cache.
                    assert p_after == p_before, f"turn {turn}: a prefill request was made"
                    assert await _node_total(client, d, "vllm:prefix_cache_hits_total") > hits_before + 100
                    assert local_after == local_before + 1
                elif expect == "pull":
                    assert p_after == p_before + 1 and local_after == local_before
                    assert await metric(client, url, "kvtether_handle_outcomes_total",
                                        outcome="attached") == attached_before + 1
                    assert await _node_total(client, p, "vllm:prompt_tokens_cached_by_source_total",
                                             source="p2p") > p2p_before
                messages = next_messages(messages, got, 50, turn, result_words=words)
            # Only the P/D turns left a handle; after a decode-local turn the store keeps the unused one.
            sessions = (await client.get(f"{url}/admin/sessions")).json()
            assert sessions[0]["turns"] == len(plan)
    plans = [s for s in exporter.get_finished_spans() if s.name == "kvtether.plan"]
    options = [dict(s.attributes or {}).get("kvtether.plan.cost.option") for s in plans]
    # The first turn has nothing to weigh (no pin, no tokens): cold without a cost decision.
    assert options == [None, "decode_local", "decode_local", "decode_local", "pull", "decode_local", "pull"]
    local = dict(plans[1].attributes or {})
    assert str(local["kvtether.plan.reason"]).startswith("auto -> decode_local")
    assert local["kvtether.plan.cost.ttft_est_s.decode_local"] < local["kvtether.plan.cost.ttft_est_s.pull"]
    long_turn = dict(plans[4].attributes or {})
    assert "max_local_suffix_tokens" in str(long_turn["kvtether.plan.cost.rejected.decode_local"])
    # The look-ahead of the local turn counted on that held handle (a pull next turn, not a cold recompute).
    after_long = dict(plans[5].attributes or {})
    assert str(after_long["kvtether.plan.reason"]).startswith("auto -> decode_local"), after_long
    assert "horizon" not in str(after_long["kvtether.plan.reason"])
    assert "max_local_suffix_tokens" in str(dict(plans[6].attributes or {})["kvtether.plan.cost.rejected.decode_local"])


async def test_a_failed_decode_local_leg_is_retried_cold() -> None:
    """A decode-local leg that fails (5xx from the pinned D) is retried as a cold P/D turn; answers stay right.
    The failed (non-streamed) leg leaves nothing behind: no open request, no TPOT quota entry."""
    gateway = {"metrics_poll_interval_s": 0.5, "min_reuse_tokens": 4, "learn_estimates": False,
               "request_stall_share": 0.5}
    async with sim_stack(stack_spec(decode=2, **RIG_SIM), "auto", gateway=gateway, calibrated=False,
                         oracle=True) as stack:
        cluster, url, app, oracle = stack.cluster, stack.url, stack.app, stack.oracle
        assert cluster is not None
        async with httpx.AsyncClient(timeout=60, limits=LIMITS) as client:
            h = {"x-session-id": "auto-2"}
            messages = first_messages(51)
            for turn in range(4):
                local_before = await metric(client, url, "kvtether_ttft_seconds_count", reuse_source="decode_local")
                p_before = await _node_total(client, cluster.prefill_urls, "vllm:request_success_total")
                if turn == 2:
                    # The pinned decode node fails the next request: this turn's decode-local leg.
                    pinned = (await client.get(f"{url}/admin/sessions")).json()[0]["decode"]
                    await client.post(f"{pinned}/admin/fault", json={"fail_next": 1})
                got = await chat(client, url, request_body(messages, stream=turn % 2 == 1), h)
                want = await chat(client, oracle, request_body(messages, stream=False),
                                  clean=False)
                assert comparable(got) == comparable(want), f"turn {turn} differs from the oracle"
                local_after = await metric(client, url, "kvtether_ttft_seconds_count", reuse_source="decode_local")
                p_after = await _node_total(client, cluster.prefill_urls, "vllm:request_success_total")
                if turn == 1:
                    assert local_after == local_before + 1 and p_after == p_before
                if turn == 2:
                    # Retried cold: one prefill request, no decode-local answer.
                    assert local_after == local_before and p_after == p_before + 1
                messages = next_messages(messages, got, 51, turn, result_words=10)
            assert await metric(client, url, "kvtether_upstream_errors_total", phase="decode") == 1
            sessions = (await client.get(f"{url}/admin/sessions")).json()
            assert sessions[0]["turns"] == 4
            nodes = app.state.gateway.orchestrator.sv.cluster.nodes.values()
            assert all(n.inflight == 0 for n in nodes), "a failed leg left a request open"
            assert app.state.gateway.orchestrator.learning.exposures == {}, "a failed leg left a TPOT quota entry"


async def test_a_turn_whose_decode_legs_all_fail_leaves_no_tpot_quota_behind() -> None:
    """The pinned D fails the decode-local leg and the cold retry's decode leg (non-streamed): the client gets
    a clean 5xx, and neither leg stays counted as a request decoding there."""
    async with rig(**_AUTO, request_stall_share=0.5) as r:
        h = {"x-session-id": "failing"}
        messages = first_messages(58)
        got = await chat(r.client, r.url, request_body(messages, stream=False), h)
        messages = next_messages(messages, got, 58, 0, result_words=10)
        d = r.cluster.decode_urls[0]
        await r.client.post(f"{d}/admin/fault", json={"fail_next": 2})
        resp = await r.client.post(f"{r.url}/v1/chat/completions", json=request_body(messages, stream=False),
                                   headers=h)
        assert resp.status_code >= 500 and "error" in resp.json()
        orch = r.gw.orchestrator
        assert await metric(r.client, r.url, "kvtether_upstream_errors_total", phase="decode") == 2
        assert orch.learning.exposures == {}
        assert all(n.inflight == 0 for n in orch.sv.cluster.nodes.values())


# What bounds local prefills' cost to D's running batch: per-request TPOT quotas (the long answer's:
# 0.09 × 2999 tokens × ~1.1 ms per step ≈ 0.3 s, room for one ~0.2 s stall, not two).
_BUDGETS = {
    "request quota": ({"request_stall_share": 0.09}, "TPOT quota"),
}


@pytest.mark.parametrize("budget", sorted(_BUDGETS))
async def test_decode_local_turns_spend_the_decode_nodes_stall_budget(budget: str) -> None:
    """While a long answer decodes on D, a first short follow-up runs locally and spends D's stall budget (a
    node's share, or the long answer's own TPOT quota); a second one right after it would stall that answer
    beyond the budget and goes through P. Nothing is left in the quotas once the requests are done."""
    knobs, refusal = _BUDGETS[budget]
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    # Speed 1: the long answer (3000 tokens) keeps decoding for a few real seconds.
    gateway = {"metrics_poll_interval_s": 0.5, "min_reuse_tokens": 4, "learn_estimates": False,
               # A local prefill is estimated at ~0.2 s, nearly all of it a stall of the running
               # answer; only the budget's price weighs it (interference weight 0).
               "seed_prefill_overhead_s": 0.2, "seed_tpot_base_s": 0.001, "seed_tpot_s_per_seq": 1e-4,
               "seed_transfer_latency_s": 0.1,  # a pull is clearly dearer than a local turn
               "tuning": {"interference_weight": 0.0}, **knobs}
    async with sim_stack(stack_spec(speed=1.0, **RIG_SIM), "auto", gateway=gateway, calibrated=False,
                         tracer_provider=provider) as stack:
        cluster, url, app = stack.cluster, stack.url, stack.app
        assert cluster is not None
        async with httpx.AsyncClient(timeout=60, limits=LIMITS) as client:
            histories = {}
            for s in ("a", "b"):
                first = first_messages(60 if s == "a" else 61)
                got = await chat(client, url, request_body(first, stream=False), {"x-session-id": s})
                histories[s] = next_messages(first, got, 60, 0, result_words=10)
            long_body = {**request_body(first_messages(62), stream=True, max_tokens=3000),
                         "min_tokens": 3000, "ignore_eos": True}
            async with client.stream("POST", f"{url}/v1/chat/completions", json=long_body,
                                     headers={"x-session-id": "long"}) as resp:
                assert resp.status_code == 200
                lines = resp.aiter_lines()
                async for line in lines:  # the long answer is decoding once its first chunk is out
                    if line.startswith("data:"):
                        break
                exporter.clear()
                sources = []
                for s in ("a", "b"):
                    before = await metric(client, url, "kvtether_ttft_seconds_count", reuse_source="decode_local")
                    await chat(client, url, request_body(histories[s], stream=False), {"x-session-id": s})
                    after = await metric(client, url, "kvtether_ttft_seconds_count", reuse_source="decode_local")
                    sources.append("decode_local" if after > before else "through P")
                plans = [dict(p.attributes or {}) for p in exporter.get_finished_spans() if p.name == "kvtether.plan"]
                stalled = await metric(client, url, "kvtether_decode_stall_seconds_total", node=cluster.decode_urls[0])
                exposures = app.state.gateway.orchestrator.learning.exposures
                quotas = [e.quota_s for e in exposures.get(cluster.decode_urls[0], {}).values()]
                await resp.aclose()  # the client walks away from the long answer
            for _ in range(100):  # the gateway notices the client left on its next chunk
                if not exposures:
                    break
                await anyio.sleep(0.02)
            leftover = {node: dict(e) for node, e in exposures.items()}
    reasons = [p["kvtether.plan.reason"] for p in plans]
    assert len(plans) == 2 and plans[0]["kvtether.plan.cost.option"] == "decode_local", reasons
    assert plans[1]["kvtether.plan.cost.option"] in ("pull", "cold"), reasons
    assert sources == ["decode_local", "through P"]
    assert "D 1 running" in str(plans[0]["kvtether.plan.reason"])
    assert refusal in str(plans[1]["kvtether.plan.cost.rejected.decode_local"])
    assert 0.15 < stalled < 0.3  # the one local turn's estimated stall (~0.2 s), counted per decode node
    if budget == "request quota":
        assert len(quotas) == 1 and 0.25 < quotas[0] < 0.35, quotas  # the long answer's alone, while it decodes
    assert leftover == {}


async def test_a_local_prefill_must_fit_a_request_still_prefilling_on_d() -> None:
    """A request is charged from the moment it is placed on D, not from its first token: a local prefill
    admitted while another turn is still prefilling there runs on into that turn's first decode steps. Here
    session x's local turn hangs on D before its first token; session y's follow-up would stall x's short
    answer far beyond its TPOT objective, so it goes through P. Nothing is left once x's leg has ended."""
    objective = 0.01  # x's answers are ~10 tokens at ~1 ms a step: its quota is a few ms of stall
    async with rig(**_AUTO, request_stall_share=0.5, tpot_budget_s=objective, seed_prefill_overhead_s=0.2,
                   seed_tpot_base_s=0.001, seed_tpot_s_per_seq=1e-4, seed_transfer_latency_s=0.1,
                   tuning={"interference_weight": 0.0}, read_timeout_s=3.0) as r:
        histories = await short_sessions(r.client, r.url, {"x": 63, "y": 64})
        orch = r.gw.orchestrator
        d = r.cluster.decode_urls[0]
        await r.client.post(f"{d}/admin/fault", json={"hang_next": 1})
        async with anyio.create_task_group() as tg:
            tg.start_soon(turn_until, r.client, r.url, "x", histories["x"])
            for _ in range(200):  # x is placed (locally, D idle) and hangs there before its first token
                if orch.learning.exposures.get(d):
                    break
                await anyio.sleep(0.02)
            assert len(orch.learning.exposures.get(d, {})) == 1, "x's turn was not charged from its placement"
            quota = next(iter(orch.learning.exposures[d].values())).quota_s
            assert 0.0 < quota < 0.01, quota
            before = await metric(r.client, r.url, "kvtether_ttft_seconds_count", reuse_source="decode_local")
            await chat(r.client, r.url, request_body(histories["y"], stream=False, max_tokens=10),
                       {"x-session-id": "y"})
            after = await metric(r.client, r.url, "kvtether_ttft_seconds_count", reuse_source="decode_local")
            assert after == before, "y's local prefill was admitted over x's TPOT quota"
            tg.cancel_scope.cancel()  # x's client gives up
        for _ in range(500):  # the gateway gives up on D at its read timeout and retries x through P
            if not orch.learning.exposures:
                break
            await anyio.sleep(0.02)
        assert orch.learning.exposures == {}


async def test_a_local_prefill_is_learned_from_ds_first_token_not_from_the_first_tool_call_delta(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM sends a stream's role chunk with the first engine output; the first tool-call delta follows once
    the parser has the function name, several decode steps later. The local-prefill sample the estimator
    learns must end at the first chunk: the hold-back is decode time, and counting it as prefill made the
    policy (and its stall budget) overcharge every local turn."""
    async with rig(policy="auto", min_reuse_tokens=4, max_local_suffix_tokens=256) as r:
        orch = r.gw.orchestrator
        pending: list[tuple[float, float]] = []  # (from the first chunk, from the first delta) of the leg
        samples: list[tuple[float, float, float]] = []
        make_sample, decode_done = remember_room._decode_sample, orch.learning.decode_done
        observe_prefill = orch.learning.estimator.observe_prefill

        def spy_sample(ctx: Any, leg: Any, result: Any) -> Any:
            if leg.plan.action.value == "decode_local" and leg.sent_at is not None:
                assert result.first_chunk is not None and result.ttft is not None
                pending[:] = [(ctx.t0 + result.first_chunk - leg.sent_at, ctx.t0 + result.ttft - leg.sent_at)]
            return make_sample(ctx, leg, result)

        def spy_learn(sample: Any, now: float) -> None:
            decode_done(sample, now)
            pending.clear()

        def spy_observe(node: str, tokens: int, context: int, seconds: float, *, now: float) -> None:
            if pending:
                samples.append((*pending[0], seconds))
            observe_prefill(node, tokens, context, seconds, now=now)

        monkeypatch.setattr(remember_room, "_decode_sample", spy_sample)
        orch.learning.decode_done, orch.learning.estimator.observe_prefill = spy_learn, spy_observe  # type: ignore[method-assign]
        h = {"x-session-id": "learn-1"}
        messages = first_messages(70)
        for turn in range(4):
            body = {**request_body(messages, stream=True), "tool_choice": "required"}
            got = await chat(r.client, r.url, body, h)
            assert got.get("tool_calls"), got
            messages = next_messages(messages, got, 70, turn, result_words=10)
    assert samples, "no decode-local turn was learned from"
    for from_first_chunk, from_first_delta, seconds in samples:
        assert seconds == pytest.approx(from_first_chunk)
        # The tool-call parser holds the first delta back, but the in-process simulator streams a decode-local
        # answer in one burst, and the relay stamps the chunks of one network read with one time: equal here.
        assert from_first_chunk <= from_first_delta


@pytest.mark.wall_clock  # reads the engine's steps on the OS clock
async def test_a_local_prefill_on_a_busy_decode_node_is_learned_from_its_mixed_step() -> None:
    """While another answer decodes on D, a local turn's cost is the engine step that prefilled its suffix
    (what the running answer waited for its next token), read off that answer's chunk arrivals: not the
    turn's own time to first token, which also holds D's request handling and the step in flight when it
    arrived (what the running answer does not lose).

    The simulator paces its steps in real time on a machine other tests share: a step overslept under load
    is caught up on by shortening the next ones, so the mixed step's real length moves with the load. The
    learned value is therefore checked against that step as D's engine ran it (its step ends, on the clock
    the gateway's relay stamps chunks with), not against the cost model. The reading itself, with explicit
    arrival times (a late first chunk, plain steps before the mixed one), is in policy/test_steps.py."""
    speed = 0.5  # GLM-5's steps: a plain decode step ~14 ms, the mixed step ~150 ms (real)
    spec = stack_spec(preset="glm-5-fp8-h200-tp8", speed=speed, **RIG_SIM)
    # No poll after the first: D's load is then the gateway's own count of its open requests (the long
    # answer), not a gauge that may have caught that answer still waiting for its KV (nothing is learned
    # from a turn queued behind others).
    gateway = {"metrics_poll_interval_s": 600.0, "min_reuse_tokens": 4, "max_local_suffix_tokens": 256,
               "tuning": {"interference_weight": 0.0}, "seed_tpot_base_s": 0.01,
               "seed_transfer_latency_s": 1.0}  # a pull is clearly dearer: the follow-up runs on D
    async with sim_stack(spec, "auto", gateway=gateway, calibrated=False) as stack:
        cluster, url, app = stack.cluster, stack.url, stack.app
        assert cluster is not None
        engine = cluster.node(cluster.decode_urls[0]).engine
        steps: list[tuple[float, list[tuple[int, int]], int]] = []  # D's step ends: when, prefill chunks, decodes
        async with httpx.AsyncClient(timeout=60, limits=LIMITS) as client:
            orch = app.state.gateway.orchestrator
            samples: list[tuple[int, int, float, float]] = []  # tokens, context, learned seconds, own TTFT
            ttft: list[float] = []
            local: list[Any] = []  # the local turn's DecodeSample (its chunk arrivals, for a failure's message)
            decode_done, observe_prefill = orch.learning.decode_done, orch.learning.estimator.observe_prefill

            def spy_learn(sample: Any, now: float) -> None:
                if sample.local and sample.first_chunk_at is not None:
                    ttft[:] = [sample.first_chunk_at - sample.sent_at]
                    local.append(sample)
                decode_done(sample, now)
                ttft.clear()

            def spy_observe(node: str, tokens: int, context: int, seconds: float, *, now: float) -> None:
                if ttft:
                    samples.append((tokens, context, seconds, ttft[0]))
                observe_prefill(node, tokens, context, seconds, now=now)

            def step_ended(step: Any) -> None:
                steps.append((time.perf_counter(), list(step.prefill_chunks), len(step.decode_contexts)))

            orch.learning.decode_done, orch.learning.estimator.observe_prefill = spy_learn, spy_observe  # type: ignore[method-assign]
            h = {"x-session-id": "a"}
            first = first_messages(80)
            got = await chat(client, url, request_body(first, stream=True), h)
            follow_up = next_messages(first, got, 80, 0, result_words=20)
            long_body = {**request_body(first_messages(81), stream=True, max_tokens=2000),
                         "min_tokens": 2000, "ignore_eos": True}
            async with client.stream("POST", f"{url}/v1/chat/completions", json=long_body,
                                     headers={"x-session-id": "long"}) as resp:
                assert resp.status_code == 200
                lines = resp.aiter_lines()  # kept: a dropped iterator would close the stream
                async for line in lines:  # the long answer is decoding once its first chunk is out
                    if line.startswith("data:"):
                        break
                before = await metric(client, url, "kvtether_ttft_seconds_count", reuse_source="decode_local")
                engine.on_step = step_ended
                await chat(client, url, request_body(follow_up, stream=True), h)
                engine.on_step = None
                after = await metric(client, url, "kvtether_ttft_seconds_count", reuse_source="decode_local")
                await resp.aclose()
    assert after == before + 1, "the follow-up did not run on D"
    assert len(samples) == 1, samples
    tokens, context, seconds, own_ttft = samples[0]
    # The one step that prefilled while the long answer decoded: it computed the end of the follow-up's prompt.
    mixed = [i for i, (_, chunks, decodes) in enumerate(steps) if chunks and decodes]
    assert len(mixed) == 1 and mixed[0] > 0, steps
    (ended, chunks, _), (began, _, _) = steps[mixed[0]], steps[mixed[0] - 1]
    assert [n + computed for n, computed in chunks] == [tokens + context]
    assert seconds < own_ttft  # not the turn's own time to first token
    # What the long answer waited for its next token, up to the relay's delays in reading its chunks.
    sent = local[0].sent_at
    timeline = {"arrivals": [round(a - sent, 4) for a in local[0].arrivals_before_first],
                "first chunk": round(own_ttft, 4), "step ends": [round(t - sent, 4) for t, _, _ in steps]}
    assert seconds == pytest.approx(ended - began, rel=0.25), (seconds, ended - began, timeline)


async def test_a_pull_turn_moves_the_pin_to_a_lighter_decode_node() -> None:
    """Rebalancing: the pinned D looks busy, the other idle, the suffix is too long to run locally. P pulls
    the history from the pinned D, the answer decodes on the idle one, and the session's pin (and its next
    handle) moves there; the answers still equal the aggregated oracle's. (P without prefix caching: with
    it, P's cache holds the first prompt and the turn may go cold there, which moves the pin all the same.)"""
    async with rig(policy="auto", decode=2, min_reuse_tokens=4, max_local_suffix_tokens=16,
                   learn_estimates=False, metrics_poll_interval_s=600.0, sim={"prefill_prefix_caching": False}) as r:
        orch = r.gw.orchestrator
        h = {"x-session-id": "move-1"}

        async def pin() -> str:
            sessions = (await r.client.get(f"{r.url}/admin/sessions")).json()
            return str(next(s["decode"] for s in sessions if s["session_id"] == "move-1"))

        messages = await _oracle_turn(r, first_messages(90), 0, h)
        home = await pin()
        other = next(u for u in r.cluster.decode_urls if u != home)
        orch.sv.cluster.nodes[home].running = 12.0  # polled gauge (the next poll is minutes away)
        attached = await metric(r.client, r.url, "kvtether_handle_outcomes_total", outcome="attached")
        messages = await _oracle_turn(r, messages, 1, h)
        assert await pin() == other, "the pin did not move to the idle decode node"
        # P was sent the old D's handle (and read it: the answer matches the oracle's, and the handle is gone).
        assert await metric(r.client, r.url, "kvtether_handle_outcomes_total", outcome="attached") == attached + 1
        assert len(r.cluster.node(home).engine.holds) == 0, "the old decode node still holds the history"
        orch.sv.cluster.nodes[home].running = 0.0
        # Both idle now: stays, pulling the handle the moved turn left on its new D.
        await _oracle_turn(r, messages, 2, h)
        assert await pin() == other
        assert await metric(r.client, r.url, "kvtether_handle_outcomes_total", outcome="attached") == attached + 2


async def test_a_turn_in_the_ttft_tail_stays_on_its_pinned_decode_node() -> None:
    """The tail-aware objective through the gateway: the same situation as the move above, but the recent
    turns' estimates (the tracker the gateway feeds with every auto decision) put this turn in the tail, so
    the slower first token of a move outweighs the balance and the pin stays. (The rig's prompts are short,
    so a move costs ~1 ms of transfer: the weight is large for that; without the term the pin moves.)"""
    async with rig(policy="auto", decode=2, min_reuse_tokens=4, max_local_suffix_tokens=16,
                   learn_estimates=False, metrics_poll_interval_s=600.0, tuning={"tail_weight": 1000.0}) as r:
        orch = r.gw.orchestrator
        h = {"x-session-id": "tail-1"}
        messages = await _oracle_turn(r, first_messages(90), 0, h)
        seen = len(orch.learning.tail)
        sessions = (await r.client.get(f"{r.url}/admin/sessions")).json()
        home = str(next(s["decode"] for s in sessions if s["session_id"] == "tail-1"))
        orch.sv.cluster.nodes[home].running = 12.0
        for _ in range(orch.learning.tail.min_samples):
            orch.learning.tail.observe(0.0)  # every recent turn was instant: any estimate is above the threshold
        await _oracle_turn(r, messages, 1, h)
        sessions = (await r.client.get(f"{r.url}/admin/sessions")).json()
        # (Pull or cold: P's prefix cache holds the first prompt, so the two differ by a read of a few tokens.)
        assert next(s["decode"] for s in sessions if s["session_id"] == "tail-1") == home
        assert len(orch.learning.tail) == seen + orch.learning.tail.min_samples + 1  # the auto decision was recorded


async def test_a_pin_moved_back_reads_only_what_its_old_decode_node_lacks() -> None:
    """Rebalancing back and forth: the D a session's pin left keeps the history in its prefix cache. The
    gateway remembers how much (verified against the session's history), and when a later turn moves the pin
    back there, that D hits its prefix cache and reads only the rest of the prompt from P."""
    async with rig(policy="auto", decode=2, min_reuse_tokens=4, max_local_suffix_tokens=16,
                   learn_estimates=False, metrics_poll_interval_s=600.0) as r:
        orch = r.gw.orchestrator
        h = {"x-session-id": "back-1"}

        async def by_source(url: str, source: str) -> float:
            return await metric(r.client, url, "vllm:prompt_tokens_by_source_total", source=source)

        messages = await _oracle_turn(r, first_messages(90), 0, h)
        state = await orch.sv.store.get("back-1")
        assert state is not None and state.decode is not None and state.elsewhere == ()
        home = state.decode
        other = next(u for u in r.cluster.decode_urls if u != home)
        orch.sv.cluster.nodes[home].running = 12.0  # polled gauges (the next poll is minutes away)
        messages = await _oracle_turn(r, messages, 1, h)
        state = await orch.sv.store.get("back-1")
        assert state is not None and state.decode == other, "the pin did not move off the busy decode node"
        (left, kept), = state.elsewhere
        assert left == home and kept > 100, state.elsewhere
        orch.sv.cluster.nodes[home].running = 0.0
        orch.sv.cluster.nodes[other].running = 12.0
        block = orch.sv.cluster.block_size(home)
        hit, read = await by_source(home, "local_cache_hit"), await by_source(home, "external_kv_transfer")
        plans: list[Any] = []
        planner = orch.plan
        orch.plan = lambda *a, **kw: (placed := planner(*a, **kw), plans.append(placed.plan))[0]  # type: ignore[method-assign]
        await _oracle_turn(r, messages, 2, h)
        state = await orch.sv.store.get("back-1")
        assert state is not None and state.decode == home, "the pin did not move back"
        assert f"D still holds {kept // block * block} tok of the history" in plans[-1].reason, plans[-1].reason
        assert state.elsewhere and state.elsewhere[-1][0] == other, "the D the pin left again is not remembered"
        hit_now, read_now = await by_source(home, "local_cache_hit"), await by_source(home, "external_kv_transfer")
        assert hit_now - hit >= kept // block * block, "the old D did not hit its prefix cache"
        assert 0 < read_now - read < kept, "the old D read the whole prompt again"


async def test_a_turn_counts_as_arriving_on_its_decode_node_only_during_its_prefill_leg(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """While a P/D turn's prefill leg runs, its decode node counts it as arriving (load already on its way,
    which rebalancing counts); after the leg, whether it succeeded or failed, it does not."""
    async with rig(policy="auto", prefill=1, decode=1, min_reuse_tokens=4, learn_estimates=False) as r:
        orch = r.gw.orchestrator
        d = orch.sv.cluster.nodes[r.cluster.decode_urls[0]]
        seen: list[int] = []
        prefill = orchestrator_room.prefill_with_recovery

        async def spy(*args: Any, **kw: Any) -> Any:
            seen.append(d.arriving)
            return await prefill(*args, **kw)

        monkeypatch.setattr(orchestrator_room, "prefill_with_recovery", spy)
        await chat(r.client, r.url, request_body(first_messages(40), stream=True), {"x-session-id": "arr-1"})
        assert seen == [1] and d.arriving == 0 and d.inflight == 0
        await r.client.post(f"{r.cluster.prefill_urls[0]}/admin/fault", json={"fail_next": 1})
        resp = await r.client.post(f"{r.url}/v1/chat/completions", json=request_body(first_messages(41), stream=False),
                                   headers={"x-session-id": "arr-2"})
        assert resp.status_code >= 500 and seen == [1, 1]
        assert d.arriving == 0 and d.inflight == 0, "a failed prefill leg left its turn counted on D"


async def test_clients_that_leave_mid_answer_free_their_decode_slots() -> None:
    """The gateway's own count of open requests per node (fresher than the polled gauges, what placement
    reads as D's load) drops back to zero when clients walk away: a non-streamed one cancelled while D
    decodes, a stream closed after its first content delta."""
    import json

    import anyio
    from kvtether.gateway.turn.body import has_first_token

    gateway = {"metrics_poll_interval_s": 0.5, "min_reuse_tokens": 4, "learn_estimates": False}
    async with sim_stack(stack_spec(speed=1.0, **RIG_SIM), "auto", gateway=gateway, calibrated=False) as stack:
        cluster, url, app = stack.cluster, stack.url, stack.app
        assert cluster is not None
        async with httpx.AsyncClient(timeout=60, limits=LIMITS) as client:
            d = app.state.gateway.orchestrator.sv.cluster.nodes[cluster.decode_urls[0]]
            long = {"min_tokens": 3000, "ignore_eos": True, "max_tokens": 3000}

            async def non_streamed() -> None:
                await client.post(f"{url}/v1/chat/completions", json={**request_body(first_messages(63),
                                  stream=False), **long}, headers={"x-session-id": "quiet"})

            async with anyio.create_task_group() as tg:
                tg.start_soon(non_streamed)
                with anyio.fail_after(30):
                    while d.inflight < 1:  # noqa: ASYNC110 - polling the gateway's own counter, no event to wait on
                        await anyio.sleep(0.01)
                body = {**request_body(first_messages(64), stream=True), **long}
                async with client.stream("POST", f"{url}/v1/chat/completions", json=body,
                                         headers={"x-session-id": "loud"}) as resp:
                    lines = resp.aiter_lines()  # kept: a dropped iterator would close the stream
                    async for line in lines:
                        payload = line[5:].strip() if line.startswith("data:") else ""
                        if payload and payload != "[DONE]" and has_first_token(json.loads(payload)):
                            break  # the stream's first content or tool-call delta reached the client
                    assert d.inflight == 2
                tg.cancel_scope.cancel()  # both clients walk away
            with anyio.fail_after(10):
                while d.inflight:  # noqa: ASYNC110 - as above
                    await anyio.sleep(0.01)


@pytest.mark.parametrize("p_caching", [True, False])
async def test_a_pd_turn_goes_back_to_the_prefill_node_whose_cache_holds_the_history(p_caching: bool) -> None:
    """P prefix caching on: the P that prefilled the session's first turn keeps its prompt's blocks, the
    gateway learns that P caches (cache_config_info) and remembers the copy, and the next P/D turn goes there
    (the other P is as idle and comes first in the configuration, which wins a tie), hits P's cache and reads from
    D only what it lacks. Prefix caching off on P: nothing is remembered and the tie goes to the first."""
    async with rig(policy="auto", prefill=2, min_reuse_tokens=4, max_local_suffix_tokens=16, learn_estimates=False,
                   metrics_poll_interval_s=600.0, sim={"prefill_prefix_caching": p_caching}) as r:
        orch = r.gw.orchestrator
        lo, hi = r.cluster.prefill_urls  # the configuration's order, whatever ports the OS gave them
        for u in (lo, hi):
            await orch.sv.cluster.refresh(orch.sv.cluster.nodes[u])  # a poll tells whether P caches, and its size
        assert orch.sv.cluster.nodes[hi].prefix_caching is p_caching
        assert (orch.sv.cluster.nodes[hi].kv_capacity_tokens or 0) > 10_000
        h = {"x-session-id": "pcache-1"}
        orch.sv.cluster.nodes[lo].running = 12.0  # the first turn's cold prefill goes to `hi`
        messages = await _oracle_turn(r, first_messages(90), 0, h)
        state = await orch.sv.store.get("pcache-1")
        assert state is not None
        orch.sv.cluster.nodes[lo].running = 0.0
        plans: list[Any] = []
        planner = orch.plan
        orch.plan = lambda *a, **kw: (placed := planner(*a, **kw), plans.append(placed.plan))[0]  # type: ignore[method-assign]

        async def by_source(source: str) -> float:
            return await metric(r.client, hi, "vllm:prompt_tokens_by_source_total", source=source)

        hit, read = await by_source("local_cache_hit"), await by_source("external_kv_transfer")
        await _oracle_turn(r, messages, 1, h)  # a tool result over the local limit: a P/D turn
        the_plan = plans[-1]
        if not p_caching:
            assert state.prefill_copies == ()
            assert the_plan.prefill == lo and "its cache holds" not in the_plan.reason, the_plan.reason
            return
        (copy,) = state.prefill_copies
        assert copy.url == hi and copy.tokens > 100, state.prefill_copies
        # A pull there reads only the answer's few blocks, a cold prefill computes them: either way P's cache
        # serves the rest (the estimates are within a read's latency of each other).
        assert the_plan.prefill == hi, the_plan.reason
        assert f"its cache holds {copy.tokens} tok" in the_plan.reason, the_plan.reason
        assert await by_source("local_cache_hit") - hit >= copy.tokens, "P did not hit its prefix cache"
        assert await by_source("external_kv_transfer") - read <= state.cached.num_tokens - copy.tokens
        after = await orch.sv.store.get("pcache-1")
        assert after is not None and [c.url for c in after.prefill_copies] == [hi]
        assert after.prefill_copies[0].tokens > copy.tokens  # now this turn's prompt
        # Eviction: the gateway counted what P took in since; on a cache that small the copy is gone.
        (mine,) = after.prefill_copies
        nodes = orch.sv.cluster.nodes
        assert orch.learning.prefill_cached(after.prefill_copies, 10**6, nodes) == {hi: mine.tokens}
        assert orch.learning.prefill_cached(after.prefill_copies, 100, nodes) == {hi: 100}  # an edited history cuts it
        nodes[hi].kv_capacity_tokens = orch.learning.prefill_written[hi] - mine.written_at + mine.tokens // 2
        assert orch.learning.prefill_cached(after.prefill_copies, 10**6, nodes) == {hi: mine.tokens // 2}  # tail first
        orch.learning.prefill_written[hi] += mine.tokens
        assert orch.learning.prefill_cached(after.prefill_copies, 10**6, nodes) == {}


async def test_tokenize_calls_use_connections_of_their_own() -> None:
    """The guard's /tokenize goes through its own client (connection pool), never the one the prefill and
    decode legs use: sharing a keep-alive connection with the prefill leg after it stalled P's answer ~44 ms
    (benchmarks/pd_hop.py)."""
    async with rig(policy="auto", min_reuse_tokens=4, max_local_suffix_tokens=16, learn_estimates=False) as r:
        gw = r.gw
        assert gw.orchestrator.sv.tokenize_client is gw.tokenize_client is not gw.client
        seen: dict[str, list[str]] = {"legs": [], "tokenize": []}

        async def on(name: str, request: httpx.Request) -> None:
            seen[name].append(request.url.path)

        on_send(gw.upstream, lambda method, url, headers: seen["legs"].append(httpx.URL(url).path))
        gw.tokenize_client.event_hooks["request"].append(lambda req: on("tokenize", req))
        messages = await _oracle_turn(r, first_messages(90), 0, {"x-session-id": "tok-1"})
        await _oracle_turn(r, messages, 1, {"x-session-id": "tok-1"})
        assert seen["tokenize"] and set(seen["tokenize"]) == {"/tokenize"}, seen
        assert "/tokenize" not in seen["legs"] and "/v1/chat/completions" in seen["legs"], seen


# 1P1D, P without prefix caching, auto deciding from its seeds only (learned timings would depend on the CPU).
_AUTO = {"policy": "auto", "min_reuse_tokens": 4, "learn_estimates": False}
_NO_P_CACHE = {"prefill_prefix_caching": False}


@pytest.mark.parametrize("marked", [True, False])
async def test_a_decode_local_turn_leaves_a_handle_of_its_whole_sequence(marked: bool) -> None:
    """With local_turn_handles (the default) a decode-local leg carries kv_transfer_params that set neither flag,
    and D keeps the turn's blocks behind a handle as vLLM does: the next, long turn pulls the whole history,
    the local turn's suffix and answer included, and P computes only its own suffix. Unmarked, the store keeps
    the first turn's handle and P recomputes what the local turn added."""
    async with rig(sim=_NO_P_CACHE, **_AUTO, max_local_suffix_tokens=256, local_turn_handles=marked) as r:
        client, url = r.client, r.url
        h = {"x-session-id": f"local-handle-{marked}"}
        messages = first_messages(57)
        held: list[int] = []
        p2p: list[float] = []
        # turn 0 cold, turn 1 local (a short tool result; streamed: vLLM 0.33 puts the handle on the
        # finish chunk), turn 2 a long tool result through a pull.
        for turn, words in enumerate((10, 600, 10)):
            before = await p2p_tokens(r)
            got = await chat(client, url, request_body(messages, stream=turn == 1), h)
            want = await chat(client, r.oracle, request_body(messages, stream=False), clean=False)
            assert comparable(got) == comparable(want), f"turn {turn} differs from the oracle"
            p2p.append(await p2p_tokens(r) - before)
            [s] = (await client.get(f"{url}/admin/sessions")).json()
            assert s["has_handle"]
            held.append(s["held_tokens"])
            # The next turn adds `words` of tool result (or user text, after an answer without tool calls).
            messages = (next_messages(messages, got, 57, turn, result_words=words) if got.get("tool_calls")
                        else [*messages, dict(got), {"role": "user", "content": tool_result(f"l{turn}", words)}])
        sources = await metric(client, url, "kvtether_ttft_seconds_count", reuse_source="decode_local")
        assert sources == 1, (p2p, held)
        kept = {o: await metric(client, url, "kvtether_local_turn_handles_total", outcome=o)
                for o in ("kept", "superseded", "missing")}
        node = r.gw.orchestrator.sv.cluster.nodes[r.cluster.decode_urls[0]]
    assert p2p[1] == 0, "the local turn made a prefill request"
    if marked:
        # The local turn's own handle: it covers the first turn's held sequence and what the turn added.
        assert held[1] > held[0] + 20, held
        assert node.local_handles is True
        # It replaced the first turn's handle, which the local turn did not use (pinned on D until its TTL).
        assert kept == {"kept": 1, "superseded": 1, "missing": 0}
        # The pull read all of it: the local turn's suffix and answer too.
        assert p2p[2] >= held[1] - 16, (p2p, held)
    else:
        assert held[1] == held[0], "unmarked, the store keeps the handle the local turn did not use"
        assert node.local_handles is None
        assert kept == {"kept": 0, "superseded": 0, "missing": 0}
        assert held[0] - 16 <= p2p[2] < held[1] + 1, (p2p, held)


async def test_a_decode_node_that_drops_the_mark_is_no_longer_counted_on() -> None:
    """A D without bidirectional_kv_xfer keeps nothing after a marked local turn: the gateway notes it (and the
    plan's look-ahead stops counting on local handles there), and the session keeps the handle that turn did
    not use. A handle from a later marked turn would turn it back on."""
    from dataclasses import replace

    async with rig(sim=_NO_P_CACHE, **_AUTO, max_local_suffix_tokens=256, local_turn_handles=True) as r:
        client, url = r.client, r.url
        d = r.cluster.decode_urls[0]
        engine = r.cluster.node(d).engine
        orch = r.gw.orchestrator
        h = {"x-session-id": "drops-mark"}
        messages = first_messages(58)
        got = await chat(client, url, request_body(messages, stream=False), h)
        [first] = (await client.get(f"{url}/admin/sessions")).json()
        engine.cfg = replace(engine.cfg, bidirectional=False)  # from here on D keeps nothing
        for turn in (0, 1):
            messages = next_messages(messages, got, 58, turn, result_words=10)
            got = await chat(client, url, request_body(messages, stream=False), h)
            assert orch.sv.cluster.nodes[d].local_handles is False
            [after] = (await client.get(f"{url}/admin/sessions")).json()
            assert after["has_handle"] and after["held_tokens"] == first["held_tokens"]
        assert await metric(client, url, "kvtether_ttft_seconds_count", reuse_source="decode_local") == 2
        nodes = {n["url"]: n for n in (await client.get(f"{url}/ready")).json()["nodes"]}
        assert nodes[d]["local_handles"] is False and "local_handles" not in nodes[r.cluster.prefill_urls[0]]
        # Due only on the first: once noted, the gateway no longer expects one there.
        assert await metric(client, url, "kvtether_local_turn_handles_total", outcome="missing") == 1
        engine.cfg = replace(engine.cfg, bidirectional=True)
        messages = next_messages(messages, got, 58, 2, result_words=10)
        await chat(client, url, request_body(messages, stream=False), h)
        assert orch.sv.cluster.nodes[d].local_handles is True
        [last] = (await client.get(f"{url}/admin/sessions")).json()
        assert last["held_tokens"] > first["held_tokens"]


async def test_requests_whose_client_has_seen_nothing_are_counted_on_their_decode_node() -> None:
    """A stream counts in its D's holding_back from its first chunk (D's first token) to its first delta; a
    non-streamed request for as long as it runs. Each leg is counted once and released once, so the count
    is back to 0 when the turns are done, also after a client that left mid-answer."""
    async with rig(**_AUTO) as r:
        client, url = r.client, r.url
        d = r.cluster.decode_urls[0]
        cl = r.gw.orchestrator.sv.cluster
        calls: list[tuple[str, int]] = []
        real = cl.hold_back

        def spy(node: str, n: int) -> None:
            calls.append((node, n))
            real(node, n)

        cl.hold_back = spy
        h = {"x-session-id": "holding-back"}
        messages = first_messages(59)
        for turn, stream in enumerate((False, True, True)):
            before = len(calls)
            got = await chat(client, url, request_body(messages, stream=stream), h)
            assert calls[before:] == [(d, 1), (d, -1)], (turn, calls[before:])
            assert cl.nodes[d].holding_back == 0
            messages = next_messages(messages, got, 59, turn, result_words=10)
        # An answer cut off before its first delta (one token: the tool call's opening tag): released at
        # the end of the leg.
        before = len(calls)
        await chat(client, url, request_body(messages, stream=True, max_tokens=1), h)
        assert calls[before:] == [(d, 1), (d, -1)], calls[before:]
        # A client that reads the first chunk and leaves.
        async with client.stream("POST", f"{url}/v1/chat/completions", headers=h,
                                 json=request_body(messages, stream=True)) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data:"):
                    break
    assert cl.nodes[d].holding_back == 0
    assert sum(n for _, n in calls) == 0


@pytest.mark.parametrize("rescue", [True, False])
async def test_with_the_decode_rescue_a_p_d_session_starts_on_a_decode_node_when_no_prefill_node_can_take_it(
        rescue: bool) -> None:
    """P/D with its prefill node out of service: P's queue is unbounded, so every turn through it is lost to the
    TTFT objective. With ``decode_ttft_rescue`` a new session's first turn is sized and starts on the least loaded
    decode node, prefilled there whole (the oracle's answer), and its next turn runs there too, within the limits;
    without it the gateway has no capacity for a new session."""
    gateway = {"policy": "auto", "ttft_objective_s": 2.0, "tuning": {"decode_ttft_rescue": rescue},
               "learn_estimates": False, "health_backoff_s": 600.0, "health_backoff_max_s": 600.0}
    async with rig(prefill=1, decode=2, **gateway) as r:
        p = r.cluster.prefill_urls[0]
        r.gw.cluster.take_out(r.gw.cluster.nodes[p], "out of service for the test")
        h = {"x-session-id": "rescued"}
        messages = first_messages(7)
        body = request_body(messages, stream=True)
        if not rescue:
            resp = await r.client.post(f"{r.url}/v1/chat/completions", json=body, headers=h)
            assert resp.status_code == 503 and resp.json()["error"]["code"] == "no_capacity", resp.text
            return
        for turn in range(2):
            messages = await _oracle_turn(r, messages, turn + 1, h)
        rescued = await metric(r.client, r.url, "kvtether_placement_decisions_total", option="decode_local",
                               reason="ttft_rescue")
        local = await metric(r.client, r.url, "kvtether_placement_decisions_total", option="decode_local")
        served = [await metric(r.client, d, "vllm:request_success_total") for d in r.cluster.decode_urls]
        # The first turn only as a rescue; the next one runs on its pinned decode node within the limits.
        assert (rescued, local) == (1, 2), (rescued, local)
        assert await metric(r.client, p, "vllm:request_success_total") == 0
        assert sorted(served) == [0, 2], served  # both turns on one decode node: the session pinned there
