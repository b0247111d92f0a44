"""kvtether.protocol is the neutral room: the gateway, the simulator and the SDK import it, and it imports none of
them (nor the CLI), so what the contract says can only change in protocol/ itself."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTOCOL = ROOT / "protocol"
OTHER_ROOMS = ("sdk", "gateway", "sim", "cli")


def imported(source: str, package: str) -> Iterator[tuple[int, str]]:
    """(line, module) for every import in ``source``, relative ones resolved against ``package``; ``from a import
    b`` names both ``a`` and ``a.b`` (b may be a module)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = parts[: len(parts) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            yield node.lineno, module
            for alias in node.names:
                yield node.lineno, f"{module}.{alias.name}"


def forbidden(module: str) -> bool:
    return any(module == f"kvtether.{room}" or module.startswith(f"kvtether.{room}.") for room in OTHER_ROOMS)


def package_of(path: Path) -> str:
    return ".".join(["kvtether", "protocol", *path.relative_to(PROTOCOL).parent.parts])


def test_protocol_imports_no_other_room() -> None:
    files = sorted(PROTOCOL.rglob("*.py"))
    assert len(files) > 5  # the room is where this test thinks it is
    offenders = [f"{path.relative_to(ROOT)}:{line}: {module}"
                 for path in files for line, module in imported(path.read_text(), package_of(path))
                 if forbidden(module)]
    assert offenders == []


def test_the_check_sees_every_form_of_import() -> None:
    source = "\n".join([
        "import kvtether.sdk.contract",
        "from kvtether.gateway import config",
        "from kvtether import sim",
        "from ... import cli",  # from kvtether.protocol.responses: up to kvtether
        "from ..common import once",  # kvtether.protocol.common: allowed
        "import json",
    ])
    found = [module for _, module in imported(source, "kvtether.protocol.responses") if forbidden(module)]
    assert found == ["kvtether.sdk.contract", "kvtether.gateway", "kvtether.gateway.config", "kvtether.sim",
                     "kvtether.cli"]
