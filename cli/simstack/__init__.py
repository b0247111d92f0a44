"""A simulated cluster and the gateway in front of it, in this process, as `replay --sim`, `assess`, `demo` and the
benchmarks start it."""
