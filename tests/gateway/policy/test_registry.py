"""Policies as objects (policy/registry.py): a policy is one file that declares its rule and its traits, the
gateway asks the traits (never the name), and the declared traits are what it does."""

from __future__ import annotations

import ast
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from kvtether.gateway import telemetry as T
from kvtether.gateway.config import ConfigError, load_config
from kvtether.gateway.policy.facts import NodeLoad
from kvtether.gateway.policy.placement import (
    ClusterView,
    HandleAction,
    HandleState,
    Plan,
    PlanInputs,
    Turn,
    choose_decode,
    plan,
    preferred_p,
)
from kvtether.gateway.policy.reasons import BUCKETS, FIRST_TURN, POLICY_FIXED, SERIES
from kvtether.gateway.policy.registry import Policy, names, policy_named, register, registered
from kvtether.gateway.policy.rules.pull import PULL
from kvtether.gateway.shell.app import create_app
from kvtether.gateway.shell.server import serve_gateway
from kvtether.sim.cluster import ClusterSpec, SimCluster
from prometheus_client.parser import text_string_to_metric_families

from tests.support.gateway_agent import chat, first_messages, next_messages, request_body

GATEWAY = Path(__file__).resolve().parents[3] / "gateway"
P0, D0, D1 = "http://p0", "http://d0", "http://d1"
VIEW = ClusterView((NodeLoad(P0),), (NodeLoad(D0), NodeLoad(D1)))


# A policy of this module's own, and all it takes: its rule and its declaration. Always a cold prefill on the
# preferred prefill node, the session kept on its decode node, and nothing held for it.
def plan_stay_cold(turn: Turn, cluster: ClusterView, _inputs: PlanInputs) -> Plan:
    decode, re_placed, why = choose_decode(turn, cluster)
    p = preferred_p(cluster.prefill, turn, decode)
    assert p is not None
    bucket = FIRST_TURN if turn.new_session else POLICY_FIXED
    return Plan(p.url, decode, HandleAction.NONE, 0, f"{why}; stay-cold: cold prefill", None, re_placed,
                bucket=bucket)


STAY_COLD = Policy("stay-cold", plan_stay_cold,
                   series=((HandleAction.NONE.value, FIRST_TURN), (HandleAction.NONE.value, POLICY_FIXED)))


def test_a_policy_defined_in_one_file_plans_turns_while_registered() -> None:
    with registered(STAY_COLD):
        assert "stay-cold" in names() and SERIES["stay-cold"] == STAY_COLD.series
        first = plan(Turn(policy="stay-cold", new_session=True), VIEW)
        assert (first.prefill, first.action, first.bucket) == (P0, HandleAction.NONE, FIRST_TURN)
        later = plan(Turn(policy="stay-cold", new_session=False, pinned_decode=D1, handle=HandleState.PRESENT,
                          handle_tokens=900, prompt_tokens=1000, reuse_tokens=900), VIEW)
        assert (later.decode, later.action, later.bucket) == (D1, HandleAction.NONE, POLICY_FIXED)
        cfg = load_config(None, prefill=[P0], decode=[D0], policy="stay-cold")
        assert cfg.placement_policy is STAY_COLD
    # Undone with the block: unknown again, to the planner and to the configuration alike.
    assert "stay-cold" not in names() and "stay-cold" not in SERIES
    with pytest.raises(ValueError, match="unknown placement policy 'stay-cold'"):
        plan(Turn(policy="stay-cold", new_session=True), VIEW)
    with pytest.raises(ConfigError, match="policy must be one of auto, pull, no-pull, reference, dynamo, llm-d"):
        load_config(None, prefill=[P0], decode=[D0], policy="stay-cold")


def test_a_name_is_registered_once() -> None:
    with pytest.raises(ValueError, match="already registered"):
        register(replace(STAY_COLD, name="pull"))


def test_every_policy_declares_series_of_known_actions_and_buckets() -> None:
    actions = {a.value for a in HandleAction}
    for name in names():
        series = policy_named(name).series
        assert series and len(set(series)) == len(series), name
        assert all(a in actions and b in BUCKETS for a, b in series), name


@pytest.mark.parametrize("name", names())
def test_the_configuration_asks_the_policy(name: str) -> None:
    """What the shell reads of the configuration is what the policy declares."""
    policy = policy_named(name)
    for handles in (False, True):
        cfg = load_config(None, prefill=[P0], decode=[D0], policy=name, local_turn_handles=handles)
        assert cfg.guarded == policy.verifies_reuse
        assert cfg.cache_aware == policy.reads_decode_cache
        assert cfg.marks_local_turns == (handles and policy.marks_local_turns)


def _policy_name_tests(tree: ast.AST, known: set[str]) -> list[int]:
    """Lines comparing something named like a policy with a policy's name (`policy == "auto"`, `… in ("pull",
    …)`)."""

    def mentions_policy(node: ast.expr) -> bool:
        return any("policy" in (n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute) else "")
                   for n in ast.walk(node))

    def names_a_policy(node: ast.expr) -> bool:
        return any(isinstance(n, ast.Constant) and n.value in known for n in ast.walk(node))

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(mentions_policy(s) for s in sides) and any(names_a_policy(s) for s in sides):
                lines.append(node.lineno)
    return lines


def test_no_code_outside_the_policy_room_tests_a_policy_name() -> None:
    known = set(names())
    found = {}
    for path in sorted(GATEWAY.rglob("*.py")):
        where = path.relative_to(GATEWAY).as_posix()
        if where.startswith("policy/"):
            continue
        lines = _policy_name_tests(ast.parse(path.read_text()), known)
        if lines:
            found[where] = lines
    assert found == {}, "ask the policy object (config.placement_policy.<trait>) instead of its name"


def test_the_scan_finds_a_name_test() -> None:
    known = set(names())
    assert _policy_name_tests(ast.parse('if config.policy == "auto": pass'), known) == [1]
    assert _policy_name_tests(ast.parse('x = sv.config.policy not in ("pull", "reference")'), known) == [1]
    assert _policy_name_tests(ast.parse('x = choice in ("none", "auto")'), known) == []


# ---- on the simulator: a turn served under a policy, and what its traits make the gateway do -----------------


async def _two_turns(policy: str, **settings: Any) -> tuple[list[str], list[bool], dict[tuple[str, str], float]]:
    """Two turns of one session on 1P+1D: each turn's reason bucket (the answer's header), whether the store held
    a handle after it, and the placement series the gateway created before the first turn."""
    spec = ClusterSpec(prefill=1, decode=1, speed=50.0, kv_recompute_threshold=4, kv_lease_duration=3600.0,
                       prefill_prefix_caching=False)
    buckets, held = [], []
    async with SimCluster(spec) as cluster:
        cfg = load_config(None, prefill=cluster.prefill_urls, decode=cluster.decode_urls, policy=policy,
                          min_reuse_tokens=4, metrics_poll_interval_s=600.0, **settings)
        app = create_app(cfg)
        async with serve_gateway(cfg, app=app) as url, httpx.AsyncClient(timeout=60) as client:
            series = _placement_series((await client.get(f"{url}/metrics")).text)
            store = app.state.gateway.orchestrator.sv.store
            messages = first_messages(71)
            for turn in range(2):
                meta: dict[str, str] = {}
                got = await chat(client, url, request_body(messages, stream=False), {"x-session-id": "traits"},
                                 response_headers=meta)
                buckets.append(meta[T.HEADER_PLAN_REASON])
                state = await store.get("traits")
                held.append(state is not None and state.handle is not None)
                messages = next_messages(messages, got, 71, turn)
    return buckets, held, series


def _placement_series(text: str) -> dict[tuple[str, str], float]:
    return {(s.labels["option"], s.labels["reason"]): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == T.M_PLACEMENT_DECISIONS}


@pytest.mark.anyio
async def test_a_policy_defined_in_one_file_serves_a_session() -> None:
    with registered(STAY_COLD):
        buckets, held, series = await _two_turns("stay-cold")
    assert buckets == [FIRST_TURN, POLICY_FIXED]
    assert held == [False, False]  # keeps_handles off: D's handle released, never stored
    assert series == dict.fromkeys(STAY_COLD.series, 0.0)


@pytest.mark.anyio
@pytest.mark.parametrize("keeps", [True, False])
async def test_keeping_handles_is_the_policys_declaration(keeps: bool) -> None:
    """The pull rule, declared once as is and once keeping no handle: the second never stores one, so its next
    turn has nothing to pull."""
    policy = PULL if keeps else replace(PULL, name="pull-keeping-nothing", keeps_handles=False)
    if keeps:
        buckets, held, _ = await _two_turns(policy.name)
    else:
        with registered(policy):
            buckets, held, _ = await _two_turns(policy.name)
    assert held == [keeps, keeps]
    assert buckets == [FIRST_TURN, "handle_verified" if keeps else "no_handle"]
