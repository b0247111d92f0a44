"""``kvtether.sdk.contract`` is the wire contract under the SDK's name: every public name that
``kvtether.protocol.contract`` defines (the contract's home, tested in tests/protocol/test_contract.py), the same
objects."""

from __future__ import annotations

import ast
import inspect
from types import ModuleType

from kvtether.protocol import contract as protocol_contract
from kvtether.sdk import contract as sdk_contract


def _defined(module: ModuleType) -> set[str]:
    """The public names a module's own top-level statements define (not the names it imports)."""
    names: set[str] = set()
    for node in ast.parse(inspect.getsource(module)).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {target.id for target in node.targets if isinstance(target, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {name for name in names if not name.startswith("_")}


def test_the_sdk_reexports_every_public_name_of_the_contract() -> None:
    public = _defined(protocol_contract)
    assert len(public) > 20  # the contract is where this test thinks it is
    assert set(sdk_contract.__all__) == public
    for name in public:
        assert getattr(sdk_contract, name) is getattr(protocol_contract, name), name
