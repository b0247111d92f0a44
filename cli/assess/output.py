"""What `kvtether assess` hands back: the assessment document, written as an HTML report (always), summarized on
stdout (unless --quiet; on stderr with --json) and whole on stdout (--json)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from kvtether.cli.assess.inputs import AssessFlags, Inputs
from kvtether.cli.assess.report import render_console, render_html
from kvtether.cli.assess.verdict import decide
from kvtether.cli.common.document import document, dumps, report_console
from kvtether.cli.common.exits import EXIT_FAILED
from kvtether.cli.common.failures import fail
from rich.console import Console
from rich.markup import escape

SCHEMA = "kvtether.assess/1"


def assessment(f: AssessFlags, inputs: Inputs, answers: dict[str, Any], time_note: str,
               started: str) -> dict[str, Any]:
    """The document every rendering reads (docs/assess.md)."""
    q4 = answers.get("q4")
    if q4 is not None and "goodput" in q4:
        q4.update(decide(q4))  # the sweep ran after compare_topologies ranked the options: its goodput ranks first
    notes = list(inputs.notes)
    if inputs.seen is not None and inputs.seen.get("policy") and not inputs.sessions:
        notes.append("no session file given: questions 1, 2 and 4 need the recording of the traffic "
                     "(AgentSession(record_to=…)); only the gateway's counters are shown")
    doc = document(
        SCHEMA, started, source=str(f.file) if f.file is not None else f"gateway {f.gateway}",
        sessions=len(inputs.sessions), turns=sum(len(s.turns) for s in inputs.sessions),
        tokenizer=inputs.token_note, cluster=inputs.shape.describe(), time_note=time_note, answers=answers,
        notes=notes)
    if inputs.seen is not None:
        doc["gateway"] = inputs.seen
    return doc


def report_path(f: AssessFlags) -> Path:
    """--report, else beside the session file, else in the working directory."""
    if f.report is not None:
        return f.report
    return f.file.with_suffix(".assess.html") if f.file is not None else Path("kvtether-assess.html")


def hand_back(err: Console, f: AssessFlags, doc: dict[str, Any]) -> None:
    """The HTML report (exit 1 when it cannot be written), the summary, where the HTML went (a note, on stderr),
    the JSON document."""
    path = report_path(f)
    try:
        path.write_text(render_html(doc), encoding="utf-8")
    except OSError as e:
        fail(err, EXIT_FAILED, f"cannot write the report {path}: {e}")
    doc["report"] = str(path)
    if not f.quiet:
        render_console(report_console(err, f.as_json), doc)
        err.print(f"report: {escape(str(path))}", highlight=False, soft_wrap=True)
    if f.as_json:
        typer.echo(dumps(doc))
