"""The poll's reading of a node's /metrics (gateway/nodes/cluster.parse_metrics, a line parser over the few gauges
placement reads) gives what prometheus_client's own parser gives for the same lines, on text shaped as vLLM
writes it: vLLM's metrics are prometheus_client's, so its /metrics is ``generate_latest`` of its registry, with
HELP and TYPE lines, sorted labels, ``_created`` samples, the process and GC collectors, and label values escaped
(``\\\\``, ``\\n``, ``\\"``)."""

from __future__ import annotations

import pytest
from kvtether.gateway.nodes.cluster import _PLACEMENT_GAUGES, parse_metrics
from kvtether.sim.metrics import NodeMetrics
from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.parser import text_string_to_metric_families


def reference(text: str) -> dict[str, float | int]:
    """parse_metrics as it was: the gauges' lines kept by a line filter, then prometheus_client's parser."""
    keep = []
    for line in text.splitlines():
        if line.startswith(_PLACEMENT_GAUGES):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in _PLACEMENT_GAUGES:
                keep.append(line)
    out: dict[str, float | int] = {"running": 0.0, "waiting": 0.0, "kv_usage": 0.0}
    for family in text_string_to_metric_families("\n".join(keep) + "\n"):
        for sample in family.samples:
            name, value, labels = sample.name, sample.value, sample.labels
            if name == "vllm:num_requests_running":
                out["running"] += value
            elif name == "vllm:num_requests_waiting":
                out["waiting"] += value
            elif name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
                out["kv_usage"] = max(float(out["kv_usage"]), value)
            elif name == "vllm:num_preemptions_total":
                out["preemptions"] = out.get("preemptions", 0.0) + value
            elif name == "vllm:num_requests_waiting_by_reason" and labels.get("reason") == "capacity":
                out["waiting_capacity"] = out.get("waiting_capacity", 0.0) + value
            elif name == "vllm:cache_config_info":
                bs, blocks = labels.get("block_size"), labels.get("num_gpu_blocks")
                if bs and bs.isdigit():
                    out["block_size"] = int(bs)
                    if blocks and blocks.isdigit():
                        out["kv_capacity_tokens"] = int(blocks) * int(bs)
                caching = labels.get("enable_prefix_caching")
                if caching in ("True", "False"):
                    out["prefix_caching"] = int(caching == "True")
    return out


def vllm_text(model: str, *, engines: int = 1, running: float = 3, waiting: tuple[int, int] = (2, 1),
              usage: float = 0.4375, preemptions: int = 5, num_gpu_blocks: str = "6772", caching: str = "True",
              process: bool = True) -> str:
    """A /metrics as vLLM 0.32 writes it (vllm/v1/metrics/loggers.py's families, per engine index): gauges,
    counters, the request histograms with vLLM's buckets, cache_config_info with every CacheConfig field as a
    label, and the default collectors a vLLM server process also exposes."""
    r = CollectorRegistry()
    if process:
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            r.register(collector)
    labels = ["model_name", "engine"]
    gauges = {
        name: Gauge(name, doc, labels, registry=r)
        for name, doc in (("vllm:num_requests_running", "Number of requests in model execution batches."),
                          ("vllm:num_requests_waiting", "Number of requests waiting to be processed."))
    }
    by_reason = Gauge("vllm:num_requests_waiting_by_reason", "Number of requests waiting, by reason.",
                      [*labels, "reason"], registry=r)
    usage_g = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels, registry=r)
    pre = Counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", labels, registry=r)
    prompt = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", labels, registry=r)
    success = Counter("vllm:request_success", "Count of successfully processed requests.",
                      [*labels, "finished_reason"], registry=r)
    ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", labels,
                     buckets=(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                              7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0), registry=r)
    e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", labels,
                    buckets=(0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                             120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0), registry=r)
    tokens = Histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", labels,
                       buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 40960),
                       registry=r)
    info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                 ["block_size", "cache_dtype", "calculate_kv_scales", "cpu_offload_gb", "enable_prefix_caching",
                  "engine", "gpu_memory_utilization", "is_attention_free", "kv_sharing_fast_prefill",
                  "mamba_cache_dtype", "num_cpu_blocks", "num_gpu_blocks", "num_gpu_blocks_override",
                  "prefix_caching_hash_algo", "sliding_window", "swap_space"], registry=r)
    for e in range(engines):
        engine = str(e)
        gauges["vllm:num_requests_running"].labels(model, engine).set(running)
        gauges["vllm:num_requests_waiting"].labels(model, engine).set(sum(waiting))
        by_reason.labels(model, engine, "capacity").set(waiting[0])
        by_reason.labels(model, engine, "deferred").set(waiting[1])
        usage_g.labels(model, engine).set(usage * (e + 1) / engines)
        pre.labels(model, engine).inc(preemptions)
        prompt.labels(model, engine).inc(123456789)
        for reason in ("abort", "error", "length", "repetition", "stop"):
            success.labels(model, engine, reason).inc(7 if reason == "stop" else 0)
        for x in (0.0123, 0.5, 3.2, 700.0):
            ttft.labels(model, engine).observe(x)
            e2e.labels(model, engine).observe(x * 3)
            tokens.labels(model, engine).observe(x * 1000)
        info.labels("16", "auto", "False", "0", caching, engine, "0.9", "False", "False", "auto", "None",
                    num_gpu_blocks, "None", "sha256", "None", "4").set(1.0)
    return generate_latest(r).decode()


TEXTS = {
    "one engine": vllm_text("Qwen/Qwen3-32B"),
    "two engines (data parallel)": vllm_text("Qwen/Qwen3-32B", engines=2, running=1, waiting=(0, 4)),
    "idle, no blocks known, caching off": vllm_text("m", running=0, waiting=(0, 0), usage=0.0, preemptions=0,
                                                   num_gpu_blocks="None", caching="False"),
    "a model name that needs escaping": vllm_text('org/m "quoted" {braced}, back\\slash\nnew line'),
    "odd values": vllm_text("m", running=float("nan"), usage=1e-05, preemptions=10**7, process=False),
    "the simulator's node": NodeMetrics("kvtether-sim", block_size=16, num_blocks=4096, engine_id="e-1").render()
    .decode(),
}


@pytest.mark.parametrize("name", list(TEXTS))
def test_vllm_shaped_text_reads_as_prometheus_clients_parser_reads_it(name: str) -> None:
    text = TEXTS[name]
    got, want = parse_metrics(text), reference(text)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == value or (value != value and got[key] != got[key]), key  # NaN reads as NaN


def test_what_vllm_text_reads_as() -> None:
    assert parse_metrics(TEXTS["one engine"]) == {
        "running": 3.0, "waiting": 3.0, "kv_usage": 0.4375, "preemptions": 5.0, "waiting_capacity": 2.0,
        "block_size": 16, "kv_capacity_tokens": 6772 * 16, "prefix_caching": 1,
    }
    two = parse_metrics(TEXTS["two engines (data parallel)"])
    assert (two["running"], two["waiting"], two["kv_usage"], two["waiting_capacity"]) == (2.0, 8.0, 0.4375, 0.0)
    idle = parse_metrics(TEXTS["idle, no blocks known, caching off"])
    assert idle["prefix_caching"] == 0 and "kv_capacity_tokens" not in idle
    assert parse_metrics(TEXTS["a model name that needs escaping"])["block_size"] == 16


@pytest.mark.parametrize("text", [
    'vllm:num_requests_running{model_name="m",engine="0"} 3.0 1700000000000\n',  # a timestamp
    'vllm:num_requests_running{model_name="m",engine="0",} 3\r\nvllm:num_requests_waiting 2\r\n',  # CRLF, ints
    'vllm:num_requests_running { model_name = "m" , engine="0" }  3.0\n',  # spaces everywhere allowed
    'vllm:kv_cache_usage_perc{model_name="a\\"}\\\\"} +Inf\n',  # an escaped quote and brace in a value
    'vllm:num_requests_waiting_by_reason{reason="capacity",model_name="x\\ny"} 4.0',  # no final newline
    'vllm:cache_config_info{block_size="32",num_gpu_blocks="10",enable_prefix_caching="True"} 1.0\n'
    'vllm:cache_config_info{block_size="64",num_gpu_blocks="None",enable_prefix_caching="False"} 1.0\n',
    "# HELP vllm:num_requests_running Running\nvllm:num_requests_running_total 5.0\nvllm:num_requests_run 1\n"
    "vllm:num_requests_running-x 1\nvllm:num_requests_running:x 1\n vllm:num_requests_running 1\n",  # not its lines
    "vllm:num_requests_waiting 2.0\n",  # the text's first line
    "",
])
def test_edge_lines_read_as_prometheus_clients_parser_reads_them(text: str) -> None:
    assert parse_metrics(text) == reference(text)


@pytest.mark.parametrize("text", [
    'vllm:num_requests_running{model_name="m" 3.0\n',  # unclosed braces
    'vllm:num_requests_running{model_name=m} 3.0\n',  # unquoted value
    'vllm:num_requests_running{model_name="m" engine="0"} 3.0\n',  # no comma between labels
    'vllm:cache_config_info{block_size="16",block_size="32"} 1.0\n',  # a label twice (where labels are read)
    "vllm:num_requests_running three\n",
    "vllm:num_requests_running 1_000\n",
    "vllm:num_requests_running\n",
    'vllm:cache_config_info{block_size="16"} 1.0 soon\n',  # a timestamp that is no number
])
def test_a_broken_gauge_line_fails_the_poll_as_before(text: str) -> None:
    with pytest.raises(ValueError):
        reference(text)
    with pytest.raises(ValueError):
        parse_metrics(text)
