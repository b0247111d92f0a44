"""kvtether SDK: session stamping for openai clients, the wire contract, client-side TTFT, recording."""
