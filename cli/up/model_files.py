"""The files `kvtether up` makes local before any instance starts: the model, a separate `--tokenizer`, and the
gateway's tokenizer. Every vLLM child runs with HF_HUB_OFFLINE=1 (vllm_instance.py), and so does the gateway
child (gateway_child.py): N instances must not race one download, and a cluster must not half-start because
the hub was slow or refused. So each name is settled here first, once:

- a local directory (or file, or a URI for vLLM's streamer) is used as it is;
- a hub name whose snapshot in the Hugging Face cache is complete is used offline, without asking the hub;
- otherwise the files are fetched (hub_fetch.py), once, with the vLLM environment's own huggingface_hub;
- unless that cannot work: a path that does not exist, or the user's own HF_HUB_OFFLINE=1. Then `up` stops with
  one line naming the file, before anything starts.

`decide` is that rule, pure over what `look` finds; `ensure_local` carries it out.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from kvtether.cli.common.exits import EXIT_FAILED, EXIT_USAGE
from kvtether.cli.up.cluster_spec import ClusterOptions
from kvtether.cli.up.hub_cache import (
    DEFAULT_REVISION,
    Kind,
    cached_snapshot,
    hub_cache_dir,
    hub_endpoint,
    hub_offline,
    is_repo_id,
    missing_for,
)
from kvtether.cli.up.hub_fetch import Fetched, fetch
from kvtether.cli.up.vllm_instance import vllm_arg

MODEL = "--model"
VLLM_TOKENIZER = "--tokenizer"
GATEWAY_TOKENIZER = "the gateway's tokenizer"

Action = Literal["local", "cached", "fetch", "refuse"]


@dataclass(frozen=True)
class Wanted:
    """Files a child will load by name: a path or a hub name, as given."""

    name: str
    kind: Kind
    # Who loads them, for messages: --model, --tokenizer, the gateway's tokenizer (several when one name serves all).
    by: tuple[str, ...]
    revision: str | None = None  # a branch, tag or commit; None: the hub's default branch
    cache_dir: str | None = None  # None: the Hugging Face cache (hub_cache_dir); else vLLM's --download-dir

    @property
    def label(self) -> str:
        at = f"@{self.revision}" if self.revision and self.revision != DEFAULT_REVISION else ""
        return f"{self.name}{at} ({' and '.join(self.by)})"

    def covers(self, other: Wanted) -> bool:
        """Whether making these files local makes `other`'s local too (a model's files hold its tokenizer's)."""
        return (self.name == other.name and (self.revision or DEFAULT_REVISION) == (other.revision or DEFAULT_REVISION)
                and self.cache_dir == other.cache_dir and (self.kind == "model" or other.kind == "tokenizer"))


@dataclass(frozen=True)
class Step:
    """What `up` does about one `Wanted` before anything starts."""

    wanted: Wanted
    action: Action
    cache: Path  # the Hugging Face cache (or --download-dir) the name was looked up in
    path: str | None = None  # local: the path given; cached: the snapshot
    problem: str | None = None  # refuse: why, in one line with the way out


def wanted_files(opts: ClusterOptions, gateway_tokenizer: str | None) -> list[Wanted]:
    """What the instances and the gateway will load by name, as vLLM reads its arguments: the model at
    `--revision` (weights into `--download-dir` when given, its configuration still from the Hugging Face cache),
    `--tokenizer` at `--tokenizer-revision` (else `--revision`), and the gateway's tokenizer setting (at the default
    branch: the gateway loads it with transformers, without a revision)."""
    args = list(opts.extra_vllm_args)
    revision = vllm_arg(args, "--revision")
    download_dir = vllm_arg(args, "--download-dir")
    wanted = [Wanted(opts.model, "model", (MODEL,), revision, download_dir)]
    if download_dir is not None:
        wanted.append(Wanted(opts.model, "tokenizer", (MODEL,), revision))
    tokenizer = vllm_arg(args, "--tokenizer")
    if tokenizer is not None:
        tokenizer_revision = vllm_arg(args, "--tokenizer-revision") or revision
        wanted.append(Wanted(tokenizer, "tokenizer", (VLLM_TOKENIZER,), tokenizer_revision))
    if gateway_tokenizer:
        wanted.append(Wanted(gateway_tokenizer, "tokenizer", (GATEWAY_TOKENIZER,)))
    return _merged(wanted)


def _merged(wanted: Sequence[Wanted]) -> list[Wanted]:
    out: list[Wanted] = []
    for w in wanted:
        i = next((i for i, o in enumerate(out) if o.covers(w)), None)
        if i is None:
            out.append(w)
        elif not set(w.by) <= set(out[i].by):
            out[i] = replace(out[i], by=(*out[i].by, *(b for b in w.by if b not in out[i].by)))
    return out


def decide(wanted: Wanted, *, exists: bool, snapshot: Path | None, offline: str | None, cache: Path) -> Step:
    """The rule (pure): a path that exists (or a URI) is used as it is; a hub name with a complete snapshot is used
    offline; else fetched, unless it cannot be (not a hub name, or the user keeps huggingface_hub offline:
    `offline` is the variable that does, as `NAME=value`)."""
    if exists or "://" in wanted.name:  # a URI (s3://, gs://) is vLLM's to read (its Run:ai streamer)
        return Step(wanted, "local", cache, path=wanted.name)
    if not is_repo_id(wanted.name):
        return Step(wanted, "refuse", cache, problem=(
            f"{wanted.label}: no such file or directory, and not a Hugging Face model name (ORG/NAME)"))
    if snapshot is not None:
        return Step(wanted, "cached", cache, path=str(snapshot))
    if offline is not None:
        return Step(wanted, "refuse", cache, problem=(
            f"{wanted.label} is not in {_cache_name(wanted, cache)}, and {offline} keeps kvtether up from fetching "
            "it: unset it on a machine that can reach the hub, or copy the model's files there first "
            "(docs/real-vllm.md#first-run-on-a-gpu-machine)"))
    return Step(wanted, "fetch", cache)


def look(wanted: Wanted, env: Mapping[str, str]) -> Step:
    """`decide` over what this machine holds now."""
    cache = Path(wanted.cache_dir) if wanted.cache_dir else hub_cache_dir(env)
    exists = os.path.exists(wanted.name)
    snapshot = None if exists else cached_snapshot(cache, wanted.name, wanted.revision, wanted.kind)
    return decide(wanted, exists=exists, snapshot=snapshot, offline=hub_offline(env), cache=cache)


def describe(step: Step, *, python: str | None, endpoint: str) -> str:
    """One line for the dry-run and the log: what is used, or what will be fetched from where into where."""
    what = step.wanted.label
    if step.action == "local":
        return f"{what}: {'a URI' if '://' in step.wanted.name else 'a local path'}, used as it is"
    if step.action == "cached":
        where = "--download-dir" if step.wanted.cache_dir else "the Hugging Face cache"
        return f"{what}: in {where}, used offline ({step.path})"
    if step.action == "refuse":
        return f"{step.problem}; kvtether up stops here"
    files = "the model (configuration, tokenizer, weights)" if step.wanted.kind == "model" else "the tokenizer files"
    by = f"with the huggingface_hub of {python}" if python else "(the vLLM python could not be asked to)"
    return f"{what}: not in {_cache_name(step.wanted, step.cache)}: fetch {files} from {endpoint} {by}"


def _cache_name(wanted: Wanted, cache: Path) -> str:
    return f"--download-dir {cache}" if wanted.cache_dir else f"the Hugging Face cache {cache}"


def dry_run_files(wanted: Sequence[Wanted], *, python: str, env: Mapping[str, str] | None = None) -> str:
    """The dry-run's first block: what each name will be, as `ensure_local` would find it now."""
    env = os.environ if env is None else env
    endpoint = hub_endpoint(env)
    lines = ["# model files  (made local before any instance starts; the instances and the gateway then run offline)"]
    lines += [f"# {describe(look(w, env), python=python, endpoint=endpoint)}" for w in wanted]
    return "\n".join(lines) + "\n\n"


class ModelFilesError(Exception):
    """A file `up` cannot make local: the one-line message, and the command's exit code."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def ensure_local(
    wanted: Sequence[Wanted],
    *,
    python: str | None,
    log: Callable[[str], None],
    env: Mapping[str, str] | None = None,
) -> list[Step]:
    """Settles every name (refusals first, so that nothing is fetched for a cluster that cannot start), then
    fetches what is missing with `python` (the vLLM environment's). Raises ModelFilesError. `python` None: the
    vLLM environment's python could not be asked (a stand-in; see preflight.py): `up` says what it would have
    fetched and starts anyway, as it does when it cannot check that python."""
    env = os.environ if env is None else env
    steps = [look(w, env) for w in wanted]
    for step in steps:
        if step.problem is not None:
            raise ModelFilesError(step.problem, EXIT_USAGE)
    endpoint = hub_endpoint(env)
    done: list[Step] = []
    for step in steps:
        if step.action != "fetch":
            log(describe(step, python=python, endpoint=endpoint))
        elif python is None:
            log(f"{describe(step, python=None, endpoint=endpoint)}: starting anyway")
        else:
            step = _fetch(step, python=python, endpoint=endpoint, env=env, log=log)
        done.append(step)
    return done


def _fetch(step: Step, *, python: str, endpoint: str, env: Mapping[str, str], log: Callable[[str], None]) -> Step:
    w = step.wanted
    log(f"fetching {w.label} from {endpoint} into {step.cache} with the huggingface_hub of {python}")
    t0 = time.monotonic()
    got: Fetched = fetch(python, w.name, kind=w.kind, revision=w.revision, cache_dir=w.cache_dir, env=env)
    if got.path is None:
        raise ModelFilesError(f"cannot fetch {w.label} from {endpoint}: {got.problem}", EXIT_FAILED)
    lacks = missing_for(Path(got.path), w.kind)
    if lacks is not None:
        raise ModelFilesError(f"fetched {w.label} into {got.path}, but it lacks {lacks}: not a {w.kind} vLLM "
                              "can load", EXIT_FAILED)
    log(f"fetched {w.label} in {time.monotonic() - t0:.0f} s: {got.path}")
    return replace(step, action="cached", path=got.path)
