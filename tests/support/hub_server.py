"""A stand-in for the Hugging Face Hub on 127.0.0.1: the part of its HTTP API the real huggingface_hub client uses
to download a repository (`HF_ENDPOINT=<endpoint>`), so tests fetch a tiny model without the network.

Served, as the hub serves them (https://huggingface.co/docs/hub/api and huggingface_hub's `file_download.py`):

- `GET /api/models/{repo}[/revision/{rev}]`: the model's info, with its commit (`sha`) and files (`siblings`);
- `GET /api/models/{repo}/tree/{rev}[/{path}]`: its files, with sizes and, for weights, LFS pointers;
- `HEAD|GET /{repo}/resolve/{rev}/{file}`: a file, with `X-Repo-Commit`, `ETag` and `Content-Length`.

Errors carry the hub's `X-Error-Code` (RepoNotFound, RevisionNotFound, EntryNotFound, GatedRepo), from which the
client raises its own exceptions. A gated repository lists its files to anyone but serves them only to a token it
names (`Authorization: Bearer ...`): 401 without one, 403 with another, as the hub does. Every request is recorded.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
import urllib.parse
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass(frozen=True)
class HubRepo:
    files: Mapping[str, bytes]
    # Tokens that may download a gated repository's files; None: not gated.
    gated_for: frozenset[str] | None = None
    branch: str = "main"

    @property
    def sha(self) -> str:
        """The commit: a hash of the files, so that other files make another commit."""
        h = hashlib.sha1()
        for name in sorted(self.files):
            h.update(name.encode() + b"\0" + self.files[name] + b"\0")
        return h.hexdigest()


@dataclass
class HubServer:
    repos: Mapping[str, HubRepo]
    endpoint: str = ""
    requests: list[tuple[str, str]] = field(default_factory=list)  # (method, path)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def downloads(self) -> list[str]:
        """The files served with GET so far, by repository path."""
        with self.lock:
            return [p.split("/resolve/", 1)[1].split("/", 1)[1] for m, p in self.requests
                    if m == "GET" and "/resolve/" in p]


def _is_lfs(name: str) -> bool:
    return name.endswith((".safetensors", ".bin", ".pt", ".pth", ".gguf"))


def _blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class _Handler(BaseHTTPRequestHandler):
    server_version = "hub-stand-in"
    hub: HubServer  # set on the handler class made for each server

    def log_message(self, *_args: object) -> None:
        pass

    def do_HEAD(self) -> None:
        self._route(head=True)

    def do_GET(self) -> None:
        self._route(head=False)

    # ---- routing ----------------------------------------------------------------------------------

    def _route(self, *, head: bool) -> None:
        url = urllib.parse.urlsplit(self.path)
        path = urllib.parse.unquote(url.path)
        with self.hub.lock:
            self.hub.requests.append(("HEAD" if head else "GET", path))
        if path.startswith("/api/models/"):
            self._api(path[len("/api/models/"):])
        elif "/resolve/" in path:
            repo_id, _, rest = path.lstrip("/").partition("/resolve/")
            rev, _, name = rest.partition("/")
            self._resolve(repo_id, rev, name, head=head)
        else:
            self._error(404, "RepoNotFound", "no such route")

    def _repo(self, repo_id: str, rev: str | None) -> HubRepo | None:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            self._error(401, "RepoNotFound", "Repository not found")
            return None
        if rev is not None and rev not in (repo.branch, repo.sha):
            self._error(404, "RevisionNotFound", "Invalid rev id: " + rev)
            return None
        return repo

    def _api(self, rest: str) -> None:
        for marker in ("/tree/", "/revision/"):
            if marker in rest:
                repo_id, _, tail = rest.partition(marker)
                rev, _, sub = tail.partition("/")
                repo = self._repo(repo_id, rev)
                if repo is not None:
                    self._json(self._tree(repo, sub) if marker == "/tree/" else self._info(repo_id, repo), repo)
                return
        repo = self._repo(rest, None)
        if repo is not None:
            self._json(self._info(rest, repo), repo)

    def _info(self, repo_id: str, repo: HubRepo) -> dict[str, object]:
        return {"_id": repo.sha[:24], "id": repo_id, "modelId": repo_id, "sha": repo.sha, "private": False,
                "gated": "manual" if repo.gated_for is not None else False, "disabled": False, "downloads": 0,
                "likes": 0, "tags": [], "lastModified": "2025-01-01T00:00:00.000Z",
                "siblings": [{"rfilename": n} for n in sorted(repo.files)]}

    def _tree(self, repo: HubRepo, sub: str) -> list[dict[str, object]]:
        out: list[dict[str, object]] = []
        for name in sorted(repo.files):
            if sub and not name.startswith(sub.rstrip("/") + "/"):
                continue
            data = repo.files[name]
            entry: dict[str, object] = {"type": "file", "oid": _blob_id(data), "size": len(data), "path": name}
            if _is_lfs(name):
                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
            out.append(entry)
        return out

    def _resolve(self, repo_id: str, rev: str, name: str, *, head: bool) -> None:
        repo = self._repo(repo_id, rev)
        if repo is None:
            return
        if repo.gated_for is not None:
            token = self.headers.get("Authorization", "").removeprefix("Bearer ").strip()
            if token not in repo.gated_for:
                code = 403 if token else 401
                self._error(code, "GatedRepo", f"Access to model {repo_id} is restricted.", repo)
                return
        data = repo.files.get(name)
        if data is None:
            self._error(404, "EntryNotFound", f"{name} does not exist", repo)
            return
        etag = hashlib.sha256(data).hexdigest() if _is_lfs(name) else _blob_id(data)
        self.send_response(200)
        self.send_header("X-Repo-Commit", repo.sha)
        self.send_header("ETag", f'"{etag}"')
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Content-Type", "application/octet-stream")
        self.end_headers()
        if not head:
            self.wfile.write(data)

    # ---- answers ----------------------------------------------------------------------------------

    def _json(self, body: object, repo: HubRepo) -> None:
        raw = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.send_header("X-Repo-Commit", repo.sha)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(raw)

    def _error(self, code: int, error_code: str, message: str, repo: HubRepo | None = None) -> None:
        raw = json.dumps({"error": message}).encode()
        self.send_response(code)
        self.send_header("X-Error-Code", error_code)
        self.send_header("X-Error-Message", message)
        if repo is not None:
            self.send_header("X-Repo-Commit", repo.sha)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(raw)


@contextlib.contextmanager
def serving_hub(repos: Mapping[str, HubRepo]) -> Iterator[HubServer]:
    """The stand-in on a free port of 127.0.0.1 for the duration; `.endpoint` is its base URL (for HF_ENDPOINT)."""
    hub = HubServer(repos=repos)
    handler = type("Handler", (_Handler,), {"hub": hub})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    hub.endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
