"""The result document a command writes with `--json` (replay's and assess's): the same head on both, so that a
document says what made it, and strict JSON whatever it holds."""

from __future__ import annotations

import datetime as dt
import json
import math
import sys
from typing import Any

from kvtether.cli.common.options import kvtether_version
from rich.console import Console


def report_console(err: Console, as_json: bool) -> Console:
    """Where a command's human report (its tables, verdicts, summaries) goes: stdout, so that `> report.txt` keeps
    it; with `--json` stdout carries the document alone, and the report goes to `err` (stderr), beside the
    progress and the notes, so that `--json > result.json` still shows it."""
    return err if as_json else Console()


def started_at() -> str:
    """Now, as the document's `started_at` (UTC, seconds)."""
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def document(schema: str, started: str, **fields: Any) -> dict[str, Any]:
    """The document's head (its schema, the version that wrote it, the command line, when it started), then
    `fields` in the order given."""
    return {"schema": schema, "kvtether_version": kvtether_version(), "command": sys.argv, "started_at": started,
            **fields}


def finite(o: Any) -> Any:
    """Strict JSON: a non-finite number (an infinite break-even: no link is fast enough) becomes null."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: finite(v) for k, v in o.items()}
    if isinstance(o, list | tuple):
        return [finite(v) for v in o]
    return o


def dumps(doc: dict[str, Any]) -> str:
    """The document as it goes to stdout: indented, strict JSON."""
    return json.dumps(finite(doc), indent=2)
