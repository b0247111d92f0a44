"""The cost model's parameters: the few an operator sets (copied from ``GatewayConfig``) and the tuning
constants, each with where its value comes from.

The constants can be overridden for experiments through the gateway's ``[gateway.tuning]`` table
(``GatewayConfig.tuning``); that is not a stable interface. "GLM-5 paced" below means
``benchmarks/placement_policies.py`` on the simulated GLM-5-FP8 8×H200 preset, 16 paced agent sessions,
P's prefix caching off (docs/cost-model.md has the figures).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

MAX_HORIZON_TURNS = 3  # the look-ahead tree grows ~3^h; deeper adds cost, not insight (loads change anyway)


@dataclass(frozen=True, slots=True)
class PolicyKnobs:
    # ---- operator settings (GatewayConfig has the same names and defaults) ----
    # Decode-local never runs a suffix longer than this (Dynamo's conditional disaggregation has the same
    # knob). 8192 = one chunked-prefill step at vLLM's default token budget on large GPUs; whether a long
    # suffix may stall a busy D that long is the TPOT quotas' call (GatewayConfig.request_stall_share).
    max_local_suffix_tokens: int = 8192
    # The same on a pool instance; None: no such limit. A pool instance exists to run long prefills locally
    # when they fit: its TPOT quotas and the KV-pressure veto already decide whether its decodes can take
    # one, and every token over a fixed cap would cross the network twice instead (docs/pool.md).
    pool_max_local_suffix_tokens: int | None = None
    # Running requests on D must keep a mean inter-token time under this over their next
    # `tpot_window_tokens`, local prefill stall included: a typical interactive TPOT objective.
    tpot_budget_s: float = 0.100
    # The TTFT objective the operator serves to (None: none set). The look-ahead may trade this turn's TTFT for
    # the next turn's, but not past the objective when an option within it exists: a turn that misses its
    # objective is lost to goodput whatever the next one gains.
    ttft_objective_s: float | None = None
    # vLLM's kv_recompute_threshold: P recomputes rather than pulls fewer tokens, so "pull" would be cold.
    recompute_threshold_tokens: int = 64
    # The gateway's handle TTL (below the engine's decoder_kv_blocks_ttl, 480 s).
    handle_ttl_s: float = 450.0
    block_size: int = 16  # prefix caching hits whole blocks only
    chunk_tokens: int = 2048  # vLLM's max_num_batched_tokens: the local prefill is spread over these steps
    # A P/D turn (pull or cold) may decode on another D than the pinned one when that D is less loaded enough
    # to pay for moving the whole prompt's KV there (the pin moves with it). Without it a pinned session keeps
    # whatever imbalance its turns' timing gave its D, which every one of its tokens pays in TPOT.
    rebalance_decode: bool = True
    # D's KV usage at or above which a decode-local prefill is vetoed (GatewayConfig.decode_pressure_usage):
    # vLLM allocates a local suffix's blocks chunk by chunk beside the running requests' growing ones, and when
    # none is free it preempts a running request, whose recompute stalls it far beyond any TPOT objective. A P/D
    # turn's KV arrives whole or not at all (D's read waits for the blocks), so it cannot preempt that way.
    local_kv_veto: float = 0.9
    # A pool (instances that prefill and decode): a session leaves its instance only when that instance has more
    # than `pool_balance_abs` requests in flight above the lightest one and more than `pool_balance_rel` times
    # its load (options.pool_overloaded). The rule is the SGLang / vLLM routers' cache-aware one. Their absolute
    # threshold (64) is sized for workers with hundreds of short requests in flight; an agent session keeps
    # about one, so 4 is four sessions' worth of imbalance, more than the one or two a burst of new sessions
    # leaves (they go to the lightest instance anyway). 1.5 is theirs: two busy instances a few requests
    # apart are not imbalanced.
    pool_balance_abs: float = 4.0
    pool_balance_rel: float = 1.5
    # A turn that every option would run over a limit that clears as the requests running there finish (a TPOT
    # quota, a prefill still running, the KV-pressure veto) waits up to this many seconds for one to clear
    # (policy/deferral.py), instead of breaking another request's TPOT at once. 0.2 s: a tenth of a 2 s TTFT
    # objective, and several of a short answer's whole decode (six tokens at 7 ms), which is what usually
    # holds the limit. 0 turns it off.
    defer_max_s: float = 0.2

    # ---- tuning constants ----
    # With a TTFT objective set, a turn that every option within the limits would run over it runs over a pool
    # instance's TPOT quota instead, when that keeps it within the objective (costmodel._within_objective_over_a_quota;
    # on a pool an answer's quota is its whole TPOT objective, so this trades the turn for at least one answer's
    # TPOT, and buys the queue behind it). With the observed queue below, five seeds of the pool: +2,955 turns of
    # 12,800 on the long documents at ×8, +76 of 11,520 on coding at ×4, −31 of 5,760 on coding-long at ×2
    # (docs/placement.md, "A pool's queue and its TTFT objective").
    ttft_over_quota: bool = True
    # The same rescue on dedicated decode nodes (P/D), a session's first turn included: when P's queue puts every
    # option within the limits past the TTFT objective, the turn runs on a decode node over its answers' TPOT
    # quotas (a first turn prefilled there whole, as Dynamo's rule does for prompts short of its threshold),
    # if that keeps it within the objective. A decode node's quota is a share of each answer's decode time kept
    # for smoothness, not its objective, so the trade differs from the pool's (docs/placement.md has what it did).
    decode_ttft_rescue: bool = False
    # A pool instance's prefill queue is what is left of the prefills running there, local turns and legs of any
    # session alike, until each is seen to end (TurnFacts.prefill_queue_s), not the gateway's count of its legs
    # there times the learned time a queued request adds; a local turn's first token waits for it too.
    pool_queue_observed: bool = True
    # Rules under evaluation, off by default (docs/placement.md has what each did on five seeds of the pool):
    # - an answer charged more stall than its TPOT objective allows stops binding (stallquota.Exposure.lost). The
    #   stall charged is conservative (counted from placement), so an answer judged lost often is not: alone it
    #   lost 62 turns of 2,304 on coding at ×4 (seed 1); with the other two rules, +2,001 on the long documents at
    #   ×8 and −748 on coding at ×4.
    release_lost_answers: bool = False
    # A deferred turn is placed again this often: about a decode step, the soonest a running answer can end.
    defer_step_s: float = 0.01
    # Waits are observed (policy/deferral.py): below this moving share of waits that cleared, turns run at once but
    # one in `defer_probe_every`. The average's weight of each wait is `defer_clear_alpha` (0.1: about the last
    # ten). 0: every turn that could wait does (the default, while the rule is evaluated). At 0.3 / 4, five seeds
    # of the pool: +21 turns of 1,182 on the bursty trace at ×2, −1 of 583 at ×1, −4 of 2,880 on coding-long.
    defer_min_clear_rate: float = 0.0
    defer_probe_every: int = 4
    defer_clear_alpha: float = 0.1
    # The window of the TPOT budget above: 16 tokens ≈ what a reader perceives as one hiccup.
    tpot_window_tokens: int = 16
    # Seconds of this turn's TTFT that one second of delay on *each* running request of D is worth (1 would
    # count a token's delay like a first token's). The TPOT quotas bound what local prefills may cost the
    # batch, so this orders turns within them: on GLM-5 paced with quotas, 0.5 ran ~80 late turns locally
    # where 0.2 ran ~100, and 1 ran 44 (lower TPOT p95, higher late TTFT p50).
    interference_weight: float = 0.2
    # Look-ahead: turns considered after this one, and the weight of each (the session may end, loads change).
    # One turn is enough to see what an option leaves behind (a handle or none, a moved pin).
    horizon_turns: int = 1
    horizon_discount: float = 0.7
    # P declines a read this close to the handle's expiry (vLLM ≤ 0.28: 5 s): a pull must start before.
    handle_margin_s: float = 5.0
    # Look-ahead: above this KV usage of D, a history held only in D's prefix cache may be evicted before the
    # next turn; the probability rises linearly to 1 at full usage (vLLM evicts free blocks only when no free
    # block is left, so below ~80 % usage nothing cached is lost between two turns).
    evict_kv_usage_knee: float = 0.8
    # Seconds of score one expected second of recompute is worth when an answer decodes on a D short of memory
    # (options.preemption_risk_s: above the knee, vLLM may preempt it and recompute its prompt). 1: as TTFT, what
    # moves a pool session off an instance short of memory; 0: off.
    preemption_weight: float = 1.0
    # Tail-aware objective: every second of an option's estimated TTFT above the `tail_quantile` of recent
    # turns' estimates costs `tail_weight` seconds more, so a turn already in the tail (a long tool result) is
    # not moved to a lighter D that lacks its history. 3 on GLM-5 paced, three session sets against 0: late
    # p95 TTFT 11–54 ms lower and p50 1–10 ms lower in each, decode TPOT p95 3–5 % higher.
    tail_weight: float = 3.0
    tail_quantile: float = 0.9
    # Seconds of this turn's TTFT one second of delay to a P/D turn arriving on D is worth (a local prefill's
    # engine step holds up another turn's KV read or first step). Off: at 1 on GLM-5 paced the late p50 moved
    # −11 ms and the p95 +18 ms, within the run-to-run noise, at +1.3 points of TPOT.
    arrival_weight: float = 0.0
    # Seconds of this turn's TTFT one second of stall on a request whose client has seen nothing yet is worth
    # (a tool-call parser holding the first delta back, or a non-streamed request), when above
    # interference_weight. Off: at 1 on GLM-5 paced the late p50 rose 17 ms and TPOT p95 5.6 points.
    holdback_weight: float = 0.0

    def __post_init__(self) -> None:
        if self.ttft_objective_s is not None and not self.ttft_objective_s > 0:
            raise ValueError("ttft_objective_s must be > 0")
        if not 0 <= self.horizon_turns <= MAX_HORIZON_TURNS:
            raise ValueError(f"horizon_turns must be in [0, {MAX_HORIZON_TURNS}]")
        if not 0.0 <= self.horizon_discount <= 1.0:
            raise ValueError("horizon_discount must be in [0, 1]")
        if self.interference_weight < 0 or self.tpot_budget_s <= 0 or self.tpot_window_tokens < 1:
            raise ValueError("interference_weight >= 0, tpot_budget_s > 0, tpot_window_tokens >= 1")
        if (self.max_local_suffix_tokens < 0 or self.recompute_threshold_tokens < 0
                or (self.pool_max_local_suffix_tokens or 0) < 0):
            raise ValueError("token limits must be >= 0")
        if not 0.0 <= self.evict_kv_usage_knee < 1.0:
            raise ValueError("evict_kv_usage_knee must be in [0, 1)")
        if self.block_size < 1 or self.chunk_tokens < 1:
            raise ValueError("block_size and chunk_tokens must be >= 1")
        if self.tail_weight < 0.0 or not 0.0 < self.tail_quantile < 1.0:
            raise ValueError("tail_weight must be >= 0 and tail_quantile in (0, 1)")
        if self.pool_balance_abs < 0.0 or self.pool_balance_rel < 1.0:
            raise ValueError("pool_balance_abs must be >= 0 and pool_balance_rel >= 1")
        if self.defer_max_s < 0.0 or self.defer_step_s <= 0.0:
            raise ValueError("defer_max_s must be >= 0 and defer_step_s > 0")
        if not (0.0 <= self.defer_min_clear_rate <= 1.0 and 0.0 < self.defer_clear_alpha <= 1.0
                and self.defer_probe_every >= 1):
            raise ValueError("defer_min_clear_rate in [0, 1], defer_clear_alpha in (0, 1], defer_probe_every >= 1")
        if self.arrival_weight < 0.0 or self.holdback_weight < 0.0:
            raise ValueError("arrival_weight and holdback_weight must be >= 0")


# What `[gateway.tuning]` may override: the constants above (the operator settings have their own names).
TUNING_FIELDS: frozenset[str] = frozenset(
    f.name for f in fields(PolicyKnobs)
    if f.name not in {"mode", "max_local_suffix_tokens", "pool_max_local_suffix_tokens", "tpot_budget_s",
                      "recompute_threshold_tokens", "handle_ttl_s", "block_size", "chunk_tokens", "rebalance_decode",
                      "pool_balance_abs", "pool_balance_rel", "defer_max_s"})
