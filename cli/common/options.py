"""What several commands' options share: on/off flags, log levels, the installed version."""

from __future__ import annotations

from importlib import metadata

from kvtether.cli.common.exits import EXIT_USAGE
from kvtether.cli.common.failures import fail_as

# The metavar of an on/off flag (`--quick/--no-quick`). typer's help shows a type after every option, `<bool>`
# for a flag, which reads as if the flag took a value (`--quick true`, which it refuses): flags show none.
FLAG = ""

# The levels both `logging` and uvicorn know, least severe first (uvicorn's own "trace" is not a logging level).
LOG_LEVELS: tuple[str, ...] = ("debug", "info", "warning", "error", "critical")


def checked_log_level(command: str, flag: str, value: str) -> str:
    """`value` lowercased when it is a log level; otherwise one line on stderr naming the flag, what was given
    and the levels there are, and exit 2 (a bad level would otherwise surface as a traceback from
    `logging.basicConfig` or uvicorn once the command is well under way)."""
    level = value.strip().lower()
    if level not in LOG_LEVELS:
        fail_as(command, EXIT_USAGE, f"{flag} must be one of {', '.join(LOG_LEVELS)}; got {value!r}")
    return level


def kvtether_version() -> str:
    """The installed distribution's version ("unknown" when running from a tree that is not installed)."""
    try:
        return metadata.version("kvtether")
    except metadata.PackageNotFoundError:
        return "unknown"
