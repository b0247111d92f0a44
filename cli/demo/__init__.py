"""``kvtether demo``: the reverse KV pull end to end on a simulated cluster, in one command."""
