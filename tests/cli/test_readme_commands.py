"""Every command README.md and docs/*.md show (fenced bash blocks, and README's Results table's "reproduce"
column), and those in the examples' docstrings, runs as written, checked cheaply and without starting a server:

- `kvtether SUB ...` (also `.venv/bin/kvtether`, and `./scripts/demo ARGS`, which runs `kvtether demo ARGS`): the
  sub-command exists and click's parser accepts the arguments (types, ranges, required options, unknown options)
  without invoking it. `--help` would not do: it stops before anything else is parsed.
- `./scripts/X`, `bash scripts/X`, `. .venv/bin/activate`: the file exists; `export NAME=VALUE`: an assignment.
- `python X.py ...` (any interpreter): the file exists, and for an argparse script `--help` exits 0 and names
  every option the line uses.

Anything else must be in EXTERNAL (another program) or ILLUSTRATIVE (a line that shows a form, not a command to
paste), each with its reason, so that a new kind of command cannot slip through unchecked.
"""

from __future__ import annotations

import ast
import functools
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import typer
from kvtether.cli.main import app

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
EXAMPLES = sorted((REPO / "examples").glob("*.py"))

# Programs that are not this project's: what they accept is theirs to document.
EXTERNAL: dict[str, str] = {
    "pip": "installs the project; pip's own arguments",
    "docker": "starts a third-party container (Jaeger); docker's own arguments",
    "kubectl": "Kubernetes' client, against the user's cluster; kubectl's own arguments",
    "kubernetes-validate": "checks manifests against the Kubernetes schemas (PyPI kubernetes-validate); its own "
                           "arguments (tests/deploy/test_kubernetes.py runs it on the manifests)",
    "curl": "an HTTP request to a running gateway; curl's own arguments",
    "jq": "reads curl's JSON; jq's own arguments",
}
# Whole lines (as written, comments stripped) that show a form rather than a command to paste, with the reason.
# None at present: placeholders such as `--model M` or `http://p0:8000` parse as the values they stand for, and a
# synopsis with [optional] parts is written out instead (docs/gateway.md).
ILLUSTRATIVE: dict[str, str] = {}

SHELL_SEPARATORS = {";", "&", "&&", "||", "|"}
REDIRECTIONS = {">", ">>", "<", "2>", "&>"}
PYTHONS = re.compile(r"^(?:\S*/)?python(?:3(?:\.\d+)?)?$")


@dataclass(frozen=True)
class Command:
    where: str  # file:line, for the failure message
    line: str
    words: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.where}: {self.line}"


def _fenced_blocks(path: Path) -> list[tuple[int, str]]:
    """(first line number, text) of each ```bash (sh, shell, console) block."""
    out, lines = [], path.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if m is None:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), len(lines))
        if m.group(1) in ("bash", "sh", "shell", "console"):
            out.append((i + 2, "\n".join(lines[i + 1 : end])))
        i = end + 1
    return out


def _results_column(path: Path) -> list[tuple[int, str]]:
    """README's Results table: the code spans of its last column (how to reproduce each row)."""
    out = []
    section = ""
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("## "):
            section = line[3:].strip()
        elif section == "Results" and line.startswith("|") and line.rstrip().endswith("|"):
            last = line.rstrip().rstrip("|").rsplit("|", 1)[-1]
            out += [(n, span) for span in re.findall(r"`([^`]+)`", last)]
    return out


def _docstring_blocks(path: Path) -> list[tuple[int, str]]:
    """The literal blocks (after `::`) of a module's docstring: the commands it tells the reader to run."""
    tree = ast.parse(path.read_text())
    doc = ast.get_docstring(tree) or ""
    first = tree.body[0].lineno if doc else 0  # the docstring's first line in the file
    out, lines = [], doc.splitlines()
    for i, line in enumerate(lines):
        if line.rstrip().endswith("::"):
            block = []
            for nxt in lines[i + 1 :]:
                if nxt.strip() and not nxt.startswith("    "):
                    break
                block.append(nxt)
            out.append((first + i + 1, "\n".join(block)))
    return out


def _lines(text: str, first: int) -> list[tuple[int, str]]:
    """Logical shell lines (a trailing backslash continues a line) with their first line's number."""
    out: list[tuple[int, str]] = []
    pending: list[str] = []
    start = first
    for n, raw in enumerate(text.splitlines(), first):
        if not pending:
            start = n
        if raw.rstrip().endswith("\\"):
            pending.append(raw.rstrip()[:-1])
            continue
        pending.append(raw)
        joined = " ".join(p.strip() for p in pending).strip()
        pending = []
        if joined and not joined.startswith("#"):
            out.append((start, joined))
    return out


def _redirection(word: str) -> bool:
    """>, >>, <, &>, >& … (the lexer groups the operator's characters, not the descriptor before it)."""
    return word in REDIRECTIONS or (bool(word) and set(word) <= set("<>&") and ("<" in word or ">" in word))


def _simple_commands(line: str) -> list[tuple[str, ...]]:
    """The simple commands of a shell line: split at ; & && || |, without redirections, loop keywords and
    leading VAR=value assignments."""
    # A descriptor written against its operator (`2> file`, `2>&1`) is the shell's; the lexer would split it off
    # as an argument, and `--seed 2 > f` (spaced) must keep its 2.
    line = re.sub(r"(^|\s)\d+(?=[<>])", r"\1", line)
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|<>")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    commands: list[list[str]] = [[]]
    words = list(lexer)
    i = 0
    while i < len(words):
        w = words[i]
        if w in SHELL_SEPARATORS:
            commands.append([])
        elif _redirection(w):
            i += 1  # and its target (a file, or the descriptor of >&)
        else:
            commands[-1].append(w)
        i += 1
    out = []
    for words_ in commands:
        while words_ and words_[0] in ("do", "then", "else"):
            words_ = words_[1:]
        if not words_ or words_[0] in ("for", "while", "if") or words_ in (["done"], ["wait"], ["fi"]):
            continue
        while words_ and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words_[0]):
            words_ = words_[1:]
        if words_:
            out.append(tuple(words_))
    return out


def _collect() -> list[Command]:
    sources: list[tuple[Path, list[tuple[int, str]]]] = [(p, _fenced_blocks(p)) for p in DOCS]
    sources.append((REPO / "README.md", _results_column(REPO / "README.md")))
    sources += [(p, _docstring_blocks(p)) for p in EXAMPLES]
    out = []
    for path, blocks in sources:
        for first, text in blocks:
            for n, line in _lines(text, first):
                where = f"{path.relative_to(REPO)}:{n}"
                if line.split(" #")[0].strip() in ILLUSTRATIVE:
                    continue
                out += [Command(where, line, words) for words in _simple_commands(line)]
    return out


COMMANDS = _collect()


def _kvtether(words: tuple[str, ...]) -> None:
    """Parse `kvtether ARGS` as the command would, without running it."""
    group: Any = typer.main.get_command(app)
    args = list(words)
    assert args, "kvtether with no sub-command"
    sub = group.commands.get(args[0])
    assert sub is not None, f"no sub-command {args[0]!r} (there are: {', '.join(sorted(group.commands))})"
    try:
        sub.make_context(args[0], args[1:], resilient_parsing=False)
    except Exception as e:  # click's UsageError and kin (typer >= 0.2x vendors click: their classes are its own)
        message = e.format_message() if hasattr(e, "format_message") else repr(e)
        raise AssertionError(f"kvtether {args[0]}: {message}") from None


@functools.cache
def _script_help(script: str) -> str | None:
    """The `--help` of an argparse script (None for a script without argparse)."""
    path = REPO / script
    if "argparse" not in path.read_text():
        return None
    proc = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True, timeout=60,
                          cwd=REPO, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, f"{script} --help: exit code {proc.returncode}\n{proc.stderr[-2000:]}"
    return proc.stdout


def _python(words: tuple[str, ...]) -> None:
    script = next((w for w in words[1:] if not w.startswith("-")), None)
    assert script is not None and script.endswith(".py"), "a python line that runs no script"
    assert (REPO / script).is_file(), f"{script}: no such file"
    help_text = _script_help(script)
    if help_text is not None:
        rest = words[words.index(script) + 1 :]
        for opt in (w.split("=", 1)[0] for w in rest if w.startswith("--")):
            assert re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", help_text), f"{script} has no option {opt}"


def check(command: Command) -> None:
    words = command.words
    program = words[0]
    if program in ("kvtether", ".venv/bin/kvtether"):
        _kvtether(words[1:])
    elif program == "export":
        assert all(re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", w) for w in words[1:]), "export takes NAME=VALUE"
    elif program in (".", "source"):
        assert (REPO / words[1]).is_file(), f"{words[1]}: no such file"
    elif program.startswith("./scripts/") or (program == "bash" and words[1].startswith("scripts/")):
        script = program[2:] if program.startswith("./") else words[1]
        assert (REPO / script).is_file(), f"{script}: no such file"
        if script == "scripts/demo":  # runs `kvtether demo "$@"`
            _kvtether(("demo", *words[1:]))
    elif PYTHONS.match(program):
        _python(words)
    else:
        assert program in EXTERNAL, f"a command of unknown kind ({program}): check it here, or list it in EXTERNAL"


def test_the_documents_have_commands_to_check() -> None:
    kinds = {c.words[0] for c in COMMANDS}
    assert {"kvtether", ".venv/bin/kvtether", "./scripts/demo", "python", ".venv/bin/python", "bash"} <= kinds
    assert any(c.where.startswith("examples/") for c in COMMANDS)
    assert any(c.where.startswith("docs/") for c in COMMANDS)
    # An allow-listed line that no document shows any more is a stale entry.
    shown = {line.split(" #")[0].strip() for path in DOCS for _, text in _fenced_blocks(path) for _, line in
             _lines(text, 1)}
    assert set(ILLUSTRATIVE) <= shown


@pytest.mark.parametrize("command", COMMANDS, ids=str)
def test_command_runs_as_written(command: Command) -> None:
    check(command)


def test_the_checker_catches_what_does_not_run() -> None:
    """The checks fail where a user's paste would: an unknown sub-command or option, a bad value, a missing
    required option, a missing file, a script option that does not exist."""
    bad = [
        "kvtether serv --prefill http://p0:8000",
        "kvtether serve --prefill http://p0:8000 [--port 8000]",
        "kvtether demo --quick true",
        "kvtether sim --port eighty",
        "kvtether up --prefill 1",
        "./scripts/nope",
        "./scripts/demo --fast",
        "python examples/nope.py",
        ".venv/bin/python benchmarks/sim_pull_sweep.py --no-such-option",
        "wget http://127.0.0.1:8000/metrics",  # a program nobody listed
    ]
    for line in bad:
        (words,) = _simple_commands(line)
        with pytest.raises(AssertionError):
            check(Command("test", line, words))
    # And the shell's own syntax is not taken for arguments.
    assert _simple_commands("for s in 0 1; do A=1 python x.py --seed $s > run$s.txt & done; wait") == [
        ("python", "x.py", "--seed", "$s")]
    assert _simple_commands("kvtether gen -o a.jsonl && kvtether replay a.jsonl --sim toy  # then") == [
        ("kvtether", "gen", "-o", "a.jsonl"), ("kvtether", "replay", "a.jsonl", "--sim", "toy")]
    assert shlex.split('--vllm-python "$(which python)"')[1] == "$(which python)"
    # A descriptor before a redirection is the shell's, not an argument.
    assert _simple_commands("kvtether replay a.jsonl --sim toy --json > r.json 2> notes.txt") == [
        ("kvtether", "replay", "a.jsonl", "--sim", "toy", "--json")]
    assert _simple_commands("python x.py --seed 2 >log 2>&1") == [("python", "x.py", "--seed", "2")]
    assert _simple_commands("python x.py --seed 2 > log") == [("python", "x.py", "--seed", "2")]
