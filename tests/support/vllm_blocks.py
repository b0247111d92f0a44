"""A real vLLM node's used KV blocks, counted exactly, and the one-token release of a decode hold.

A node's `vllm:kv_cache_usage_perc` is `1 − free blocks / (num_gpu_blocks − 1)` (vLLM's block pool; the − 1 is the
null block). A held block stays allocated, so it counts as used; a released one goes back to the free queue, still
hashed, as ordinary prefix cache, which counts as free. So the usage of an otherwise idle node is an exact count of
its held blocks.
"""

from __future__ import annotations

import time
from typing import Any

import anyio
import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.support.vllm_fixtures import Backend, metric_sum, rewrite_host

M_USAGE = "vllm:kv_cache_usage_perc"


async def total_blocks(client: httpx.AsyncClient, url: str) -> int:
    """The blocks `kv_cache_usage_perc` is a share of: num_gpu_blocks (vllm:cache_config_info) minus the null block."""
    text = (await client.get(url + "/metrics")).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "vllm:cache_config_info" and s.labels.get("num_gpu_blocks", "None") != "None":
                return int(s.labels["num_gpu_blocks"]) - 1
    raise AssertionError(f"{url} reports no num_gpu_blocks in vllm:cache_config_info")


class Blocks:
    """D's used KV blocks, from its usage gauge."""

    def __init__(self, client: httpx.AsyncClient, url: str, total: int) -> None:
        self.client, self.url, self.total = client, url, total

    async def used(self) -> int:
        return round(await metric_sum(self.client, self.url, M_USAGE) * self.total)

    async def until(self, want: int, within_s: float) -> int:
        """Poll until `want` blocks are used or `within_s` passed; the last count. vLLM frees a released hold in
        the engine step that sees D's worker report it, and the gauge follows with that step's stats: nothing
        to wait on but the gauge."""
        deadline = time.monotonic() + within_s
        while True:
            got = await self.used()
            if got == want or time.monotonic() >= deadline:
                return got
            await anyio.sleep(0.25)

    async def lowest(self, for_s: float) -> int:
        """The fewest blocks used over `for_s` of polls: a hold that is freed shows up as a drop."""
        deadline = time.monotonic() + for_s
        low = await self.used()
        while time.monotonic() < deadline:
            await anyio.sleep(0.25)
            low = min(low, await self.used())
        return low


async def blocks_of(client: httpx.AsyncClient, b: Backend) -> Blocks:
    return Blocks(client, b.decode_url, await total_blocks(client, b.decode_url))


async def release(client: httpx.AsyncClient, b: Backend, handle: dict[str, Any], token: int) -> None:
    """The one-token release (docs/operations.md, "Decode memory"): P computes the one token locally and notifies D.
    P's answer carries prefill params for a one-block lease of P's own: dropped."""
    body = {"model": b.model, "prompt": [token], "max_tokens": 1, "stream": False,
            "kv_transfer_params": rewrite_host(handle, b.decode_url)}
    r = await client.post(b.prefill_url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text


async def block_size(client: httpx.AsyncClient, url: str) -> int:
    """The node's KV block size (vllm:cache_config_info): prefix-cache hits and reads are whole blocks of it."""
    text = (await client.get(url + "/metrics")).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "vllm:cache_config_info" and s.labels.get("block_size", "None") != "None":
                return int(s.labels["block_size"])
    raise AssertionError(f"{url} reports no block_size in vllm:cache_config_info")
