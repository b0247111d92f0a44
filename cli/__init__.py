"""The `kvtether` command."""
