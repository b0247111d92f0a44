"""kvtether gateway: session-pinned P/D orchestration with a token-verified reverse KV pull."""
