"""DNS discovery: with a resolver the test scripts (what each answer does to the desired set), and against a real DNS
server on 127.0.0.1 (dnslib) through dnspython's asyncio resolver (A, AAAA and SRV records on the wire)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
from kvtether.gateway.nodes.discovery import Member, load_discovery
from kvtether.gateway.nodes.discovery.dns import DnsDiscovery, DnsPythonResolver, ResolveFailed

from tests.gateway.discovery.scripted_dns import ScriptedResolver
from tests.gateway.discovery.waiting import until

pytestmark = pytest.mark.anyio


def _dns(**names: Any) -> DnsDiscovery:
    return DnsDiscovery(load_discovery({"source": "dns", **names}), ScriptedResolver())


async def test_a_records_give_one_node_per_address_at_the_configured_port() -> None:
    disc = _dns(dns_prefill=["p.kv.svc:8000"], dns_decode=["d.kv.svc:8001"])
    r = disc.resolver
    assert isinstance(r, ScriptedResolver)
    r.a = {"p.kv.svc": ["10.0.0.1"], "d.kv.svc": ["10.0.0.3", "10.0.0.2", "fd00::4"]}
    assert await disc.resolve_once() == {
        "prefill": ["http://10.0.0.1:8000"],
        "decode": ["http://10.0.0.2:8001", "http://10.0.0.3:8001", "http://[fd00::4]:8001"], "both": []}


async def test_srv_records_carry_the_port_and_their_targets_resolve() -> None:
    disc = _dns(dns_pool=["_http._tcp.pool.kv.svc"])
    r = disc.resolver
    assert isinstance(r, ScriptedResolver)
    r.srv_records = {"_http._tcp.pool.kv.svc": [("n0.pool.kv.svc", 8100), ("n1.pool.kv.svc", 8200),
                                                 ("starting.pool.kv.svc", 8300)]}
    r.a = {"n0.pool.kv.svc": ["10.0.1.1"], "n1.pool.kv.svc": ["10.0.1.2"]}
    assert (await disc.resolve_once())["both"] == ["http://10.0.1.1:8100", "http://10.0.1.2:8200"]


async def test_a_name_that_fails_keeps_its_last_answer_and_one_with_no_records_has_no_nodes() -> None:
    disc = _dns(dns_decode=["d.kv.svc:8000"], dns_prefill=["p.kv.svc:8000"])
    r = disc.resolver
    assert isinstance(r, ScriptedResolver)
    r.a = {"d.kv.svc": ["10.0.0.2"], "p.kv.svc": ["10.0.0.1"]}
    await disc.resolve_once()
    r.failing = {"d.kv.svc"}  # the DNS server does not answer: a DNS outage must not drain the decode nodes
    r.a["p.kv.svc"] = []  # the prefill Service has no ready endpoint left
    assert await disc.resolve_once() == {"prefill": [], "decode": ["http://10.0.0.2:8000"], "both": []}


async def test_run_publishes_every_round_and_a_vanished_address_is_gone_from_the_set() -> None:
    disc = DnsDiscovery(load_discovery({"source": "dns", "dns_decode": ["d.kv.svc:8000"], "dns_interval_s": 0.01}),
                        ScriptedResolver())
    r = disc.resolver
    assert isinstance(r, ScriptedResolver)
    r.a = {"d.kv.svc": ["10.0.0.2", "10.0.0.3"]}
    seen: list[dict[str, Member]] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(disc.run, lambda s: seen.append(dict(s)))
        await until(lambda: seen)
        assert seen[-1] == {"http://10.0.0.2:8000": Member("decode"), "http://10.0.0.3:8000": Member("decode")}
        r.a = {"d.kv.svc": ["10.0.0.3"]}
        await until(lambda: "http://10.0.0.2:8000" not in seen[-1])
        tg.cancel_scope.cancel()
    assert seen[-1] == {"http://10.0.0.3:8000": Member("decode")}


# ---- a real DNS server --------------------------------------------------------------------------------------

@contextlib.contextmanager
def dns_server(zone: str) -> Iterator[int]:
    """dnslib's server on 127.0.0.1 (UDP, a free port) answering from `zone` (zone-file text); its port."""
    dnslib = pytest.importorskip("dnslib")
    from dnslib.server import DNSServer
    from dnslib.zoneresolver import ZoneResolver

    server = DNSServer(ZoneResolver(zone), port=0, address="127.0.0.1")
    server.start_thread()  # the test's server; the gateway's side runs on the event loop
    try:
        yield int(server.server.server_address[1])
    finally:
        server.stop()
    assert dnslib


ZONE = """
p.kv.svc.cluster.local.                 5 IN A     127.0.0.11
d.kv.svc.cluster.local.                 5 IN A     127.0.0.21
d.kv.svc.cluster.local.                 5 IN A     127.0.0.22
d.kv.svc.cluster.local.                 5 IN AAAA  fd00::23
_http._tcp.pool.kv.svc.cluster.local.   5 IN SRV   0 50 8100 n0.pool.kv.svc.cluster.local.
_http._tcp.pool.kv.svc.cluster.local.   5 IN SRV   0 50 8200 n1.pool.kv.svc.cluster.local.
n0.pool.kv.svc.cluster.local.           5 IN A     127.0.0.31
n1.pool.kv.svc.cluster.local.           5 IN A     127.0.0.32
"""


@pytest.mark.wall_clock  # a real DNS server on a real socket
async def test_against_a_real_dns_server_a_aaaa_and_srv() -> None:
    with dns_server(ZONE) as port:
        settings = load_discovery({"source": "dns", "dns_prefill": ["p.kv.svc.cluster.local:8000"],
                                   "dns_decode": ["d.kv.svc.cluster.local:8001"],
                                   "dns_pool": ["_http._tcp.pool.kv.svc.cluster.local", "gone.kv.svc.cluster.local"]})
        resolver = DnsPythonResolver(["127.0.0.1"], port=port, lifetime_s=5.0)
        # Straight from the resolver first: a failure here names its cause (resolve_once would log and keep []).
        assert await resolver.addresses("p.kv.svc.cluster.local") == ["127.0.0.11"]
        disc = DnsDiscovery(settings, resolver)
        assert await disc.resolve_once() == {
            "prefill": ["http://127.0.0.11:8000"],
            "decode": ["http://127.0.0.21:8001", "http://127.0.0.22:8001", "http://[fd00::23]:8001"],
            "both": ["http://127.0.0.31:8100", "http://127.0.0.32:8200"]}  # the unknown name: NXDOMAIN, no nodes


async def test_a_dns_server_that_does_not_answer_is_a_failure_not_an_empty_answer() -> None:
    resolver = DnsPythonResolver(["127.0.0.1"], port=9, lifetime_s=0.3)  # nothing answers there
    with pytest.raises(ResolveFailed):
        await resolver.addresses("d.kv.svc.cluster.local")
