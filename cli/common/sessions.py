"""Reading the sessions a command runs: a session file, or another tool's file imported on the fly (`--format`)."""

from __future__ import annotations

from pathlib import Path

from kvtether.cli.common.exits import EXIT_USAGE
from kvtether.cli.common.failures import fail
from kvtether.sdk.sessionfile import SessionFileError, SessionRecord, read_sessions
from rich.console import Console

SESSION_FORMAT = "session"


def load_sessions(path: Path, fmt: str, model: str | None) -> list[SessionRecord]:
    """Read a session file (or import another tool's format); raises SessionFileError/ImportFormatError/OSError."""
    if fmt == SESSION_FORMAT:
        return read_sessions(path)
    # Imported here: a session file needs none of the importers.
    from kvtether.cli.gen.importers import import_file

    return import_file(path, fmt, model=model or "default")


def load_sessions_or_fail(console: Console, path: Path, fmt: str, model: str | None,
                          limit: int | None) -> list[SessionRecord]:
    """The first `limit` sessions of `path`; a missing, unreadable, malformed or empty file is a usage error
    (exit 2 with one line), since nothing was run."""
    from kvtether.cli.gen.importers import ImportFormatError

    try:
        sessions = load_sessions(path, fmt, model)
    except FileNotFoundError:
        fail(console, EXIT_USAGE, f"{path}: no such file")
    except (SessionFileError, ImportFormatError) as e:
        fail(console, EXIT_USAGE, f"malformed session file: {e}")
    except (OSError, UnicodeDecodeError) as e:
        fail(console, EXIT_USAGE, f"{path}: cannot read ({e})")
    if limit is not None:
        sessions = sessions[:limit]
    if not sessions:
        fail(console, EXIT_USAGE, f"{path}: no sessions")
    return sessions
