"""The rules other gateways ship, as kvtether policies (gateway/policy/peers.py): Dynamo's conditional
disaggregation and llm-d's prefix decider, pure and on the simulator."""

from __future__ import annotations

from dataclasses import replace

import pytest
from kvtether.gateway.policy.facts import NodeLoad
from kvtether.gateway.policy.peers import PeerKnobs, decide, uncached_tokens
from kvtether.gateway.policy.placement import ClusterView, HandleAction, HandleState, Turn, plan
from kvtether.gateway.policy.reasons import BUCKETS, OTHER, SERIES

from tests.support.gateway_agent import chat, comparable, first_messages, next_messages, request_body
from tests.support.sim_rig import metric, rig

P, D = NodeLoad("http://p0"), NodeLoad("http://d0")
BUSY_P = NodeLoad("http://p0", waiting=2)


def test_dynamo_isl_bounding_as_dynamo_defines_it() -> None:
    k = PeerKnobs(block_size=64)
    # Dynamo's own cases: 1000 prompt, 14 cached blocks of 64 → 104 uncached, ratio 0.104: local.
    assert decide("dynamo", 1000, 14 * 64, P, D, k).local
    # 200 prompt, nothing cached: ratio 1.0 → disaggregate; uncached exactly at the threshold → disaggregate.
    assert not decide("dynamo", 200, 0, P, D, k).local
    loose = PeerKnobs(block_size=64, dynamo_eff_isl_ratio=0.99)
    assert not decide("dynamo", 2048 + 64 * 100, 64 * 100, P, D, loose).local
    assert decide("dynamo", 2047 + 64 * 100, 64 * 100, P, D, loose).local
    # The decode node's cache matches whole blocks: 100 cached tokens of 64-token blocks are 64.
    assert uncached_tokens(1000, 100, 64) == 936
    # An unknown prompt length (nothing cached to compare with) is never bounded.
    assert not decide("dynamo", None, 0, P, D, k).local
    # isl_bounding ignores the prefill node's load; prefill_load reads only it; isl_or_load either.
    assert not decide("dynamo", 200, 0, BUSY_P, D, k).local
    assert decide("dynamo", 200, 0, BUSY_P, D, PeerKnobs(dynamo_rule="prefill_load")).local
    assert not decide("dynamo", 1000, 14 * 64, P, D, PeerKnobs(dynamo_rule="prefill_load", block_size=64)).local
    assert decide("dynamo", 1000, 14 * 64, P, D, PeerKnobs(dynamo_rule="isl_or_load", block_size=64)).local
    assert decide("dynamo", 200, 0, BUSY_P, D, PeerKnobs(dynamo_rule="isl_or_load")).local
    # The decode-busy veto cancels a local prefill on a fuller decode node.
    veto = PeerKnobs(block_size=64, dynamo_decode_busy_share=0.5)
    assert decide("dynamo", 1000, 14 * 64, P, NodeLoad("http://d0", kv_usage=0.4), veto).local
    v = decide("dynamo", 1000, 14 * 64, P, NodeLoad("http://d0", kv_usage=0.6), veto)
    assert not v.local and "decode busy" in v.reason


def test_llm_d_disaggregates_above_its_non_cached_tokens() -> None:
    k = PeerKnobs(block_size=16)
    assert decide("llm-d", 1000, 992, P, D, k).local  # 8 uncached
    assert decide("llm-d", 1008, 992, P, D, k).local  # 16 uncached: not above
    assert not decide("llm-d", 1009, 992, P, D, k).local
    assert not decide("llm-d", None, 0, P, D, k).local
    assert not decide("llm-d", 1000, 992, BUSY_P, NodeLoad("http://d0", kv_usage=0.99), PeerKnobs(
        llm_d_non_cached_tokens=4)).local  # no load term: only the threshold decides
    with pytest.raises(ValueError):
        decide("pull", 10, 0, P, D, k)


@pytest.mark.parametrize("policy", ["dynamo", "llm-d"])
def test_peer_plans_pin_never_pull_and_their_reasons_have_buckets(policy: str) -> None:
    view = ClusterView(prefill=(P, NodeLoad("http://p1", waiting=3)), decode=(D, NodeLoad("http://d1")))
    base = Turn(policy=policy, new_session=False, pinned_decode="http://d1", handle=HandleState.PRESENT,
                handle_tokens=990, prompt_tokens=1000, reuse_tokens=990)
    local = plan(replace(base, decode_cached_tokens=992), view)
    assert (local.action, local.prefill, local.decode) == (HandleAction.DECODE_LOCAL, None, "http://d1")
    cold = plan(base, view)  # nothing cached on D: disaggregated, and no handle sent (these gateways never pull)
    assert (cold.action, cold.prefill, cold.decode, cold.reuse_tokens) == \
        (HandleAction.NONE, "http://p0", "http://d1", 0)
    # After a failed decode-local leg the turn is disaggregated whatever the rule says.
    retry = plan(replace(base, decode_cached_tokens=992, allow_local=False), view)
    assert retry.action is HandleAction.NONE
    for p in (local, cold):
        bucket = p.bucket
        assert bucket in BUCKETS and bucket != OTHER, p.reason
        assert (p.action.value, bucket) in SERIES[policy], (p.action.value, bucket)
    # A new pin: the least-loaded decode node, disaggregated (nothing is cached anywhere).
    new = plan(Turn(policy=policy, new_session=True), view)
    assert new.action is HandleAction.NONE and new.bucket == "uncached_long"


@pytest.mark.anyio
async def test_dynamo_runs_follow_ups_on_decode_and_releases_the_handles_it_never_reads() -> None:
    """A session under Dynamo's rule on the simulator: the first turn disaggregated, follow-ups whose new part
    is short prefilled on the decode node against its prefix cache; every answer equals the oracle; the handle
    D returns after a P/D turn is released (nothing reads it), so D holds nothing once the session ends."""
    async with rig(policy="dynamo", decode=2) as r:
        messages = first_messages(60)
        plans: list[str] = []
        sid = {"x-session-id": "peer-dynamo"}
        for turn in range(5):
            seen: dict[str, str] = {}
            body = request_body(messages, stream=turn % 2 == 1)
            got = await chat(r.client, r.url, body, sid, response_headers=seen)
            want = await chat(r.client, r.oracle, {**body, "stream": False}, clean=False)
            assert comparable(got) == comparable(want), f"turn {turn} differs from the oracle"
            plans.append(seen["x-kvtether-plan"])
            messages = next_messages(messages, got, 60, turn)
        assert plans[0] == "none" and plans[1:] == ["decode_local"] * 4, plans
        assert await metric(r.client, r.url, "kvtether_handle_releases_total", reason="unused") >= 1
        assert await metric(r.client, r.url, "kvtether_offered_tokens_total") == 0
        assert await metric(r.client, r.url, "kvtether_placement_decisions_total", option="decode_local",
                            reason="uncached_short") == 4
