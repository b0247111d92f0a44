"""`kvtether assess`: each answer against a small hand-computed case (pure functions, no simulator runs)."""

from __future__ import annotations

import math

import pytest
from kvtether.cli.assess.analysis import (
    RetentionSetup,
    TurnFacts,
    TurnTiming,
    breakeven_gbps,
    compare_topologies,
    late_from,
    prefix_share,
    pull_economics,
    recompute_seconds,
    retention,
)
from kvtether.cli.assess.cluster import build_shape
from kvtether.cli.assess.gateway import GatewaySeen, Scrape, histogram_quantile, parse_metrics, summarize_gateway
from kvtether.cli.assess.tokens import sim_encoder, turn_facts
from kvtether.gateway.policy.retention import RetentionKnobs
from kvtether.sdk.sessionfile import Recorded, SessionRecord, TurnRecord
from kvtether.sim.cost import CostModel, Hardware, ModelShape


def tf(sid: str, i: int, prompt: int, reused: int, held: int | None = None, gap: float = 1.0) -> TurnFacts:
    return TurnFacts(sid, i, prompt, reused, held if held is not None else prompt + 10, 10, gap)


# --- 1 -------------------------------------------------------------------------------------------------------


def test_prefix_share_by_turn_growth_and_spread() -> None:
    s1 = [tf("a", 0, 100, 0), tf("a", 1, 200, 150), tf("a", 2, 400, 300)]
    s2 = [tf("b", 0, 100, 0), tf("b", 1, 100, 50)]
    q = prefix_share([s1, s2])
    rows = {r["turn"]: r for r in q["per_turn"]}
    assert rows[0]["share_p50"] is None  # nothing is held before a session's first turn
    assert rows[1]["share_p50"] == pytest.approx(0.625)  # (0.75 + 0.5) / 2
    assert rows[1]["prompt_tokens_mean"] == 150
    assert rows[2]["share_p50"] == pytest.approx(0.75)
    assert q["token_weighted_share"] == pytest.approx(500 / 700, abs=1e-4)
    # Per-session means: a = 0.75, b = 0.5.
    assert q["per_session_share"]["min"] == 0.5 and q["per_session_share"]["max"] == 0.75
    # Prompt growth: least squares over (0,100) (1,200) (2,400) (0,100) (1,100).
    xs, ys = [0, 1, 2, 0, 1], [100, 200, 400, 100, 100]
    mx, my = sum(xs) / 5, sum(ys) / 5
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    assert q["prompt_growth_tokens_per_turn"] == pytest.approx(slope, abs=0.1)
    assert late_from([s1, s2]) == 1
    assert "repeat" in q["verdict"]


def test_token_facts_reuse_equals_the_previous_hold() -> None:
    """With the simulator's template the next prompt extends prompt + answer token for token: the reusable prefix
    is exactly the previous hold."""
    system = {"role": "system", "content": "you are a helper"}
    user = {"role": "user", "content": "list the files please"}
    answer = {"role": "assistant", "content": "here they are now"}
    s = SessionRecord("s", "m", turns=[
        TurnRecord(0, messages=[system, user], recorded=Recorded(answer=answer)),
        TurnRecord(1, new_messages=[{"role": "user", "content": "and now read the first one"}], delay_ms=2000),
    ])
    enc = sim_encoder()
    facts = turn_facts([s], enc)[0]
    held0 = enc([system, user, answer], None, False)
    assert facts[0].reused_tokens == 0
    assert facts[0].prompt_tokens == len(enc([system, user], None, True))
    assert facts[1].reused_tokens == len(held0)
    nxt = {"role": "user", "content": "and now read the first one"}
    assert facts[1].prompt_tokens == len(enc([system, user, answer, nxt], None, True))
    assert facts[1].gap_s == 2.0


def test_an_edited_history_reuses_only_the_common_prefix() -> None:
    system = {"role": "system", "content": "you are a helper"}
    s = SessionRecord("s", "m", turns=[
        TurnRecord(0, messages=[system, {"role": "user", "content": "one two three"}],
                   recorded=Recorded(answer={"role": "assistant", "content": "four"})),
        TurnRecord(1, messages=[system, {"role": "user", "content": "one TWO three"},
                                {"role": "assistant", "content": "four"}, {"role": "user", "content": "five"}]),
    ])
    enc = sim_encoder()
    facts = turn_facts([s], enc)[0]
    head = enc([system], None, False)
    assert len(head) <= facts[1].reused_tokens < facts[0].prompt_tokens


# --- 2 -------------------------------------------------------------------------------------------------------


def simple_cost() -> CostModel:
    """1 ms of prefill per token, no attention or memory term; 1e5 B of KV per token; an 8 Gb/s link."""
    model = ModelShape(name="m", active_params=0.5e9, weight_bytes=0.0, n_layers=1, n_heads=0, qk_head_dim=1,
                       v_head_dim=1, kv_bytes_per_token=1e5, kv_regions=0)
    hw = Hardware(name="h", n_gpus=1, peak_flops=1e12, hbm_bandwidth=1e18, efficiency=1.0, link_bandwidth=1e9,
                  link_latency=0.01, step_overhead=0.0)
    return CostModel(model=model, hardware=hw)


def test_pull_economics_hand_computed() -> None:
    cost = simple_cost()
    assert recompute_seconds(cost, 1000, 800, 100_000) == pytest.approx(0.8)
    # 800 tokens × 1e5 B = 8e7 B must cross in 0.8 − 0.01 s: 1.0127e8 B/s = 0.810 Gb/s.
    assert breakeven_gbps(cost, 800, 0.8) == pytest.approx(8e7 / 0.79 * 8 / 1e9)
    assert math.isinf(breakeven_gbps(cost, 800, 0.005))  # the transfer's latency alone exceeds the saving
    sessions = [[tf("a", 0, 500, 0), tf("a", 1, 1000, 800), tf("a", 2, 1100, 50)]]
    q = pull_economics(sessions, cost, 100_000, min_reuse_tokens=64)
    assert q["turns"] == 2 and q["pays"] == 1 and q["below_min_reuse"] == 1
    assert q["pays_share"] == 0.5
    row = q["per_turn"][0]
    assert row["turn"] == 1 and row["kv_mb_mean"] == pytest.approx(80.0)
    assert row["transfer_ms_mean"] == pytest.approx(90.0)  # 10 ms latency + 8e7 B at 1e9 B/s
    assert row["recompute_ms_mean"] == pytest.approx(800.0)
    assert q["saved_ms_total"] == pytest.approx(710.0)
    assert q["link_gbps"] == 8.0


def test_a_slow_link_makes_the_pull_lose() -> None:
    cost = simple_cost()
    slow = CostModel(model=cost.model, hardware=Hardware(**{**{f: getattr(cost.hardware, f) for f in (
        "name", "n_gpus", "peak_flops", "hbm_bandwidth", "efficiency", "link_latency", "step_overhead")},
        "link_bandwidth": 5e7}))  # 0.4 Gb/s: 8e7 B take 1.6 s > 0.8 s of compute
    q = pull_economics([[tf("a", 0, 500, 0), tf("a", 1, 1000, 800)]], slow, 100_000, 64)
    assert q["pays"] == 0 and q["pays_share"] == 0.0
    assert "not worth it" in q["verdict"]


# --- 3 -------------------------------------------------------------------------------------------------------


def setup(capacity: int = 100_000, concurrency: int = 1, **knobs: float | None) -> RetentionSetup:
    return RetentionSetup(decode_nodes=1, kv_capacity_tokens=capacity, block_size=1, decoder_ttl_s=480.0,
                          session_ttl_s=450.0, concurrency=concurrency, knobs=RetentionKnobs(**knobs))  # type: ignore[arg-type]


def durations(sessions: list[list[TurnFacts]], d: float = 1.0) -> dict[tuple[str, int], float]:
    return {(t.session_id, t.index): d for s in sessions for t in s}


def test_retention_expired_when_the_gap_outlasts_the_handle_ttl() -> None:
    s = [[tf("a", 0, 100, 0, held=110, gap=0.0), tf("a", 1, 200, 110, held=210, gap=5.0),
          tf("a", 2, 300, 210, gap=600.0)]]
    q = retention(s, setup(budget_share=None), durations(s))
    assert q["outcomes"] == {"available": 1, "expired": 1, "released_pressure": 0, "released_budget": 0,
                             "evicted": 0}
    assert q["gaps_over_session_ttl"] == 1 and q["gaps_over_decoder_ttl"] == 1
    assert q["peak_held_tokens"] == {"D0": 210}
    assert "expired" in q["verdict"]


def test_retention_keeps_a_session_that_pauses_longer_than_its_rhythm_while_d_has_room() -> None:
    # Mean gap 5 s after turn 1, then 100 s away (well within the TTL): the gateway once released such a hold as
    # idle; with D's memory not wanted it is still there when the session comes back.
    s = [[tf("a", 0, 100, 0, gap=0.0), tf("a", 1, 200, 110, gap=5.0), tf("a", 2, 300, 210, gap=100.0)]]
    q = retention(s, setup(budget_share=None), durations(s))
    assert q["outcomes"]["available"] == 2 and q["gone_share"] == 0.0


def test_retention_budget_and_pressure() -> None:
    # Two sessions at once on one decode node of 1000 tokens; each holds 400 after its first turn.
    s = [[tf("a", 0, 300, 0, held=400, gap=0.0), tf("a", 1, 500, 400, gap=2.0)],
         [tf("b", 0, 300, 0, held=400, gap=0.0), tf("b", 1, 500, 400, gap=2.0)]]
    q = retention(s, setup(capacity=1000, concurrency=2, budget_share=0.5), durations(s))
    # 800 held > 500 budget: one hold is released (the bigger-or-older first); the other is pulled.
    assert q["outcomes"]["released_budget"] == 1 and q["outcomes"]["available"] == 1
    # No budget: at t = 3 a's second turn (700 tokens) runs beside b's hold: 400 + 700 > 1000, a turn would wait
    # for memory, so the gateway releases b's hold for it.
    s2 = [[tf("a", 0, 300, 0, held=400, gap=0.0), tf("a", 1, 700, 400, gap=2.0)],
          [tf("b", 0, 300, 0, held=400, gap=0.0), tf("b", 1, 500, 400, gap=5.0)]]
    q2 = retention(s2, setup(capacity=1000, concurrency=2, budget_share=None), durations(s2))
    assert q2["outcomes"]["released_pressure"] == 1 and q2["outcomes"]["available"] == 1
    assert q2["outcomes"]["evicted"] == 0
    assert q2["held_series"] and max(row["D0"] for row in q2["held_series"]) == 800


# --- 4 -------------------------------------------------------------------------------------------------------


def timing(turn: int, ttft: float, tpot: float = 10.0) -> TurnTiming:
    return TurnTiming(turn=turn, ttft_ms=ttft, tpot_ms=tpot)


def test_compare_topologies_picks_the_lowest_late_p95_with_its_margin() -> None:
    runs = {
        "no-pull": [timing(0, 50), timing(1, 400), timing(2, 500), timing(2, 600)],
        "colocated": [timing(0, 40), timing(1, 100), timing(2, 200), timing(2, 300)],
    }
    q = compare_topologies(runs, late=1, tpot_slo_ms=None)
    # Late (turn >= 1) p95 by linear interpolation: [100, 200, 300] -> 290; [400, 500, 600] -> 590.
    assert q["options"]["colocated"]["late_ttft_ms"]["p95"] == pytest.approx(290.0)
    assert q["options"]["no-pull"]["late_ttft_ms"]["p95"] == pytest.approx(590.0)
    assert q["best"] == "colocated" and q["runner_up"] == "no-pull"
    assert q["margin"] == pytest.approx(590 / 290, abs=1e-3)
    assert q["verdict"].startswith("best: colocated")
    per_turn = {r["turn"]: r for r in q["options"]["no-pull"]["per_turn_ttft_ms"]}
    assert per_turn[2]["p50"] == 550.0 and per_turn[2]["n"] == 2


@pytest.mark.parametrize(("best", "topology"), [("colocated", "colocated serving"),
                                                ("hybrid", "one pool of instances that take both roles"),
                                                ("auto", "prefill/decode disaggregation")])
def test_the_verdict_names_the_topology_of_the_best_option(best: str, topology: str) -> None:
    runs = {o: [timing(1, 900), timing(2, 900)] for o in ("colocated", "hybrid", "auto")}
    runs[best] = [timing(1, 100), timing(2, 100)]
    q = compare_topologies(runs, late=1, tpot_slo_ms=50.0)
    assert q["best"] == best and q["topology"] == topology
    assert q["verdict"].endswith(f"recommended topology: {topology}")
    # No option meets the objectives on 90 % of its turns: no topology is recommended.
    missed = {o: {"attainment": 0.0, "met": 0, "turns": 2, "objectives": {"ttft_ms": 2000.0, "tpot_ms": 50.0}}
              for o in runs}
    q = compare_topologies(runs, late=1, tpot_slo_ms=50.0, attained=missed)
    assert q["recommended"] == [] and "no topology recommended" in q["verdict"]


def test_compare_topologies_calls_a_small_margin_a_tie() -> None:
    runs = {"no-pull": [timing(1, 1000)], "reference": [timing(1, 1050)]}
    q = compare_topologies(runs, late=1, tpot_slo_ms=None)
    assert q["best"] == "no-pull" and q["margin"] == pytest.approx(1.05)
    assert q["ranking"]["tied"] == ["no-pull", "reference"]
    assert q["verdict"].startswith("a tie between no-pull and reference")


def test_compare_topologies_judges_tpot_by_the_engines_measurement() -> None:
    """The client measured both TPOTs alike (its clock is noisy); the engine's TPOT, where given, is the one the
    ranking reads, and the client's stays in the document beside it."""
    runs = {"colocated": [timing(1, 100, tpot=20.0)], "pull": [timing(1, 110, tpot=20.0)]}
    q = compare_topologies(runs, late=1, tpot_slo_ms=50.0, engine_tpots={"colocated": [80.0, 90.0], "pull": [15.0]})
    assert q["best"] == "pull" and q["ranking"]["decided_by"] == "tpot_p95", q["verdict"]
    colocated = q["options"]["colocated"]
    assert colocated["tpot_source"] == "engine" and colocated["tpot_ms"]["n"] == 2
    assert colocated["client_tpot_ms"]["p95"] == 20.0


# --- cluster and gateway parsing -----------------------------------------------------------------------------


def test_cluster_parts_replace_the_preset() -> None:
    base = build_shape("llama-3.1-8b-h100")
    assert not base.prefill_prefix_caching  # as replay's simulated cluster (cli/simstack)
    assert base.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 and base.gpus == 2 and base.link_gbps == pytest.approx(400)
    shape = build_shape("llama-3.1-8b-h100", prefill=2, decode=2, kv_dtype="fp8", link_gbps=100, gpus_per_node=2)
    assert shape.kv_bytes_per_token == 2 * 32 * 8 * 128 * 1
    assert shape.gpus == 8 and shape.link_gbps == pytest.approx(100)
    assert shape.kv_capacity_tokens > base.kv_capacity_tokens  # half the bytes, twice the GPUs
    assert shape.preset.name != base.preset.name and "kv_dtype=fp8" in shape.changed
    with pytest.raises(ValueError):
        build_shape("glm-5-fp8-h200-tp8", kv_heads=8)  # MLA: the GQA formula needs every part


def test_gateway_counters_summarised() -> None:
    text = "\n".join([
        '# TYPE kvtether_handle_outcomes_total counter',
        'kvtether_handle_outcomes_total{outcome="attached"} 6',
        'kvtether_handle_outcomes_total{outcome="expired"} 1',
        'kvtether_handle_outcomes_total{outcome="missing"} 1',
        '# TYPE kvtether_handle_releases_total counter',
        'kvtether_handle_releases_total{reason="pressure"} 2',
        'kvtether_handle_releases_total{reason="final"} 3',
        '# TYPE kvtether_prompt_tokens_total counter',
        'kvtether_prompt_tokens_total 1000',
        '# TYPE kvtether_reused_tokens_total counter',
        'kvtether_reused_tokens_total 800',
        '# TYPE kvtether_ttft_seconds histogram',
        'kvtether_ttft_seconds_bucket{reuse_source="decode_pull",mode="pd",policy="auto",le="0.1"} 5',
        'kvtether_ttft_seconds_bucket{reuse_source="decode_pull",mode="pd",policy="auto",le="0.25"} 10',
        'kvtether_ttft_seconds_bucket{reuse_source="decode_pull",mode="pd",policy="auto",le="+Inf"} 10',
        'kvtether_ttft_seconds_count{reuse_source="decode_pull",mode="pd",policy="auto"} 10',
        'kvtether_ttft_seconds_sum{reuse_source="decode_pull",mode="pd",policy="auto"} 1.2',
        '',
    ])
    seen = GatewaySeen(url="http://gw", scrapes=[Scrape(0.0, parse_metrics(text))], ready={"mode": "pd"})
    g = summarize_gateway(seen)
    assert g["handle_outcomes"] == {"attached": 6, "expired": 1, "missing": 1}
    assert g["gone_share"] == 0.25 and g["reused_share"] == 0.8
    assert g["releases"] == {"pressure": 2, "final": 3}
    # p50: rank 5 lands on the top of the first bucket; p95: rank 9.5 is 90 % of the way through (0.1, 0.25].
    assert g["ttft_ms_by_source"]["decode_pull"]["p50"] == 100.0
    assert g["ttft_ms_by_source"]["decode_pull"]["p95"] == pytest.approx(235.0)
    assert histogram_quantile([(1.0, 0.0), (math.inf, 0.0)], 0.5) is None


def test_a_pool_gateways_nodes_are_assessed_at_the_same_gpu_count() -> None:
    from kvtether.cli.assess.inputs import shape_from_ready

    def ready(*roles: str) -> dict[str, object]:
        return {"nodes": [{"url": f"http://n{i}", "role": r} for i, r in enumerate(roles)]}

    assert shape_from_ready(ready("prefill", "decode", "decode")) == (1, 2, None)
    assert shape_from_ready(ready()) == (None, None, None)
    p, d, note = shape_from_ready(ready("both", "both", "both"))
    assert (p, d) == (1, 2) and note is not None and "3 pool instance(s)" in note and "1P 2D" in note
    assert shape_from_ready(ready("both", "both", "both", "both"))[:2] == (2, 2)
    assert shape_from_ready(ready("both"))[:2] == (1, 1)
    p, d, note = shape_from_ready(ready("prefill", "decode", "both", "both"))
    assert (p, d) == (2, 2) and note is not None and "and 1P 1D" in note
