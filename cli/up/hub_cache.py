"""The Hugging Face cache, read as huggingface_hub lays it out, without importing it: where it is, whether the
hub may be asked at all, and whether it holds a model's or a tokenizer's files complete enough to load offline.

The layout is huggingface_hub's documented one, the same in every version vLLM has used
(https://huggingface.co/docs/huggingface_hub/guides/manage-cache): `<cache>/models--ORG--NAME/refs/<branch>` holds
the commit a branch or tag pointed at when it was fetched, `snapshots/<commit>/` the files (links into `blobs/`,
which hold the bytes once a download completed). The variables are read as its `constants.py` reads them, so the
answers hold for every process started with the same environment: the vLLM instances, the gateway, the fetch.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

DEFAULT_ENDPOINT = "https://huggingface.co"
DEFAULT_REVISION = "main"
OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")

# What a load needs: "model", the configuration, weights and tokenizer (what a vLLM instance reads);
# "tokenizer", the tokenizer and its configuration alone (what the gateway's guard, or vLLM's --tokenizer, reads).
Kind = Literal["model", "tokenizer"]

# huggingface_hub's `validate_repo_id`: an optional namespace, a name; ASCII letters, digits, '-', '_', '.'.
_REPO_ID = re.compile(r"(\b[\w\-.]{1,96}\b/)?\b[\w\-.]{1,96}\b", re.ASCII)
_COMMIT = re.compile(r"[0-9a-f]{40}")
_TRUE = {"1", "ON", "YES", "TRUE"}

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
# vLLM's own checkpoint index files (sharded weights): every shard they name must be there.
_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_CONFIGS = ("config.json", "params.json")  # transformers' configuration, or Mistral's native one
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "tekken.json")


def hub_cache_dir(env: Mapping[str, str]) -> Path:
    """Where huggingface_hub keeps repositories: HF_HUB_CACHE, else HUGGINGFACE_HUB_CACHE, else HF_HOME/hub, else
    XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub."""
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or _expand("~/.cache"), "huggingface")
    hub = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or os.path.join(_expand(home), "hub")
    return Path(_expand(hub))


def _expand(path: str) -> str:
    return os.path.expandvars(os.path.expanduser(path))


def hub_offline(env: Mapping[str, str]) -> str | None:
    """The variable that keeps huggingface_hub off the network (as `NAME=value`), or None when it may go online."""
    for name in OFFLINE_VARS:
        value = env.get(name)
        if value:  # huggingface_hub reads the first one set, as `HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE`
            return f"{name}={value}" if value.upper() in _TRUE else None
    return None


def hub_endpoint(env: Mapping[str, str]) -> str:
    return (env.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def is_repo_id(name: str) -> bool:
    """Whether `name` can name a hub repository (`NAME` or `ORG/NAME`); a path such as `.cache/m` or `/m/x` cannot."""
    return (bool(_REPO_ID.fullmatch(name)) and "--" not in name and ".." not in name
            and not name.endswith(".git"))


def repo_folder(cache: Path, repo_id: str) -> Path:
    return cache / ("models--" + repo_id.replace("/", "--"))


def cached_snapshot(cache: Path, repo_id: str, revision: str | None, kind: Kind) -> Path | None:
    """The snapshot of `repo_id` at `revision` (a branch, tag or commit; None: main) in `cache`, when it holds what
    a `kind` load needs; None when it is not there, or only in part (a tokenizer fetched alone, an interrupted
    download)."""
    folder = repo_folder(cache, repo_id)
    rev = revision or DEFAULT_REVISION
    commit = rev if _COMMIT.fullmatch(rev) else _read_ref(folder / "refs" / rev)
    if commit is None:
        return None
    snapshot = folder / "snapshots" / commit
    return snapshot if missing_for(snapshot, kind) is None else None


def _read_ref(path: Path) -> str | None:
    try:
        commit = path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return commit if _COMMIT.fullmatch(commit) else None


def missing_for(folder: Path, kind: Kind) -> str | None:
    """What `folder` (a snapshot) lacks for a `kind` load, in a few words; None when nothing. A file counts when it
    can be read: a link whose blob never finished downloading does not."""
    if kind == "tokenizer":
        if any((folder / f).is_file() for f in _TOKENIZER_FILES):
            return None
        return "a tokenizer (" + ", ".join(_TOKENIZER_FILES) + ")"
    if not any((folder / f).is_file() for f in _CONFIGS):
        return "a config.json"
    for index in _INDEXES:
        if (folder / index).is_file():
            shards = _index_shards(folder / index)
            if shards is None:
                return f"a readable {index}"
            absent = sorted(s for s in shards if not (folder / s).is_file())
            if absent:
                return f"{len(absent)} of the {len(shards)} weight files {index} names ({absent[0]}, ...)"
            return None
    if any(p.is_file() for p in _top_level(folder) if p.name.endswith(WEIGHT_SUFFIXES)):
        return None
    return "weights (*.safetensors, *.bin, *.pt)"


def _index_shards(path: Path) -> set[str] | None:
    try:
        weight_map = json.loads(path.read_text())["weight_map"]
        return {str(v) for v in weight_map.values()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _top_level(folder: Path) -> list[Path]:
    try:
        return list(folder.iterdir())
    except OSError:
        return []
