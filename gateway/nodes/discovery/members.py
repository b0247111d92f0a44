"""What a discovery answer does to the node set: pure functions, no I/O.

A backend turns what it sees (a DNS answer, the pods a list and watch know) into the *desired* set: each node's
URL, its role, and whether it is serving or leaving (``Member``). :func:`reconcile` compares that set with the
discovered nodes the cluster knows and says what changes: a new node joins (polled, and routable once healthy),
a node that leaves drains (no new sessions; its running turns finish; each of its sessions moves at its next
turn), a node gone before it ever joined is simply dropped. The same answer gives the same changes on every
replica, so replicas sharing a session store reach the same view without talking to each other.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from kvtether.gateway.nodes.discovery.settings import DiscoverySettings

# A discovered node's states. A static node is READY from the start.
JOINING: Final = "joining"  # discovered, not yet polled healthy: takes no traffic
READY: Final = "ready"  # takes traffic (while healthy: the health rules of cluster.py still apply)
DRAINING: Final = "draining"  # leaving: no new turns; removed once its running turns are done
STATES: Final = (JOINING, READY, DRAINING)

# Role label values, llm-d's included (its pods say prefill, decode or prefill-decode; "both" is its old name).
ROLE_VALUES: Final = {"prefill": "prefill", "decode": "decode", "both": "both", "prefill-decode": "both",
                      "pool": "both"}


@dataclass(frozen=True, slots=True)
class Member:
    """One node as a discovery source sees it: its role and whether it is leaving."""

    role: str  # prefill | decode | both
    draining: bool = False


@dataclass(frozen=True, slots=True)
class PodFacts:
    """What discovery reads of a pod (kubernetes.py fills it from the API's Pod)."""

    name: str
    uid: str
    ip: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    ready: bool = False  # the PodReady condition is True
    deleting: bool = False  # metadata.deletionTimestamp is set
    phase: str | None = None
    ports: Mapping[str, int] = field(default_factory=dict)  # named container ports


@dataclass(frozen=True, slots=True)
class Change:
    """A node's move from one state to another; None: not in the cluster (before it joined, after it left)."""

    url: str
    role: str
    before: str | None
    after: str | None


def node_url(scheme: str, host: str, port: int) -> str:
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"{scheme}://{host}:{port}"


def role_of(labels: Mapping[str, str], role_labels: Iterable[str]) -> str | None:
    """The role the first role label present names; None without one, or with a value no role has."""
    for key in role_labels:
        if key in labels:
            return ROLE_VALUES.get(labels[key].strip().lower())
    return None


def pod_member(pod: PodFacts, settings: DiscoverySettings) -> tuple[str, Member] | None:
    """The pod as a node: routable when Ready and not being deleted; draining once being deleted (whether it still
    answers or not); None when it has no address or role yet, or is not Ready (the health rules take a known node
    that stops answering out; a pod that is not Ready is not added)."""
    role = role_of(pod.labels, settings.role_labels)
    if role is None or not pod.ip:
        return None
    url = node_url(settings.scheme, pod.ip, pod.ports.get(settings.port_name, settings.port))
    if pod.deleting or pod.phase in ("Succeeded", "Failed"):
        return url, Member(role, draining=True)
    if not pod.ready:
        return None
    return url, Member(role)


def pod_members(pods: Iterable[PodFacts], settings: DiscoverySettings) -> dict[str, Member]:
    """The desired set from the pods known. Two pods on one address (an IP reused by a new pod while the old one
    terminates): the serving one wins."""
    out: dict[str, Member] = {}
    for pod in sorted(pods, key=lambda p: p.uid):
        found = pod_member(pod, settings)
        if found is None:
            continue
        url, member = found
        if url not in out or out[url].draining:
            out[url] = member
    return out


def dns_members(answers: Mapping[str, Iterable[str]]) -> dict[str, Member]:
    """The desired set from one round of DNS answers: the URLs each role's names resolved to (a role -> URLs
    mapping). A headless Service answers with its ready endpoints only, so an address it no longer gives is gone:
    it is simply absent here, and reconcile drains it. One URL under two roles: the first role listed wins."""
    out: dict[str, Member] = {}
    for role in ("prefill", "decode", "both"):
        for url in answers.get(role, ()):
            out.setdefault(url, Member(role))
    return out


def reconcile(known: Mapping[str, tuple[str, str]], desired: Mapping[str, Member]) -> list[Change]:
    """The changes that bring the discovered nodes the cluster knows (url -> (role, state)) to `desired`, in URL
    order. A desired node that is new joins; one that leaves (draining, or absent) drains, or is dropped if it
    had not joined yet; a draining node that serves again, or a node whose role changed, joins again (polled
    afresh before it takes traffic). A draining node's removal once idle is the cluster's (it knows the turns)."""
    changes: list[Change] = []
    for url in sorted(set(known) | set(desired)):
        member = desired.get(url)
        if url not in known:
            if member is not None and not member.draining:
                changes.append(Change(url, member.role, None, JOINING))
            continue
        role, state = known[url]
        leaving = member is None or member.draining
        if leaving:
            if state == JOINING:
                changes.append(Change(url, role, state, None))
            elif state != DRAINING:
                changes.append(Change(url, role, state, DRAINING))
        elif member is not None and (state == DRAINING or member.role != role):
            changes.append(Change(url, member.role, state, JOINING))
    return changes
