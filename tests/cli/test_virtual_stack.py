"""The simulated stack on a virtual clock (cli/simstack, sim/virtual.py): its figures are the cost model's to the
microsecond, the same in every run, and the gateway's own CPU is modelled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from kvtether.cli.simstack import StackSpec, sim_stack
from kvtether.cli.simstack.decode_times import DecodeTimes
from kvtether.cli.simstack.gateway_cost import AGGREGATED_COST, NO_COST, PD_COST, PEAK_WINDOW_S, CostLedger, GatewayCost
from kvtether.cli.streaming import StreamedAnswer, loop_clock_ns, stream_answer
from kvtether.sim.presets import get_preset
from kvtether.sim.virtual import current_virtual_loop, run_virtual

PRESET = "qwen3-32b-h200-tp8"
ROOT = Path(__file__).resolve().parents[2]
KVTETHER = str(Path(sys.executable).parent / "kvtether")  # the console script of this environment


def _body(model: str) -> bytes:
    body = {"model": model, "messages": [{"role": "user", "content": "tell me about the cache " * 300}],
            "max_tokens": 16, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    return json.dumps(body, separators=(",", ":")).encode()


async def _lone_turn(option: str, cost: GatewayCost | None) -> tuple[StreamedAnswer, int, list[float], Any]:
    """One cold streamed turn alone on a fresh 1P 1D (or 2-node colocated) stack: the answer, the body's size, the
    decoding engine's TPOTs, and the gateway model's report."""
    loop = current_virtual_loop()
    assert loop is not None
    async with sim_stack(StackSpec(preset=PRESET, prefill=1, decode=1), option, gateway_cost=cost) as stack:
        assert stack.virtual and stack.cluster is not None
        times = DecodeTimes()
        times.watch_decoding(stack.cluster)
        body = _body(stack.model)
        async with httpx.AsyncClient() as http:
            resp = await http.post(stack.url + "/v1/models")  # nothing but turns is charged
            assert resp.status_code in (200, 405)
            answer = await stream_answer(http, stack.url + "/v1/chat/completions", json.loads(body),
                                         {"x-session-id": "s"}, clock_ns=loop_clock_ns())
        return answer, len(body), times.tpot_ms(), stack.gateway_model()


def test_a_lone_cold_turn_costs_what_the_cost_model_says_plus_the_modelled_gateway() -> None:
    preset = get_preset(PRESET)
    c, budget = preset.cost, preset.max_num_batched_tokens
    # Colocated: the gateway's turn, the engine's serving overhead, the chunked prefill whose last step samples.
    answer, size, tpots, model = run_virtual(_lone_turn, "colocated", None)
    n = answer.reader.prompt_tokens
    assert n is not None and n > 1000
    expected = AGGREGATED_COST.turn_s + c.hardware.request_overhead + c.lone_prefill_seconds(n, 0, budget)
    assert answer.ttft_ms() == pytest.approx(expected * 1e3, abs=1e-3)  # to the microsecond
    assert model["turns"] == 1 and model["busy_s"] > AGGREGATED_COST.turn_s  # the turn, then its chunks
    # A lone stream's TPOT on the client is the engine's own step time.
    assert len(tpots) == 1 and answer.tpot_ms() == pytest.approx(tpots[0], abs=1e-3)

    # P/D, cold: the gateway's turn (by its body's size), P's request and prefill, D's request, its read of the
    # prompt's KV but the last token's (P computed it) and the step that samples the first token.
    answer, size, tpots, _ = run_virtual(_lone_turn, "no-pull", None)
    n = answer.reader.prompt_tokens
    assert n is not None
    gateway = PD_COST.turn_s + PD_COST.per_body_kb_s * size / 1024
    engines = (2 * c.hardware.request_overhead + c.lone_prefill_seconds(n, 0, budget) + c.transfer_seconds(n - 1)
               + c.step_seconds([(1, n - 1)], []))
    assert answer.ttft_ms() == pytest.approx((gateway + engines) * 1e3, abs=1e-3)
    assert len(tpots) == 1 and answer.tpot_ms() == pytest.approx(tpots[0], abs=1e-3)

    # A free gateway: the engines alone.
    answer, _, _, model = run_virtual(_lone_turn, "no-pull", NO_COST)
    assert answer.ttft_ms() == pytest.approx(engines * 1e3, abs=1e-3)
    assert model["busy_s"] == 0


async def _queued(cost: GatewayCost) -> tuple[list[float], dict[str, Any]]:
    """Eight turns sent at once to a colocated stack whose modelled gateway is slow: their TTFTs and its report."""
    import anyio

    async with sim_stack(StackSpec(preset=PRESET, prefill=1, decode=1), "colocated", gateway_cost=cost) as stack:
        ttfts: list[float] = []
        async with httpx.AsyncClient() as http:

            async def one(i: int) -> None:
                a = await stream_answer(http, stack.url + "/v1/chat/completions", json.loads(_body(stack.model)),
                                        {"x-session-id": f"s{i}"}, clock_ns=loop_clock_ns())
                ttfts.append(a.ttft_ms() or 0.0)

            async with anyio.create_task_group() as tg:
                for i in range(8):
                    tg.start_soon(one, i)
        return sorted(ttfts), stack.gateway_model() or {}


def test_the_busiest_window_is_what_a_burst_saw_whatever_the_run_s_mean() -> None:
    """Two servers, a run of five windows: busy 19 s of the second window's 20 server-seconds (one hold across its
    start), idle otherwise. The run's mean is a fifth of that; its busiest whole window says the burst was 95 %."""
    w = PEAK_WINDOW_S
    ledger = CostLedger(since=100.0)
    ledger.busy(100.0 + w - 1.0, 2.0)  # 1 s in the first window, 1 s in the second
    ledger.busy(100.0 + w + 1.0, w - 1.0)
    ledger.busy(100.0 + w, w - 1.0)
    assert ledger.busy_by_window == pytest.approx({0: 1.0, 1: 1.0 + 2 * (w - 1.0)})
    assert ledger.peak_utilisation(100.0 + 5 * w, workers=2) == pytest.approx((2 * w - 1.0) / (2 * w))
    assert ledger.utilisation(100.0 + 5 * w, workers=2) == pytest.approx(2 * w / (5 * w * 2))
    assert ledger.peak_utilisation(100.0 + w / 2, workers=2) is None  # no whole window yet
    assert CostLedger().peak_utilisation(1.0, 1) is None


def test_a_saturated_gateway_queues_turns() -> None:
    slow = GatewayCost(turn_s=0.5, per_body_kb_s=0.0, per_chunk_s=0.0)
    ttfts, model = run_virtual(_queued, slow)
    # One server, 0.5 s a turn: the last of the eight waits for the seven before it.
    assert ttfts[0] >= 500 and ttfts[-1] >= 8 * 500
    assert model["queued_s"] >= sum(0.5 * i for i in range(8)) - 1e-6
    assert model["utilisation"] > 0.7 and model["saturated"]
    # Each turn's wait for the server, as the TTFTs show it: 0, 0.5, ..., 3.5 s, in the replay's percentiles
    # (cli/common/stats.py: linear between closest ranks).
    assert model["queue_ms"] == pytest.approx({"p50": 1750.0, "p99": 3465.0, "max": 3500.0}, abs=1e-3)
    two = GatewayCost(turn_s=0.5, per_body_kb_s=0.0, per_chunk_s=0.0, workers=2)
    ttfts2, _ = run_virtual(_queued, two)
    assert ttfts2[-1] < ttfts[-1] - 1000  # two processes serve the same burst in about half the time


async def _stack(spec: StackSpec, settings: dict[str, Any]) -> None:
    async with sim_stack(spec, "auto", gateway=settings):
        pass


def test_what_cannot_follow_virtual_time_is_refused() -> None:
    with pytest.raises(ValueError, match="speed 1"):
        run_virtual(_stack, StackSpec(preset="toy", speed=4.0), {})
    with pytest.raises(ValueError, match="in memory"):
        run_virtual(_stack, StackSpec(preset="toy"), {"store": "redis://127.0.0.1:1"})


async def _plain_stack() -> tuple[Any, Any, list[str]]:
    spec = StackSpec(preset="toy", speed=4.0)
    async with sim_stack(spec, "auto", gateway={"min_reuse_tokens": 4}, calibrated=False, oracle=True) as stack:
        assert stack.oracle is not None
        body = {"model": stack.model, "messages": [{"role": "user", "content": "tell me about the cache " * 20}],
                "max_tokens": 12, "temperature": 0}
        answers = []
        async with httpx.AsyncClient() as http:
            for url in (stack.url, stack.oracle):
                resp = await http.post(url + "/v1/chat/completions", json=body, headers={"x-session-id": "plain"})
                assert resp.status_code == 200, resp.text
                answers.append(resp.json()["choices"][0]["message"]["content"])
        return stack.config, stack.costed, answers


def test_an_uncalibrated_stack_is_the_callers_and_its_oracle_answers_as_the_cluster_does() -> None:
    from kvtether.gateway.config import GatewayConfig

    config, costed, (via_gateway, from_oracle) = run_virtual(_plain_stack)
    defaults = GatewayConfig()
    # The gateway's defaults under the caller's settings: no time rule, no calibrated seeds; any speed, and a
    # free gateway (no cost model) unless one is given.
    assert config.policy == "auto" and config.min_reuse_tokens == 4
    assert config.session_ttl_s == defaults.session_ttl_s and config.engine_kv_ttl_s == defaults.engine_kv_ttl_s
    assert config.seed_prefill_overhead_s == defaults.seed_prefill_overhead_s
    assert costed is None
    assert via_gateway and via_gateway == from_oracle


def _replay(session_file: Path, hash_seed: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    out = subprocess.run(
        [KVTETHER, "replay", str(session_file), "--sim", PRESET, "--compare",
         "--virtual", "--json", "--quiet"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    doc: dict[str, Any] = json.loads(out.stdout)
    return doc


def _without_wall_clock(doc: Any) -> Any:
    if isinstance(doc, dict):
        return {k: _without_wall_clock(v) for k, v in doc.items() if k not in ("wall_s", "started_at", "cpu_s")}
    if isinstance(doc, list):
        return [_without_wall_clock(v) for v in doc]
    return doc


def test_two_virtual_replays_in_two_processes_give_the_same_document(tmp_path: Path) -> None:
    sessions = tmp_path / "s.jsonl"
    gen = subprocess.run([KVTETHER, "gen", "--sessions", "3", "--turns", "4",
                          "--seed", "3", "-o", str(sessions)], capture_output=True, text=True, cwd=ROOT, timeout=120,
                         check=False)
    assert gen.returncode == 0, gen.stderr
    a, b = _replay(sessions, "1"), _replay(sessions, "2")
    assert _without_wall_clock(a) == _without_wall_clock(b)
    runs = a["runs"]
    assert [r["clock"] for r in runs] == ["virtual"] * 3 and a["target"]["virtual"] is True
    # The document is not trivially the same: the runs measured real turns, differently per policy.
    assert all(r["ok"] == 12 for r in runs)
    assert len({json.dumps(r["ttft_ms"]) for r in runs}) == 3
    assert all(r["gateway_model"]["turns"] == 12 and r["virtual_s"] > 0 for r in runs)


def test_a_simulated_option_s_gateway_has_a_connection_for_every_request_its_nodes_run() -> None:
    """The gateway's default pool of connections to the nodes (512) is sized for no cluster in particular; the
    simulated options' gateway gets as many as the nodes run requests, twice over for P/D's two legs, so that
    a load the nodes carry is never held back by the gateway's pool."""
    from kvtether.cli.assess.cluster import build_shape
    from kvtether.cli.assess.topology import option_gateway

    shape = build_shape(PRESET, prefill=1, decode=2)

    async def limit(option: str) -> int:
        async with option_gateway(option, shape, 1.0) as stack:
            return int(stack.app.state.gateway.config.max_connections)

    want = 2 * 3 * get_preset(PRESET).max_num_seqs
    assert [run_virtual(limit, o) for o in ("colocated", "auto", "hybrid")] == [want] * 3
