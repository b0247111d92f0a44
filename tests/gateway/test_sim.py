"""The gateway against the simulator: oracle equality, reverse pull, edited histories, failures.

The oracle is a single aggregated sim node answering the same messages directly: a correct gateway
must give exactly its answers (the sim's output is a function of the KV it attends to, so a pull of
the wrong tokens shows up as a different answer).
"""

from __future__ import annotations

import json
from typing import Any

import anyio
import httpx
import pytest
from kvtether.cli.simstack import sim_stack
from kvtether.gateway.config import GatewayConfig
from kvtether.gateway.nodes.cluster import sample_sum
from kvtether.gateway.stores import FailSafeStore, MemorySessionStore
from kvtether.gateway.stores.sessions import TakenHandle

from tests.support.gateway_agent import (
    MODEL,
    chat,
    comparable,
    first_messages,
    next_messages,
    request_body,
)
from tests.support.sim_rig import LIMITS, RIG_SIM, metric, outcome, p2p_tokens, rig, run_session, stack_spec

pytestmark = pytest.mark.anyio


async def test_multi_turn_sessions_equal_the_oracle_and_pull_every_turn() -> None:
    async with rig(prefill=2, decode=2) as r:
        answers = await run_session(r, 1, 12, check_pull=True)
        assert any(a.get("tool_calls") for a in answers) and any(not a.get("tool_calls") for a in answers)
        sessions = (await r.client.get(f"{r.url}/admin/sessions")).json()
        assert len(sessions) == 1 and sessions[0]["turns"] == 12 and sessions[0]["held_tokens"] > 500
        assert sessions[0]["session_id"] == "sess-1" and sessions[0]["decode"] in r.cluster.decode_urls
        assert await outcome(r, "refused_by_guard") == 0
        xfers = sum([await metric(r.client, u, "vllm:nixl_xfer_time_seconds_count") for u in r.cluster.prefill_urls])
        assert xfers >= 11


async def test_plain_openai_client_is_pinned_by_message_chain() -> None:
    async with rig() as r:
        await run_session(r, 2, 10, header=False, check_pull=True)
        sessions = (await r.client.get(f"{r.url}/admin/sessions")).json()
        assert len(sessions) == 1 and sessions[0]["turns"] == 10


async def test_reasoning_history_is_guarded() -> None:
    # The template drops reasoning before the last user message: such turns are partial matches.
    async with rig() as r:
        await run_session(r, 3, 10, thinking=True)
        assert await outcome(r, "truncated") + await outcome(r, "refused_by_guard") > 0
        assert await outcome(r, "attached") > 0


async def test_concurrent_sessions_do_not_share_handles() -> None:
    async with rig(prefill=1, decode=2) as r:
        async with anyio.create_task_group() as tg:
            for s in range(10, 14):
                tg.start_soon(run_session, r, s, 6)
            for s in range(20, 22):
                tg.start_soon(lambda s=s: run_session(r, s, 6, header=False))
        sessions = (await r.client.get(f"{r.url}/admin/sessions")).json()
        assert len(sessions) == 6 and all(s["turns"] == 6 for s in sessions)
        assert await outcome(r, "refused_by_guard") == 0


async def test_older_backend_without_stream_handles() -> None:
    async with rig(sim={"emulate": "0.32"}) as r:
        await run_session(r, 4, 6, stream_every=1)  # every turn streamed: never a handle
        assert await metric(r.client, r.url, "kvtether_stream_handles_missing_total") == 6
        assert await outcome(r, "attached") == 0 and await outcome(r, "missing") == 5


# ---- edited histories ----------------------------------------------------------------------------


def _edits(messages: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Edited versions of a history whose next request would otherwise extend D's held sequence."""
    out: dict[str, list[dict[str, Any]]] = {}
    # A message removed from the middle (keep the system prompt and the tail).
    mid = len(messages) // 2
    out["removed_middle"] = messages[:mid] + messages[mid + 1 :]
    # A rewritten tool result (the latest one), or the last user message when there is none.
    rewritten = [dict(m) for m in messages]
    idx = max(i for i, m in enumerate(rewritten) if m["role"] in ("tool", "user"))
    rewritten[idx]["content"] = "REDACTED " + str(rewritten[idx]["content"])[::-1]
    out["rewritten_tool_result"] = rewritten
    # Reasoning stripped from every assistant message by the client.
    out["stripped_reasoning"] = [{k: v for k, v in m.items() if k not in ("reasoning_content", "reasoning")}
                                 for m in messages]
    # Compaction: early turns dropped after the system prompt.
    out["compacted"] = messages[:1] + messages[5:]
    return out


async def _edited_history_answers(policy: str) -> tuple[int, int, dict[str, float]]:
    """(wrong answers, edited requests, handle outcomes) for a policy on a fixed set of edits."""
    wrong = total = 0
    async with rig(policy=policy) as r:
        for session in range(40, 43):
            messages = first_messages(session)
            sid = {"x-session-id": f"edit-{session}"}
            thinking = session == 42
            for turn in range(4):
                ans = await chat(r.client, r.url, request_body(messages, stream=turn % 2 == 1, thinking=thinking), sid)
                prev_messages = messages
                messages = next_messages(messages, ans, session, turn)
            edits = _edits(messages)
            # A regenerated last turn: the previous prompt again, without its answer.
            edits["regenerated"] = prev_messages
            for name, edited in edits.items():
                # Re-establish a fresh handle for the unedited history first.
                ans = await chat(r.client, r.url, request_body(messages, stream=False, thinking=thinking), sid)
                messages = next_messages(messages, ans, session, 100 + total)
                edited = _edits(messages)[name] if name != "regenerated" else edited
                if name == "regenerated":
                    edited = messages[:-1] if messages[-1]["role"] == "user" else edited
                body = request_body(edited, stream=total % 2 == 0, thinking=thinking)
                got = await chat(r.client, r.url, body, sid)
                want = await chat(r.client, r.oracle, {**body, "stream": False}, clean=False)
                total += 1
                if comparable(got) != comparable(want):
                    wrong += 1
                ans2 = await chat(r.client, r.url, request_body(messages, stream=False, thinking=thinking), sid)
                messages = next_messages(messages, ans2, session, 200 + total)
        outcomes = {o: await outcome(r, o) for o in ("attached", "truncated", "refused_by_guard", "missing")}
    return wrong, total, outcomes


async def test_edited_histories_give_no_wrong_answer() -> None:
    wrong, total, outcomes = await _edited_history_answers("pull")
    assert total >= 12
    assert wrong == 0, f"{wrong} wrong answers of {total}"
    assert outcomes["truncated"] + outcomes["refused_by_guard"] >= total // 2


async def test_a_handle_p_did_not_read_is_reported_as_what_p_did_not_as_a_pull() -> None:
    """An edit late in the last message: the guard cuts the handle at the edit, which P's own prefix cache
    (it prefilled that prompt last turn) already covers; with vLLM's default recompute threshold P reads
    nothing from D. The header and the metrics say P's own cache, as P's counters do (a turn P did read is
    reported as a pull: run_session's check_pull)."""
    async with rig(sim={"kv_recompute_threshold": 64}) as r:
        sid = {"x-session-id": "unread-1"}
        messages = first_messages(50)
        await chat(r.client, r.url, request_body(messages, stream=False), sid)
        edited = [messages[0], {**messages[1], "content": str(messages[1]["content"]) + " (and mind the tests)"}]
        turns: list[tuple[str, float, dict[str, str]]] = []

        async def turn(history: list[dict[str, Any]]) -> dict[str, Any]:
            before_p2p = await p2p_tokens(r)
            headers: dict[str, str] = {}
            body = request_body(history, stream=False)
            got = await chat(r.client, r.url, body, sid, response_headers=headers)
            assert comparable(got) == comparable(await chat(r.client, r.oracle, body, clean=False))
            turns.append((headers["x-kvtether-reuse-source"], await p2p_tokens(r) - before_p2p, headers))
            return got

        answer = await turn(edited)
        await turn(next_messages(edited, answer, 50, 1))  # extends the edited turn: D holds exactly this history
        (edit_source, edit_p2p, edit_headers), (next_source, next_p2p, next_headers) = turns
        assert edit_headers["x-kvtether-plan"] == "truncate", edit_headers
        assert (edit_source, edit_p2p) == ("prefill_cache", 0), turns
        assert int(edit_headers["x-kvtether-reuse-tokens"]) > 0
        # The next turn's whole handle: P's cache holds the edited prompt, and what it lacks (the short answer)
        # is below P's recompute threshold, so P computes it: no pull either, and said so.
        assert next_headers["x-kvtether-plan"] == "attach" and (next_source, next_p2p) == ("prefill_cache", 0), turns
        assert await outcome(r, "unread") == 2
        text = (await r.client.get(f"{r.url}/metrics")).text
        assert sample_sum(text, "kvtether_reused_tokens_total", source="decode_pull") == 0
        assert sample_sum(text, "kvtether_reused_tokens_total", source="prefill_cache") == \
            int(edit_headers["x-kvtether-reuse-tokens"]) + int(next_headers["x-kvtether-reuse-tokens"])
        assert sample_sum(text, "kvtether_offered_tokens_total") > 0


async def test_reference_policy_gives_wrong_answers_on_edited_histories() -> None:
    wrong, _, _ = await _edited_history_answers("reference")
    assert wrong > 0, "the unguarded reference behaviour should corrupt some edited turns"


# ---- failures ------------------------------------------------------------------------------------


async def test_expired_handle_on_the_engine_recomputes_without_error() -> None:
    # The engine frees the held blocks after 20 simulated seconds (0.4 s real); the gateway still
    # believes its 450 s: P's read fails (kv_load_failure_policy "fail" → 500), the gateway retries cold.
    async with rig(sim={"decoder_kv_blocks_ttl": 20.0}) as r:
        messages = first_messages(5)
        h = {"x-session-id": "exp"}
        for turn in range(3):
            got = await chat(r.client, r.url, request_body(messages, stream=turn == 1), h)
            want = await chat(r.client, r.oracle, request_body(messages, stream=False), clean=False)
            assert comparable(got) == comparable(want)
            messages = next_messages(messages, got, 5, turn)
            await anyio.sleep(0.6)
        assert await outcome(r, "attached") == 2
        assert await outcome(r, "retried_cold") == 2
        assert await metric(r.client, r.url, "kvtether_upstream_errors_total", phase="prefill") == 2


async def test_gateway_side_expiry_goes_cold() -> None:
    async with rig(session_ttl_s=0.3, sweep_interval_s=0.1) as r:
        messages = first_messages(6)
        h = {"x-session-id": "short"}
        got = await chat(r.client, r.url, request_body(messages, stream=False), h)
        await anyio.sleep(0.5)
        assert (await r.client.get(f"{r.url}/admin/sessions")).json() == []  # swept
        messages = next_messages(messages, got, 6, 0)
        got = await chat(r.client, r.url, request_body(messages, stream=True), h)
        want = await chat(r.client, r.oracle, request_body(messages, stream=False), clean=False)
        assert comparable(got) == comparable(want)
        assert await outcome(r, "attached") == 0


async def test_a_handle_the_store_cannot_hand_out_is_counted_as_such_not_as_a_lost_race() -> None:
    class TakeFails(MemorySessionStore):
        failing = False

        async def take_handle(self, session_id: str) -> TakenHandle | None:
            if self.failing:
                raise ConnectionError("store went away")
            return await super().take_handle(session_id)

    inner = TakeFails()
    async with rig(store=FailSafeStore(inner, timeout_s=1.0, cooldown_s=0.01)) as r:
        messages = first_messages(7)
        h = {"x-session-id": "flaky"}
        got = await chat(r.client, r.url, request_body(messages, stream=False), h)
        inner.failing = True  # the session (and its handle) is read; taking the handle fails
        messages = next_messages(messages, got, 7, 0)
        got = await chat(r.client, r.url, request_body(messages, stream=True), h)
        want = await chat(r.client, r.oracle, request_body(messages, stream=False), clean=False)
        assert comparable(got) == comparable(want)  # cold, and right
        assert await outcome(r, "store_unavailable") == 1
        assert await outcome(r, "lost_race") == 0 and await outcome(r, "attached") == 0


@pytest.mark.parametrize("how", ["fail", "stop"])
async def test_dead_decode_is_replaced(how: str) -> None:
    async with rig(prefill=1, decode=2) as r:
        messages = first_messages(7)
        h = {"x-session-id": "dead"}
        for turn in range(6):
            if turn == 3:
                pinned = (await r.client.get(f"{r.url}/admin/sessions")).json()[0]["decode"]
                if how == "fail":
                    await r.client.post(f"{pinned}/admin/fault", json={"fail_next": 1000})
                else:
                    await r.cluster.node(pinned).stop()
            got = await chat(r.client, r.url, request_body(messages, stream=turn % 2 == 1), h)
            want = await chat(r.client, r.oracle, request_body(messages, stream=False), clean=False)
            assert comparable(got) == comparable(want)
            messages = next_messages(messages, got, 7, turn)
        now = (await r.client.get(f"{r.url}/admin/sessions")).json()[0]["decode"]
        assert now != pinned
        if how == "fail":  # a stopped node may be seen dead by the poller first, before any request fails
            assert await metric(r.client, r.url, "kvtether_upstream_errors_total", phase="decode") >= 1
        assert await outcome(r, "attached") >= 3  # pulls resume on the new decode node


async def test_aggregated_mode_pins_sessions() -> None:
    async with rig(prefill=0, decode=0, aggregated=2) as r:
        await run_session(r, 8, 6)
        await run_session(r, 9, 6, header=False)
        sessions = (await r.client.get(f"{r.url}/admin/sessions")).json()
        assert len(sessions) == 2 and all(s["turns"] == 6 for s in sessions)
        device = sum([await metric(r.client, u, "vllm:prompt_tokens_cached_by_source_total", source="device")
                      for u in r.cluster.aggregated_urls])
        assert device > 1000  # the replicas' prefix caches served the histories


# ---- API surface -----------------------------------------------------------------------------------


async def test_api_errors_are_openai_shaped_and_internals_never_leak() -> None:
    async with rig(max_body_bytes=4096) as r:
        c, url = r.client, r.url

        def is_error(resp: httpx.Response, status: int) -> None:
            assert resp.status_code == status, resp.text
            err = resp.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}

        msgs = [{"role": "user", "content": "hi"}]
        is_error(await c.post(f"{url}/v1/chat/completions", content=b"{not json"), 400)
        is_error(await c.post(f"{url}/v1/chat/completions", json=[1, 2]), 400)
        is_error(await c.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": msgs,
                                                                  "kv_transfer_params": {"x": 1}}), 400)
        is_error(await c.post(f"{url}/v1/chat/completions", json={"model": "nope", "messages": msgs}), 404)
        is_error(await c.post(f"{url}/v1/chat/completions", json={"model": MODEL}), 400)
        is_error(await c.post(f"{url}/v1/completions", json={"model": MODEL}), 400)
        is_error(await c.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": msgs, "stream": "y"}),
                 400)
        is_error(await c.post(f"{url}/v1/chat/completions",
                              json={"model": MODEL, "messages": [{"role": "user", "content": "x" * 5000}]}), 413)
        is_error(await c.get(f"{url}/v1/chat/completions"), 405)
        is_error(await c.get(f"{url}/nope"), 404)
        assert (await c.get(f"{url}/admin/sessions")).json() == []  # nothing rejected touched a session

        models = (await c.get(f"{url}/v1/models")).json()
        assert [m["id"] for m in models["data"]] == [MODEL]
        assert (await c.get(f"{url}/health")).status_code == 200
        assert (await c.get(f"{url}/ready")).json()["ready"] is True

        # Token ids the client asked for come through; kv_transfer_params never does.
        body = {"model": MODEL, "messages": msgs, "max_tokens": 10, "return_token_ids": True, "temperature": 0}
        data = (await c.post(f"{url}/v1/chat/completions", json=body)).json()
        assert "kv_transfer_params" not in json.dumps(data)
        assert data["prompt_token_ids"] and data["choices"][0]["token_ids"]
        async with c.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}) as resp:
            text = (await resp.aread()).decode()
        assert "kv_transfer_params" not in text and "token_ids" in text

        # Text completions, both ways.
        cbody = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
        data = (await c.post(f"{url}/v1/completions", json=cbody)).json()
        assert data["choices"][0]["text"] and "kv_transfer_params" not in json.dumps(data)
        async with c.stream("POST", f"{url}/v1/completions", json={**cbody, "stream": True}) as resp:
            text = (await resp.aread()).decode()
        assert resp.status_code == 200 and "[DONE]" in text and "token_ids" not in text

        metrics_text = (await c.get(f"{url}/metrics")).text
        for name in ("kvtether_ttft_seconds_bucket", "kvtether_handle_outcomes_total", "kvtether_pinned_sessions",
                     "kvtether_upstream_errors_total"):
            assert name in metrics_text or name == "kvtether_upstream_errors_total"
        assert "anon-" not in metrics_text  # no session ids as labels


async def test_prefill_failure_is_retried_on_another_node_and_reported_cleanly() -> None:
    async with rig(prefill=2, decode=1) as r:
        msgs = first_messages(9)
        await r.client.post(f"{r.cluster.prefill_urls[0]}/admin/fault", json={"fail_next": 1})
        await r.client.post(f"{r.cluster.prefill_urls[1]}/admin/fault", json={"fail_next": 1})
        resp = await r.client.post(f"{r.url}/v1/chat/completions", json=request_body(msgs, stream=False))
        assert resp.status_code == 502 and resp.json()["error"]["type"] == "upstream_error"
        # Both nodes marked unhealthy until the next poll; then service resumes.
        await anyio.sleep(1.2)
        got = await chat(r.client, r.url, request_body(msgs, stream=True))
        want = await chat(r.client, r.oracle, request_body(msgs, stream=False), clean=False)
        assert comparable(got) == comparable(want)


def test_config_type_is_exported() -> None:
    assert GatewayConfig().policy == "auto"


async def test_spans_per_request_and_leg() -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import SpanKind

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    async with sim_stack(stack_spec(**RIG_SIM), "pull", calibrated=False, tracer_provider=provider) as stack:
        url = stack.url
        async with httpx.AsyncClient(timeout=60, limits=LIMITS) as client:
            messages = first_messages(30)
            h = {"x-session-id": "traced", "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
            for turn in range(2):
                got = await chat(client, url, request_body(messages, stream=turn == 1), h)
                messages = next_messages(messages, got, 30, turn)
    spans = exporter.get_finished_spans()
    names = [s.name for s in spans]
    servers = [s for s in spans if s.kind is SpanKind.SERVER]
    assert len(servers) == 2 and all(s.name == "POST /v1/chat/completions" for s in servers)
    assert all(format(s.context.trace_id, "032x") == "0af7651916cd43dd8448eb211c80319c" for s in spans)
    assert names.count("kvtether.plan") == 2 and "kvtether.tokenize" in names and "kvtether.guard" in names
    legs = [s for s in spans if s.kind is SpanKind.CLIENT and s.name == f"chat {MODEL}"]
    assert sorted(dict(s.attributes or {})["kvtether.leg"] for s in legs) == ["decode", "decode", "prefill", "prefill"]
    decode = [s for s in legs if dict(s.attributes or {})["kvtether.leg"] == "decode"][-1]
    attrs = dict(decode.attributes or {})
    assert attrs["gen_ai.conversation.id"] == "traced" and attrs["kvtether.reuse.source"] == "decode_pull"
    assert attrs["kvtether.ttft_s"] > 0 and "gen_ai.response.time_to_first_chunk" in attrs
    # The node's own answer id and model, streamed (the last decode leg) and whole (the first).
    for leg in [s for s in legs if dict(s.attributes or {})["kvtether.leg"] == "decode"]:
        a = dict(leg.attributes or {})
        assert str(a["gen_ai.response.id"]).startswith(("chatcmpl-", "cmpl-")) and a["gen_ai.response.model"] == MODEL
    assert all({"gen_ai.response.id", "gen_ai.response.model"} <= set(dict(s.attributes or {})) for s in legs)
    plan = [s for s in spans if s.name == "kvtether.plan"][-1]
    assert dict(plan.attributes or {})["kvtether.plan.action"] == "attach"


async def test_a_hanging_prefill_with_a_handle_is_retried_without_it_within_the_bound() -> None:
    """Protocol §2: a prefill with a handle may never answer (expired handle under "recompute", a P without
    bidirectional_kv_xfer). The gateway abandons it after pull_timeout_s and retries cold; the answer is right."""
    async with rig(pull_timeout_s=1.0) as r:
        msgs = first_messages(41)
        h = {"x-session-id": "hangs"}
        got = await chat(r.client, r.url, request_body(msgs, stream=False), h)
        msgs = next_messages(msgs, got, 41, 0)
        await r.client.post(f"{r.cluster.prefill_urls[0]}/admin/fault", json={"hang_next": 1})
        started = anyio.current_time()
        # The hung P never answers and no read timeout is set: only pull_timeout_s ends the leg (never before it
        # has passed), so any bound far below the test's own timeout tells the two apart, however busy the
        # machine.
        with anyio.fail_after(120):
            got = await chat(r.client, r.url, request_body(msgs, stream=False), h)
        took = anyio.current_time() - started
        want = await chat(r.client, r.oracle, request_body(msgs, stream=False), clean=False)
        assert comparable(got) == comparable(want)
        assert await metric(r.client, r.url, "kvtether_handle_outcomes_total", outcome="attached") == 1
        assert await metric(r.client, r.url, "kvtether_handle_outcomes_total", outcome="retried_cold") == 1
        assert took >= 1.0, f"the pull was given up before pull_timeout_s (turn took {took:.1f} s)"
        # The abandoned handle is released on D (the hung P never read it): only the new turn's hold is left.
        d = r.cluster.decode_urls[0]
        for _ in range(100):
            held = [h for h in (await r.client.get(f"{d}/admin/state")).json()["held"] if h["kind"] == "retained"]
            if len(held) == 1:
                break
            await anyio.sleep(0.05)
        assert len(held) == 1, held
        assert await metric(r.client, r.url, "kvtether_handle_releases_total", reason="unused") == 1
