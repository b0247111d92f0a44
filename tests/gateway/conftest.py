"""The gateway's tests run in virtual time (sim/virtual.py): the simulated cluster, the gateway and the tests'
clients share one clock that jumps from event to event, so a test that waits out a TTL, a backoff or a poll
interval takes no wall time, and no timing in it depends on this machine's load. The gateway and the simulated
nodes follow the loop's clock by themselves (gateway/clock.py, sim/clock.py).

A test that needs the wall clock is marked ``wall_clock`` with its reason and runs on a plain asyncio loop: a
client or tokenizer in a worker thread, a real socket (a listen backlog, Redis, a DNS server), or its own reads
of the OS clock."""

from __future__ import annotations

from typing import Any

import pytest
from kvtether.sim.virtual import VirtualLoop


@pytest.fixture
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    if request.node.get_closest_marker("wall_clock") is not None:
        return "asyncio"
    return "asyncio", {"loop_factory": VirtualLoop}
