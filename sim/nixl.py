"""The NIXL-like KV transfer between nodes, over each node's own HTTP server.

The reader contacts the holder at the ``remote_host:remote_port`` it was given (no rewriting here:
a proxy that forgets to rewrite an unroutable side-channel host makes the read fail, as with vLLM).
``POST /nixl/read`` returns the content of the requested blocks and frees the hold (single use);
``POST /nixl/notify`` only frees it (the reader decided to recompute); ``POST /nixl/heartbeat`` renews a
prefill's lease while the decode request waits in its queue. A hold the holder's worker does not track
(kv.Hold.tracked) is readable but neither single use nor freed by a notification.

Each body carries the reader's vLLM version when the transport knows it: vLLM's NIXL handshake compares a
compatibility hash that includes the version string, so nodes of different releases cannot transfer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import httpx
import orjson
from kvtether.sim.model import DIGEST_SIZE

_NO_DIGEST = bytes(DIGEST_SIZE)


class KVLoadError(Exception):
    """The read was declined (hold gone, expired, wrong engine) or the transfer failed."""


@dataclass(frozen=True, slots=True)
class BlockData:
    """One block as a read returns it: its content (token ids whose KV it holds), the content digest of the block
    before it, and its own content digest when the holder sealed it (a full block), so the reader need not hash
    the same content again."""

    content: list[int]
    parent: bytes
    digest: bytes | None = None


def encode_blocks(blocks: list[BlockData]) -> dict[str, object]:
    """A read's answer on the wire: the blocks' contents as one list with their lengths, and their parents and
    digests as one hex string each (a digest of zeros: none). A long history is thousands of blocks; one JSON
    object per block cost more than the rest of the read."""
    lengths: list[int] = []
    content: list[int] = []
    parents: list[bytes] = []
    digests: list[bytes] = []
    for b in blocks:
        lengths.append(len(b.content))
        content.extend(b.content)
        parents.append(b.parent)
        digests.append(b.digest if b.digest is not None else _NO_DIGEST)
    return {"lengths": lengths, "content": content, "parents": b"".join(parents).hex(),
            "digests": b"".join(digests).hex()}


def decode_blocks(doc: object) -> list[BlockData]:
    """The blocks of :func:`encode_blocks`' answer; a malformed one is a failed read."""
    try:
        if not isinstance(doc, dict):
            raise TypeError("not a JSON object")
        lengths, content = doc["lengths"], doc["content"]
        parents, digests = bytes.fromhex(doc["parents"]), bytes.fromhex(doc["digests"])
        n = len(lengths)
        if len(parents) != n * DIGEST_SIZE or len(digests) != n * DIGEST_SIZE or sum(lengths) != len(content):
            raise ValueError("the read's parts disagree in length")
    except (KeyError, TypeError, ValueError) as e:
        raise KVLoadError(f"malformed read answer: {e!r}") from e
    out: list[BlockData] = []
    pos = 0
    for i, length in enumerate(lengths):
        at = i * DIGEST_SIZE
        digest = digests[at:at + DIGEST_SIZE]
        out.append(BlockData(content[pos:pos + length], parents[at:at + DIGEST_SIZE],
                             None if digest == _NO_DIGEST else digest))
        pos += length
    return out


@dataclass(frozen=True, slots=True)
class RemoteRef:
    """Where a hold lives: what a reader needs from `kv_transfer_params`."""

    host: str
    port: int
    engine_id: str
    request_id: str


class KVTransport(Protocol):
    async def read(self, ref: RemoteRef, block_ids: list[int]) -> list[BlockData]: ...

    async def notify(self, ref: RemoteRef) -> None: ...

    async def heartbeat(self, ref: RemoteRef) -> None: ...

    async def aclose(self) -> None: ...


def _url(ref: RemoteRef, path: str) -> str:
    host = f"[{ref.host}]" if ":" in ref.host else ref.host
    return f"http://{host}:{ref.port}{path}"


# Keep-alive: the client must drop an idle connection before the server does. With httpx's default 5 s
# expiry against uvicorn's default 5 s, a read sent on a connection the server is just closing fails
# with a connection error that surfaced as a spurious "KV load failure". The sim's servers keep idle
# connections SERVER_KEEPALIVE_S (node.py); clients drop theirs after CLIENT_KEEPALIVE_EXPIRY_S.
CLIENT_KEEPALIVE_EXPIRY_S = 2.0
SERVER_KEEPALIVE_S = 65

# Failures where the request most likely never reached the handler (stale pooled connection, reset,
# refused): worth one retry on a fresh connection. Timeouts are not retried (the holder is slow, and a
# second wait would double it).
_JSON = {"content-type": "application/json"}
_CONNECTION_ERRORS = (httpx.ConnectError, httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)


class HttpKVTransport:
    def __init__(
        self,
        timeout: float = 30.0,
        *,
        keepalive_expiry: float = CLIENT_KEEPALIVE_EXPIRY_S,
        vllm_version: str | None = None,
    ) -> None:
        self._timeout = timeout
        self._keepalive_expiry = keepalive_expiry
        self._vllm_version = vllm_version
        self._http: httpx.AsyncClient | None = None
        self.retries = 0  # white-box counter for tests

    @property
    def _client(self) -> httpx.AsyncClient:
        # Created on first use: most nodes of a test cluster never read, and building a client is slow.
        # Plain HTTP between nodes: no TLS context, and no proxy from the environment on loopback.
        if self._http is None:
            self._http = httpx.AsyncClient(
                timeout=self._timeout,
                verify=False,
                trust_env=False,
                limits=httpx.Limits(keepalive_expiry=self._keepalive_expiry),
            )
        return self._http

    async def _post(self, url: str, body: Mapping[str, object]) -> httpx.Response:
        """POST, retried once on a connection-level error. All three endpoints tolerate a repeat: a read
        whose first attempt was served after all is declined (409, single use) rather than served twice,
        and notify/heartbeat are idempotent."""
        content = orjson.dumps(body)
        try:
            return await self._client.post(url, content=content, headers=_JSON)
        except _CONNECTION_ERRORS:
            self.retries += 1
            return await self._client.post(url, content=content, headers=_JSON)

    def _body(self, ref: RemoteRef, **extra: object) -> dict[str, object]:
        body: dict[str, object] = {"engine_id": ref.engine_id, "request_id": ref.request_id, **extra}
        if self._vllm_version is not None:
            body["vllm_version"] = self._vllm_version  # what the handshake's compatibility hash compares
        return body

    async def read(self, ref: RemoteRef, block_ids: list[int]) -> list[BlockData]:
        body = self._body(ref, block_ids=block_ids)
        try:
            resp = await self._post(_url(ref, "/nixl/read"), body)
        except httpx.HTTPError as e:
            raise KVLoadError(f"read from {ref.host}:{ref.port} failed: {e!r}") from e
        if resp.status_code != 200:
            raise KVLoadError(f"read declined by {ref.host}:{ref.port}: {resp.status_code} {resp.text[:200]}")
        try:
            doc = orjson.loads(resp.content)
        except orjson.JSONDecodeError as e:
            raise KVLoadError(f"read from {ref.host}:{ref.port}: the answer is not JSON") from e
        return decode_blocks(doc)

    async def notify(self, ref: RemoteRef) -> None:
        body = self._body(ref)
        # Best effort: the holder frees at its TTL anyway.
        with contextlib.suppress(httpx.HTTPError):
            await self._post(_url(ref, "/nixl/notify"), body)

    async def heartbeat(self, ref: RemoteRef) -> None:
        body = self._body(ref)
        with contextlib.suppress(httpx.HTTPError):
            await self._post(_url(ref, "/nixl/heartbeat"), body)

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
