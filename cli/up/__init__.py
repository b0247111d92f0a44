"""``kvtether up``: a vLLM prefill/decode cluster and the gateway in front, as supervised child processes."""
