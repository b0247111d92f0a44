"""Test seams on the gateway's completion-leg client (gateway/transport/upstream.py): see or fail its requests,
or break its streams."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import httpx
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


def break_streams(upstream: Upstream, node: str, after: int) -> list[int]:
    """Every streamed answer from `node` breaks after `after` network reads (the connection dropped); returns
    the list the broken streams are counted in."""
    broken: list[int] = []
    real = upstream.send

    async def send(method: str, url: str, body: bytes = b"", headers: Mapping[str, str] | None = None,
                   **kw: Any) -> UpstreamResponse:
        resp = await real(method, url, body, headers, **kw)
        if url.startswith(node) and b'"stream":true' in body.replace(b" ", b""):
            pieces = resp.pieces

            async def cut() -> AsyncIterator[bytes]:
                n = 0
                async for piece in pieces():
                    if n == after:
                        broken.append(1)
                        raise httpx.RemoteProtocolError("peer closed connection without sending complete body")
                    n += 1
                    yield piece

            resp.pieces = cut  # type: ignore[method-assign]
        return resp

    upstream.send = send  # type: ignore[method-assign]
    return broken
