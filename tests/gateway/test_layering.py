"""The gateway's rooms import one way: shell → api → turn → {guard, policy, nodes, stores, transport}.

A module may import from its own room, from any room below it, and from the gateway's root modules (errors,
tenancy, config, telemetry, clock), which every room may import and which import only the bottom rooms. Read from the
source with ``ast``, so an import inside a function or under ``TYPE_CHECKING`` counts too.

Outside its own rooms the gateway imports nothing of the client SDK (``kvtether.sdk``): what both sides speak, the
session headers and the prefix-hash chain included, lives in ``kvtether.protocol``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

GATEWAY = Path(__file__).resolve().parents[2] / "gateway"
PACKAGE = "kvtether.gateway"
# Higher imports lower; equal levels may import each other.
LEVELS = {"shell": 4, "api": 3, "turn": 2, "guard": 1, "policy": 1, "nodes": 1, "stores": 1, "transport": 1}
ROOT_MODULES = {"__init__", "errors", "tenancy", "config", "telemetry", "clock"}
ROOT_LEVEL = 1  # what the root modules themselves may import: the bottom rooms, and each other


def _room_of(module: str) -> str | None:
    """The room (or root module) a ``kvtether.gateway.…`` module name lies in; None outside the gateway."""
    if module != PACKAGE and not module.startswith(PACKAGE + "."):
        return None
    parts = module.split(".")
    return parts[2] if len(parts) > 2 else "__init__"


def _level(room: str) -> int:
    return ROOT_LEVEL if room in ROOT_MODULES else LEVELS[room]


def _imported(tree: ast.AST, module: str) -> list[tuple[int, str]]:
    """(line, module name) of every import in a module's tree; ``from P import x`` names ``P.x`` (x may be a
    module), relative imports resolved against `module`."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[:-node.level]
                base = ".".join([*anchor, base] if base else anchor)
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def _module_name(path: Path) -> str:
    """The module's dotted name; a package's ``__init__`` keeps it, so relative imports resolve in the package."""
    return ".".join([PACKAGE, *path.relative_to(GATEWAY).with_suffix("").parts])


def upward_imports(source: str, module: str) -> list[str]:
    """The imports in `source` (the text of `module`) that reach a room above the module's own."""
    here = _room_of(module)
    assert here is not None
    out = []
    for line, name in _imported(ast.parse(source), module):
        room = _room_of(name)
        if room is None or room == here:
            continue
        if room in ROOT_MODULES and here not in ROOT_MODULES:
            continue  # the root modules are every room's
        if _level(room) > _level(here):
            out.append(f"{module}:{line} imports {name} ({here} may not import {room})")
    return out


def _sources() -> list[Path]:
    return sorted(GATEWAY.rglob("*.py"))


def test_every_gateway_module_lies_in_a_known_room() -> None:
    unknown = []
    for path in _sources():
        rel = path.relative_to(GATEWAY)
        room = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        if room not in LEVELS and room not in ROOT_MODULES:
            unknown.append(str(rel))
    assert not unknown, f"place these in the layering (tests/gateway/test_layering.py): {unknown}"


def test_no_gateway_module_imports_from_a_room_above_it() -> None:
    problems = []
    for path in _sources():
        problems += upward_imports(path.read_text(encoding="utf-8"), _module_name(path))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(("module", "source", "bad"), [
    ("kvtether.gateway.turn.legs", "from kvtether.gateway.shell.app import Gateway", True),
    ("kvtether.gateway.turn.legs", "def f():\n    from kvtether.gateway.api import edge", True),
    ("kvtether.gateway.turn.legs", "from kvtether.gateway import api", True),
    ("kvtether.gateway.guard.verify", "import kvtether.gateway.turn.body", True),
    ("kvtether.gateway.transport.upstream", "from ..turn import body", True),
    ("kvtether.gateway.errors", "from kvtether.gateway.turn.context import Services", True),
    ("kvtether.gateway.api.chat", "from kvtether.gateway.turn.orchestrator import Orchestrator", False),
    ("kvtether.gateway.turn.legs", "from kvtether.gateway.errors import GatewayError", False),
    ("kvtether.gateway.turn.legs", "from kvtether.gateway import telemetry as T", False),
    ("kvtether.gateway.nodes.cluster", "from kvtether.gateway.policy.placement import ClusterView", False),
    ("kvtether.gateway.config", "from kvtether.gateway.policy.knobs import PolicyKnobs", False),
    ("kvtether.gateway.shell.app", "from kvtether.protocol.messages import MessagesError", False),
])
def test_the_check_tells_an_upward_import_from_a_downward_one(module: str, source: str, bad: bool) -> None:
    assert bool(upward_imports(source, module)) is bad


SDK = "kvtether.sdk"


def sdk_imports(source: str, module: str) -> list[str]:
    """The imports in `source` (the text of `module`) that reach the client SDK."""
    return [f"{module}:{line} imports {name}" for line, name in _imported(ast.parse(source), module)
            if name == SDK or name.startswith(SDK + ".")]


def test_the_gateway_imports_nothing_from_the_sdk() -> None:
    problems = []
    for path in _sources():
        problems += sdk_imports(path.read_text(encoding="utf-8"), _module_name(path))
    assert not problems, "import these from kvtether.protocol:\n" + "\n".join(problems)


@pytest.mark.parametrize(("module", "source", "bad"), [
    ("kvtether.gateway.turn.body", "from kvtether.sdk.contract import Chain", True),
    ("kvtether.gateway.turn.body", "import kvtether.sdk.contract", True),
    ("kvtether.gateway.turn.body", "from kvtether.sdk import contract", True),
    ("kvtether.gateway.turn.body", "from kvtether import sdk", True),
    ("kvtether.gateway.turn.body", "def f():\n    from ...sdk import contract", True),
    ("kvtether.gateway.turn.body", "from kvtether.protocol.contract import Chain", False),
    ("kvtether.gateway.turn.body", "from kvtether.sdkish import x", False),
])
def test_the_check_tells_an_sdk_import(module: str, source: str, bad: bool) -> None:
    assert bool(sdk_imports(source, module)) is bad
