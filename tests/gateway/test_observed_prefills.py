"""What the auto policy plans with is what the gateway observes: prefills it counts as running on a node end when
the gateway sees them end (the local turn's first token, the prefill leg's answer), not when their estimate says
so; and its cost model counts a node's cache in the node's own block size, as polled."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from kvtether.gateway.turn import place as place_room

from tests.support.gateway_agent import chat, first_messages, next_messages, request_body, short_sessions, turn_until
from tests.support.sim_rig import rig

pytestmark = pytest.mark.anyio

_AUTO = {"policy": "auto", "min_reuse_tokens": 4, "learn_estimates": False}


async def test_a_local_prefill_runs_on_d_until_its_first_token_is_seen_not_until_its_estimate_ends() -> None:
    """Session x's local turn hangs on D before its first token. Its estimate put the end of its prefill within a
    fraction of a second; seconds later the gateway still counts it running there (expected to run as much again
    as it has overrun), so a turn placed on D meanwhile is planned with it (an answer there would decode beside
    it). Once x's leg has ended (the gateway gives up on D at its read timeout and retries x through P), nothing
    of it is left."""
    async with rig(**_AUTO, request_stall_share=0.5, read_timeout_s=3.0) as r:
        histories = await short_sessions(r.client, r.url, {"x": 63, "y": 64})
        orch = r.gw.orchestrator
        learning, clock = orch.learning, orch.sv.clock
        d = r.cluster.decode_urls[0]
        await r.client.post(f"{d}/admin/fault", json={"hang_next": 1})
        async with anyio.create_task_group() as tg:
            tg.start_soon(turn_until, r.client, r.url, "x", histories["x"])
            for _ in range(200):  # x is placed locally (D idle) and hangs there before its first token
                if learning.running_prefills.get(d):
                    break
                await anyio.sleep(0.01)
            [(url, until_end, _, _, _)] = learning.prefills_running(clock())
            assert url == d and 0.0 < until_end < 1.0, until_end
            await anyio.sleep(until_end + 1.0)  # well past its estimated end, and not seen to end
            [(url, ends_in, _, _, _)] = learning.prefills_running(clock())
            assert url == d and ends_in >= 1.0, "an unseen prefill past its estimate counts as running for its overrun"
            # y's turn, planned now, is planned with x's prefill still running on D: an answer placed there would
            # decode beside what is left of it (stallquota.pending_s), however long ago its estimate said it ended.
            plan = place_room.plan
            seen: list[tuple[tuple[str, float, float, float, int], ...]] = []

            def spy(turn: Any, *args: Any) -> Any:
                seen.append(turn.running_prefills)
                return plan(turn, *args)

            place_room.plan = spy  # type: ignore[assignment]
            try:
                await chat(r.client, r.url, request_body(histories["y"], stream=False, max_tokens=10),
                           {"x-session-id": "y"})
            finally:
                place_room.plan = plan  # type: ignore[assignment]
            assert seen, "y's turn was not planned"
            [(url, ends_in, _, _, _)] = [p for p in seen[0] if p[0] == d]
            assert ends_in >= 1.0, seen
            tg.cancel_scope.cancel()  # x's client gives up
        for _ in range(500):  # the gateway gives up on D at its read timeout and retries x through P
            if not learning.running_prefills and not learning.exposures:
                break
            await anyio.sleep(0.02)
        assert learning.prefills_running(clock()) == ()


async def test_the_cost_model_counts_in_the_block_size_the_decode_node_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    # GLM-5's sparse attention backend runs 64-token blocks (vLLM's CPU backend 128); the gateway's setting is
    # unset, so the size comes from D's poll, not from the 16 of most GPU backends.
    seen: list[int] = []
    plan = place_room.plan

    def spy(turn: object, view: object, estimates: object, knobs: object, peers: object) -> object:
        seen.append(knobs.block_size)  # type: ignore[attr-defined]
        return plan(turn, view, estimates, knobs, peers)  # type: ignore[arg-type]

    monkeypatch.setattr(place_room, "plan", spy)
    async with rig(**_AUTO, sim={"preset": "glm-5-fp8-h200-tp8"}) as r:
        messages = first_messages(7)
        for turn in range(2):
            got = await chat(r.client, r.url, request_body(messages, stream=False, max_tokens=10),
                             {"x-session-id": "blocks"})
            messages = next_messages(messages, got, 7, turn, result_words=10)
            await anyio.sleep(1.0)  # a poll of D's /metrics (every 0.5 s here) says its block size
    assert seen and seen[-1] == 64, seen
