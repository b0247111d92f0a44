"""Where the nodes are: one small interface, three sources (docs/operations.md, "Nodes that come and go").

A :class:`Discovery` runs for the gateway's lifetime and publishes the *desired* node set (URL -> role, serving
or leaving) each time it learns something; the cluster reconciles its view with it (``cluster.apply_members``:
joins, drains, removals) and the poll loop brings a joining node in once it answers. ``static`` publishes
nothing (its nodes are the configured lists, in the cluster from the start); ``dns`` re-resolves one headless
Service per role; ``kubernetes`` lists and watches the pods of a namespace by label selector. All run on the
event loop (no threads), so the simulated stack's virtual loop could drive them too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol

from kvtether.gateway.nodes.discovery.members import Change, Member
from kvtether.gateway.nodes.discovery.settings import DiscoveryError, DiscoverySettings, load_discovery

if TYPE_CHECKING:
    from kvtether.gateway.clock import Clock

Publish = Callable[[Mapping[str, Member]], None]

__all__ = ["Change", "Discovery", "DiscoveryError", "DiscoverySettings", "Member", "Publish", "StaticDiscovery",
           "load_discovery", "open_discovery"]


class Discovery(Protocol):
    """A source of nodes: ``run`` publishes the whole desired set on every change it sees, until cancelled."""

    source: str

    async def run(self, publish: Publish) -> None: ...


class StaticDiscovery:
    """The configured lists: the cluster starts with them, and they never change."""

    source = "static"

    async def run(self, publish: Publish) -> None:
        return None


def open_discovery(settings: DiscoverySettings, clock: Clock | None = None) -> Discovery:
    """The backend `settings` name. The Kubernetes client is imported only when asked for (the ``kubernetes``
    extra: pip install 'kvtether[kubernetes]')."""
    if settings.source == "dns":
        from kvtether.gateway.nodes.discovery.dns import DnsDiscovery

        return DnsDiscovery(settings)
    if settings.source == "kubernetes":
        from kvtether.gateway.nodes.discovery.kubernetes import KubernetesDiscovery

        return KubernetesDiscovery(settings)
    return StaticDiscovery()
