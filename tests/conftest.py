from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.support.processes import Spawn, spawned

if TYPE_CHECKING:
    from tests.support.vllm_fixtures import Backend


@pytest.fixture
def anyio_backend() -> str:
    # The gateway and simulator run on asyncio (uvicorn); test on the same backend.
    return "asyncio"


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    """`spawn(argv, **popen_kwargs)`: a subprocess in a session of its own, killed on teardown with its whole
    process tree (see support/processes.py), however the test ended."""
    with spawned() as start:
        yield start


@pytest.fixture(scope="session")
def vllm_pair(pytestconfig: pytest.Config) -> Iterator[Backend]:
    """The session's one real vLLM pair (support/vllm_fixtures.py): here because tests of two folders use it, the
    real-vLLM ones and the protocol script that runs on both backends. Imported here, not at the top: a run that
    never asks for the pair (the SDK's on openai 1.x) loads nothing of the launcher."""
    from tests.support.vllm_fixtures import shared_vllm_pair

    with shared_vllm_pair(pytestconfig) as b:
        yield b


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Real-vLLM ordering: tests that start their own cluster (`vllm_first`) run before the shared pair
    exists, so two pairs never share the two cores; tests that wait out the decode TTL and send expired
    handles (`vllm_late`) run after every other test, so no other test's handles age or fail beside them."""

    def rank(item: pytest.Item) -> int:
        if item.get_closest_marker("vllm_first"):
            return 0
        if item.get_closest_marker("vllm_late"):
            return 2
        return 1

    items.sort(key=rank)  # stable: the order within each rank is pytest's own


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    """On a failed real-vLLM test, attach the tail of every vLLM child's log (CI shows nothing else of them)."""
    outcome = yield
    report = outcome.get_result()
    log_dir = os.environ.get("KVTETHER_TEST_LOG_DIR")
    if not (report.failed and log_dir and item.get_closest_marker("vllm")):
        return
    for path in sorted(Path(log_dir).glob("**/*.log")):
        try:
            tail = path.read_text(errors="replace").splitlines()[-40:]
        except OSError:
            continue
        report.sections.append((f"vLLM log {path.name} (last 40 lines)", "\n".join(tail)))
