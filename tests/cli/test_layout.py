"""The CLI's shape: every function in cli/ fits on a screen (a long command reads as its steps: check, load, run,
render), and the exit codes are declared in one place."""

from __future__ import annotations

import ast
from pathlib import Path

CLI = Path(__file__).resolve().parents[2] / "cli"
MAX_FUNCTION_LINES = 80


def _functions(path: Path) -> list[tuple[str, int, int]]:
    """(name, first line, lines) of every function and method in the file, nested ones included; a function's
    lines run from its `def` (or first decorator) to its last line."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            out.append((node.name, first, (node.end_lineno or node.lineno) - first + 1))
    return out


def test_no_cli_function_is_longer_than_a_screen() -> None:
    files = sorted(CLI.rglob("*.py"))
    assert files, f"no Python files under {CLI}"
    long = [f"{path.relative_to(CLI.parent)}:{line} {name} ({n} lines)"
            for path in files for name, line, n in _functions(path) if n > MAX_FUNCTION_LINES]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: split them into steps\n" + "\n".join(long)


def test_exit_codes_are_declared_once() -> None:
    declared = []
    for path in sorted(CLI.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    names = [e for e in (t.elts if isinstance(t, ast.Tuple) else [t]) if isinstance(e, ast.Name)]
                    declared += [f"{path.relative_to(CLI.parent)}: {e.id}" for e in names if e.id.startswith("EXIT_")]
    assert declared and all(d.startswith("cli/common/exits.py") for d in declared), declared
