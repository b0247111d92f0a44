"""A simulated cluster and the gateway in front of it, in this process, as `replay --sim`, `assess`, `demo` and the
benchmarks start it."""

# Prefix caching on a simulated cluster's prefill nodes. Off, as in vLLM's published P/D runs: a simulated
# cluster serves only the sessions run on it, so with it on one P keeps every history cached, which a P shared
# by the rest of a production cluster's sessions does not; the pull would then have nothing left to save.
DEFAULT_PREFILL_PREFIX_CACHING = False
