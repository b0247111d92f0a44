"""The `kvtether` command: each sub-command lives in its own module with a `register(app)` function."""

from __future__ import annotations

import importlib
import signal
import threading

import typer

# A job started in the background by a non-interactive shell inherits SIGINT as ignored, and Python then never
# turns it into KeyboardInterrupt: every command must stop on Ctrl-C (and on SIGINT from a test or a supervisor)
# whatever it inherited, also while it is still starting up.
if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

app = typer.Typer(
    name="kvtether",
    help="Session-pinned, token-verified KV reuse for multi-turn agents on vLLM prefill/decode clusters.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)

# Filled in as the command modules land; every name here must import.
_COMMAND_MODULES: tuple[str, ...] = (
    "cmd_serve", "cmd_sim", "cmd_replay", "cmd_sessions", "cmd_gen", "cmd_up", "cmd_demo",
)

for _name in _COMMAND_MODULES:
    importlib.import_module(f"kvtether.cli.{_name}").register(app)


@app.callback()
def _root() -> None:
    """kvtether: sim, serve, demo, replay, up, sessions."""
