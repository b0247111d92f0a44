"""What the commands share: exit codes, failures, session loading, the result document, options."""
