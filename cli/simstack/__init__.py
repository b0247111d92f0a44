"""One simulated stack: a simulated vLLM cluster and the gateway in front of it, in this process, as
`replay --sim`, `assess`, `demo` and the benchmarks start it (stack.py); the engines' own TPOT
(decode_times.py), the estimator's calibration (calibration.py) and where the stack's logs go (logs.py).

Importing this package imports neither the simulator nor the gateway: a replay against a running gateway needs
neither.
"""

from kvtether.cli.simstack.stack import (
    COLOCATED,
    DEFAULT_PREFILL_PREFIX_CACHING,
    HYBRID,
    ONE_POOL,
    SimStack,
    StackSpec,
    StackTimes,
    gateway_settings,
    seed_settings,
    sim_stack,
    time_settings,
)

__all__ = [
    "COLOCATED",
    "DEFAULT_PREFILL_PREFIX_CACHING",
    "HYBRID",
    "ONE_POOL",
    "SimStack",
    "StackSpec",
    "StackTimes",
    "gateway_settings",
    "seed_settings",
    "sim_stack",
    "time_settings",
]
