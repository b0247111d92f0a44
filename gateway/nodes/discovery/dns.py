"""DNS discovery: one headless Service per role, re-resolved every ``dns_interval_s``.

A headless Service answers with the addresses of its *ready* endpoints only: an A/AAAA query of ``HOST`` (the
node at ``HOST``'s address and the configured port), or an SRV query of ``_SERVICE._PROTO.HOST`` (each record's
target, resolved to its addresses, at the record's port). An address the answer no longer gives has left and
drains. A name that cannot be resolved at all this round (a timeout, no server answering) keeps its last answer:
a DNS outage must not drain the cluster; a name that resolves to nothing (NXDOMAIN, no records) has no nodes.
DNS carries no labels and no "terminating" flag, so the role comes from which name answered and a leaving node
is seen only once it is gone from the answer (CoreDNS caches answers for up to its TTL, 30 s in kubeadm's
Corefile). Queries go through dnspython's asyncio resolver: no thread.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

import anyio
from kvtether.gateway.nodes.discovery.members import dns_members, node_url
from kvtether.gateway.nodes.discovery.settings import DiscoverySettings, parse_dns_name

if TYPE_CHECKING:
    from kvtether.gateway.nodes.discovery import Publish

log = logging.getLogger(__name__)


class ResolveFailed(Exception):
    """The name could not be resolved this time (as opposed to: it has no records)."""


class Resolver(Protocol):
    async def addresses(self, host: str) -> list[str]:
        """The A and AAAA addresses of `host`; [] when it has none; ResolveFailed when no answer came."""
        ...

    async def srv(self, name: str) -> list[tuple[str, int]]:
        """(target, port) of each SRV record of `name`; [] when it has none; ResolveFailed when no answer came."""
        ...


class DnsPythonResolver:
    """The system's resolver configuration (/etc/resolv.conf, its search domains), or `nameservers` on `port`."""

    def __init__(self, nameservers: list[str] | None = None, port: int = 53, lifetime_s: float = 5.0) -> None:
        import dns.asyncresolver

        self._resolver = dns.asyncresolver.Resolver(configure=nameservers is None)
        if nameservers is not None:
            self._resolver.nameservers = list(nameservers)
            self._resolver.port = port
        self._resolver.lifetime = lifetime_s

    async def _query(self, name: str, rdtype: str) -> list[object]:
        import dns.exception
        import dns.resolver

        if rdtype in ("A", "AAAA") and _is_address(name):
            return []
        try:
            answer = await self._resolver.resolve(name, rdtype, search=True)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return []
        except (dns.exception.DNSException, OSError) as exc:
            raise ResolveFailed(f"{name} {rdtype}: {type(exc).__name__}: {exc}") from None
        return list(answer)

    async def addresses(self, host: str) -> list[str]:
        if _is_address(host):
            return [host]
        return [str(getattr(r, "address", "")) for t in ("A", "AAAA") for r in await self._query(host, t)]

    async def srv(self, name: str) -> list[tuple[str, int]]:
        return [(str(getattr(r, "target", "")).rstrip("."), int(getattr(r, "port", 0)))
                for r in await self._query(name, "SRV")]


def _is_address(host: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class DnsDiscovery:
    source = "dns"

    def __init__(self, settings: DiscoverySettings, resolver: Resolver | None = None) -> None:
        self.settings = settings
        self.resolver: Resolver = resolver or DnsPythonResolver(lifetime_s=min(5.0, settings.dns_interval_s))
        self.roles = {"prefill": settings.dns_prefill, "decode": settings.dns_decode, "both": settings.dns_pool}
        self._last: dict[str, list[str]] = {}  # each name's last answer (kept while it cannot be resolved)

    async def resolve_once(self) -> dict[str, list[str]]:
        """Every role's URLs as its names resolve now (a name that fails keeps its last answer)."""
        out: dict[str, list[str]] = {}
        for role, names in self.roles.items():
            urls: list[str] = []
            for name in names:
                try:
                    self._last[name] = await self._urls(name)
                except ResolveFailed as exc:
                    log.warning("discovery: %s did not resolve (%s); keeping its last answer", name, exc)
                urls.extend(u for u in self._last.get(name, []) if u not in urls)
            out[role] = urls
        return out

    async def _urls(self, name: str) -> list[str]:
        host, port = parse_dns_name(name, self.settings.port)
        scheme = self.settings.scheme
        if port is not None:
            return sorted(node_url(scheme, a, port) for a in await self.resolver.addresses(host))
        urls: list[str] = []
        for target, srv_port in await self.resolver.srv(host):
            # A target without an address of its own (yet) is skipped: it would be a URL nothing can reach.
            urls.extend(node_url(scheme, a, srv_port) for a in await self.resolver.addresses(target))
        return sorted(set(urls))

    async def run(self, publish: Publish) -> None:
        while True:
            publish(dns_members(await self.resolve_once()))
            await anyio.sleep(self.settings.dns_interval_s)
