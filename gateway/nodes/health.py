"""Bringing nodes back: a node out of service is probed on its own ``/health`` with bounded backoff.

A node goes out when it is unreachable, fails a run of requests, or fails a poll and its /health too
(``cluster.Cluster.take_out``); a client's bad request never takes it out (a 4xx is the request's fault, and
validation stops most before they reach a node). Out, it is probed after ``health_backoff_s``, then after
twice that while it keeps failing, up to ``health_backoff_max_s``: a node that comes back is in service
again within that bound. Back in, it is half-open: the next failed request takes it out again with the
doubled backoff, and a request that succeeds resets it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio

if TYPE_CHECKING:
    from kvtether.gateway.config import GatewayConfig
    from kvtether.gateway.nodes.cluster import Cluster, Node


def next_backoff(current_s: float, config: GatewayConfig) -> float:
    """The wait before the next probe of a node out of service (0: it just went out)."""
    if current_s <= 0.0:
        return config.health_backoff_s
    return min(config.health_backoff_max_s, current_s * 2.0)


async def probe_forever(cluster: Cluster) -> None:
    cluster.wake = anyio.Event()
    while True:
        now = cluster.clock()
        due = [n for n in cluster.nodes.values() if not n.healthy and n.out_until <= now]
        async with anyio.create_task_group() as tg:
            for node in due:
                tg.start_soon(_probe, cluster, node)
        pending = [n.out_until for n in cluster.nodes.values() if not n.healthy]
        wait = min(pending, default=now + cluster.config.health_backoff_max_s) - cluster.clock()
        with anyio.move_on_after(max(0.01, wait)):
            await cluster.wake.wait()
        cluster.wake = anyio.Event()


async def _probe(cluster: Cluster, node: Node) -> None:
    if await cluster.alive(node):
        cluster.back_in(node, "/health answers")
        await cluster.refresh(node)  # its load and models, before turns are placed on it again
    else:
        node.backoff_s = next_backoff(node.backoff_s, cluster.config)
        node.out_until = cluster.clock() + node.backoff_s
