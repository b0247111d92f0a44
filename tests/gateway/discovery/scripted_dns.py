"""A resolver the test scripts, for DNS discovery without a DNS server (dns.Resolver)."""

from __future__ import annotations

from kvtether.gateway.nodes.discovery.dns import ResolveFailed


class ScriptedResolver:
    """Answers from dicts the test edits; a name in `failing` raises ResolveFailed (no answer came)."""

    def __init__(self) -> None:
        self.a: dict[str, list[str]] = {}
        self.srv_records: dict[str, list[tuple[str, int]]] = {}
        self.failing: set[str] = set()

    async def addresses(self, host: str) -> list[str]:
        if host in self.failing:
            raise ResolveFailed(host)
        return list(self.a.get(host, [host] if host[0].isdigit() else []))

    async def srv(self, name: str) -> list[tuple[str, int]]:
        if name in self.failing:
            raise ResolveFailed(name)
        return list(self.srv_records.get(name, []))
