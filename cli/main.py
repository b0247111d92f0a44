"""The `kvtether` command: each sub-command is registered by its module (`register(app)`): a command of one module
is a module here (`serve`, `sim`, `sessions`), a command of several a package (`replay`, `assess`, `up`, `demo`, `gen`)
whose `command` module registers it."""

from __future__ import annotations

import importlib
import signal
import threading
from typing import Any

import typer
from kvtether.cli.common.options import FLAG, kvtether_version
from typer.core import TyperCommand, TyperGroup

# A job started in the background by a non-interactive shell inherits SIGINT as ignored, and Python then never
# turns it into KeyboardInterrupt: every command must stop on Ctrl-C (and on SIGINT from a test or a supervisor)
# whatever it inherited, also while it is still starting up.
if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


class _FlagHelp:
    """typer shows a type after every option, `<bool>` after --help too, as if it took a value: none here, as for
    the commands' own flags (options.FLAG)."""

    def get_help_option(self, ctx: Any) -> Any:
        option = super().get_help_option(ctx)  # type: ignore[misc]
        if option is not None:
            option.metavar = FLAG
        return option


class _Command(_FlagHelp, TyperCommand):
    pass


class _Group(_FlagHelp, TyperGroup):
    pass


app = typer.Typer(
    cls=_Group,
    name="kvtether",
    help="Session-pinned, token-verified KV reuse for multi-turn agents on vLLM prefill/decode clusters.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)

# The modules that register the commands, in the order of `kvtether --help`; every name here must import.
_COMMAND_MODULES: tuple[str, ...] = (
    "serve", "sim", "replay.command", "sessions", "gen.command", "up.command", "demo.command", "assess.command",
)

for _name in _COMMAND_MODULES:
    importlib.import_module(f"kvtether.cli.{_name}").register(app)
for _info in app.registered_commands:
    if _info.cls in (None, TyperCommand):
        _info.cls = _Command


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"kvtether {kvtether_version()}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", metavar=FLAG, is_eager=True, callback=_print_version,
                                 help="Print kvtether's version and exit."),
) -> None:
    """kvtether: sim, serve, demo, replay, assess, up, sessions."""
