"""kvtether simulator: a vLLM-compatible prefill/decode engine simulator (embedded backend and test oracle)."""
