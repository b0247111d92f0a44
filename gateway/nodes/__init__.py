"""The nodes: the gateway's view of them, bringing them back, and what their held KV costs (retention)."""
