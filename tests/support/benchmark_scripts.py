"""Load a script from benchmarks/ as a module, for tests of its pure parts (benchmarks/ is not a package).

Registered in sys.modules under its own name before it runs, as when run as a script: its dataclasses and
its `from <other benchmark> import …` lines resolve the same way.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import types

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


def load(name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module
