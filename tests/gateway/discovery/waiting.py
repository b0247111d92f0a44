"""Waiting for what a background task does (discovery publishes, the cluster applies) without a fixed sleep."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio


async def until(check: Callable[[], Any], within_s: float = 10.0, step_s: float = 0.01) -> None:
    """Wait until `check()` is truthy; fail with its last value after `within_s`."""
    last: Any = None
    for _ in range(int(within_s / step_s)):
        if last := check():
            return
        await anyio.sleep(step_s)
    raise AssertionError(f"not reached in {within_s} s: {last!r}")


async def eventually(check: Callable[[], Awaitable[Any]], within_s: float = 10.0, step_s: float = 0.05) -> None:
    """Wait until the awaited `check()` is truthy (e.g. an HTTP call); fail with its last value after `within_s`."""
    last: Any = None
    for _ in range(int(within_s / step_s)):
        if last := await check():
            return
        await anyio.sleep(step_s)
    raise AssertionError(f"not reached in {within_s} s: {last!r}")
