"""Client-facing APIs the gateway serves by translating them to its internal Chat Completions path."""
