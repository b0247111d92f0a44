"""The discovery loop of a gateway: a source's desired sets applied to the cluster as they come, each joining
node polled at once (it takes traffic from its first successful poll, not from the next poll round)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

import anyio
from kvtether.gateway.nodes.discovery.members import JOINING, Member

if TYPE_CHECKING:
    from kvtether.gateway.nodes.cluster import Cluster
    from kvtether.gateway.nodes.discovery import Discovery

log = logging.getLogger(__name__)

RESTART_S = 5.0


async def discover_forever(cluster: Cluster, discovery: Discovery) -> None:
    """Runs `discovery` for the gateway's lifetime (the static source returns at once). A source that fails
    unexpectedly is started again after a pause: the nodes it published stay as they are meanwhile."""
    async with anyio.create_task_group() as tg:

        def publish(desired: Mapping[str, Member]) -> None:
            for change in cluster.apply_members(desired):
                node = cluster.nodes.get(change.url)
                if change.after == JOINING and node is not None:
                    tg.start_soon(cluster.refresh, node)

        while True:
            try:
                await discovery.run(publish)
                return
            except Exception:
                log.exception("discovery (%s) failed; starting it again", discovery.source)
                await anyio.sleep(RESTART_S)
