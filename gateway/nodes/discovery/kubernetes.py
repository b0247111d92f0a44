"""Kubernetes discovery: the pods of a namespace by label selector, listed then watched, with lightkube's async
client (httpx-based; no thread).

The contract is the API server's (https://kubernetes.io/docs/reference/using-api/api-concepts/): list, then watch
from the list's ``resourceVersion``; when the server ends a watch (its timeout) lightkube opens the next one from
the last version it saw; when the stream breaks (a severed connection, an API server restart) the watch resumes
from the last version seen here; a ``410 Gone`` (that version is older than the server keeps) means events were
missed, so the pods are listed again and whatever the new list does not show is gone. Every event updates the
pods known and publishes the desired node set (members.pod_members): a pod is a node while Ready and not being
deleted, draining once its ``deletionTimestamp`` is set, gone once deleted.

Credentials: a kubeconfig file when one is set, else (lightkube's ``KubeConfig.from_env``) the pod's service
account (its token re-read when the kubelet rotates it) and outside a cluster ``$KUBECONFIG`` or
``~/.kube/config``. The service account needs ``get``, ``list`` and ``watch`` on ``pods`` in the namespace
(deploy/kubernetes/rbac.yaml).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import anyio
from kvtether.gateway.nodes.discovery.members import PodFacts, pod_members
from kvtether.gateway.nodes.discovery.settings import DiscoverySettings, parse_selector

if TYPE_CHECKING:
    from kvtether.gateway.nodes.discovery import Publish

log = logging.getLogger(__name__)

GONE = 410


class Relist(Exception):
    """The watch's resourceVersion is too old (410 Gone): list again."""


def pod_facts(pod: Any) -> PodFacts:
    """The facts discovery reads of a lightkube ``Pod``."""
    meta, status, spec = pod.metadata, pod.status, pod.spec
    conditions = (status.conditions or []) if status is not None else []
    ports = {p.name: p.containerPort for c in (spec.containers if spec is not None else []) for p in (c.ports or [])
             if p.name}
    return PodFacts(name=meta.name or "", uid=meta.uid or meta.name or "",
                    ip=status.podIP if status is not None else None, labels=dict(meta.labels or {}),
                    ready=any(c.type == "Ready" and c.status == "True" for c in conditions),
                    deleting=meta.deletionTimestamp is not None,
                    phase=status.phase if status is not None else None, ports=ports)


def label_selector(selector: str) -> list[tuple[str, Any]]:
    """settings.selector in lightkube's form (pairs of key and operator)."""
    from lightkube import operators

    out: list[tuple[str, Any]] = []
    for key, op, values in parse_selector(selector):
        value: Any
        if op in ("=", "!="):
            value = operators.equal(values[0]) if op == "=" else operators.not_equal(values[0])
        elif op in ("exists", "!exists"):
            value = operators.exists() if op == "exists" else operators.not_exists()
        else:
            value = operators.in_(values) if op == "in" else operators.not_in(values)
        out.append((key, value))
    return out


class KubernetesDiscovery:
    source = "kubernetes"

    def __init__(self, settings: DiscoverySettings) -> None:
        self.settings = settings
        self.pods: dict[str, PodFacts] = {}  # by uid
        self.version: str | None = None  # the last resourceVersion seen; None: list (again)
        # What the tests and /ready's logs read: how often the pods were listed, and the watch resumed.
        self.lists = 0
        self.resumes = 0

    def _client(self) -> Any:
        import httpx2
        from lightkube import AsyncClient, KubeConfig

        s = self.settings
        config = KubeConfig.from_file(s.kubeconfig) if s.kubeconfig else KubeConfig.from_env()
        # No read timeout on the watch beyond the server's own (lightkube clears it for watches).
        return AsyncClient(config=config, namespace=s.namespace, timeout=httpx2.Timeout(10.0),
                           field_manager="kvtether")

    async def run(self, publish: Publish) -> None:
        from lightkube import ConfigError

        while True:
            try:
                client = self._client()
                break
            except ConfigError as exc:  # no kubeconfig, no service account: say so once per try, in one line
                log.error("discovery: no Kubernetes credentials (%s); again in %.0f s", exc, self.settings.retry_max_s)
                await anyio.sleep(self.settings.retry_max_s)
        wait = self.settings.retry_s
        try:
            while True:
                try:
                    if self.version is None:
                        await self._list(client)
                        publish(pod_members(self.pods.values(), self.settings))
                    await self._watch(client, publish)
                    wait = self.settings.retry_s
                except Relist:
                    log.info("discovery: the watch's resourceVersion is gone (410): listing the pods again")
                    self.version = None
                    continue
                except Exception as exc:  # the API server away, a broken stream: retry, resuming where it was
                    if isinstance(exc, anyio.get_cancelled_exc_class()):
                        raise
                    log.warning("discovery: %s failed (%s: %s); again in %.1f s",
                                "list" if self.version is None else "watch", type(exc).__name__, exc, wait)
                    await anyio.sleep(wait)
                    wait = min(self.settings.retry_max_s, wait * 2)
                    self.resumes += self.version is not None
        finally:
            with anyio.CancelScope(shield=True):
                await client.close()

    async def _list(self, client: Any) -> None:
        from lightkube.resources.core_v1 import Pod

        pods = client.list(Pod, namespace=self.settings.namespace or client.namespace,
                           labels=label_selector(self.settings.selector))
        found: dict[str, PodFacts] = {}
        async for pod in pods:
            facts = pod_facts(pod)
            found[facts.uid] = facts
        self.pods = found  # what the new list does not show is gone
        self.version = pods.resourceVersion
        self.lists += 1

    async def _watch(self, client: Any, publish: Publish) -> None:
        from lightkube import ApiError
        from lightkube.resources.core_v1 import Pod

        try:
            async for kind, pod in client.watch(
                    Pod, namespace=self.settings.namespace or client.namespace,
                    labels=label_selector(self.settings.selector), resource_version=self.version,
                    server_timeout=max(1, int(self.settings.watch_timeout_s))):
                if pod.metadata is not None and pod.metadata.resourceVersion:
                    self.version = pod.metadata.resourceVersion
                if kind == "BOOKMARK":
                    continue
                facts = pod_facts(pod)
                if kind == "DELETED":
                    self.pods.pop(facts.uid, None)
                else:  # ADDED, MODIFIED
                    self.pods[facts.uid] = facts
                publish(pod_members(self.pods.values(), self.settings))
        except ApiError as exc:
            if exc.status is not None and exc.status.code == GONE:
                raise Relist from None
            raise
