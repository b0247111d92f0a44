"""A node's /metrics text (sim/metrics.py's own writer) is byte for byte what prometheus_client's
``generate_latest`` writes for the same registry: on a node that served P/D turns (counters, NIXL histograms,
the waiting-by-reason gauges), with label values that need escaping, values Go formats with an exponent, and
children added or replaced between scrapes."""

from __future__ import annotations

import math
from typing import Any

import httpx
import pytest
from kvtether.sim import metrics as sim_metrics
from kvtether.sim.cluster import SimCluster
from kvtether.sim.metrics import NodeMetrics
from kvtether.sim.tokenizer import default_tokenizer
from prometheus_client import generate_latest
from prometheus_client import metrics as prom_metrics
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

TOK = default_tokenizer()
P_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
TEXT = (
    "The scrape came every second, the histograms filled one transfer at a time, and the decode node kept "
    "its counters at zero until the first read arrived from the prefill node next door. "
)


async def complete(h: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int,
                   kvp: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "kvtether-sim", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True}
    if kvp is not None:
        body["kv_transfer_params"] = kvp
    r = await h.post(url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def assert_same(m: NodeMetrics) -> None:
    assert m.render().decode() == generate_latest(m.registry).decode()


@pytest.mark.anyio
async def test_a_busy_p_d_pair_renders_as_generate_latest() -> None:
    async with SimCluster(speed=50.0) as c, httpx.AsyncClient(timeout=20) as h:
        p_url, d_url = c.prefill_urls[0], c.decode_urls[0]
        for node in c.nodes:
            assert_same(node.metrics)  # at start-up: every child at 0, no waiting-by-reason child yet
        for k in range(4):
            prompt = TOK.encode(TEXT * (k + 1))
            p = await complete(h, p_url, prompt, 1, P_PARAMS)
            await complete(h, d_url, prompt, 6, p["kv_transfer_params"])
            for node in c.nodes:
                assert_same(node.metrics)
        d = c.node(d_url).metrics
        text = d.render().decode()
        assert 'vllm:nixl_xfer_time_seconds_count{engine="0",model_name="kvtether-sim"} 4.0' in text
        assert 'vllm:num_requests_waiting_by_reason{engine="0",model_name="kvtether-sim",reason="capacity"}' in text
        served = await h.get(d_url + "/metrics")
        assert served.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
        assert served.text == d.render().decode()


def test_odd_labels_and_values_render_as_generate_latest() -> None:
    m = NodeMetrics('org/model "q"\\v2\nfinal', block_size=16, num_blocks=10**7, engine_id='id"\\\n', )
    assert_same(m)
    s = m.series
    for value in (1e6, 123456789.0, 3.5e-05, 1e21, 0.1 + 0.2, 2.0**60, -0.0, -7.5, math.inf, -math.inf, math.nan):
        s.kv_usage.set(value)
        s.running.set(-value)
        s.prompt_tokens.inc(abs(value) if math.isfinite(value) else 1)
        s.xfer_bytes.observe(abs(value) if math.isfinite(value) else 2.0**50)
        s.xfer_time.observe(value if math.isfinite(value) else 100.0)
        assert_same(m)
    # A child made after the first scrape, and one removed and made again (a new creation time).
    s.request_success("repetition").inc()
    m.cached_by_source.labels(*m.base, "a\\b").inc(3)
    assert_same(m)
    m.request_success.remove(*m.base, "abort")
    assert_same(m)
    m.request_success.labels(*m.base, "abort").inc(2)
    assert_same(m)


def test_without_created_series_it_still_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prom_metrics, "_use_created", False)
    m = NodeMetrics("kvtether-sim", block_size=16, num_blocks=64, engine_id="e")
    m.series.xfer_time.observe(0.02)
    assert_same(m)
    assert "_created" not in m.render().decode()


def test_the_text_parses_to_vllms_families() -> None:
    m = NodeMetrics("kvtether-sim", block_size=16, num_blocks=64, engine_id="e")
    m.series.xfer_descriptors.observe(17)
    families = {f.name: f for f in text_string_to_metric_families(m.render().decode())}
    assert families["vllm:nixl_num_descriptors"].type == "histogram"
    assert families["vllm:prompt_tokens"].type == "counter"
    (info,) = families["vllm:cache_config_info"].samples
    assert info.labels == {"model_name": "kvtether-sim", "engine": "0", "block_size": "16", "num_gpu_blocks": "64",
                           "enable_prefix_caching": "True", "engine_id": "e"}


@pytest.mark.parametrize("value", [
    0.0, -0.0, 1.0, 0.5, 3.5e-05, 1e-300, 5e-324, 999999.9999, 1e6, 1234567.0, 2.0**53, 1e16, 1e21, 1.7965e9,
    -1e6, -1e22, math.inf, -math.inf, math.nan, 12, True,
])
def test_the_value_format_is_go_s(value: float) -> None:
    assert sim_metrics._go_float(value) == floatToGoString(value)
