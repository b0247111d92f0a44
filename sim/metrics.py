"""Prometheus metrics of one node, under vLLM's names and with its `model_name` label."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_XFER_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class NodeMetrics:
    def __init__(
        self,
        model_name: str,
        *,
        block_size: int,
        num_blocks: int,
        engine_id: str,
        enable_prefix_caching: bool = True,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r, labels = self.registry, ["model_name"]
        self._model = model_name
        self.running = Gauge("vllm:num_requests_running", "Requests in execution batches", labels, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be processed", labels, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 1 = 100 %", labels, registry=r)
        self.prefix_queries = Counter(
            "vllm:prefix_cache_queries", "Prefix-cache queries, in tokens", labels, registry=r
        )
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prefix-cache hits, in tokens", labels, registry=r)
        self.cached_by_source = Counter(
            "vllm:prompt_tokens_cached_by_source",
            "Cached prompt tokens by where the KV came from",
            [*labels, "source"],
            registry=r,
        )
        self.prompt_by_source = Counter(
            "vllm:prompt_tokens_by_source", "Prompt tokens by how they were obtained", [*labels, "source"], registry=r
        )
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed", labels, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generation tokens processed", labels, registry=r)
        self.request_success = Counter(
            "vllm:request_success", "Finished requests", [*labels, "finished_reason"], registry=r
        )
        self.xfer_time = Histogram(
            "vllm:nixl_xfer_time_seconds", "NIXL transfer time", labels, buckets=_XFER_BUCKETS, registry=r
        )
        self.xfer_failed = Counter("vllm:nixl_num_failed_transfers", "Failed NIXL transfers", labels, registry=r)
        self.xfer_tokens = Counter("vllm:nixl_num_transferred_tokens", "Tokens read over NIXL", labels, registry=r)
        cache_info = Gauge(
            "vllm:cache_config_info",
            "Information of the KV-cache config",
            ["model_name", "block_size", "num_gpu_blocks", "enable_prefix_caching", "engine_id"],
            registry=r,
        )
        cache_info.labels(model_name, str(block_size), str(num_blocks), str(enable_prefix_caching), engine_id).set(1)
        for src in ("device", "p2p"):
            self.cached_by_source.labels(model_name, src)
        for src in ("local_compute", "local_cache_hit", "external_kv_transfer"):
            self.prompt_by_source.labels(model_name, src)

    @property
    def model(self) -> str:
        return self._model

    def render(self) -> bytes:
        return generate_latest(self.registry)
