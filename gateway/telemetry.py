"""Every span, attribute and metric name of the gateway, in one module.

GenAI semantic-convention names move (notes §2.3); keeping them here means one edit when they do.
Metrics never carry session ids or prefix hashes as labels (unbounded cardinality); spans do.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Mapping
from typing import Any

from kvtether.gateway.policy.retention import RELEASE_REASONS
from opentelemetry import trace
from opentelemetry.trace import SpanKind
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

TRACER_NAME = "kvtether.gateway"

# Spans (notes §2.7): SERVER per client request, INTERNAL steps, CLIENT per upstream leg.
SPAN_PLAN = "kvtether.plan"
SPAN_GUARD = "kvtether.guard"
SPAN_TOKENIZE = "kvtether.tokenize"
# A discovered node's change of state (joined, ready, draining, removed): a short span of its own, off any turn.
SPAN_NODE_CHANGE = "kvtether.node.change"
KIND_SERVER = SpanKind.SERVER
KIND_INTERNAL = SpanKind.INTERNAL
KIND_CLIENT = SpanKind.CLIENT


def server_span_name(method: str, path: str) -> str:
    return f"{method} {path}"


def chat_span_name(operation: str, model: str) -> str:
    return f"{operation} {model}"


# GenAI attributes.
GEN_AI_OPERATION = "gen_ai.operation.name"
GEN_AI_PROVIDER = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_STREAM = "gen_ai.request.stream"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_CONVERSATION_ID = "gen_ai.conversation.id"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_RESPONSE_TTFC = "gen_ai.response.time_to_first_chunk"
GEN_AI_USAGE_INPUT = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT = "gen_ai.usage.output_tokens"
GEN_AI_USAGE_CACHE_READ = "gen_ai.usage.cache_read.input_tokens"
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"
ERROR_TYPE = "error.type"
HTTP_METHOD = "http.request.method"
HTTP_ROUTE = "http.route"
HTTP_STATUS = "http.response.status_code"

# Our own attributes.
ATTR_LEG = "kvtether.leg"  # prefill | decode | aggregated
ATTR_TURN = "kvtether.turn.index"
ATTR_PREFIX = "kvtether.prefix.hash"
ATTR_SESSION_SOURCE = "kvtether.session.source"  # header | prefix | new
ATTR_POLICY = "kvtether.policy"
ATTR_PLAN_ACTION = "kvtether.plan.action"
ATTR_PLAN_REASON = "kvtether.plan.reason"
ATTR_PLAN_REASON_BUCKET = "kvtether.plan.reason_bucket"  # the reason label of kvtether_placement_decisions_total
ATTR_PREFILL = "kvtether.prefill.node"
ATTR_DECODE = "kvtether.decode.node"
ATTR_RE_PLACED = "kvtether.plan.re_placed"
# Why a re-placed turn's session left its node (kvtether_session_moves_total's reason).
ATTR_MOVE_REASON = "kvtether.plan.move_reason"
# A node's change of state (SPAN_NODE_CHANGE): its URL, role, the discovery source, the state before and after.
ATTR_NODE_URL = "kvtether.node.url"
ATTR_NODE_ROLE = "kvtether.node.role"
ATTR_NODE_SOURCE = "kvtether.node.source"
ATTR_NODE_STATE_BEFORE = "kvtether.node.state_before"  # none: it was not known
ATTR_NODE_STATE_AFTER = "kvtether.node.state_after"  # removed: it left the view
# Seconds the turn waited for a limit to clear before this placement (policy/deferral.py); on a placement that
# decides to wait instead, the wait it asks for.
ATTR_PLAN_DEFERRED_S = "kvtether.plan.deferred_s"
ATTR_PLAN_DEFERS = "kvtether.plan.defers"  # this placement was not run: the turn waits, then is placed again
ATTR_HANDLE_OUTCOME = "kvtether.handle.outcome"
ATTR_HELD_TOKENS = "kvtether.held.tokens"
ATTR_PROMPT_TOKENS = "kvtether.prompt.tokens"
ATTR_REUSE_TOKENS = "kvtether.reuse.tokens"
ATTR_REUSE_SOURCE = "kvtether.reuse.source"
ATTR_HANDLE_READ = "kvtether.handle.read"
ATTR_TTFT = "kvtether.ttft_s"
ATTR_RETRIED = "kvtether.retried"
ATTR_PINNED = "kvtether.pinned.node"  # the decode node the session was pinned to before this turn
ATTR_HANDLE_AGE = "kvtether.handle.age_s"
ATTR_SUFFIX_TOKENS = "kvtether.suffix.tokens"  # prompt tokens prefill computes (prompt - reused)
ATTR_GUARD_VERDICT = "kvtether.guard.verdict"  # match | partial | refused
ATTR_GATEWAY_OVERHEAD = "kvtether.gateway.overhead_s"
ATTR_MODE = "kvtether.mode"  # pd | aggregated
ATTR_STREAM_END = "kvtether.stream.end"  # complete | client_left | broken (streamed answers)
ATTR_TOKENIZE_SOURCE = "kvtether.tokenize.source"  # local | remote (the engine's /tokenize)
# ---- cost-based placement ----
ATTR_DECODE_HELD_KV_TOKENS = "kvtether.decode.held_kv_tokens"  # handles the plan's D held (last review)
ATTR_SESSION_FINAL = "kvtether.session.final"  # the client marked this turn as the session's last
ATTR_DECODE_CACHED_TOKENS = "kvtether.decode.cached_tokens"  # prompt prefix the pinned D's prefix cache holds
ATTR_COST_PREFIX = "kvtether.plan.cost."  # + CostDecision.trace_attributes() keys (option, estimates, reason …)


def cost_attributes(attrs: Mapping[str, Any]) -> dict[str, Any]:
    """The cost decision's flat attributes under the telemetry prefix."""
    return {ATTR_COST_PREFIX + k: v for k, v in attrs.items()}
# ---- end of the cost-based placement block ----

EVENT_FIRST_CHUNK = "first_chunk"
EVENT_FIRST_TOKEN = "first_token"

# Response headers: how this turn's KV was reused (the replay CLI and the demo read every x-kvtether-*).
HEADER_REUSE_SOURCE = "x-kvtether-reuse-source"
HEADER_REUSE_TOKENS = "x-kvtether-reuse-tokens"
HEADER_PLAN = "x-kvtether-plan"
# The bucket of the plan's reason (policy/reasons.py): a closed set, so no node URL or estimate reaches a client.
HEADER_PLAN_REASON = "x-kvtether-plan-reason"
# Hosted tools the gateway left out of an Agent-API turn (hosted_tools = "drop"): their types, comma-separated.
HEADER_DROPPED_TOOLS = "x-kvtether-dropped-tools"
# Client bookkeeping items left out of a Responses turn (bookkeeping_items = "drop"): their types, comma-separated.
HEADER_DROPPED_ITEMS = "x-kvtether-dropped-items"

PROVIDER = "openai"

# Reuse sources (TTFT histogram label) and handle outcomes (counter label): closed sets.
REUSE_SOURCES = ("decode_pull", "prefill_cache", "decode_local", "none")
GUARD_VERDICTS = ("match", "partial", "refused")
MODES = ("pd", "aggregated")
HANDLE_OUTCOMES = ("attached", "truncated", "refused_by_guard", "expired", "missing", "unused_local", "unused_cold",
                   "lost_race", "store_unavailable", "retried_cold", "unread")
PHASES = ("tokenize", "prefill", "decode", "aggregated", "metrics")

M_TTFT = "kvtether_ttft_seconds"
M_GATEWAY_OVERHEAD = "kvtether_gateway_overhead_seconds"
M_REQUESTS = "kvtether_requests_total"
# Streamed answers by how they ended: whole (`[DONE]` sent), the client left before that, or the stream broke
# (the node's stream failed or ended without `[DONE]`; the client got an error event). A stream's request is
# counted 2xx at its start whatever follows, so only this series shows agents that stopped reading.
M_STREAMS = "kvtether_streams_total"
STREAM_ENDS = ("complete", "client_left", "broken")
M_HANDLE_OUTCOMES = "kvtether_handle_outcomes_total"
M_PINNED_SESSIONS = "kvtether_pinned_sessions"
M_UPSTREAM_ERRORS = "kvtether_upstream_errors_total"
# Completion legs that found every upstream connection of their gateway process taken (max_connections) and
# waited for one, and their seconds waiting: time in the gateway before any node sees the request.
M_CONNECTION_WAITS = "kvtether_upstream_connection_waits_total"
M_CONNECTION_WAIT_SECONDS = "kvtether_upstream_connection_wait_seconds_total"
M_REUSED_TOKENS = "kvtether_reused_tokens_total"
M_OFFERED_TOKENS = "kvtether_offered_tokens_total"
M_PROMPT_TOKENS = "kvtether_prompt_tokens_total"
M_STREAM_HANDLE_MISSING = "kvtether_stream_handles_missing_total"
M_LOCAL_HANDLES = "kvtether_local_turn_handles_total"
# A marked decode-local turn's handle: kept (came back and stored), superseded (it replaced a handle the turn did
# not use, which D now frees only at its TTL), missing (due but none came back: D keeps no local turns).
LOCAL_HANDLE_OUTCOMES = ("kept", "superseded", "missing")
M_DECODE_STALL = "kvtether_decode_stall_seconds_total"
# Decode memory (retention): handles released by reason (policy/retention.py RELEASE_REASONS), releases that
# did not happen (cause: upstream = the prefill node failed it, no_prefill = none could take it, queue_full =
# too many waiting; the engine's TTL frees those holds in the end), and what the session store holds per decode
# node, in tokens and as a share of the node's KV capacity.
M_HANDLE_RELEASES = "kvtether_handle_releases_total"
M_RELEASE_FAILURES = "kvtether_handle_release_failures_total"
RELEASE_FAILURES = ("upstream", "no_prefill", "queue_full")
M_HELD_KV_TOKENS = "kvtether_held_kv_tokens"
M_HELD_KV_SHARE = "kvtether_held_kv_share"
M_HELD_KV_BUDGET = "kvtether_held_kv_budget"  # the configured held_kv_budget (alerts and dashboards compare with it)
# 1 while the gateway places turns on a node, 0 while it has taken it out of service (read at each scrape).
M_NODE_HEALTHY = "kvtether_node_healthy"
# The nodes the gateway knows, by role and state (joining, ready, draining; out: ready but taken out of service
# by the health rules), read at each scrape; and the sessions that left their node at a turn, by why
# (cluster.Cluster.move_reason): draining, gone, unhealthy, rebalance.
M_NODES = "kvtether_nodes"
NODE_STATES = ("joining", "ready", "draining", "out")
M_SESSION_MOVES = "kvtether_session_moves_total"
MOVE_REASONS = ("draining", "gone", "unhealthy", "rebalance", "kv_pressure")
# P/D plans by option (the plan's action) and reason (a bucket of its reason text: policy/reasons.py BUCKETS).
M_PLACEMENT_DECISIONS = "kvtether_placement_decisions_total"
M_DEFERRED_TURNS = "kvtether_deferred_turns_total"
M_DEFERRED_SECONDS = "kvtether_deferred_seconds_total"
# Placed within the limits after waiting; run over one when the wait ran out; run over one at once, without
# waiting, because recent waits seldom cleared (policy/deferral.py).
DEFER_OUTCOMES = ("cleared", "forced", "skipped")
# Hosted tools left out of /v1/responses and /v1/messages turns, by type without its version (web_search_20250305
# and web_search_preview are web_search): the closed set the translations drop (kvtether.protocol).
M_DROPPED_TOOLS = "kvtether_dropped_tools_total"
DROPPED_TOOL_TYPES = ("web_search", "file_search", "code_interpreter", "computer_use", "image_generation", "mcp",
                      "local_shell", "shell", "apply_patch", "computer", "web_fetch", "code_execution", "bash",
                      "text_editor", "memory", "tool_search_tool_regex", "tool_search_tool_bm25", "mcp_toolset",
                      "tool_search", "programmatic_tool_calling", "browser_toolset", "computer_toolset")
# Items left out of agent-API turns, by type (bookkeeping_items = "drop"): client bookkeeping items of
# /v1/responses (kvtether.protocol.responses.items.BOOKKEEPING_ITEMS) and the blocks of a /v1/messages tool
# result no model behind vLLM reads (kvtether.protocol.messages.request.REFUSED_TOOL_RESULT_BLOCKS).
M_DROPPED_ITEMS = "kvtether_dropped_items_total"
DROPPED_ITEM_TYPES = ("mcp_list_tools", "mcp_approval_request", "mcp_approval_response", "web_search_call",
                      "document", "search_result", "browser_state")
ROUTES = ("chat", "completions", "messages", "responses")
STATUS_CLASSES = ("2xx", "4xx", "5xx")
# The guard's local tokenizer: ids that differed from the engine's /tokenize (check = startup | turn; each
# switches that model back to /tokenize), and guarded turns by which tokenizer gave their ids.
M_TOKENIZER_MISMATCHES = "kvtether_tokenizer_mismatches_total"
M_GUARD_TOKENIZE = "kvtether_guard_tokenize_total"
TOKENIZER_CHECKS = ("startup", "turn")
TOKENIZE_SOURCES = ("local", "remote")
# Shared session store (Redis/Valkey; the memory store is not measured): each call's latency, and the calls that
# timed out, failed, or were skipped while the store was paused after a failure (each answered cold, never failed).
M_STORE_SECONDS = "kvtether_store_seconds"
M_STORE_FAILURES = "kvtether_store_failures_total"
STORE_OPERATIONS = ("get", "put", "take_handle", "find_by_prefix", "delete", "sweep", "list", "count")
STORE_FAILURES = ("timeout", "error", "skipped")
STORE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)

# Server TTFT buckets of the GenAI conventions, stretched to long-context prefills.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80)
# The gateway's own share of a turn is meant to be a few milliseconds: finer buckets at the low end.
OVERHEAD_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1)


class Metrics:
    """Prometheus metrics in a per-app registry (several gateways can live in one test process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        # mode = pd | aggregated (the gateway's), policy = the configured one (auto | pull | no-pull | reference).
        self.ttft = Histogram(M_TTFT, "Gateway-measured time to first token, by where the reused KV came from",
                              ["reuse_source", "mode", "policy"], buckets=TTFT_BUCKETS, registry=r)
        self.gateway_overhead = Histogram(
            M_GATEWAY_OVERHEAD, "Time to first token spent in the gateway itself (TTFT minus time awaiting "
            "tokenize, prefill and the decode leg's first token)", ["mode"], buckets=OVERHEAD_BUCKETS, registry=r)
        self.requests = Counter(M_REQUESTS, "Client requests by route and status class", ["route", "status"],
                                registry=r)
        self.streams = Counter(M_STREAMS, "Streamed answers by route and how they ended", ["route", "end"],
                               registry=r)
        self.handle_outcomes = Counter(M_HANDLE_OUTCOMES, "What happened to a session's handle on a turn",
                                       ["outcome"], registry=r)
        # Gauges under several workers (`kvtether serve --workers N`: their metrics merged at each scrape,
        # gateway/shell/workers.py) take one running worker's value, never their sum: the most recent, as each
        # worker reads the same shared store (sessions, held KV) or sets its own view just before it answers the
        # scrape (node health); the budget is one setting. multiprocess_mode is ignored in one process.
        self.pinned_sessions = Gauge(M_PINNED_SESSIONS, "Sessions currently pinned to a node", registry=r,
                                     multiprocess_mode="livemostrecent")
        self.upstream_errors = Counter(M_UPSTREAM_ERRORS, "Upstream failures by node and phase", ["node", "phase"],
                                       registry=r)
        self.connection_waits = Counter(M_CONNECTION_WAITS, "Upstream requests that waited for a free connection "
                                        "(every one of max_connections taken)", registry=r)
        self.connection_wait_seconds = Counter(M_CONNECTION_WAIT_SECONDS, "Seconds upstream requests waited for a "
                                               "free connection", registry=r)
        # What the engine reported it did not compute, by where it came from (guard/readback.py); beside what the
        # gateway offered, so a handle that was sent and not read shows as the gap between the two.
        self.reused_tokens = Counter(M_REUSED_TOKENS, "Prompt tokens a node reported it did not compute, by source",
                                     ["source"], registry=r)
        for source in REUSE_SOURCES:
            self.reused_tokens.labels(source)
        self.offered_tokens = Counter(M_OFFERED_TOKENS, "Handle tokens offered to prefill nodes", registry=r)
        self.prompt_tokens = Counter(M_PROMPT_TOKENS, "Prompt tokens of P/D turns with a verified prompt", registry=r)
        self.stream_handles_missing = Counter(
            M_STREAM_HANDLE_MISSING, "Finished turns whose decode node returned no handle (e.g. streams before 0.33)",
            registry=r)
        self.local_handles = Counter(
            M_LOCAL_HANDLES, "Decode-local turns marked for retention, by what became of their handle", ["outcome"],
            registry=r)
        for outcome in LOCAL_HANDLE_OUTCOMES:
            self.local_handles.labels(outcome)
        # rate() of it is the share of the node's time its running batch lost to local prefills (each request's
        # TPOT quota, request_stall_share, bounds what any one of them loses).
        self.decode_stall = Counter(
            M_DECODE_STALL,
            "Estimated seconds decode-local prefills (on a pool instance, prefill legs too) stalled a node's decodes",
            ["node"], registry=r)
        for outcome in HANDLE_OUTCOMES:
            self.handle_outcomes.labels(outcome)
        self.handle_releases = Counter(M_HANDLE_RELEASES, "Handles released on their decode node, by reason",
                                       ["reason"], registry=r)
        for reason in RELEASE_REASONS:
            self.handle_releases.labels(reason)
        self.release_failures = Counter(M_RELEASE_FAILURES, "Handle releases that did not happen, by cause",
                                        ["cause"], registry=r)
        for cause in RELEASE_FAILURES:
            self.release_failures.labels(cause)
        self.held_kv_tokens = Gauge(M_HELD_KV_TOKENS, "KV tokens the gateway's handles hold on a decode node "
                                    "(whole blocks, each once)", ["node"], registry=r,
                                    multiprocess_mode="livemostrecent")
        self.held_kv_budget = Gauge(M_HELD_KV_BUDGET, "The held KV budget: a share of each decode node's KV capacity",
                                    registry=r, multiprocess_mode="livemax")  # one setting, the same in every worker
        self.node_healthy = Gauge(M_NODE_HEALTHY, "1 while the gateway places turns on the node, 0 while it is out",
                                  ["node", "role"], registry=r, multiprocess_mode="livemostrecent")
        self.nodes = Gauge(M_NODES, "Nodes the gateway knows, by role and state", ["role", "state"], registry=r,
                           multiprocess_mode="livemostrecent")
        self.session_moves = Counter(M_SESSION_MOVES, "Sessions that left their node at a turn, by why", ["reason"],
                                     registry=r)
        for reason in MOVE_REASONS:
            self.session_moves.labels(reason)
        for route in ROUTES:  # every series from the start, so a rate() sees the first error
            for status in STATUS_CLASSES:
                self.requests.labels(route, status)
            for end in STREAM_ENDS:
                self.streams.labels(route, end)
        self.held_kv_share = Gauge(M_HELD_KV_SHARE, "Share of a decode node's KV capacity its held handles take",
                                   ["node"], registry=r, multiprocess_mode="livemostrecent")
        self.placement_decisions = Counter(M_PLACEMENT_DECISIONS, "P/D turns' placements, by option and reason",
                                           ["option", "reason"], registry=r)
        self.deferred_turns = Counter(M_DEFERRED_TURNS, "Turns over a limit that clears: those that waited for it "
                                      "before they were placed, by how they then ran, and those that did not wait",
                                      ["outcome"], registry=r)
        self.deferred_seconds = Counter(M_DEFERRED_SECONDS, "Seconds turns waited for a limit to clear", registry=r)
        for outcome in DEFER_OUTCOMES:
            self.deferred_turns.labels(outcome)
        self.store_seconds = Histogram(M_STORE_SECONDS, "Latency of the shared session store's calls",
                                       ["operation"], buckets=STORE_BUCKETS, registry=r)
        self.store_failures = Counter(M_STORE_FAILURES, "Session store calls answered without the store",
                                      ["operation", "reason"], registry=r)
        for op in STORE_OPERATIONS:
            self.store_seconds.labels(op)
            for reason in STORE_FAILURES:
                self.store_failures.labels(op, reason)
        self.tokenizer_mismatches = Counter(
            M_TOKENIZER_MISMATCHES, "Local tokenizer ids that differed from the engine's /tokenize", ["check"],
            registry=r)
        self.guard_tokenize = Counter(M_GUARD_TOKENIZE, "Guarded turns' prompt ids by tokenizer", ["source"],
                                      registry=r)
        for check in TOKENIZER_CHECKS:
            self.tokenizer_mismatches.labels(check)
        for where in TOKENIZE_SOURCES:
            self.guard_tokenize.labels(where)
        self.dropped_tools = Counter(M_DROPPED_TOOLS, "Hosted tools left out of agent-API turns, by type",
                                     ["type"], registry=r)
        for kind in DROPPED_TOOL_TYPES:
            self.dropped_tools.labels(kind)
        self.dropped_items = Counter(M_DROPPED_ITEMS, "Client bookkeeping items left out of agent-API turns, by "
                                     "type", ["type"], registry=r)
        for kind in DROPPED_ITEM_TYPES:
            self.dropped_items.labels(kind)
        self._policy = "auto"

    def set_policy(self, policy: str) -> None:
        """The configured policy (a label of the TTFT histogram); series are created for it up front."""
        self._policy = policy
        for mode in MODES:
            self.gateway_overhead.labels(mode)
            for source in REUSE_SOURCES:
                self.ttft.labels(source, mode, policy)

    def expect_decisions(self, series: Iterable[tuple[str, str]]) -> None:
        """The placement series the policy can produce (its declared (action, reason bucket) pairs), at zero from
        the start (P/D mode: aggregated turns are not placed by a policy)."""
        for option, reason in series:
            self.placement_decisions.labels(option, reason)

    def connection_waited(self, seconds: float) -> None:
        """An upstream request waited `seconds` for a connection slot (transport/upstream.py)."""
        self.connection_waits.inc()
        self.connection_wait_seconds.inc(seconds)

    def observe_ttft(self, source: str, mode: str, seconds: float, overhead_s: float | None = None) -> None:
        """One turn's TTFT and, when known, the gateway's own share of it."""
        self.ttft.labels(source, mode, self._policy).observe(seconds)
        if overhead_s is not None:
            self.gateway_overhead.labels(mode).observe(overhead_s)


def tracer(provider: trace.TracerProvider | None = None) -> trace.Tracer:
    """The gateway's tracer: from ``provider`` when given (tests, embedding apps), else the global one."""
    if provider is not None:
        return provider.get_tracer(TRACER_NAME)
    return trace.get_tracer(TRACER_NAME)


def set_attrs(span: trace.Span, attrs: dict[str, Any]) -> None:
    for key, value in attrs.items():
        if value is not None:
            span.set_attribute(key, value)


def guard_verdict(reuse: int, held: int, min_reuse: int) -> str:
    """match: all of D's held tokens are a prefix of the prompt; partial: only some (the handle is truncated);
    refused: fewer than ``min_reuse`` verified (the handle is not sent)."""
    if reuse < min_reuse:
        return "refused"
    return "match" if reuse >= held else "partial"


def reuse_headers(source: str, tokens: int | None, plan_action: str | None,
                  reason_bucket: str | None = None) -> dict[str, str]:
    out = {HEADER_REUSE_SOURCE: source, HEADER_REUSE_TOKENS: str(tokens or 0)}
    if plan_action:
        out[HEADER_PLAN] = plan_action
    if reason_bucket:
        out[HEADER_PLAN_REASON] = reason_bucket
    return out


# ---- exporters -----------------------------------------------------------------------------------------

SERVICE_NAME = "kvtether-gateway"
EXPORTERS = ("otlp", "console", "none")
PROTOCOLS = ("http/protobuf", "grpc")
_setup_lock = threading.Lock()
_installed: trace.TracerProvider | None = None


class TracingConfigError(ValueError):
    """An OTEL_* value the gateway cannot honour; the message names the variable."""


def exporter_names(env: Mapping[str, str], otlp_endpoint: str | None = None) -> list[str]:
    """Which exporters ``OTEL_TRACES_EXPORTER`` asks for (comma-separated, like the SDK's auto-configuration).

    Unset, the spec's default is ``otlp``; we only take it when an OTLP endpoint is configured (the variable, or
    the gateway's ``otlp_endpoint``), so a plain ``kvtether serve`` does not retry a collector that is not there.
    """
    raw = env.get("OTEL_TRACES_EXPORTER")
    if raw is None or not raw.strip():
        configured = otlp_endpoint or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get(
            "OTEL_EXPORTER_OTLP_ENDPOINT")
        return ["otlp"] if configured else []
    names = [n.strip().lower() for n in raw.split(",") if n.strip()]
    for n in names:
        if n not in EXPORTERS:
            raise TracingConfigError(f"OTEL_TRACES_EXPORTER: {n!r} is not one of {', '.join(EXPORTERS)}")
    return [] if "none" in names else names


def otlp_protocol(env: Mapping[str, str]) -> str:
    proto = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
             or "http/protobuf").strip().lower()
    if proto not in PROTOCOLS:
        raise TracingConfigError(f"OTEL_EXPORTER_OTLP_PROTOCOL: {proto!r} is not one of {', '.join(PROTOCOLS)}")
    return proto


def make_exporters(env: Mapping[str, str], otlp_endpoint: str | None = None) -> list[Any]:
    """Span exporters from the standard variables. Endpoint, headers, timeout, TLS and compression are read
    by the OTLP exporters themselves from ``OTEL_EXPORTER_OTLP_*``; ``otlp_endpoint`` (gateway config) only
    fills in when no endpoint variable is set."""
    out: list[Any] = []
    for name in exporter_names(env, otlp_endpoint):
        if name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            out.append(ConsoleSpanExporter(service_name=SERVICE_NAME))
            continue
        has_env_endpoint = bool(env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
        endpoint = None if has_env_endpoint else otlp_endpoint
        if otlp_protocol(env) == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

            out.append(GrpcExporter(endpoint=endpoint))
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

            out.append(HttpExporter(endpoint=_traces_url(endpoint) if endpoint else None))
    return out


def _traces_url(endpoint: str) -> str:
    """A bare collector address gets OTLP/HTTP's signal path, as ``OTEL_EXPORTER_OTLP_ENDPOINT`` does; a URL
    with a path is taken as the full traces URL (like ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``)."""
    from urllib.parse import urlsplit

    return endpoint.rstrip("/") + "/v1/traces" if urlsplit(endpoint).path in ("", "/") else endpoint


def make_provider(exporters: list[Any], *, batch: bool = True) -> trace.TracerProvider:
    """An SDK provider. The sampler comes from ``OTEL_TRACES_SAMPLER``/``OTEL_TRACES_SAMPLER_ARG`` (the SDK reads
    them when none is passed; default parentbased_always_on), the resource from ``OTEL_SERVICE_NAME`` and
    ``OTEL_RESOURCE_ATTRIBUTES`` (with ``kvtether-gateway`` as the service name when neither sets one)."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    attrs = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": SERVICE_NAME}
    provider = TracerProvider(resource=Resource.create(attrs))
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
    return provider


def in_memory_provider() -> tuple[trace.TracerProvider, Any]:
    """A provider whose spans land in an ``InMemorySpanExporter`` as they end (tests, ``kvtether demo --trace``)."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    return make_provider([exporter], batch=False), exporter


def setup_tracing(otlp_endpoint: str | None = None,
                  env: Mapping[str, str] | None = None) -> trace.TracerProvider | None:
    """Install the exporters the ``OTEL_*`` variables ask for as the global provider (`kvtether serve`).

    Once per process (OpenTelemetry's global provider can be set only once); returns the provider, or None
    when nothing is to be exported — then spans cost nothing (the API's no-op tracer).
    """
    global _installed
    with _setup_lock:
        if _installed is not None:
            return _installed
        exporters = make_exporters(os.environ if env is None else env, otlp_endpoint)
        if not exporters:
            return None
        _installed = make_provider(exporters)
        trace.set_tracer_provider(_installed)
        return _installed
