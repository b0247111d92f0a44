"""Node-to-node KV transport: keep-alive settings and the one retry on a connection-level error."""

from __future__ import annotations

import asyncio
import json

import pytest
from kvtether.sim.cluster import SimCluster
from kvtether.sim.nixl import (
    CLIENT_KEEPALIVE_EXPIRY_S,
    SERVER_KEEPALIVE_S,
    BlockData,
    HttpKVTransport,
    KVLoadError,
    RemoteRef,
    decode_blocks,
    encode_blocks,
)


class FlakyHolder:
    """A holder that answers the first request of each connection and drops the connection on the second
    without answering: what a client sees when it reuses a pooled connection the server is closing."""

    def __init__(self) -> None:
        self.connections = 0
        self.requests = 0
        self.server: asyncio.Server | None = None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        served = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":", 1)[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                await reader.readexactly(length)
                self.requests += 1
                if served:
                    return  # close without a response
                served += 1
                body = json.dumps(encode_blocks([BlockData([1, 2, 3], bytes(16))])).encode()
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                    + str(len(body)).encode()
                    + b"\r\n\r\n"
                    + body
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def __aenter__(self) -> RemoteRef:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return RemoteRef(host="127.0.0.1", port=port, engine_id="e", request_id="r")

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()


@pytest.mark.anyio
async def test_read_on_a_connection_the_server_drops_is_retried_once() -> None:
    holder = FlakyHolder()
    transport = HttpKVTransport(keepalive_expiry=60.0)  # keep the pooled connection for the second read
    try:
        async with holder as ref:
            for _ in range(3):
                blocks = await transport.read(ref, [0])
                assert blocks[0].content == [1, 2, 3]
        # Reads 2 and 3 each hit a dropped pooled connection and succeeded on a fresh one.
        assert transport.retries == 2 and holder.connections == 3 and holder.requests == 5
    finally:
        await transport.aclose()


@pytest.mark.anyio
async def test_a_second_connection_failure_is_a_load_error() -> None:
    holder = FlakyHolder()
    transport = HttpKVTransport()
    try:
        async with holder as ref:
            pass  # the holder is gone: connection refused, twice
        with pytest.raises(KVLoadError):
            await transport.read(ref, [0])
        assert transport.retries == 1
    finally:
        await transport.aclose()


@pytest.mark.anyio
async def test_client_keepalive_is_shorter_than_the_nodes() -> None:
    assert CLIENT_KEEPALIVE_EXPIRY_S < 5.0 < SERVER_KEEPALIVE_S  # 5 s: httpx's default pool expiry
    async with SimCluster(prefill=0, decode=0, aggregated=1) as c:
        server = c.nodes[0]._server
        assert server is not None and server.config.timeout_keep_alive == SERVER_KEEPALIVE_S


def test_a_read_answer_carries_each_block_as_it_was_and_a_malformed_one_fails_the_read() -> None:
    """Blocks of any length (a partial last one, an empty one) come back with their parents and, where the holder
    sealed one, their digests; an answer whose parts disagree is a failed read, not a crash."""
    blocks = [BlockData([1, 2, 3, 4], bytes(range(16)), bytes(range(16, 32))),
              BlockData([5, 6], bytes(range(32, 48))), BlockData([], bytes(16))]
    doc = json.loads(json.dumps(encode_blocks(blocks)))
    assert decode_blocks(doc) == blocks
    for broken in ({**doc, "lengths": [4, 2]}, {**doc, "content": [1]}, {**doc, "parents": "00"},
                   {k: v for k, v in doc.items() if k != "digests"}, [1, 2]):
        with pytest.raises(KVLoadError):
            decode_blocks(broken)
