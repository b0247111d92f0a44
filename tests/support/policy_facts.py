"""The facts the cost policy's tests decide over: the nodes' URLs, a large MoE decode node's estimates, and a
follow-up turn whose history D already holds."""

from __future__ import annotations

from typing import Any

from kvtether.gateway.policy import TurnFacts
from kvtether.gateway.policy.estimates import EstimatorSeeds, EstimatorSnapshot

D0, D1 = "http://d0", "http://d1"
P0, P1 = "http://p0", "http://p1"

# A large MoE decode node (GLM-5-FP8 on 8 x H200, the simulator's cost model): a prefill step reads nearly
# every expert (~70 ms even for a short suffix) while a decode step of a small batch reads few (~7 ms + 2 ms
# per sequence); a pull reads ~6 us of KV per history token.
MOE = EstimatorSnapshot(EstimatorSeeds(
    prefill_overhead_s=0.063, prefill_s_per_token=1.3e-5, prefill_s_per_pair=7e-10, transfer_latency_s=0.001,
    transfer_s_per_token=6e-6, tpot_base_s=0.0047, tpot_s_per_seq=0.002, queue_s_per_request=0.1))


def history_turn(prompt: int, suffix: int, **kw: Any) -> TurnFacts:
    """A follow-up turn whose whole history (prompt − suffix) is verified against D's handle."""
    args: dict[str, Any] = {
        "reuse_tokens": prompt - suffix,
        "handle_valid": True,
        "handle_age_s": 10.0,
        "decode_cached_tokens": prompt - suffix,
    }
    args.update(kw)
    return TurnFacts(prompt, suffix, **args)
