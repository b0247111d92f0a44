"""The gateway's view of its nodes: role, health, load and capabilities, refreshed in the background.

Load comes from each node's Prometheus ``/metrics`` (running + waiting requests, KV usage, preemptions), the block
size from ``vllm:cache_config_info``, the engine version from ``/version`` (streamed responses carry
D's handle only from vLLM 0.33). A node that fails a request is marked unhealthy at once, so the next
turn is re-placed without waiting for the next poll.

Nodes come and go under a discovery source (nodes/discovery/): ``apply_members`` reconciles the view with the
source's desired set. A new node joins (``joining``: polled at once, routable once a poll succeeds and it names
its models); a node that leaves drains (``draining``: no turn is placed on it, so no new session starts there and
each of its sessions moves at its next turn, while the turns already running on it finish) and is removed once
none of this gateway's requests is open on it. Static nodes are ``ready`` from the start and never leave.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING
from urllib.parse import urlparse

import anyio
import httpx
from kvtether.gateway.clock import DEFAULT_CLOCK, Clock
from kvtether.gateway.config import GatewayConfig
from kvtether.gateway.nodes.discovery.members import DRAINING, JOINING, READY, Change, Member, reconcile
from kvtether.gateway.nodes.health import next_backoff
from kvtether.gateway.policy.placement import ClusterView, NodeLoad
from prometheus_client.parser import text_string_to_metric_families

if TYPE_CHECKING:
    from kvtether.gateway.transport.upstream import Upstream

log = logging.getLogger(__name__)

STREAM_HANDLE_VERSION = (0, 33)
DEFAULT_BLOCK_SIZE = 16
SOFT_ERRORS_TO_UNHEALTHY = 3


def parse_version(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    m = re.match(r"\s*v?(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


@lru_cache(maxsize=1024)
def host_of(url: str) -> str:
    return urlparse(url).hostname or "localhost"


@lru_cache(maxsize=1024)
def port_of(url: str) -> int | None:
    return urlparse(url).port


@dataclass
class Node:
    url: str
    role: str  # prefill | decode | both (a pool instance: kv_both, prefills and decodes) | aggregated
    bidirectional: bool = True
    healthy: bool = True
    running: float = 0.0
    waiting: float = 0.0
    # Of those, the ones waiting for scheduling capacity (vllm:num_requests_waiting_by_reason{reason="capacity"},
    # vLLM 0.32 on): not its KV reads in flight, which vLLM counts as waiting too. None: not exported.
    waiting_capacity: float | None = None
    kv_usage: float = 0.0
    preemptions: float = 0.0  # vllm:num_preemptions_total as last polled (a counter: retention reads its rise)
    polls: int = 0  # successful /metrics polls so far: tells a fresh poll's gauges from ones already read
    block_size: int | None = None
    # From vllm:cache_config_info: whether the node keeps finished requests' blocks for reuse, and its KV
    # cache size in tokens (num_gpu_blocks × block_size); None until a poll said.
    prefix_caching: bool | None = None
    kv_capacity_tokens: int | None = None
    version: str | None = None
    models: list[str] = field(default_factory=list)
    max_model_len: dict[str, int] = field(default_factory=dict)  # per served model, from /v1/models
    last_error: str | None = None
    consecutive_errors: int = 0
    # While out of service: when its /health is probed next (the gateway's clock), and the backoff
    # after that probe if it fails too (health.py). Reset by a request that succeeds.
    out_until: float = 0.0
    backoff_s: float = 0.0
    inflight: int = 0  # requests this gateway has open on the node: fresher than the polled gauges
    # Of those, prefill legs (a pool instance tells them from its decodes by this: they queue a new leg, the
    # decodes share its steps).
    prefilling: int = 0
    # Of those, how many were open at the last poll (and so are inside `running`); when one ends, the polled
    # gauge is known to be one too high until the next poll.
    inflight_at_poll: int = 0
    # P/D turns planned onto this decode node whose prefill leg is still running (then `inflight` takes
    # over): load already on its way, which rebalancing counts so that turns planned meanwhile do not herd.
    arriving: int = 0
    # P/D turns planned onto this decode node: when each is expected to reach D (the gateway's clock; once its
    # prefill leg is done, when it did) and how long D's read of it should take, until that read is over. A
    # local prefill's step on D would hold them up (policy/options.blocked_s).
    arrivals: dict[int, tuple[float, float]] = field(default_factory=dict)
    # Requests of this gateway on the node whose client has seen nothing yet although the node is already
    # decoding them: streams between their first chunk and first delta (a tool-call parser holding the name
    # back), and non-streamed requests. A local prefill's stall delays their TTFT itself.
    holding_back: int = 0
    # Decode only: whether a decode-local turn marked for retention came back with a handle (vLLM with
    # bidirectional_kv_xfer); None until one did or did not. False stops the policy from counting on it.
    local_handles: bool | None = None
    # Decode only: KV tokens the session store's handles hold on this node (whole blocks), as of the last
    # retention review (gateway/nodes/retention.py).
    held_kv_tokens: int = 0
    # joining | ready | draining (discovery/members.py); a static node is ready from the start.
    state: str = READY
    discovered: bool = False  # from a discovery source (else from the configured lists: never leaves)

    @property
    def routable(self) -> bool:
        """Turns may be placed here: in service and neither joining nor draining."""
        return self.healthy and self.state == READY

    @property
    def host(self) -> str:
        return host_of(self.url)

    @property
    def stream_handles(self) -> bool:
        """Whether streamed responses carry the handle (vLLM >= 0.33); unknown versions are assumed new."""
        v = parse_version(self.version)
        return v is None or v >= STREAM_HANDLE_VERSION

    def load(self, now: float | None = None) -> NodeLoad:
        # Polled gauges lag by up to a poll interval; the gateway's own open requests do not, so a burst
        # of new sessions spreads instead of herding onto the node that looked idle at the last poll.
        running = max(self.running, float(self.inflight))
        arrivals = () if now is None else tuple(
            (at - now, read) for at, read in self.arrivals.values() if at + read >= now)
        return NodeLoad(self.url, self.routable, running, self.waiting, self.kv_usage, self.bidirectional,
                        prefix_caching=self.prefix_caching is True, arriving=float(self.arriving),
                        arrivals=arrivals, holding_back=float(self.holding_back), both=self.role == "both",
                        prefilling=float(min(self.prefilling, running)))


def sample_sum(text: str, sample: str, **labels: str) -> float:
    """Sum of the Prometheus samples named exactly `sample` (e.g. ``vllm:…_total``, ``…_count``) whose labels
    include `labels`, over every label set."""
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())
    )


_PLACEMENT_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                     "vllm:gpu_cache_usage_perc", "vllm:cache_config_info", "vllm:num_preemptions_total",
                     "vllm:num_requests_waiting_by_reason")
# After a sample's name: its labels (``name="value"`` pairs, values that may hold braces, commas and escaped
# quotes), its value and an optional timestamp: the text exposition format, as prometheus_client writes it.
_NAME, _VALUE = r"[a-zA-Z_][a-zA-Z0-9_]*", r'"(?:[^"\\\n]|\\.)*"'
_PAIR = rf"[ \t]*{_NAME}[ \t]*=[ \t]*{_VALUE}[ \t]*"
_SAMPLE_REST = re.compile(rf"[ \t]*(\{{(?:{_PAIR}(?:,{_PAIR})*,?)?[ \t]*\}})?[ \t]*([^ \t]+)(?:[ \t]+([^ \t]+))?[ \t]*")
_LABEL = re.compile(rf'({_NAME})[ \t]*=[ \t]*"((?:[^"\\\n]|\\.)*)"')
_ESCAPE = re.compile(r'\\[\\n"]')
_UNESCAPED = {"\\\\": "\\", "\\n": "\n", '\\"': '"'}
# A line that starts with one of the names and a separator (not a longer name that starts with it).
_GAUGE_NAMES = "|".join(map(re.escape, _PLACEMENT_GAUGES))
_GAUGE_LINE = re.compile(rf"\n({_GAUGE_NAMES})(?=[{{ \t\r\n]|\Z)([^\n]*)")


def _number(text: str) -> float:
    """A sample's value as the text format writes it (``1.0``, ``3.5e-05``, ``+Inf``, ``NaN``)."""
    if "_" in text:
        raise ValueError(f"invalid value: {text!r}")
    return float(text)


def _labels(inside: str) -> dict[str, str]:
    """The labels of a sample whose label text `_SAMPLE_REST` matched (``name="value",…``, between the braces),
    with their values unescaped (``\\\\``, ``\\n``, ``\\"``)."""
    labels: dict[str, str] = {}
    for m in _LABEL.finditer(inside):
        name, value = m.group(1), m.group(2)
        if name in labels:
            raise ValueError(f"duplicate label {name!r}: {{{inside}}}")
        labels[name] = _ESCAPE.sub(lambda e: _UNESCAPED[e.group(0)], value) if "\\" in value else value
    return labels


def _gauge_samples(text: str) -> Iterator[tuple[str, str, float]]:
    """The samples of the gauges placement reads, in the order of the text: (name, the text between its braces,
    value). A node's /metrics is mostly histograms, and this runs on the event loop every stream the gateway
    relays shares, once per node per poll: so one regular-expression scan finds the lines that start with these
    names (no split into lines, no parse of the others). A line of one of these names that is not a sample raises
    ValueError (the poll fails), as prometheus_client's parser does."""
    for line in _GAUGE_LINE.finditer("\n" + text):
        name, rest = line.group(1), line.group(2).rstrip("\r")
        m = _SAMPLE_REST.fullmatch(rest)
        if m is None:
            raise ValueError(f"invalid sample line: {name}{rest}")
        labels, value, timestamp = m.group(1), m.group(2), m.group(3)
        if timestamp is not None:
            _number(timestamp)
        yield name, labels[1:-1] if labels else "", _number(value)


_LABELLED = ("vllm:num_requests_waiting_by_reason", "vllm:cache_config_info")
_KVTETHER_METRIC = "kvtether_requests_total"  # in every kvtether gateway's /metrics, in no vLLM's


def parse_metrics(text: str) -> dict[str, float | int]:
    """The few vLLM gauges placement and retention use, summed over label sets (one engine per node here)."""
    out: dict[str, float | int] = {"running": 0.0, "waiting": 0.0, "kv_usage": 0.0}
    for name, labels_text, value in _gauge_samples(text):
        # Every line's labels are checked (by _SAMPLE_REST), and read on the two lines that need them.
        labels = _labels(labels_text) if labels_text and name in _LABELLED else {}
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
            bs = labels.get("block_size")
            blocks = labels.get("num_gpu_blocks")
            if bs and bs.isdigit():
                out["block_size"] = int(bs)
                if blocks and blocks.isdigit():
                    out["kv_capacity_tokens"] = int(blocks) * int(bs)
            caching = labels.get("enable_prefix_caching")
            if caching in ("True", "False"):
                out["prefix_caching"] = int(caching == "True")
    return out


def poll_timeout_s(config: GatewayConfig) -> float:
    """How long one poll of a node may take: two intervals and a second, at most 5 s."""
    return min(5.0, config.metrics_poll_interval_s * 2 + 1)


class Cluster:
    def __init__(self, config: GatewayConfig, client: httpx.AsyncClient,
                 on_poll_failure: Callable[[str], None] | None = None, clock: Clock = DEFAULT_CLOCK,
                 poller: Upstream | None = None) -> None:
        self.config = config
        self.client = client
        # The /metrics polls' own keep-alive connections (the lean client, transport/upstream.py): a poll per
        # node every interval is the gateway's steadiest traffic, and httpx's layers cost ~1 ms of CPU a poll.
        # None: they go through `client` like the rarer /version, /v1/models and /health.
        self.poller = poller
        self.clock = clock  # the gateway's (clock.py): health backoffs, expected arrivals
        self.on_poll_failure = on_poll_failure  # a node's /metrics poll failed (its URL): counted by the app
        self._arrival_ids = itertools.count()
        # Set when a node is taken out, so the health prober (health.py) probes it without waiting.
        self.wake: anyio.Event | None = None
        self.nodes: dict[str, Node] = {}
        # Told every change of a discovered node's state (a join, a drain, a removal): metrics, spans, logs.
        self.on_change: Callable[[Change], None] | None = None
        for url in config.prefill:
            self.nodes[url] = Node(url, "prefill", bidirectional=config.is_bidirectional(url))
        for url in config.decode:
            self.nodes.setdefault(url, Node(url, "decode"))
        for url in config.nodes:
            self.nodes.setdefault(url, Node(url, "both"))
        for url in config.aggregated:
            self.nodes.setdefault(url, Node(url, "aggregated"))

    def session_nodes(self) -> tuple[str, ...]:
        """The nodes a session may be pinned to now: those that decode (decode, pool, aggregated ones), in
        service and neither joining nor draining."""
        return tuple(n.url for n in self.nodes.values() if n.role != "prefill" and n.routable)

    def pool_urls(self) -> tuple[str, ...]:
        """The pool instances (kv_both) the cluster knows, configured or discovered."""
        return tuple(n.url for n in self.nodes.values() if n.role == "both")

    def apply_members(self, desired: Mapping[str, Member]) -> list[Change]:
        """Reconcile the discovered nodes with a discovery source's desired set (members.reconcile): new ones
        join, leaving ones drain (or go, if idle or never joined). A configured node is never touched. Returns the
        changes, each also told to ``on_change``."""
        known = {u: (n.role, n.state) for u, n in self.nodes.items() if n.discovered}
        changes = reconcile(known, {u: m for u, m in desired.items() if u in known or u not in self.nodes})
        for c in changes:
            node = self.nodes.get(c.url)
            if c.after is None:
                self.nodes.pop(c.url, None)
            elif node is None:
                bidirectional = c.role == "both" or self.config.is_bidirectional(c.url)
                self.nodes[c.url] = Node(c.url, c.role, bidirectional=bidirectional, state=c.after, discovered=True)
            else:
                if c.after == JOINING:  # joins again: polled afresh (a new pod at the address, or a new role)
                    node.version, node.models, node.polls = None, [], 0
                node.state, node.role = c.after, c.role
            self._changed(c)
        for node in [n for n in self.nodes.values() if n.state == DRAINING]:
            self.drop_if_drained(node)
        return changes

    def _changed(self, change: Change) -> None:
        log.info("node %s (%s): %s -> %s", change.url, change.role, change.before or "unknown",
                 change.after or "removed")
        if self.on_change is not None:
            self.on_change(change)

    def drop_if_drained(self, node: Node) -> None:
        """A draining node leaves the view once no request of this gateway is open or headed there."""
        if node.state == DRAINING and node.inflight == 0 and node.arriving == 0 and node.url in self.nodes:
            del self.nodes[node.url]
            self._changed(Change(node.url, node.role, DRAINING, None))

    def move_reason(self, pinned: str | None) -> str:
        """Why a session leaves its node `pinned`: draining, gone (no longer in the view), unhealthy, kv_pressure
        (the node serves, short of memory: its KV usage at decode_pressure_usage), or rebalance (the node serves,
        the policy moved the pin to a lighter one)."""
        node = self.nodes.get(pinned or "")
        if node is None:
            return "gone"
        if node.state == DRAINING:
            return "draining"
        if not node.healthy:
            return "unhealthy"
        return "kv_pressure" if node.kv_usage >= self.config.decode_pressure_usage else "rebalance"

    def role(self, role: str) -> list[Node]:
        """The nodes that serve `role`: a pool instance ("both") serves prefill and decode."""
        both = role in ("prefill", "decode")
        return [n for n in self.nodes.values() if n.role == role or (both and n.role == "both")]

    def view(self, now: float | None = None) -> ClusterView:
        """Every node's load; with `now` (the gateway's clock) the decode nodes' expected arrivals too."""
        return ClusterView(tuple(n.load() for n in self.role("prefill")),
                           tuple(n.load(now) for n in self.role("decode")))

    def aggregated_view(self) -> tuple[NodeLoad, ...]:
        return tuple(n.load() for n in self.role("aggregated"))

    def node(self, url: str) -> Node:
        return self.nodes[url]

    def block_size(self, url: str) -> int:
        node = self.nodes.get(url)
        if self.config.block_size is not None:
            return self.config.block_size
        if node is not None and node.block_size:
            return node.block_size
        return DEFAULT_BLOCK_SIZE

    def mark_failed(self, url: str, why: str, *, hard: bool = True) -> None:
        """A failed request: unreachable (hard) marks the node unhealthy at once; an HTTP 5xx (soft) only
        after ``SOFT_ERRORS_TO_UNHEALTHY`` in a row, since a live node may fail one request for reasons
        that are not its own (e.g. a KV read from a peer)."""
        node = self.nodes.get(url)
        if node is None:
            return
        node.consecutive_errors += 1
        node.last_error = why
        if hard or node.consecutive_errors >= SOFT_ERRORS_TO_UNHEALTHY:
            self.take_out(node, why)

    def take_out(self, node: Node, why: str) -> None:
        """Out of service until its /health answers (probed with backoff by health.HealthProber)."""
        if node.healthy:
            log.warning("node %s marked unhealthy: %s", node.url, why)
            node.backoff_s = next_backoff(node.backoff_s, self.config)
            node.out_until = self.clock() + node.backoff_s
            if self.wake is not None:
                self.wake.set()
        node.healthy = False

    def back_in(self, node: Node, why: str) -> None:
        if not node.healthy:
            log.info("node %s healthy again (%s)", node.url, why)
        node.healthy = True

    def retry_after(self, role: str) -> float:
        """Seconds until the first node of `role` is probed again (what a 503's Retry-After says)."""
        outs = [n.out_until for n in self.role(role) if not n.healthy]
        return max(self.config.health_backoff_s, min(outs, default=0.0) - self.clock())

    def begin(self, url: str, *, prefill: bool = False) -> None:
        node = self.nodes.get(url)
        if node is not None:
            node.inflight += 1
            node.prefilling += prefill

    def hold_back(self, url: str, n: int) -> None:
        node = self.nodes.get(url)
        if node is not None:
            node.holding_back = max(0, node.holding_back + n)

    def note_local_handles(self, url: str, kept: bool) -> None:
        """Whether decode node `url` returned a handle for a decode-local turn marked for retention."""
        node = self.nodes.get(url)
        if node is not None and node.local_handles is not kept:
            if not kept:
                log.warning("decode node %s returned no handle for a marked decode-local turn: not counting on "
                            "them there (is bidirectional_kv_xfer on?)", url)
            node.local_handles = kept

    def end(self, url: str, *, prefill: bool = False) -> None:
        node = self.nodes.get(url)
        if node is not None:
            node.inflight = max(0, node.inflight - 1)
            if node.state == DRAINING:
                self.drop_if_drained(node)
            if prefill:
                node.prefilling = max(0, node.prefilling - 1)
            if node.inflight_at_poll > 0:
                # An agent's next turn often comes within a poll interval of the last one: without this the
                # finished request still looks like a running batch member on its decode node.
                node.inflight_at_poll -= 1
                node.running = max(0.0, node.running - 1.0)

    @contextlib.contextmanager
    def heading_to(self, url: str, arrival: tuple[float, float] | None = None,
                   clock: Callable[[], float] | None = None) -> Iterator[None]:
        """A P/D turn's prefill leg, on its way to decode node `url`: counted in its `arriving`. With
        `arrival` (when it should reach D on `clock`, D's read seconds) also in its `arrivals`: until the leg
        is done as estimated, then as it went, until the read should be over."""
        node = self.nodes.get(url)
        key = next(self._arrival_ids)
        if node is not None:
            node.arriving += 1
            if arrival is not None and clock is not None:
                now = clock()
                for k in [k for k, (at, read) in node.arrivals.items() if at + read < now]:
                    del node.arrivals[k]  # bounded: reads long over go (load() skips them meanwhile)
                node.arrivals[key] = arrival
        try:
            yield
        except BaseException:
            if node is not None:
                node.arrivals.pop(key, None)  # the leg failed: no request is headed to D after all
            raise
        else:
            if node is not None and key in node.arrivals and clock is not None:
                node.arrivals[key] = (clock(), node.arrivals[key][1])
        finally:
            if node is not None:
                node.arriving = max(0, node.arriving - 1)

    def mark_ok(self, url: str) -> None:
        node = self.nodes.get(url)
        if node is not None:
            node.consecutive_errors = 0

    def max_model_len(self, model: str) -> int | None:
        """The smallest context any node serving `model` reported (a turn may land on any of them)."""
        lens = [n.max_model_len[model] for n in self.nodes.values() if model in n.max_model_len]
        return min(lens) if lens else None

    def served_models(self) -> list[str]:
        seen: list[str] = []
        for n in self.nodes.values():
            for m in n.models:
                if m not in seen:
                    seen.append(m)
        return seen

    async def refresh(self, node: Node) -> None:
        """One poll of a node; any failure marks it unhealthy until a later poll succeeds."""
        timeout = httpx.Timeout(poll_timeout_s(self.config))
        try:
            text = await self._scrape(node.url, timeout)
            if _KVTETHER_METRIC in text and "vllm:" not in text:
                # Another kvtether gateway (e.g. --prefill pointed at `kvtether up`'s gateway port): it would
                # answer, and refuse every leg's kv_transfer_params.
                why = (f"{node.url} is a kvtether gateway, not a vLLM server: give the gateway the vLLM "
                       "servers' URLs (kvtether up --json prints them)")
                node.last_error = why
                self.take_out(node, why)
                return
            parsed = parse_metrics(text)
            node.running = float(parsed["running"])
            node.inflight_at_poll = node.inflight
            node.waiting = float(parsed["waiting"])
            node.kv_usage = float(parsed["kv_usage"])
            node.preemptions = float(parsed.get("preemptions", 0.0))
            capacity = parsed.get("waiting_capacity")
            node.waiting_capacity = float(capacity) if capacity is not None else None
            node.polls += 1
            if "block_size" in parsed:
                node.block_size = int(parsed["block_size"])
            if "kv_capacity_tokens" in parsed:
                node.kv_capacity_tokens = int(parsed["kv_capacity_tokens"])
            if "prefix_caching" in parsed:
                node.prefix_caching = bool(parsed["prefix_caching"])
            if node.version is None or not node.healthy:
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    v = await self.client.get(f"{node.url}/version", timeout=timeout)
                    if v.status_code == 200:
                        node.version = str(v.json().get("version"))
            if not node.models or not node.healthy:
                with contextlib.suppress(httpx.HTTPError, ValueError, AttributeError, TypeError):
                    m = await self.client.get(f"{node.url}/v1/models", timeout=timeout)
                    if m.status_code == 200:
                        cards = m.json().get("data", [])
                        node.models = [str(x["id"]) for x in cards]
                        node.max_model_len = {str(x["id"]): int(x["max_model_len"]) for x in cards
                                              if isinstance(x.get("max_model_len"), int)}
            if node.state == JOINING and node.models and self.nodes.get(node.url) is node:
                # Joined: it answers its polls and names its models. From now on turns may be placed on it.
                node.state = READY
                self._changed(Change(node.url, node.role, JOINING, READY))
            if not node.healthy and node.consecutive_errors < SOFT_ERRORS_TO_UNHEALTHY:
                # Out after a failed poll or an unreachable request: answering polls again is proof enough.
                # Out after a run of failed requests: only its /health probe (with backoff) brings it back.
                self.back_in(node, "metrics answer again")
        except (httpx.HTTPError, ValueError) as exc:
            node.last_error = f"poll failed: {type(exc).__name__}: {exc}"
            if self.on_poll_failure is not None:
                self.on_poll_failure(node.url)
            # A slow or failed /metrics is no proof the node is down (a busy engine answers it late): it is
            # out only if its /health fails too.
            if not await self.alive(node):
                self.take_out(node, node.last_error)

    async def _scrape(self, url: str, bound: httpx.Timeout) -> str:
        """A node's /metrics text; an answer other than 200 raises httpx.HTTPStatusError, as httpx's would."""
        if self.poller is None:
            resp = await self.client.get(f"{url}/metrics", timeout=bound)
            resp.raise_for_status()
            return resp.text
        answer = await self.poller.send("GET", f"{url}/metrics", read_timeout=bound.read)
        body = await answer.read()
        if answer.status_code != 200:
            request = httpx.Request("GET", f"{url}/metrics")
            raise httpx.HTTPStatusError(f"/metrics answered {answer.status_code}", request=request,
                                        response=httpx.Response(answer.status_code, request=request))
        return body.decode("utf-8", "replace")

    async def alive(self, node: Node) -> bool:
        """One /health probe: the node's own word on whether it serves (vLLM answers 200 once its engine runs)."""
        try:
            resp = await self.client.get(f"{node.url}/health",
                                         timeout=httpx.Timeout(min(2.0, self.config.connect_timeout_s)))
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    async def refresh_all(self) -> None:
        for node in [n for n in self.nodes.values() if n.state == DRAINING]:
            self.drop_if_drained(node)
        async with anyio.create_task_group() as tg:
            for node in list(self.nodes.values()):
                tg.start_soon(self.refresh, node)

    async def poll_forever(self) -> None:
        while True:
            await anyio.sleep(self.config.metrics_poll_interval_s)
            await self.refresh_all()
