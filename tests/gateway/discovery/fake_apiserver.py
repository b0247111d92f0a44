"""A scripted Kubernetes API server on 127.0.0.1 that speaks the list and watch protocol for pods, so that the real
client library (lightkube, over HTTP) runs against it.

``GET /api/v1/namespaces/NS/pods`` answers a PodList with the current ``resourceVersion``; with ``watch=true`` it
streams one JSON event per line (ADDED, MODIFIED, DELETED, BOOKMARK, ERROR), first the events after the
requested version, then each new one as the test makes it, until ``timeoutSeconds`` pass. A requested version
older than the server keeps (``compact``) gets an ERROR event with a 410 Status, as the API server sends. The
test can sever every open watch (the connection is cut mid-stream), send a bookmark, or change pods without an
event at all (what a client that missed events would not know)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Generator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs

import anyio
import uvicorn


def pod(name: str, ip: str | None, role: str | None, *, ready: bool = True, deleting: bool = False,
        phase: str = "Running", port: int | None = None, labels: dict[str, str] | None = None) -> dict[str, Any]:
    """A Pod object as the API server returns it (only the fields discovery reads, and a few more)."""
    meta: dict[str, Any] = {"name": name, "namespace": "kv", "uid": f"uid-{name}",
                            "labels": {"app.kubernetes.io/part-of": "kvtether", **({"kvtether.io/role": role}
                                                                                   if role else {}),
                                       **(labels or {})}}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-01T00:00:00Z"
    container: dict[str, Any] = {"name": "vllm", "image": "vllm/vllm-openai"}
    if port is not None:
        container["ports"] = [{"name": "http", "containerPort": port}]
    status: dict[str, Any] = {"phase": phase,
                              "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    return {"kind": "Pod", "apiVersion": "v1", "metadata": meta, "spec": {"containers": [container]},
            "status": status}


@dataclass
class FakeApiServer:
    pods: dict[str, dict[str, Any]] = field(default_factory=dict)
    version: int = 100
    events: list[tuple[int, str, dict[str, Any]]] = field(default_factory=list)
    oldest: int = 0  # a watch from a version below this gets 410 Gone
    requests: list[dict[str, str]] = field(default_factory=list)  # every list and watch, with its query
    _changed: anyio.Event = field(default_factory=anyio.Event)
    _sever: int = 0  # bumped to cut every open watch

    # ---- what the test does ---------------------------------------------------------------------------
    def put(self, p: dict[str, Any], *, event: bool = True) -> None:
        kind = "MODIFIED" if p["metadata"]["name"] in self.pods else "ADDED"
        self._emit(kind, p, event)
        self.pods[p["metadata"]["name"]] = p

    def delete(self, name: str, *, event: bool = True) -> None:
        p = self.pods.pop(name)
        self._emit("DELETED", p, event)

    def bookmark(self) -> None:
        self.version += 1
        self.events.append((self.version, "BOOKMARK", {"kind": "Pod", "apiVersion": "v1",
                                                       "metadata": {"resourceVersion": str(self.version)}}))
        self._wake()

    def compact(self) -> None:
        """Forget every event so far: a watch from any version seen until now gets 410 Gone."""
        self.version += 1
        self.oldest = self.version
        self.events.clear()

    def sever(self) -> None:
        self._sever += 1
        self._wake()

    def watches(self) -> list[dict[str, str]]:
        return [r for r in self.requests if r.get("watch") == "true"]

    def lists(self) -> list[dict[str, str]]:
        return [r for r in self.requests if r.get("watch") != "true"]

    def _emit(self, kind: str, p: dict[str, Any], event: bool) -> None:
        self.version += 1
        p["metadata"]["resourceVersion"] = str(self.version)
        if event:
            self.events.append((self.version, kind, json.loads(json.dumps(p))))
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    # ---- the API -----------------------------------------------------------------------------------------
    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        query = {k: v[0] for k, v in parse_qs(scope["query_string"].decode()).items()}
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        self.requests.append({"path": scope["path"], "authorization": headers.get("authorization", ""), **query})
        if scope["path"] != "/api/v1/namespaces/kv/pods":
            await _json(send, 404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 404,
                                    "message": "not found"})
            return
        if query.get("watch") != "true":
            items = [p for p in self.pods.values() if _selected(p, query.get("labelSelector", ""))]
            await _json(send, 200, {"kind": "PodList", "apiVersion": "v1",
                                    "metadata": {"resourceVersion": str(self.version)}, "items": items})
            return
        await self._watch(query, send)

    async def _watch(self, query: dict[str, str], send: Any) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"transfer-encoding", b"chunked")]})
        since = int(query.get("resourceVersion") or self.version)
        selector = query.get("labelSelector", "")
        if since < self.oldest:
            gone = {"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                                "code": 410, "reason": "Expired",
                                                "message": f"too old resource version: {since} ({self.oldest})"}}
            await send({"type": "http.response.body", "body": json.dumps(gone).encode() + b"\n", "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        sever = self._sever
        with anyio.move_on_after(float(query.get("timeoutSeconds", "300"))):
            while True:
                for version, kind, obj in [e for e in self.events if e[0] > since]:
                    since = version
                    if kind == "BOOKMARK" or _selected(obj, selector):
                        line = json.dumps({"type": kind, "object": obj}).encode() + b"\n"
                        await send({"type": "http.response.body", "body": line, "more_body": True})
                if self._sever != sever:
                    return  # no final chunk: the client sees the stream cut mid-way
                await self._changed.wait()
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _selected(p: dict[str, Any], selector: str) -> bool:
    labels = p.get("metadata", {}).get("labels", {})
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    return True


async def _json(send: Any, status: int, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


@contextlib.asynccontextmanager
async def serving(app: Any) -> AsyncIterator[str]:
    """`app` on 127.0.0.1 (a free port) in this event loop; its URL."""
    server = _Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="critical", lifespan="off"))
    async with anyio.create_task_group() as tg:
        tg.start_soon(server.serve)
        for _ in range(1000):
            if server.started:
                break
            await anyio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            server.should_exit = True
            server.force_exit = True


TOKEN = "service-account-token"


def kubeconfig(url: str, namespace: str = "kv") -> str:
    """A kubeconfig that points at `url`, with a bearer token."""
    return json.dumps({"apiVersion": "v1", "kind": "Config", "current-context": "fake",
                       "clusters": [{"name": "fake", "cluster": {"server": url}}],
                       "users": [{"name": "fake", "user": {"token": TOKEN}}],
                       "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake",
                                                                 "namespace": namespace}}]})
