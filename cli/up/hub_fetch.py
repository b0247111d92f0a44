"""Fetching a model from the Hugging Face Hub, once, with the vLLM environment's own huggingface_hub: the one
that will read the files back, with its cache and its settings (HF_HOME, HF_HUB_CACHE, HF_TOKEN or the stored
login, HF_ENDPOINT, proxies), and its progress bars on stderr.

The script runs in that environment's python (`python -c`), which need not have kvtether; it prints one JSON
line: the snapshot's path, or the error's class names and first line, which `fetch_problem` turns into the
command's one-line message (pure).

Which files: the repository's, but for those no vLLM load reads (Meta's original `*.pth` checkpoints, TF, Flax,
ONNX, Rust and TFLite weights, GGUF files). Not fewer: offline, vLLM asks huggingface_hub for every file of the
formats it may load (`*.safetensors`, `*.bin`, `*.pt`; `download_weights_from_hf`), and recent huggingface_hub
refuses a snapshot that lacks one the repository lists (IncompleteSnapshotError). A tokenizer alone: no weights.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvtether.cli.up.hub_cache import Kind, hub_endpoint

# Never read by a vLLM load from a hub repository.
_NOT_VLLMS = ("*.pth", "*.gguf", "*.onnx", "*.onnx_data", "*.h5", "*.msgpack", "*.ot", "*.tflite")
_WEIGHTS = ("*.safetensors", "*.bin", "*.pt")

# Written for any python 3 and any huggingface_hub vLLM has required (errors are told apart by class name).
_FETCH = r"""
import json, sys
spec = json.loads(sys.argv[1])
out = {"path": None, "error": None, "message": None, "status": None, "token": None}
try:
    from huggingface_hub import HfApi, snapshot_download
    try:
        from huggingface_hub import get_token
        out["token"] = get_token() is not None
    except Exception:
        pass
    # The model's info first: one request, not retried, so that an unreachable hub is said at once, and a gated
    # model without a token before any download.
    info = HfApi().model_info(spec["repo"], revision=spec["revision"])
    if getattr(info, "gated", False) and out["token"] is False:
        out["error"], out["message"] = ["GatedRepoError"], "gated"
    else:
        out["path"] = snapshot_download(spec["repo"], revision=spec["revision"], cache_dir=spec["cache_dir"],
                                        ignore_patterns=spec["ignore"])
except Exception as e:
    chain, seen = [], e
    while seen is not None and len(chain) < 5:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    out["error"] = [c.__name__ for x in chain for c in type(x).__mro__]
    out["message"] = (str(e).strip().splitlines() or [type(e).__name__])[0]
    out["status"] = getattr(getattr(e, "response", None), "status_code", None)
print(json.dumps(out))
"""

_UNREACHABLE = {"ConnectError", "ConnectionError", "ConnectTimeout", "ReadTimeout", "TimeoutException", "Timeout",
                "ProxyError", "LocalEntryNotFoundError", "OfflineModeIsEnabled"}
FIRST_RUN_DOC = "docs/real-vllm.md#first-run-on-a-gpu-machine"


def fetch_spec(repo: str, *, kind: Kind, revision: str | None, cache_dir: str | None) -> dict[str, object]:
    """The script's argument: which repository and revision, into which cache, without which files."""
    ignore = [*_NOT_VLLMS, *(_WEIGHTS if kind == "tokenizer" else ())]
    return {"repo": repo, "revision": revision, "cache_dir": cache_dir, "ignore": ignore}


@dataclass(frozen=True)
class Fetched:
    """The snapshot's path, or (path None) the problem in one line: why not, and what to do."""

    path: str | None = None
    problem: str = ""


def fetch(python: str, repo: str, *, kind: Kind, revision: str | None, cache_dir: str | None,
          env: Mapping[str, str]) -> Fetched:
    """Runs the fetch in `python` (stdout captured for its answer, stderr left to the terminal for the progress
    bars); no timeout: a large model takes what the network takes, and Ctrl-C stops it (the caller's handler)."""
    spec = json.dumps(fetch_spec(repo, kind=kind, revision=revision, cache_dir=cache_dir))
    try:
        proc = subprocess.run([python, "-c", _FETCH, spec], stdout=subprocess.PIPE, text=True, env=dict(env),
                              stdin=subprocess.DEVNULL, check=False)
    except OSError as e:
        return Fetched(problem=f"cannot run {python}: {e.strerror or e}")
    try:
        got = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return Fetched(problem=f"{python} ended with exit code {proc.returncode} without an answer (see above)")
    if got.get("path"):
        return Fetched(path=str(got["path"]))
    return Fetched(problem=fetch_problem(got.get("error") or [], str(got.get("message") or ""), got.get("status"),
                                         got.get("token"), repo=repo, revision=revision, python=python,
                                         page=f"{hub_endpoint(env)}/{repo}"))


def fetch_problem(error: Sequence[str], message: str, status: object, token: object, *, repo: str,
                  revision: str | None, python: str, page: str) -> str:
    """The one-line message for the script's error: its class names (the exception's, its bases', those of its
    causes), its first line, the HTTP status, and whether a token was found (None: unknown)."""
    names = set(error)
    if "ImportError" in names and "huggingface_hub" in message:
        return f"{python} cannot import huggingface_hub ({message}); vLLM depends on it: install it there"
    if "GatedRepoError" in names:
        if token is True:
            return (f"{repo} is gated and the token found may not read it: accept its conditions at {page} with its "
                    "account")
        found = "no token was found" if token is False else "it needs a token"
        return (f"{repo} is gated and {found}: accept its conditions at {page}, then set HF_TOKEN (or run "
                "`hf auth login`) for the user that runs kvtether up")
    if "RevisionNotFoundError" in names:
        return f"{repo} has no revision {revision!r} (vLLM's --revision or --tokenizer-revision)"
    if "RepositoryNotFoundError" in names:
        private = ("or it is private and the token found may not read it" if token is True
                   else "set HF_TOKEN if it is private")
        return f"no model {repo} on the hub: check the name ({private})"
    if names & _UNREACHABLE:
        return (f"the hub cannot be reached ({message}): check the network and proxy (HTTPS_PROXY; HF_ENDPOINT for "
                f"a mirror), or copy the model's files to this machine first ({FIRST_RUN_DOC})")
    if "HfHubHTTPError" in names:
        return f"the hub answered {status}: {message}"
    kind = next((n for n in error if n.endswith("Error")), "error")
    return f"{kind}: {message}"
