"""How a command fails: one line on stderr that says what is wrong (and, where it can, what to do), then its exit
code (common/exits.py). Never a traceback: a user who gave a bad flag or a missing file learns nothing from one."""

from __future__ import annotations

from typing import NoReturn

import typer
from rich.console import Console
from rich.markup import escape


def fail(console: Console, code: int, message: str) -> NoReturn:
    """`error: MESSAGE` on `console` (stderr), then exit with `code`. The message is the user's words and paths,
    never markup, and one line whatever the terminal's width (a script may grep it)."""
    console.print(f"[red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def fail_as(command: str, code: int, message: str) -> NoReturn:
    """`kvtether COMMAND: MESSAGE` on stderr, then exit with `code`: the form of the commands that run servers
    (`serve`, `up`), whose other lines on stderr are logs that name their source too."""
    typer.echo(f"kvtether {command}: {message}", err=True)
    raise typer.Exit(code)
