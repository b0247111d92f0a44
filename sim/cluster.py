"""An in-process P/D cluster of simulated vLLM nodes, each a uvicorn server on its own port.

Used by the gateway, CLI and protocol tests (keep the names stable)::

    async with SimCluster(prefill=1, decode=1, speed=50) as cluster:
        cluster.prefill_urls, cluster.decode_urls, cluster.urls(), cluster.node(url).engine
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import uuid
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from kvtether.sim.clock import Source
from kvtether.sim.config import NodeConfig
from kvtether.sim.node import SimNode
from kvtether.sim.presets import get_preset


def engine_id(seed: int, index: int) -> str:
    """The engine id of a cluster's `index`-th node (vLLM's is a random UUID): a UUID drawn from the seed."""
    return str(uuid.UUID(bytes=hashlib.blake2b(f"{seed}/{index}".encode(), digest_size=16).digest()))


@dataclass
class ClusterSpec:
    prefill: int = 1
    decode: int = 1
    aggregated: int = 0
    preset: str = "toy"
    speed: float = 1.0
    host: str = "127.0.0.1"
    emulate: str = "0.33"
    bidirectional: bool = True
    decoder_kv_blocks_ttl: float = 480.0
    kv_recompute_threshold: int = 64
    kv_load_failure_policy: str = "fail"
    side_channel_host: str = "localhost"
    model_name: str = "kvtether-sim"
    base_port: int = 0  # 0 = free ports; else node i listens on base_port + i (prefill, decode, aggregated)
    kv_lease_duration: float = 30.0
    kv_lease_real_floor_s: float = 30.0  # see NodeConfig
    # Prefix caching on the prefill-role nodes (decode and aggregated nodes keep it on): the vLLM blog's
    # bidirectional-transfer runs switch it off on P so that every reused token comes over the pull.
    prefill_prefix_caching: bool = True
    # KV-cache blocks of each prefill-role node (vLLM --num-gpu-blocks-override); None: the preset's. A
    # smaller P cache stands for one the rest of a large cluster's sessions share.
    prefill_num_gpu_blocks: int | None = None
    # The same for each decode-role node: a small D cache shows what its holds cost (queued and preempted work).
    decode_num_gpu_blocks: int | None = None
    tool_call_parser: str | None = None  # vLLM --tool-call-parser on every node; None: the preset's
    callable_tools: tuple[str, ...] | None = None  # the functions the simulated model may call (NodeConfig)
    stream_interval: int = 1  # vLLM --stream-interval on every node (NodeConfig)
    # The simulated model's seed (NodeConfig.seed), and what the nodes' engine ids are drawn from: the same spec
    # makes the same cluster, answers and ids included.
    seed: int = 0

    def node_configs(self) -> list[NodeConfig]:
        get_preset(self.preset)  # fail early with UnknownPreset
        roles = ["prefill"] * self.prefill + ["decode"] * self.decode + ["aggregated"] * self.aggregated
        return [
            NodeConfig(
                role=role,
                preset=self.preset,
                speed=self.speed,
                emulate=self.emulate,
                bidirectional=self.bidirectional,
                decoder_kv_blocks_ttl=self.decoder_kv_blocks_ttl,
                kv_lease_duration=self.kv_lease_duration,
                kv_lease_real_floor_s=self.kv_lease_real_floor_s,
                kv_recompute_threshold=self.kv_recompute_threshold,
                kv_load_failure_policy=self.kv_load_failure_policy,
                side_channel_host=self.side_channel_host,
                model_name=self.model_name,
                enable_prefix_caching=self.prefill_prefix_caching if role == "prefill" else True,
                num_gpu_blocks_override={
                    "prefill": self.prefill_num_gpu_blocks,
                    "decode": self.decode_num_gpu_blocks,
                }.get(role),
                tool_call_parser=self.tool_call_parser,
                callable_tools=self.callable_tools,
                stream_interval=self.stream_interval,
                seed=self.seed,
                engine_id=engine_id(self.seed, i),
            )
            for i, role in enumerate(roles)
        ]


class SimCluster:
    def __init__(self, spec: ClusterSpec | None = None, *, clock: Source | None = None, **overrides: Any) -> None:
        """`clock`: the time source of every node's clock (sim/clock.py), e.g. a virtual loop's ``loop.time``;
        None: the OS's."""
        base = spec or ClusterSpec()
        self.spec = dataclasses.replace(base, **overrides) if overrides else base
        self.clock = clock
        self.nodes: list[SimNode] = []
        self.prefill_urls: list[str] = []
        self.decode_urls: list[str] = []
        self.aggregated_urls: list[str] = []

    async def start(self) -> SimCluster:
        configs = self.spec.node_configs()
        self.nodes = [SimNode(cfg, clock=self.clock) for cfg in configs]
        ports = [self.spec.base_port + i if self.spec.base_port else 0 for i in range(len(self.nodes))]
        try:
            await asyncio.gather(*(n.start(self.spec.host, p) for n, p in zip(self.nodes, ports, strict=True)))
        except BaseException:
            await self.stop()
            raise
        by_role = {"prefill": self.prefill_urls, "decode": self.decode_urls, "aggregated": self.aggregated_urls}
        for n in self.nodes:
            by_role[n.cfg.role].append(n.url)
        return self

    async def stop(self) -> None:
        await asyncio.gather(*(n.stop() for n in self.nodes if n.port), return_exceptions=True)

    async def __aenter__(self) -> SimCluster:
        return await self.start()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    def urls(self) -> dict[str, list[str]]:
        return {
            "prefill": list(self.prefill_urls),
            "decode": list(self.decode_urls),
            "aggregated": list(self.aggregated_urls),
        }

    def node(self, url: str) -> SimNode:
        for n in self.nodes:
            if n.url == url.rstrip("/"):
                return n
        raise KeyError(url)
