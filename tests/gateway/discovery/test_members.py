"""What a pod event or a DNS answer does to the node set: the pure rules (members.py) and the settings' loader."""

from __future__ import annotations

import pytest
from kvtether.gateway.config import ConfigError, load_config
from kvtether.gateway.nodes.discovery import DiscoveryError, Member, load_discovery
from kvtether.gateway.nodes.discovery.members import (
    DRAINING,
    JOINING,
    READY,
    Change,
    PodFacts,
    dns_members,
    pod_member,
    pod_members,
    reconcile,
)

K8S = load_discovery({"source": "kubernetes"})


def _pod(uid: str = "u1", ip: str | None = "10.0.0.1", role: str | None = "decode", **kw: object) -> PodFacts:
    labels = {"kvtether.io/role": role} if role else {}
    return PodFacts(name=uid, uid=uid, ip=ip, labels=labels, **{"ready": True, "phase": "Running", **kw})  # type: ignore[arg-type]


@pytest.mark.parametrize(("pod", "expected"), [
    (_pod(), ("http://10.0.0.1:8000", Member("decode"))),
    (_pod(ready=False), None),  # not Ready: not routable, not added
    (_pod(ready=False, deleting=True), ("http://10.0.0.1:8000", Member("decode", draining=True))),
    (_pod(deleting=True), ("http://10.0.0.1:8000", Member("decode", draining=True))),
    (_pod(phase="Failed"), ("http://10.0.0.1:8000", Member("decode", draining=True))),
    (_pod(ip=None), None),  # scheduled, no address yet
    (_pod(role=None), None),
    (_pod(role="router"), None),  # a value no role has
    (_pod(role="prefill-decode"), ("http://10.0.0.1:8000", Member("both"))),  # llm-d's name for a pool instance
    (_pod(ports={"http": 8100}), ("http://10.0.0.1:8100", Member("decode"))),
    (_pod(ip="fd00::1"), ("http://[fd00::1]:8000", Member("decode"))),
])
def test_a_pod_is_a_node_while_ready_and_drains_once_deleted(pod: PodFacts,
                                                             expected: tuple[str, Member] | None) -> None:
    assert pod_member(pod, K8S) == expected


def test_kvtether_role_label_wins_over_llm_d_s() -> None:
    pod = PodFacts("a", "a", "10.0.0.1", {"llm-d.ai/role": "prefill", "kvtether.io/role": "decode"}, ready=True)
    assert pod_member(pod, K8S) == ("http://10.0.0.1:8000", Member("decode"))


def test_a_new_pod_on_a_reused_address_serves_while_the_old_one_terminates() -> None:
    old = _pod(uid="b-old", deleting=True)
    new = _pod(uid="a-new")
    assert pod_members([old, new], K8S) == {"http://10.0.0.1:8000": Member("decode")}
    assert pod_members([new, old], K8S) == {"http://10.0.0.1:8000": Member("decode")}


def test_dns_answers_give_each_url_its_first_role() -> None:
    assert dns_members({"decode": ["http://a:1", "http://b:1"], "prefill": ["http://b:1"]}) == {
        "http://a:1": Member("decode"), "http://b:1": Member("prefill")}


def test_reconcile_joins_drains_drops_and_rejoins() -> None:
    known = {"http://ready:1": ("decode", READY), "http://joining:1": ("decode", JOINING),
             "http://draining:1": ("decode", DRAINING), "http://leaving:1": ("prefill", READY),
             "http://relabeled:1": ("decode", READY), "http://back:1": ("decode", DRAINING)}
    desired = {"http://ready:1": Member("decode"), "http://new:1": Member("prefill"),
               "http://leaving:1": Member("prefill", draining=True), "http://relabeled:1": Member("both"),
               "http://back:1": Member("decode"), "http://new-but-leaving:1": Member("decode", draining=True)}
    assert reconcile(known, desired) == [
        Change("http://back:1", "decode", DRAINING, JOINING),  # serves again: polled afresh before traffic
        Change("http://joining:1", "decode", JOINING, None),  # gone before it joined: dropped
        Change("http://leaving:1", "prefill", READY, DRAINING),
        Change("http://new:1", "prefill", None, JOINING),
        Change("http://relabeled:1", "both", READY, JOINING),
    ]  # the draining node stays draining (the cluster removes it once idle); a leaving unknown node is ignored


def test_reconcile_is_idempotent() -> None:
    desired = {"http://a:1": Member("decode")}
    assert reconcile({"http://a:1": ("decode", READY)}, desired) == []
    assert reconcile({"http://a:1": ("decode", DRAINING)}, {}) == []


def test_settings_load_from_a_table_with_defaults_and_checks() -> None:
    s = load_discovery({"source": "dns", "dns-decode": "d.kv.svc:8000", "dns_prefill": ["_http._tcp.p.kv.svc"],
                        "dns_interval_s": 2})
    assert s.dns_decode == ["d.kv.svc:8000"] and s.dns_interval_s == 2.0 and s.dynamic
    assert load_discovery(None).source == "static" and not load_discovery(None).dynamic
    for bad, message in [({"source": "consul"}, "source must be one of"),
                         ({"source": "dns"}, "needs names"),
                         ({"source": "dns", "dns_decode": ["d:notaport"]}, "is not HOST:PORT"),
                         ({"source": "kubernetes", "selector": "a in b"}, "cannot read"),
                         ({"sourec": "dns"}, "unknown setting 'sourec'"),
                         ({"port": "80"}, "port must be int"),
                         ({"dns_interval_s": 0}, "must be > 0")]:
        with pytest.raises(DiscoveryError, match=message):
            load_discovery(bad)


def test_the_gateway_config_takes_discovery_as_its_own_table(tmp_path: object) -> None:
    from pathlib import Path

    path = Path(str(tmp_path)) / "gateway.toml"
    path.write_text('[gateway]\nprefill = ["http://p:8000"]\n[gateway.discovery]\nsource = "dns"\n'
                    'dns_decode = ["d.kv.svc:8000"]\n')
    cfg = load_config(path)
    assert cfg.discovery.source == "dns" and cfg.decode == []  # no static decode needed: DNS finds them
    # Flags over the file: a key the flags give replaces the file's, the rest of the file's table stays.
    cfg = load_config(path, discovery={"dns_decode": ["other.kv.svc:8000"]})
    assert cfg.discovery.source == "dns" and cfg.discovery.dns_decode == ["other.kv.svc:8000"]
    with pytest.raises(ConfigError, match="needs at least one prefill"):
        load_config(None, prefill=["http://p:8000"])
    with pytest.raises(ConfigError, match="aggregated nodes are listed only"):
        load_config(None, aggregated=["http://a:8000"], discovery={"source": "kubernetes"})
    with pytest.raises(ConfigError, match=r"discovery\.source must be one of"):
        load_config(None, discovery={"source": "etcd"})
