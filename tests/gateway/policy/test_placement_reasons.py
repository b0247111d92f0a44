"""The plan's reason as a metric label (policy/reasons.py): every reason each policy writes carries a named
bucket, set where the plan is made, and each (action, bucket) a policy produces is one of the series created for it
at start-up."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from kvtether.gateway.config import POLICIES
from kvtether.gateway.policy.estimates import EstimatorSeeds, EstimatorSnapshot
from kvtether.gateway.policy.facts import CostDecision, NodeLoad, OptionEstimate
from kvtether.gateway.policy.peers import PeerKnobs
from kvtether.gateway.policy.placement import ClusterView, HandleAction, HandleState, Plan, Turn, plan
from kvtether.gateway.policy.reasons import BUCKETS, OTHER, SERIES
from kvtether.gateway.policy.rules.auto import decision_bucket

P0, D0, D1 = "http://p0", "http://d0", "http://d1"
VIEW = ClusterView((NodeLoad(P0),), (NodeLoad(D0), NodeLoad(D1)))
D0_LOST = ClusterView((NodeLoad(P0),), (NodeLoad(D0, healthy=False), NodeLoad(D1)))
ONE_WAY_P = ClusterView((NodeLoad(P0, bidirectional=False),), (NodeLoad(D0), NodeLoad(D1)))
NO_P = ClusterView((NodeLoad(P0, healthy=False),), (NodeLoad(D0), NodeLoad(D1)))
BUSY_D0 = ClusterView((NodeLoad(P0),), (NodeLoad(D0, running=60), NodeLoad(D1)))
# Reading KV costs 1 ms a token: recomputing the prompt on P beats pulling a short handle.
SLOW_LINK = EstimatorSnapshot(EstimatorSeeds(transfer_s_per_token=1e-3))


def follow_up(policy: str, **kw: Any) -> Turn:
    """A turn that extends the session's history: its 4000 held tokens all verified, 200 new."""
    args: dict[str, Any] = {"policy": policy, "new_session": False, "pinned_decode": D0,
                            "handle": HandleState.PRESENT, "handle_tokens": 4000, "prompt_tokens": 4200,
                            "reuse_tokens": 4000, "suffix_tokens": 200, "decode_cached_tokens": 4000,
                            "handle_age_s": 5.0}
    args.update(kw)
    return Turn(**args)


def first(policy: str) -> Turn:
    return Turn(policy=policy, new_session=True, prompt_tokens=3000, suffix_tokens=3000)


# (policy, turn, view, estimates, expected action, expected bucket): each rule and reason of the policies.
CASES: list[tuple[str, Turn, ClusterView, EstimatorSnapshot | None, str, str]] = [
    # The pull rule (rules/pull.py): every cold why, and both pulls.
    ("pull first turn", first("pull"), VIEW, None, "none", "first_turn"),
    ("pull no handle", follow_up("pull", handle=HandleState.MISSING), VIEW, None, "none", "no_handle"),
    ("pull expired", follow_up("pull", handle=HandleState.EXPIRED), VIEW, None, "none", "no_handle"),
    ("pull node lost", follow_up("pull"), D0_LOST, None, "none", "node_lost"),
    ("pull node lost, no handle", follow_up("pull", handle=HandleState.MISSING), D0_LOST, None, "none", "node_lost"),
    ("pull unverified", follow_up("pull", reuse_tokens=None), VIEW, None, "none", "guard_refused"),
    ("pull one-way P", follow_up("pull"), ONE_WAY_P, None, "none", "no_bidirectional_prefill"),
    ("pull short reuse", follow_up("pull", reuse_tokens=10), VIEW, None, "none", "guard_refused"),
    ("pull diverged, no partial", follow_up("pull", reuse_tokens=3000, partial_reuse=False), VIEW, None, "none",
     "guard_refused"),
    ("pull diverged, two groups", follow_up("pull", reuse_tokens=3000, handle_groups=2), VIEW, None, "none",
     "guard_refused"),
    ("pull attach", follow_up("pull"), VIEW, None, "attach", "handle_verified"),
    ("pull truncate", follow_up("pull", reuse_tokens=3000), VIEW, None, "truncate", "handle_verified"),
    # The other fixed rules.
    ("no-pull", follow_up("no-pull"), VIEW, None, "none", "policy_fixed"),
    ("no-pull first turn", first("no-pull"), VIEW, None, "none", "policy_fixed"),
    ("reference attach", follow_up("reference"), VIEW, None, "attach", "policy_fixed"),
    ("reference no handle", follow_up("reference", handle=HandleState.MISSING), VIEW, None, "none", "policy_fixed"),
    ("reference first turn", first("reference"), VIEW, None, "none", "policy_fixed"),
    # auto (costmodel.choose): the option that won on cost, or what ruled the pull out.
    ("auto first turn", first("auto"), VIEW, None, "none", "first_turn"),
    ("auto local", follow_up("auto"), VIEW, None, "decode_local", "local_cheapest"),
    ("auto pull, rebalanced", follow_up("auto"), BUSY_D0, None, "attach", "pull_cheapest"),
    ("auto pull truncated", follow_up("auto", handle_tokens=4100, reuse_tokens=4000), BUSY_D0, None, "truncate",
     "pull_cheapest"),
    ("auto cold", follow_up("auto", handle_tokens=100, reuse_tokens=100, prompt_tokens=12000, suffix_tokens=11900,
                            decode_cached_tokens=100), VIEW, SLOW_LINK, "none", "cold_cheapest"),
    ("auto no handle", follow_up("auto", handle=HandleState.MISSING), VIEW, None, "decode_local", "no_handle"),
    ("auto expired", follow_up("auto", handle=HandleState.EXPIRED), VIEW, None, "decode_local", "no_handle"),
    ("auto handle expires in P's queue", follow_up("auto", handle_age_s=10_000.0), VIEW, None, "decode_local",
     "no_handle"),
    ("auto refused", follow_up("auto", reuse_tokens=10), VIEW, None, "decode_local", "guard_refused"),
    ("auto node lost", follow_up("auto"), D0_LOST, None, "none", "node_lost"),
    ("auto one-way P", follow_up("auto"), ONE_WAY_P, None, "decode_local", "no_bidirectional_prefill"),
    ("auto one-way P, long suffix", follow_up("auto", prompt_tokens=16000, suffix_tokens=12000), ONE_WAY_P, None,
     "none", "no_bidirectional_prefill"),
    ("auto forced", follow_up("auto", prompt_tokens=24000, suffix_tokens=20000), NO_P, None, "decode_local",
     "forced"),
    # A two-token answer cannot take what a prefill still running on D0 would stall it within the TPOT objective:
    # the pull (to D0) is over that limit; the cold prefill, whose answer arrives later, is not.
    ("auto pull over a limit", follow_up("auto", expected_output_tokens=2, running_prefills=((D0, 0.5, 0.5, 0.3, 0),)),
     ClusterView((NodeLoad(P0),), (NodeLoad(D0, running=2),)), None, "none", "pull_over_limit"),
    # auto without a verified prompt length goes the pull rule's way.
    ("auto unverified", follow_up("auto", prompt_tokens=None), VIEW, None, "none", "guard_refused"),
    ("auto unverified first turn", Turn(policy="auto", new_session=True), VIEW, None, "none", "first_turn"),
]


@pytest.mark.parametrize(("turn", "view", "est", "action", "bucket"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_every_reason_of_every_policy_has_its_bucket(turn: Turn, view: ClusterView, est: EstimatorSnapshot | None,
                                                     action: str, bucket: str) -> None:
    p = plan(turn, view, est)
    assert (p.action.value, p.bucket) == (action, bucket), p.reason
    assert bucket in BUCKETS and bucket != OTHER
    # Created at zero for the policy at start-up.
    assert (action, bucket) in SERIES[turn.policy]


BUSY_P = ClusterView((NodeLoad(P0, waiting=2),), (NodeLoad(D0), NodeLoad(D1)))
FULL_D0 = ClusterView((NodeLoad(P0),), (NodeLoad(D0, kv_usage=0.9), NodeLoad(D1)))
LOAD_RULE, VETO = PeerKnobs(dynamo_rule="prefill_load"), PeerKnobs(dynamo_decode_busy_share=0.5)
# The peer gateways' rules (policy/peers.py), with the knobs that reach each of their reasons.
PEER_CASES: list[tuple[str, Turn, ClusterView, PeerKnobs | None, str, str]] = [
    ("dynamo short uncached", follow_up("dynamo"), VIEW, None, "decode_local", "uncached_short"),
    ("dynamo long uncached", follow_up("dynamo", decode_cached_tokens=0), VIEW, None, "none", "uncached_long"),
    ("dynamo first turn", first("dynamo"), VIEW, None, "none", "uncached_long"),
    ("dynamo prefill busy", follow_up("dynamo", decode_cached_tokens=0), BUSY_P, LOAD_RULE, "decode_local",
     "prefill_busy"),
    ("dynamo decode busy", follow_up("dynamo"), FULL_D0, VETO, "none", "decode_busy"),
    ("dynamo node lost", follow_up("dynamo"), D0_LOST, None, "none", "node_lost"),
    ("llm-d short uncached", follow_up("llm-d", prompt_tokens=4010), VIEW, None, "decode_local", "uncached_short"),
    ("llm-d long uncached", follow_up("llm-d"), VIEW, None, "none", "uncached_long"),
]


@pytest.mark.parametrize(("turn", "view", "peers", "action", "bucket"), [c[1:] for c in PEER_CASES],
                         ids=[c[0] for c in PEER_CASES])
def test_every_reason_of_the_peer_rules_has_its_bucket(turn: Turn, view: ClusterView, peers: PeerKnobs | None,
                                                       action: str, bucket: str) -> None:
    p = plan(turn, view, peers=peers)
    assert (p.action.value, p.bucket) == (action, bucket), p.reason
    if bucket != "node_lost":  # a lost node's turn is counted when it happens (not pre-created)
        assert (action, bucket) in SERIES[turn.policy]


def test_a_turn_run_over_a_pool_quota_for_its_ttft_objective_has_a_bucket_of_its_own() -> None:
    """costmodel's rescue (``ttft_over_quota``, reached from the facts in test_stallquota.py): forced, and told
    apart from a turn forced because nothing else could run it."""
    local = OptionEstimate("decode_local", False, "TPOT quota: …", soft=True, ttft_s=0.5, decode_url=D0)
    rescued = CostDecision("decode_local", "auto -> decode_local (forced): …", {}, None, D0, options=(local,),
                           forced=True, rescued=True)
    assert decision_bucket(rescued, False, None) == "ttft_rescue"
    assert decision_bucket(replace(rescued, rescued=False), False, None) == "forced"
    for action in ("decode_local", "attach", "truncate", "none"):
        assert (action, "ttft_rescue") in SERIES["auto"]


def test_the_cases_reach_every_bucket_but_other() -> None:
    reached = {c[5] for c in CASES} | {c[5] for c in PEER_CASES} | {"ttft_rescue"}  # the test above
    assert reached == set(BUCKETS) - {OTHER}


def test_a_plan_no_rule_named_is_other() -> None:
    # Built by hand: no rule named its bucket, whatever its reason says.
    assert Plan(P0, D0, HandleAction.NONE, 0, "session pinned to decode x; cold prefill: new session").bucket == OTHER
    # auto: a pull ruled out for a reason this version does not know.
    auto = plan(follow_up("auto", handle=HandleState.MISSING), VIEW)
    assert auto.decision is not None
    odd = tuple(replace(o, why_not="a new limit") if o.option == "pull" else o for o in auto.decision.options)
    assert decision_bucket(replace(auto.decision, options=odd), auto.re_placed, auto.handle_outcome) == OTHER
    # ... or an option name it does not know.
    strange = CostDecision("teleport", "auto -> teleport", {}, P0, D0, 0, "auto",  # type: ignore[arg-type]
                           options=(OptionEstimate("pull", True),))
    assert decision_bucket(strange, False, None) == OTHER


def test_every_series_is_of_a_known_action_and_bucket() -> None:
    actions = {a.value for a in HandleAction}
    for policy, series in SERIES.items():
        assert policy in POLICIES
        assert len(set(series)) == len(series)
        assert all(a in actions and b in BUCKETS and b != OTHER for a, b in series), policy
