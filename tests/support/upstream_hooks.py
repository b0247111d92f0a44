"""Test seams on the gateway's completion-leg client (gateway/transport/upstream.py): see or fail its requests."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from kvtether.gateway.transport.upstream import Upstream, UpstreamResponse

# Called with the method, URL and headers of every request, before it is sent; raising fails the request there.
OnSend = Callable[[str, str, Mapping[str, str]], Awaitable[None] | None]


def on_send(upstream: Upstream, hook: OnSend) -> None:
    real = upstream.send

    async def send(method: str, url: str, body: bytes = b"", headers: Mapping[str, str] | None = None,
                   **kw: Any) -> UpstreamResponse:
        outcome = hook(method, url, headers or {})
        if outcome is not None:
            await outcome
        return await real(method, url, body, headers, **kw)

    upstream.send = send  # type: ignore[method-assign]
