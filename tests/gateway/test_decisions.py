"""kvtether_placement_decisions_total through the gateway on the simulator: one count per planned turn, by the
plan's action (what the x-kvtether-plan header says) and the bucket of its reason, under a fixed policy (pull) and
under auto. Every series the policy can produce is there at zero before the first turn."""

from __future__ import annotations

from collections import Counter
from typing import Any

import httpx
import pytest
from kvtether.cli.simstack import sim_stack
from kvtether.gateway import telemetry as T
from kvtether.gateway.policy.reasons import SERIES
from prometheus_client.parser import text_string_to_metric_families

from tests.support.gateway_agent import chat, first_messages, next_messages, request_body
from tests.support.sim_rig import LIMITS, RIG_SIM, stack_spec

pytestmark = pytest.mark.anyio

EDITED = "edited"  # a turn whose system prompt was rewritten: the guard verifies too little of the handle

# policy -> (its settings, each turn's tool-result words or EDITED, the (action, reason) each turn must count).
RUNS: dict[str, tuple[dict[str, Any], list[int | str], list[tuple[str, str]]]] = {
    "pull": ({}, [10, 10, 10, EDITED],
             [("none", "first_turn"), ("attach", "handle_verified"), ("attach", "handle_verified"),
              ("none", "guard_refused")]),
    # As in test_auto.py: short suffixes run on the pinned decode node, a long one through a pull (its
    # decisions from the seeds only, so they do not depend on this machine's speed).
    "auto": ({"max_local_suffix_tokens": 256, "min_reuse_tokens": 4, "learn_estimates": False,
              "local_turn_handles": False}, [10, 10, 600, 10, EDITED],
             [("none", "first_turn"), ("decode_local", "local_cheapest"), ("decode_local", "local_cheapest"),
              ("attach", "pull_cheapest"), ("none", "guard_refused")]),
}


def decisions(text: str) -> dict[tuple[str, str], float]:
    return {(s.labels["option"], s.labels["reason"]): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == T.M_PLACEMENT_DECISIONS}


@pytest.mark.parametrize("policy", list(RUNS))
async def test_each_planned_turn_counts_its_option_and_reason(policy: str) -> None:
    settings, suffixes, want = RUNS[policy]
    provider, exporter = T.in_memory_provider()
    spec = stack_spec(prefill_prefix_caching=False, **RIG_SIM)
    async with sim_stack(spec, policy, gateway={"metrics_poll_interval_s": 0.5, **settings}, calibrated=False,
                         tracer_provider=provider) as stack:
        url = stack.url
        async with httpx.AsyncClient(timeout=60, limits=LIMITS) as client:
            before = decisions((await client.get(f"{url}/metrics")).text)
            actions, answered = [], []
            messages = first_messages(70)
            for turn, words in enumerate(suffixes):
                sent = messages
                if words == EDITED:
                    sent = [{**messages[0], "content": "You are a different agent. " + messages[0]["content"]},
                            *messages[1:]]
                meta: dict[str, str] = {}
                body = {**request_body(sent, stream=turn % 2 == 1), "tool_choice": "required"}
                got = await chat(client, url, body, {"x-session-id": f"decisions-{policy}"}, response_headers=meta)
                actions.append(meta[T.HEADER_PLAN])
                answered.append(meta[T.HEADER_PLAN_REASON])
                if words != EDITED:
                    messages = next_messages(messages, got, 70, turn, result_words=int(words))
            after = decisions((await client.get(f"{url}/metrics")).text)
    # Before the first turn: exactly the policy's series, at zero.
    assert before == dict.fromkeys(SERIES[policy], 0.0)
    # One count per turn, by the action the response named and the reason the plan gave.
    buckets = [dict(s.attributes or {})[T.ATTR_PLAN_REASON_BUCKET] for s in exporter.get_finished_spans()
               if s.name == T.SPAN_PLAN]
    assert list(zip(actions, buckets, strict=True)) == want
    assert answered == buckets  # the answer names the same bucket the span and the metric count
    counted = {k: v for k, v in after.items() if v}
    assert counted == dict(Counter(want)), after
