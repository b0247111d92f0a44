"""Unit tests of the gateway's pure core: guard, placement, sessions, config, body rules. No I/O."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from kvtether.gateway.config import ConfigError, GatewayConfig, load_config
from kvtether.gateway.guard.verify import HeldSequence, is_exact_extension, truncate_handle, verified_reuse
from kvtether.gateway.policy import PolicyKnobs
from kvtether.gateway.policy.placement import (
    ClusterView,
    HandleAction,
    HandleState,
    NoCapacity,
    NodeLoad,
    Turn,
    plan,
    plan_aggregated,
)
from kvtether.gateway.stores import MemorySessionStore
from kvtether.gateway.stores.sessions import SessionState
from kvtether.gateway.turn import body as B

# ---- guard ----------------------------------------------------------------------------------


@pytest.mark.parametrize("bs", [1, 4, 16])
@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 64, 100])
def test_held_sequence_exact_extension(bs: int, n: int) -> None:
    held_tokens = list(range(1000, 1000 + n))
    held = HeldSequence.from_tokens(held_tokens, bs)
    assert held.num_tokens == n
    assert len(held.tail) < bs
    prompt = [*held_tokens, 7, 8, 9]
    assert verified_reuse(held, prompt) == n
    assert is_exact_extension(held, prompt)
    assert verified_reuse(held, held_tokens) == n


def test_guard_finds_first_divergence_block_aligned_and_exact_in_tail() -> None:
    bs = 4
    tokens = list(range(30))  # 7 full blocks (28) + tail of 2
    held = HeldSequence.from_tokens(tokens, bs)
    for pos in range(30):
        prompt = list(tokens)
        prompt[pos] = -1
        reuse = verified_reuse(held, prompt)
        if pos < 28:
            assert reuse == (pos // bs) * bs  # a mismatching block proves nothing about its start
        else:
            assert reuse == pos  # the tail is compared token by token
        assert not is_exact_extension(held, prompt)
        assert reuse <= pos


def test_guard_short_prompt_and_removed_middle() -> None:
    tokens = list(range(100))
    held = HeldSequence.from_tokens(tokens, 16)
    assert verified_reuse(held, tokens[:50]) == 48
    assert verified_reuse(held, tokens[:40] + tokens[50:]) == 32
    assert verified_reuse(held, []) == 0


def test_guard_never_overstates_reuse_randomised() -> None:
    import random

    rng = random.Random(7)
    for _ in range(300):
        bs = rng.choice([1, 2, 16])
        held_tokens = [rng.randrange(5) for _ in range(rng.randrange(0, 60))]
        prompt = [rng.randrange(5) for _ in range(rng.randrange(0, 80))]
        if rng.random() < 0.5:
            prompt = held_tokens[: rng.randrange(0, len(held_tokens) + 1)] + prompt
        reuse = verified_reuse(HeldSequence.from_tokens(held_tokens, bs), prompt)
        assert prompt[:reuse] == held_tokens[:reuse]
        true_lcp = next((i for i, (a, b) in enumerate(zip(held_tokens, prompt, strict=False)) if a != b),
                        min(len(held_tokens), len(prompt)))
        assert true_lcp - reuse < bs  # at most the part of one block is given away


def test_truncate_handle_per_protocol() -> None:
    handle = {"remote_num_tokens": 99, "remote_block_ids": [[10, 11, 12, 13, 14, 15, 16]], "remote_host": "x"}
    out = truncate_handle(handle, 33, 16)
    assert out["remote_num_tokens"] == 33
    assert out["remote_block_ids"] == [[10, 11, 12]]  # ceil(33/16) = 3
    assert handle["remote_block_ids"] == [[10, 11, 12, 13, 14, 15, 16]]  # the original is untouched
    assert truncate_handle(handle, 32, 16)["remote_block_ids"] == [[10, 11]]
    two = truncate_handle({"remote_num_tokens": 40, "remote_block_ids": [[1, 2, 3], [4, 5, 6]]}, 17, 16)
    assert two["remote_block_ids"] == [[1, 2], [4, 5]]
    with pytest.raises(ValueError):
        truncate_handle(handle, -1, 16)


# ---- placement --------------------------------------------------------------------------------

P1, P2, D1, D2 = "http://p1:1", "http://p2:1", "http://d1:1", "http://d2:1"


def cluster(**over: NodeLoad) -> ClusterView:
    nodes = {"p1": NodeLoad(P1), "p2": NodeLoad(P2, running=3), "d1": NodeLoad(D1), "d2": NodeLoad(D2, waiting=1)}
    nodes.update(over)
    return ClusterView((nodes["p1"], nodes["p2"]), (nodes["d1"], nodes["d2"]))


def existing(**kw: object) -> Turn:
    base: dict[str, object] = dict(policy="pull", new_session=False, pinned_decode=D2, handle=HandleState.PRESENT,
                                   handle_tokens=500, prompt_tokens=700, reuse_tokens=500)
    base.update(kw)
    return Turn(**base)  # type: ignore[arg-type]


def test_new_session_goes_to_least_loaded_cold() -> None:
    p = plan(Turn(policy="pull", new_session=True), cluster())
    assert (p.prefill, p.decode, p.action) == (P1, D1, HandleAction.NONE)
    assert "new session" in p.reason and p.handle_outcome is None


def test_exact_extension_attaches_on_pinned_decode() -> None:
    p = plan(existing(), cluster())
    assert p.decode == D2  # pinned even though more loaded
    assert p.action is HandleAction.ATTACH and p.reuse_tokens == 500 and p.handle_outcome == "attached"
    assert "pinned" in p.reason


def test_partial_match_truncates_or_goes_cold() -> None:
    p = plan(existing(reuse_tokens=300), cluster())
    assert p.action is HandleAction.TRUNCATE and p.reuse_tokens == 300 and p.handle_outcome == "truncated"
    p = plan(existing(reuse_tokens=300, partial_reuse=False), cluster())
    assert p.action is HandleAction.NONE and p.handle_outcome == "refused_by_guard"
    p = plan(existing(reuse_tokens=300, handle_groups=2), cluster())
    assert p.action is HandleAction.NONE
    p = plan(existing(reuse_tokens=10), cluster())
    assert p.action is HandleAction.NONE and "threshold" in p.reason


def test_regenerated_turn_never_offers_the_whole_prompt() -> None:
    # The prompt equals the held prefix: P must still compute its last token itself.
    p = plan(existing(prompt_tokens=400, reuse_tokens=400), cluster())
    assert p.action is HandleAction.TRUNCATE and p.reuse_tokens == 399


def test_handle_states_and_unverified() -> None:
    assert plan(existing(handle=HandleState.MISSING), cluster()).handle_outcome == "missing"
    assert plan(existing(handle=HandleState.EXPIRED), cluster()).handle_outcome == "expired"
    p = plan(existing(reuse_tokens=None, prompt_tokens=None), cluster())
    assert p.action is HandleAction.NONE and p.handle_outcome == "refused_by_guard"


def test_dead_pinned_decode_is_replaced_cold() -> None:
    p = plan(existing(), cluster(d2=NodeLoad(D2, healthy=False)))
    assert p.decode == D1 and p.re_placed and p.action is HandleAction.NONE
    p = plan(existing(exclude=frozenset({D2})), cluster())
    assert p.decode == D1 and p.re_placed


def test_handles_only_to_bidirectional_prefill() -> None:
    c = cluster(p1=NodeLoad(P1, bidirectional=False))
    p = plan(existing(), c)
    assert p.prefill == P2 and p.action is HandleAction.ATTACH
    c = cluster(p1=NodeLoad(P1, bidirectional=False), p2=NodeLoad(P2, bidirectional=False))
    p = plan(existing(), c)
    assert p.action is HandleAction.NONE and p.prefill == P1
    p = plan(existing(policy="reference", round_robin=0), c)
    assert p.action is HandleAction.NONE


def test_every_policy_is_one_rule_behind_one_call() -> None:
    """Each policy an operator may configure has its rule, and plan() is the only way in."""
    from kvtether.gateway.config import POLICIES
    from kvtether.gateway.policy.registry import names

    assert set(POLICIES) == set(names())
    for name in names():
        p = plan(existing(policy=name), cluster())
        assert p.decode in (D1, D2) and p.reason, name
    with pytest.raises(ValueError, match="unknown placement policy"):
        plan(existing(policy="fastest"), cluster())


def test_no_pull_never_attaches_and_reference_round_robins_unchecked() -> None:
    assert plan(existing(policy="no-pull"), cluster()).action is HandleAction.NONE
    plans = [plan(existing(policy="reference", round_robin=i, reuse_tokens=0), cluster()) for i in range(4)]
    assert [p.prefill for p in plans] == [P1, P2, P1, P2]
    assert [p.decode for p in plans] == [D1, D2, D1, D2]
    assert all(p.action is HandleAction.ATTACH for p in plans)  # no guard: that is its flaw


def test_no_capacity() -> None:
    with pytest.raises(NoCapacity):
        plan(Turn(policy="pull", new_session=True), ClusterView((NodeLoad(P1, healthy=False),), (NodeLoad(D1),)))
    with pytest.raises(NoCapacity):
        plan(Turn(policy="pull", new_session=True), ClusterView((NodeLoad(P1),), ()))


def test_plan_is_exhaustively_sane() -> None:
    # Every combination yields a plan whose attach decisions respect the guard and capability rules.
    for state, reuse, partial, bidi, d2_ok in itertools.product(
        list(HandleState), [None, 0, 63, 64, 300, 500], [True, False], [True, False], [True, False]
    ):
        c = cluster(p1=NodeLoad(P1, bidirectional=bidi), p2=NodeLoad(P2, bidirectional=bidi),
                    d2=NodeLoad(D2, healthy=d2_ok))
        p = plan(existing(handle=state, reuse_tokens=reuse, partial_reuse=partial), c)
        assert p.reason
        if p.action is not HandleAction.NONE:
            assert state is HandleState.PRESENT and bidi and d2_ok and reuse is not None and reuse >= 64
            assert p.decode == D2
            assert (p.action is HandleAction.ATTACH) == (reuse == 500)
            assert partial or p.action is HandleAction.ATTACH


def test_aggregated_affinity() -> None:
    reps = (NodeLoad("http://a:1", running=2), NodeLoad("http://b:1"))
    assert plan_aggregated(None, reps).decode == "http://b:1"
    assert plan_aggregated("http://a:1", reps).decode == "http://a:1"
    p = plan_aggregated("http://a:1", (NodeLoad("http://a:1", healthy=False), NodeLoad("http://b:1")))
    assert p.decode == "http://b:1" and p.re_placed


# ---- sessions ----------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.anyio
async def test_store_take_handle_is_single_use_and_expiry_sweeps() -> None:
    clock = FakeClock()
    store = MemorySessionStore(clock=clock)
    await store.put(SessionState("s", decode=D1, handle={"x": 1}, handle_at=100.0, expires_at=110.0, prefix_key="k"))
    assert await store.find_by_prefix("k") == "s"
    taken = await store.take_handle("s")
    assert taken is not None and taken.handle == {"x": 1}
    assert await store.take_handle("s") is None
    state = await store.get("s")
    assert state is not None and state.decode == D1 and state.handle is None
    clock.now = 111.0
    assert await store.get("s") is None
    assert await store.find_by_prefix("k") is None
    await store.put(SessionState("t", expires_at=115.0))
    clock.now = 120.0
    assert await store.sweep() == 1 and await store.count() == 0


@pytest.mark.anyio
async def test_store_is_bounded_and_prefix_keys_move() -> None:
    store = MemorySessionStore(max_sessions=3, clock=FakeClock())
    for i in range(5):
        await store.put(SessionState(f"s{i}", expires_at=1e9, prefix_key=f"k{i}"))
    assert await store.count() == 3
    assert await store.find_by_prefix("k0") is None and await store.find_by_prefix("k4") == "s4"
    await store.put(SessionState("s4", expires_at=1e9, prefix_key="k4b"))
    assert await store.find_by_prefix("k4") is None and await store.find_by_prefix("k4b") == "s4"


# ---- config --------------------------------------------------------------------------------


def test_config_load_and_validate(tmp_path: Path) -> None:
    f = tmp_path / "gw.toml"
    f.write_text('[gateway]\nprefill = ["http://p:1/"]\ndecode = ["http://d:1"]\npolicy = "no-pull"\n'
                 "session_ttl_s = 100\n")
    cfg = load_config(f, port=9000, aggregated=[])
    assert cfg.prefill == ["http://p:1"] and cfg.policy == "no-pull" and cfg.port == 9000 and cfg.session_ttl_s == 100
    assert load_config(None, prefill=["http://p:1"], decode=["http://d:1"]).effective_policy == "auto"
    assert GatewayConfig(prefill=["http://p:1"], unidirectional_prefill=["http://p:1/"]).is_bidirectional(
        "http://p:1") is False
    bad: list[dict[str, object]] = [
        {"prefill": ["http://p:1"]},
        {"prefill": ["http://p:1"], "decode": ["http://d:1"], "aggregated": ["http://a:1"]},
        {"prefill": ["http://p:1"], "decode": ["http://d:1"], "policy": "magic"},
        {"prefill": ["http://p:1"], "decode": ["http://d:1"], "session_ttl_s": 500.0},
        {"prefill": ["p:1"], "decode": ["http://d:1"]},
        {"prefill": ["http://p:1"], "decode": ["http://d:1"], "session_ttl_s": "x"},
        {"aggregated": ["http://a:1"], "nonsense": 1},
    ]
    for over in bad:
        with pytest.raises(ConfigError):
            load_config(None, **over)
    keyed = load_config(None, prefill=["http://p:1"], decode=["http://d:1"], reasoning_key="k" * 16,
                        responses_ttl_s=60)
    assert keyed.reasoning_key == "k" * 16 and keyed.responses_ttl_s == 60
    for over in ({"reasoning_key": "short"}, {"reasoning_key": 5}, {"responses_ttl_s": 0}):
        with pytest.raises(ConfigError, match=next(iter(over))):
            load_config(None, prefill=["http://p:1"], decode=["http://d:1"], **over)
    f.write_text("prefil = 1\n")
    with pytest.raises(ConfigError, match="unknown setting"):
        load_config(f)
    f.write_text("prefill = [\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(f)


def test_model_aliases_resolve_exact_names_before_patterns_in_order_and_are_checked(tmp_path: Path) -> None:
    f = tmp_path / "gw.toml"
    f.write_text('[gateway]\naggregated = ["http://a:1"]\n[gateway.model_aliases]\n"claude-haiku-*" = "small"\n'
                 '"claude-*" = "big"\n"claude-opus-4-8" = "opus-like"\n"gpt-4?" = "big"\n')
    cfg = load_config(f)
    assert cfg.aliased("claude-opus-4-8") == "opus-like"  # an exact alias first, wherever it stands
    assert cfg.aliased("claude-haiku-4-5") == "small"  # then the patterns, the first that matches
    assert cfg.aliased("claude-sonnet-4-5") == "big"
    assert cfg.aliased("gpt-4o") == "big" and cfg.aliased("gpt-4o-mini") is None
    assert cfg.aliased("Claude-opus-4-8") is None and cfg.aliased("big") is None  # case-sensitive; no alias
    assert cfg.listed_aliases() == {"claude-opus-4-8": "opus-like"}
    for aliases in ({"": "big"}, {"x": ""}, {"x": 3}, {"big": "big"}, "big"):
        with pytest.raises(ConfigError, match="model_aliases"):
            load_config(None, aggregated=["http://a:1"], model_aliases=aliases)


def test_tuning_overrides_reach_the_cost_model_and_are_checked(tmp_path: Path) -> None:
    """The cost model's constants are not settings, but [gateway.tuning] overrides them for experiments: the
    values reach PolicyKnobs and the estimator; unknown names and wrong types are refused by name."""
    from kvtether.gateway.turn.place import learning_params, policy_knobs

    f = tmp_path / "gw.toml"
    f.write_text('[gateway]\nprefill = ["http://p:1"]\ndecode = ["http://d:1"]\nmax_local_suffix_tokens = 512\n'
                 "[gateway.tuning]\ninterference-weight = 0.5\nhorizon_turns = 2\nestimate_half_life_s = 60\n"
                 "ttft_over_quota = false\n")
    cfg = load_config(f)
    knobs = policy_knobs(cfg)
    assert (knobs.interference_weight, knobs.horizon_turns, knobs.max_local_suffix_tokens) == (0.5, 2, 512)
    assert knobs.ttft_over_quota is False and PolicyKnobs().ttft_over_quota
    assert knobs.tail_weight == PolicyKnobs().tail_weight  # untouched constants keep their defaults
    assert learning_params(cfg).half_life_s == 60
    base = {"prefill": ["http://p:1"], "decode": ["http://d:1"]}
    for tuning, message in (({"max_local_suffix_tokens": 1}, "unknown constant"),  # a setting, not tuning
                            ({"decode_stall_share": 0.1}, "unknown constant"),
                            ({"horizon_turns": 1.5}, "must be an integer"),
                            ({"interference_weight": "x"}, "must be a number"),
                            ({"ttft_over_quota": 0}, "must be true or false"),
                            ({"horizon_turns": 9}, "horizon_turns must be in"),
                            ({"estimate_half_life_s": 0}, "estimate_half_life_s must be > 0")):
        with pytest.raises(ConfigError, match=message):
            load_config(None, **base, tuning=tuning)
    for name, value in (("block_size", "16"), ("read_timeout_s", "5"), ("model", 7)):
        with pytest.raises(ConfigError, match=name):
            load_config(None, **base, **{name: value})


# ---- body rules ----------------------------------------------------------------------------------


def test_prefill_and_decode_bodies() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 50,
            "max_completion_tokens": 50, "stream_options": {"include_usage": True}, "min_tokens": 3,
            "return_token_ids": True}
    p = B.prefill_body(body, None)
    assert p["stream"] is False and p["max_tokens"] == 1 and p["max_completion_tokens"] == 1
    assert "stream_options" not in p and "min_tokens" not in p and "return_token_ids" not in p
    assert p["kv_transfer_params"]["do_remote_decode"] is True
    d = B.decode_body(body, {"a": 1}, want_token_ids=True)
    assert d["stream"] is True and d["max_tokens"] == 50 and d["kv_transfer_params"] == {"a": 1}
    assert d["return_token_ids"] is True
    assert "kv_transfer_params" not in body  # inputs are never mutated
    assert body["stream"] is True and body["max_tokens"] == 50 and "stream_options" in body and "min_tokens" in body
    assert B.with_host({"remote_host": "localhost", "x": 1}, "10.0.0.2") == {"remote_host": "10.0.0.2", "x": 1}


def test_strip_internal() -> None:
    resp = {"id": "x", "prompt_token_ids": [1], "kv_transfer_params": {"a": 1},
            "choices": [{"message": {"content": "x"}, "token_ids": [2], "finish_reason": "stop"}]}
    assert B.strip_internal(resp, keep_token_ids=False)
    assert resp == {"id": "x", "choices": [{"message": {"content": "x"}, "finish_reason": "stop"}]}
    resp2 = {"prompt_token_ids": [1], "kv_transfer_params": None, "choices": [{"token_ids": [2]}]}
    B.strip_internal(resp2, keep_token_ids=True)
    assert resp2 == {"prompt_token_ids": [1], "choices": [{"token_ids": [2]}]}


def test_a_null_kv_transfer_params_counts_as_stripped() -> None:
    """The relay re-serializes a chunk only when strip_internal says it changed: a null field removed from
    the parsed chunk must say so, or the original line (field included) reaches the client."""
    chunk = {"id": "x", "kv_transfer_params": None, "choices": [{"delta": {"content": "hi"}}]}
    assert B.strip_internal(chunk, keep_token_ids=True)
    assert "kv_transfer_params" not in chunk
    assert not B.strip_internal({"id": "x", "choices": [{"delta": {"content": "hi"}}]}, keep_token_ids=True)


def test_chat_chains_link_a_turn_to_the_next() -> None:
    body1 = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    answer = {"role": "assistant", "content": "hello", "reasoning_content": "think"}
    assert B.chat_chain(body1).parent is None
    own = B.chat_chain(body1).after(answer)
    # The client echoes the answer back (without reasoning, with content "" → same key when relevant).
    body2 = {"model": "m", "messages": [*body1["messages"], {"role": "assistant", "content": "hello"},
                                        {"role": "user", "content": "next"}]}
    assert B.chat_chain(body2).parent == own
    other_model = {**body2, "model": "other"}
    assert B.chat_chain(other_model).parent != own


def test_stream_answer_accumulates_tool_calls() -> None:
    a = B.StreamAnswer()
    a.add({"delta": {"role": "assistant", "content": None}})
    a.add({"delta": {"tool_calls": [{"index": 0, "id": "c1", "type": "function",
                                     "function": {"name": "ls", "arguments": ""}}]}})
    a.add({"delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"p":'}}]}})
    a.add({"delta": {"tool_calls": [{"index": 0, "function": {"arguments": '"/"}'}}]}})
    assert a.message() == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": '{"p":"/"}'}}]}


def test_tokenize_body_and_literal_ids() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}],
            "chat_template_kwargs": {"enable_thinking": False}}
    t = B.tokenize_body("chat", body)
    assert t is not None and t["add_generation_prompt"] is True and t["tools"] == body["tools"]
    assert t["chat_template_kwargs"] == {"enable_thinking": False}
    assert B.tokenize_body("completions", {"model": "m", "prompt": ["a", "b"]}) is None
    assert B.literal_prompt_ids("completions", {"prompt": [1, 2, 3]}) == [1, 2, 3]


def test_a_turns_sequence_is_built_once_and_its_slices_hold_what_lists_would() -> None:
    from kvtether.gateway.turn.context import LegResult

    prompt, output = list(range(100, 140)), [7, 8, 9]
    result = LegResult(prompt_ids=prompt, output_ids=output)
    seq = result.sequence()
    assert list(seq) == prompt + output and result.sequence() is seq
    previous = HeldSequence.from_tokens(prompt[:32], 16)
    for n in (0, 15, 16, 41, 42):
        from_array = HeldSequence.from_tokens(seq[:n], 16, prefix=previous)
        assert from_array == HeldSequence.from_tokens((prompt + output)[:n], 16)


def test_parse_vllm_metrics() -> None:
    from kvtether.gateway.nodes.cluster import Node, parse_metrics, parse_version

    text = """# HELP vllm:num_requests_running Running
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m",engine="0"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m",engine="0"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="m",engine="0"} 0.25
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",enable_prefix_caching="True"} 1.0
"""
    out = parse_metrics(text)
    assert out == {"running": 3.0, "waiting": 2.0, "kv_usage": 0.25, "block_size": 128, "prefix_caching": 1}
    assert parse_version("0.32.0") == (0, 32) and parse_version("v0.33.1rc1") == (0, 33) and parse_version("x") is None
    assert not Node("http://d:1", "decode", version="0.32.0").stream_handles
    assert Node("http://d:1", "decode", version="0.33.0").stream_handles
    node = Node("http://d:1", "decode", running=1, inflight=4)
    assert node.load().running == 4  # the gateway's own open requests count before the next poll


def test_parse_metrics_reads_only_the_placement_gauges() -> None:
    """The line filter before the parser keeps the gauges' samples with or without labels (braces and spaces
    inside label values too) and drops the rest: histograms, series whose name only starts with a gauge's."""
    from kvtether.gateway.nodes.cluster import parse_metrics

    hist = "".join(f'vllm:time_to_first_token_seconds_bucket{{le="{b}",model_name="m"}} {i}\n'
                   for i, b in enumerate((0.001, 0.01, 0.1, 1.0, "+Inf")))
    text = f"""# TYPE vllm:time_to_first_token_seconds histogram
{hist}vllm:num_requests_running{{model_name="m",engine="0"}} 3.0
vllm:num_requests_running{{model_name="m",engine="1"}} 1.0
vllm:num_requests_waiting_by_reason{{reason="preempted"}} 9.0
vllm:num_requests_waiting {{}} 2.0
vllm:num_requests_waiting_total 7.0
vllm:kv_cache_usage_perc{{model_name="a {{b}} c"}} 0.5
"""
    assert parse_metrics(text) == {"running": 4.0, "waiting": 2.0, "kv_usage": 0.5}


def test_a_nodes_load_carries_each_count_under_its_own_name() -> None:
    """What the cost model reads of a node (prefix caching, arrivals, hold-back) comes from the field of the
    same name: a swapped pair here silently misplaces turns, with no error anywhere."""
    from kvtether.gateway.nodes.cluster import Node

    node = Node("http://d1", "decode", running=2.0, waiting=1.0, kv_usage=0.5, prefix_caching=True,
                arriving=3, holding_back=1, arrivals={7: (10.0, 0.5)})
    load = node.load(now=9.0)
    assert (load.running, load.waiting, load.kv_usage) == (2.0, 1.0, 0.5)
    assert load.prefix_caching is True and load.arriving == 3.0 and load.holding_back == 1.0
    assert load.arrivals == ((1.0, 0.5),)
    assert Node("http://p1", "prefill", prefix_caching=None).load().prefix_caching is False


def test_parse_metrics_reads_the_kv_cache_config() -> None:
    # vLLM's cache_config_info carries every CacheConfig field as a label (None ones as "None").
    from kvtether.gateway.nodes.cluster import parse_metrics

    info = ('vllm:cache_config_info{block_size="64",cache_dtype="auto",enable_prefix_caching="%s",'
            'num_cpu_blocks="None",num_gpu_blocks="%s",engine="0"} 1.0\n')
    got = parse_metrics(info % ("True", "6772"))
    assert got["block_size"] == 64 and got["kv_capacity_tokens"] == 6772 * 64 and got["prefix_caching"] == 1
    got = parse_metrics(info % ("False", "None"))
    assert got["prefix_caching"] == 0 and "kv_capacity_tokens" not in got


def test_own_requests_that_end_after_a_poll_leave_the_polled_running_gauge() -> None:
    import httpx
    from kvtether.gateway.nodes.cluster import Cluster

    c = Cluster(GatewayConfig(prefill=["http://p:1"], decode=["http://d:1"]), httpx.AsyncClient())
    node = c.nodes["http://d:1"]
    c.begin(node.url)
    # A poll while the request runs: the gauge counts it (and one request of another client).
    node.running, node.inflight_at_poll = 2.0, node.inflight
    c.begin(node.url)  # opened after the poll: not inside the gauge
    c.end(node.url)
    assert node.load().running == 1.0  # one of ours ended: the other client's request and ours still open
    c.end(node.url)
    assert node.inflight == 0 and node.load().running == 1.0  # the polled-in one was already taken off


def test_a_pd_turns_arrival_on_its_decode_node_is_kept_until_its_read_should_be_over() -> None:
    """heading_to records when a P/D turn should reach D and D's read seconds; the view gives them relative
    to now. Once the prefill leg is done the arrival is when it went, until the read is over; a failed leg
    leaves nothing behind."""
    import httpx
    from kvtether.gateway.nodes.cluster import Cluster

    t = [100.0]
    c = Cluster(GatewayConfig(prefill=["http://p:1"], decode=["http://d:1"]), httpx.AsyncClient())
    d = c.nodes["http://d:1"]
    with c.heading_to(d.url, (100.3, 0.05), lambda: t[0]):
        assert d.arriving == 1
        [(at, read)] = c.view(100.1).decode[0].arrivals
        assert at == pytest.approx(0.2) and read == 0.05
        assert c.view().decode[0].arrivals == ()  # no clock, no arrivals
        t[0] = 100.2  # P answered early: the turn reaches D now
    assert d.arriving == 0
    [(at, read)] = c.view(100.21).decode[0].arrivals
    assert at == pytest.approx(-0.01) and read == 0.05
    assert c.view(100.3).decode[0].arrivals == ()  # its read is over
    with pytest.raises(RuntimeError), c.heading_to(d.url, (101.0, 0.05), lambda: t[0]):
        raise RuntimeError("prefill failed")
    assert d.arriving == 0 and c.view(100.21).decode[0].arrivals[0][0] == pytest.approx(-0.01)
    assert len(d.arrivals) == 1
    t[0] = 200.0
    with c.heading_to(d.url, (200.5, 0.05), lambda: t[0]):
        assert len(d.arrivals) == 1  # the old one, long over, was dropped


# ---- policy "auto": the cost model's decision mapped onto a Plan -----------------------------------------


def auto(**kw: object) -> Turn:
    base: dict[str, object] = dict(policy="auto", new_session=False, pinned_decode=D2, handle=HandleState.PRESENT,
                                   handle_tokens=12_000, prompt_tokens=12_200, reuse_tokens=12_000,
                                   suffix_tokens=200, decode_cached_tokens=12_000, expected_output_tokens=100)
    base.update(kw)
    return Turn(**base)  # type: ignore[arg-type]


def test_auto_short_suffix_runs_on_the_pinned_decode_without_a_prefill() -> None:
    p = plan(auto(), cluster(d2=NodeLoad(D2)))
    assert p.action is HandleAction.DECODE_LOCAL and p.prefill is None and p.decode == D2 and p.reuse_tokens == 0
    assert p.decision is not None and p.decision.option == "decode_local"
    assert p.reason.startswith("auto -> decode_local") and p.handle_outcome == "unused_local"


def test_auto_long_suffix_pulls_exact_or_truncated() -> None:
    idle = cluster(d2=NodeLoad(D2))  # as idle as D1: no reason to move the pin
    # Over the local limit: through P. (Within the default 8192, an idle D would run it itself.)
    limit = PolicyKnobs(max_local_suffix_tokens=2048)
    p = plan(auto(prompt_tokens=17_000, suffix_tokens=5_000, decode_cached_tokens=0), idle, None, limit)
    assert p.action is HandleAction.ATTACH and p.prefill == P1 and p.decode == D2 and p.reuse_tokens == 12_000
    assert p.handle_outcome == "attached" and p.decision is not None and p.decision.option == "pull"
    p = plan(auto(prompt_tokens=17_000, suffix_tokens=5_000, reuse_tokens=8_000, decode_cached_tokens=8_000),
             idle, None, limit)
    assert p.action is HandleAction.TRUNCATE and p.reuse_tokens == 8_000 and p.handle_outcome == "truncated"
    # A link so slow that recomputing beats reading: the verified handle is left unused, and counted so.
    from kvtether.gateway.policy.estimates import EstimatorSeeds, EstimatorSnapshot

    slow = EstimatorSnapshot(EstimatorSeeds(transfer_latency_s=2.0, transfer_s_per_token=1e-3))
    p = plan(auto(prompt_tokens=17_000, suffix_tokens=5_000, decode_cached_tokens=0), idle, slow, limit)
    assert p.action is HandleAction.NONE and p.decision is not None and p.decision.option == "cold"
    assert p.handle_outcome == "unused_cold"


def test_auto_pull_onto_a_lighter_decode_moves_the_pin_and_still_attaches_the_handle() -> None:
    busy = NodeLoad(D2, running=16, waiting=2)
    p = plan(auto(prompt_tokens=17_000, suffix_tokens=5_000, decode_cached_tokens=0), cluster(d2=busy))
    # P reads the history from D2 (the handle's node), the answer decodes on idle D1: the pin moves.
    assert p.action is HandleAction.ATTACH and p.decode == D1 and p.reuse_tokens == 12_000
    assert p.re_placed and p.handle_outcome == "attached"
    assert f"moves the pin from {D2}" in p.reason
    # The pull rule keeps its pin whatever the load (the baseline auto is compared with).
    p = plan(existing(prompt_tokens=17_000, handle_tokens=12_000, reuse_tokens=12_000), cluster(d2=busy))
    assert p.decode == D2 and p.action is HandleAction.ATTACH


def test_auto_busy_decode_refuses_a_large_local_suffix() -> None:
    busy = NodeLoad(D2, running=64)
    p = plan(auto(prompt_tokens=14_000, suffix_tokens=1_800, decode_cached_tokens=12_000), cluster(d2=busy))
    assert p.action is not HandleAction.DECODE_LOCAL
    # Its TTFT alone would win; the stall it causes to 64 running requests (interference) does not.
    assert p.decision is not None and p.decision.estimates_s["decode_local"] < p.decision.estimates_s["pull"]
    assert p.decision.scores_s["decode_local"] > p.decision.scores_s["pull"]
    assert "decode_local interference" in p.reason


def test_auto_falls_back_to_the_pull_rules_without_a_prompt_length_and_replaces_a_dead_decode() -> None:
    p = plan(auto(prompt_tokens=None, reuse_tokens=None), cluster())
    assert p.action is HandleAction.NONE and p.decision is None and p.handle_outcome == "refused_by_guard"
    p = plan(Turn(policy="auto", new_session=True), cluster())
    assert p.action is HandleAction.NONE and p.decode == D1
    p = plan(auto(), cluster(d2=NodeLoad(D2, healthy=False)))
    assert p.action is HandleAction.NONE and p.decode == D1 and p.re_placed and p.handle_outcome == "missing"


def test_auto_local_failure_retry_never_goes_local_again() -> None:
    p = plan(auto(allow_local=False), cluster(d2=NodeLoad(D2)))
    assert p.action is not HandleAction.DECODE_LOCAL
    # ... unless no prefill node is left: then the turn runs on D rather than failing.
    down = cluster(d2=NodeLoad(D2), p1=NodeLoad(P1, healthy=False), p2=NodeLoad(P2, healthy=False))
    p = plan(auto(allow_local=False), down)
    assert p.action is HandleAction.DECODE_LOCAL and p.decision is not None and p.decision.forced


def test_pull_prefers_the_sessions_previous_prefill_when_as_idle() -> None:
    p = plan(existing(last_prefill=P2), cluster(p2=NodeLoad(P2)))
    assert p.prefill == P2
    p = plan(existing(last_prefill=P2), cluster())  # P2 is busier: least loaded wins
    assert p.prefill == P1


def test_decode_nodes_the_pin_left_are_cut_to_the_prompts_overlap() -> None:
    """Each remembered prefix is a prefix of the session's history: an edit that keeps only `overlap`
    tokens of it cuts every entry to that, an edit before all of them drops them, the new pin's goes."""
    from kvtether.gateway.policy.copies import DecodeCopy, cut

    left = (DecodeCopy("http://d1", 4000), DecodeCopy("http://d2", 9000))
    assert cut(left, 12000) == left
    assert cut(left, 6000) == (("http://d1", 4000), ("http://d2", 6000))
    assert cut(left, 0) == ()
    assert cut(left, 12000, drop="http://d2") == (("http://d1", 4000),)


def test_tenant_cache_salts_are_stable_across_replicas_distinct_per_tenant_and_unguessable() -> None:
    from kvtether.gateway.tenancy import Auth

    keys = {"key-a-000001": "A", "key-a-000002": "A", "key-b-000003": "B"}
    one, two = Auth(GatewayConfig(api_keys=keys)), Auth(GatewayConfig(api_keys=dict(reversed(keys.items()))))
    a, b = one.cache_salt("A", None), one.cache_salt("B", None)
    assert a is not None and b is not None and a != b
    assert two.cache_salt("A", None) == a  # another replica, same keys: the same salt
    assert "A" not in a and one.cache_salt("A", "user-1") not in (a, "user-1")
    assert one.cache_salt("A", "user-1") != one.cache_salt("B", "user-1")
    # A tenant's salt hangs on its own keys only.
    assert Auth(GatewayConfig(api_keys={**keys, "key-b-000004": "B"})).cache_salt("A", None) == a
    assert Auth(GatewayConfig(api_keys={**keys, "key-a-000005": "A"})).cache_salt("A", None) != a
    # Off, or without tenants: the client's salt as sent.
    assert Auth(GatewayConfig(api_keys=keys, tenant_cache_salt=False)).cache_salt("A", "u") == "u"
    assert Auth(GatewayConfig()).cache_salt(None, "u") == "u" and Auth(GatewayConfig()).cache_salt(None, None) is None


def test_a_pull_is_learned_as_what_p_lacked_of_the_handle_not_the_whole_handle() -> None:
    from types import SimpleNamespace

    from kvtether.gateway.guard.readback import read_of
    from kvtether.gateway.policy.placement import HandleAction, Plan
    from kvtether.gateway.turn.context import Placement, TurnContext
    from kvtether.gateway.turn.legs import _prefill_learned

    seen: list[dict[str, object]] = []

    class Spy:
        def prefill_done(self, node: str, prompt: int, cached: int, seconds: float, **kw: object) -> None:
            seen.append({"prompt": prompt, "cached": cached, **kw})

        def wrote(self, node: str, prompt: int, hit: int) -> None:
            pass

    sv = SimpleNamespace(learning=Spy(), clock=lambda: 5.0)
    state = SessionState("s", decode="http://d0", expires_at=9.0, created_at=0.0)
    ctx = TurnContext("chat", {}, {}, False, False, "s", "header", state, 0.0, None)  # type: ignore[arg-type]
    handle = {"remote_num_tokens": 1000}
    the_plan = Plan("http://p0", "http://d0", HandleAction.ATTACH, 1000, "")
    placed = Placement(the_plan, prefill_cached={"http://p0": 640})  # P still holds the session's first 640 tokens
    # P reports what it did not compute: the whole handle (it read the rest from D), or only its own hit.
    _prefill_learned(sv, ctx, placed, "http://p0", 1200, read_of(1000, 1200, 1000), 0.2, handle)  # type: ignore[arg-type]
    placed = Placement(the_plan)
    _prefill_learned(sv, ctx, placed, "http://p0", 1200, read_of(1000, 1200, 1000), 0.2, handle)  # type: ignore[arg-type]
    _prefill_learned(sv, ctx, placed, "http://p0", 800, read_of(1000, 800, 800), 0.2, handle)  # type: ignore[arg-type]
    _prefill_learned(sv, ctx, placed, "http://p0", 1200, read_of(None, 1200, 0), 0.2, None)  # type: ignore[arg-type]
    # A handle P did not read (its own cache held more of the prompt): nothing came from D.
    placed = Placement(the_plan, prefill_cached={"http://p0": 1024})
    _prefill_learned(sv, ctx, placed, "http://p0", 1200, read_of(1000, 1200, 1024), 0.2, handle)  # type: ignore[arg-type]
    assert [s["pulled_tokens"] for s in seen] == [360, 1000, 800, 0, 0]
    assert all(s["pulled_from"] == "http://d0" for s in seen)


@pytest.mark.anyio
async def test_a_failed_poll_is_counted_and_takes_a_node_out_only_when_its_health_fails_too() -> None:
    import httpx
    from kvtether.gateway.nodes.cluster import Cluster

    health = {"status": 200}

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            return httpx.Response(500, text="busy")
        return httpx.Response(health["status"], json={})

    failed: list[str] = []
    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
        c = Cluster(GatewayConfig(prefill=["http://p:1"], decode=["http://d:1"]), client,
                    on_poll_failure=failed.append)
        node = c.nodes["http://d:1"]
        await c.refresh(node)
        assert failed == ["http://d:1"] and node.healthy  # a slow or failing /metrics alone proves nothing
        health["status"] = 503
        await c.refresh(node)
        assert failed == ["http://d:1"] * 2 and not node.healthy


def test_the_guards_tokenize_body_renders_reasoning_effort_as_the_chat_request_does() -> None:
    from kvtether.gateway.turn import body as B

    msgs = [{"role": "user", "content": "x"}]
    got = B.tokenize_body("chat", {"model": "m", "messages": msgs, "reasoning_effort": "none",
                                   "chat_template_kwargs": {"custom": 1}})
    assert got is not None and got["chat_template_kwargs"] == {"custom": 1, "reasoning_effort": "none",
                                                               "enable_thinking": False}
    kept = B.tokenize_body("chat", {"model": "m", "messages": msgs, "reasoning_effort": "low",
                                    "chat_template_kwargs": {"enable_thinking": True}})
    assert kept is not None and kept["chat_template_kwargs"] == {"enable_thinking": True, "reasoning_effort": "low"}
    plain = B.tokenize_body("chat", {"model": "m", "messages": msgs})
    assert plain is not None and "chat_template_kwargs" not in plain
