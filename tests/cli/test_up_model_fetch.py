"""`kvtether up` makes the model's files local before any instance starts: a local path as it is, a hub name in the
Hugging Face cache offline, else fetched once with the vLLM environment's huggingface_hub; a name it cannot make
local stops it in one line before anything starts.

The rule (`decide`) and the cache layout are tested pure; fetches use the real huggingface_hub client against a
stand-in hub on 127.0.0.1 (tests/support/hub_server.py, through HF_ENDPOINT), never the network; `up` end to end
runs a fake vLLM package (no GPU) whose instances record what they found with HF_HUB_OFFLINE=1.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvtether.cli.common.exits import EXIT_FAILED, EXIT_USAGE
from kvtether.cli.main import app
from kvtether.cli.up import gateway_child
from kvtether.cli.up.cluster_spec import ClusterOptions
from kvtether.cli.up.hub_cache import cached_snapshot, hub_cache_dir, hub_offline, is_repo_id, missing_for
from kvtether.cli.up.hub_fetch import fetch_problem, fetch_spec
from kvtether.cli.up.launcher import plan_cluster, served_tokenizer
from kvtether.cli.up.model_files import (
    GATEWAY_TOKENIZER,
    MODEL,
    VLLM_TOKENIZER,
    ModelFilesError,
    Wanted,
    decide,
    ensure_local,
    look,
    wanted_files,
)
from typer.testing import CliRunner

from tests.support.hub_server import HubRepo, HubServer, serving_hub
from tests.support.processes import Spawn, read_line, start_with_sigint_default, wait_exit

CACHE = Path("/c/hub")
COMMIT = "a" * 40


def _model(name: str = "org/tiny", **kw: object) -> Wanted:
    return Wanted(name, "model", (MODEL,), **kw)  # type: ignore[arg-type]


# ---- the rule (pure) ---------------------------------------------------------------------------------------


def test_a_path_that_exists_is_used_as_it_is_whatever_else_holds() -> None:
    for offline in (None, "HF_HUB_OFFLINE=1"):
        step = decide(_model("org/tiny"), exists=True, snapshot=None, offline=offline, cache=CACHE)
        assert (step.action, step.path, step.problem) == ("local", "org/tiny", None)
    # vLLM streams a URI itself: nothing to fetch, nothing to refuse.
    step = decide(_model("s3://bucket/tiny"), exists=False, snapshot=None, offline="HF_HUB_OFFLINE=1", cache=CACHE)
    assert (step.action, step.path) == ("local", "s3://bucket/tiny")


def test_a_cached_hub_name_is_used_offline_and_a_missing_one_fetched() -> None:
    snap = CACHE / "models--org--tiny" / "snapshots" / COMMIT
    for offline in (None, "HF_HUB_OFFLINE=1"):
        step = decide(_model(), exists=False, snapshot=snap, offline=offline, cache=CACHE)
        assert (step.action, step.path) == ("cached", str(snap))
    step = decide(_model(), exists=False, snapshot=None, offline=None, cache=CACHE)
    assert (step.action, step.path, step.problem) == ("fetch", None, None)


def test_what_cannot_be_made_local_is_refused_in_one_line_naming_it() -> None:
    step = decide(_model(), exists=False, snapshot=None, offline="HF_HUB_OFFLINE=1", cache=CACHE)
    assert step.action == "refuse" and step.problem is not None
    assert step.problem.startswith("org/tiny (--model) is not in the Hugging Face cache /c/hub, and HF_HUB_OFFLINE=1 "
                                   "keeps kvtether up from fetching it")
    step = decide(_model("/models/tiny"), exists=False, snapshot=None, offline=None, cache=CACHE)
    assert step.action == "refuse"
    assert step.problem == ("/models/tiny (--model): no such file or directory, and not a Hugging Face model name "
                            "(ORG/NAME)")
    for step in (decide(_model(), exists=False, snapshot=None, offline="HF_HUB_OFFLINE=1", cache=CACHE),
                 decide(_model("./m"), exists=False, snapshot=None, offline=None, cache=CACHE)):
        assert step.problem is not None and "\n" not in step.problem


def test_hub_names_and_paths() -> None:
    assert all(is_repo_id(n) for n in ("Qwen/Qwen3-8B", "gpt2", "meta-llama/Llama-3.1-8B-Instruct", "a.b_c/d-e"))
    assert not any(is_repo_id(n) for n in (".cache/tiny-llama", "/m/tiny", "a/b/c", "org/-x", "a--b/c", "a/b..c",
                                           "org/x.git", "~/models/x", ""))


def test_the_cache_and_offline_are_read_as_huggingface_hub_reads_them(tmp_path: Path) -> None:
    home = str(Path.home())
    assert hub_cache_dir({}) == Path(home) / ".cache" / "huggingface" / "hub"
    assert hub_cache_dir({"XDG_CACHE_HOME": "/x"}) == Path("/x/huggingface/hub")
    assert hub_cache_dir({"XDG_CACHE_HOME": "/x", "HF_HOME": "~/hf"}) == Path(home) / "hf" / "hub"
    assert hub_cache_dir({"HF_HOME": "/h", "HUGGINGFACE_HUB_CACHE": "/legacy"}) == Path("/legacy")
    assert hub_cache_dir({"HF_HOME": "/h", "HUGGINGFACE_HUB_CACHE": "/l", "HF_HUB_CACHE": "/new"}) == Path("/new")
    assert hub_offline({}) is None
    assert hub_offline({"HF_HUB_OFFLINE": "1"}) == "HF_HUB_OFFLINE=1"
    assert hub_offline({"HF_HUB_OFFLINE": "true"}) == "HF_HUB_OFFLINE=true"
    assert hub_offline({"TRANSFORMERS_OFFLINE": "1"}) == "TRANSFORMERS_OFFLINE=1"
    # The first one set decides, as in huggingface_hub's constants.
    assert hub_offline({"HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "1"}) is None


def _snapshot(cache: Path, repo: str, files: dict[str, str], *, ref: str | None = "main") -> Path:
    folder = cache / ("models--" + repo.replace("/", "--"))
    snap = folder / "snapshots" / COMMIT
    for name, text in files.items():
        (snap / name).parent.mkdir(parents=True, exist_ok=True)
        (snap / name).write_text(text)
    if ref is not None:
        (folder / "refs").mkdir(parents=True, exist_ok=True)
        (folder / "refs" / ref).write_text(COMMIT)
    return snap


def test_a_snapshot_counts_only_when_complete_for_the_load(tmp_path: Path) -> None:
    tok = {"tokenizer.json": "{}", "tokenizer_config.json": "{}"}
    snap = _snapshot(tmp_path, "org/tok-only", {"config.json": "{}", **tok})
    # A tokenizer fetched alone (the gateway's, an earlier run) is no model: its weights are missing.
    assert cached_snapshot(tmp_path, "org/tok-only", None, "model") is None
    assert missing_for(snap, "model") == "weights (*.safetensors, *.bin, *.pt)"
    assert cached_snapshot(tmp_path, "org/tok-only", None, "tokenizer") == snap
    index = json.dumps({"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}})
    snap = _snapshot(tmp_path, "org/sharded", {"config.json": "{}", "model.safetensors.index.json": index,
                                                "model-1.safetensors": "w", **tok})
    assert cached_snapshot(tmp_path, "org/sharded", None, "model") is None  # an interrupted download
    (snap / "model-2.safetensors").symlink_to(tmp_path / "blob-never-finished")
    assert cached_snapshot(tmp_path, "org/sharded", None, "model") is None
    (snap / "model-2.safetensors").unlink()
    (snap / "model-2.safetensors").write_text("w")
    assert cached_snapshot(tmp_path, "org/sharded", None, "model") == snap
    # Revisions: a branch or tag through refs/, a commit directly; another branch is not this one.
    snap = _snapshot(tmp_path, "org/tagged", {"config.json": "{}", "model.safetensors": "w"}, ref="v1")
    assert cached_snapshot(tmp_path, "org/tagged", "v1", "model") == snap
    assert cached_snapshot(tmp_path, "org/tagged", COMMIT, "model") == snap
    assert cached_snapshot(tmp_path, "org/tagged", None, "model") is None
    assert cached_snapshot(tmp_path, "org/absent", None, "model") is None


def _opts(*extra: str, model: str = "org/tiny") -> ClusterOptions:
    return ClusterOptions(model=model, cpu_count=2, extra_vllm_args=extra)


def test_every_name_a_child_loads_is_wanted_once() -> None:
    # The default: the gateway tokenizes with the served model, whose files hold the tokenizer.
    opts = _opts()
    assert wanted_files(opts, served_tokenizer(opts)) == [Wanted("org/tiny", "model", (MODEL, GATEWAY_TOKENIZER))]
    opts = _opts("--tokenizer", "org/tok", "--revision", "v2")
    assert wanted_files(opts, served_tokenizer(opts)) == [
        Wanted("org/tiny", "model", (MODEL,), "v2"),
        # vLLM reads --tokenizer at --revision unless --tokenizer-revision says otherwise; the gateway at main.
        Wanted("org/tok", "tokenizer", (VLLM_TOKENIZER,), "v2"),
        Wanted("org/tok", "tokenizer", (GATEWAY_TOKENIZER,)),
    ]
    opts = _opts("--tokenizer=org/tok", "--tokenizer_revision", "t1")
    assert wanted_files(opts, "org/tok") == [
        _model(), Wanted("org/tok", "tokenizer", (VLLM_TOKENIZER,), "t1"),
        Wanted("org/tok", "tokenizer", (GATEWAY_TOKENIZER,))]
    # vLLM reads the weights from --download-dir, its configuration and tokenizer from the Hugging Face cache.
    opts = _opts("--download-dir", "/w")
    assert wanted_files(opts, None) == [Wanted("org/tiny", "model", (MODEL,), None, "/w"),
                                        Wanted("org/tiny", "tokenizer", (MODEL,))]
    assert wanted_files(_opts(), "") == [_model()]  # `--gateway-set tokenizer=` turns the gateway's off


def test_a_model_keeps_every_format_vllm_may_load_and_a_tokenizer_comes_without_weights() -> None:
    model = fetch_spec("org/m", kind="model", revision=None, cache_dir=None)["ignore"]
    tokenizer = fetch_spec("org/m", kind="tokenizer", revision="v1", cache_dir="/d")
    assert isinstance(model, list) and isinstance(tokenizer["ignore"], list)
    assert not {"*.safetensors", "*.bin", "*.pt", "*.json"} & set(model) and {"*.pth", "*.msgpack"} <= set(model)
    assert {"*.safetensors", "*.bin", "*.pt"} <= set(tokenizer["ignore"])
    assert (tokenizer["revision"], tokenizer["cache_dir"]) == ("v1", "/d")


def test_each_error_the_fetch_reports_is_one_line_with_the_way_out() -> None:
    def problem(error: list[str], message: str, status: int | None = None, token: bool | None = False) -> str:
        return fetch_problem(error, message, status, token, repo="org/m", revision=None, python="/v/python",
                             page="https://hub/org/m")

    assert problem(["ModuleNotFoundError", "ImportError"], "No module named 'huggingface_hub'") == (
        "/v/python cannot import huggingface_hub (No module named 'huggingface_hub'); vLLM depends on it: install "
        "it there")
    # Told apart before their bases: a gated repository's error is a RepositoryNotFoundError too.
    gated = ["GatedRepoError", "RepositoryNotFoundError", "HfHubHTTPError"]
    assert problem(gated, "401", 401, token=None).startswith("org/m is gated and it needs a token: accept its "
                                                             "conditions at https://hub/org/m")
    assert problem(["RepositoryNotFoundError", "HfHubHTTPError"], "404", 404, token=True) == (
        "no model org/m on the hub: check the name (or it is private and the token found may not read it)")
    assert problem(["HfHubHTTPError", "HTTPStatusError"], "500 Server Error", 500) == (
        "the hub answered 500: 500 Server Error")
    assert problem(["OSError", "Exception"], "No space left on device") == "OSError: No space left on device"


# ---- fetching from the stand-in hub, with the real client -------------------------------------------------


def _tokenizer_files() -> dict[str, bytes]:
    """A real (tiny) tokenizer, as `save_pretrained` writes it: what the gateway's guard loads."""
    import tempfile

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "<|im_end|>", "hello", "world", "!"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>")
    with tempfile.TemporaryDirectory() as d:
        fast.save_pretrained(d)
        return {p.name: p.read_bytes() for p in Path(d).iterdir()}


@pytest.fixture(scope="module")
def tiny_files() -> dict[str, bytes]:
    """A tiny model repository as the hub holds one: configuration, tokenizer, weights in two formats vLLM reads,
    and in two it never reads (Meta's original checkpoint, Flax)."""
    return {
        **_tokenizer_files(),
        "config.json": json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}).encode(),
        "generation_config.json": b'{"max_new_tokens": 8}',  # contents differ: a blob is fetched once
        "model.safetensors": b"w" * 256,
        "pytorch_model.bin": b"b" * 256,
        "original/params.json": b'{"dim": 8}',
        "original/consolidated.00.pth": b"o" * 256,
        "flax_model.msgpack": b"f" * 256,
        "README.md": b"# tiny",
    }


@pytest.fixture
def hub(tiny_files: dict[str, bytes]) -> Iterator[HubServer]:
    repos = {
        "org/tiny": HubRepo(tiny_files),
        "org/gated": HubRepo(tiny_files, gated_for=frozenset({"hf_good"})),
        "org/readme-only": HubRepo({"README.md": b"# nothing to serve"}),
    }
    with serving_hub(repos) as server:
        yield server


@pytest.fixture
def hub_env(tmp_path: Path, hub: HubServer) -> dict[str, str]:
    """This process's environment without the user's Hugging Face settings, with an empty cache of its own and the
    stand-in as the hub."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_"))}
    return {**env, "HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": hub.endpoint, "HF_HUB_DISABLE_TELEMETRY": "1"}


def _ensure(wanted: list[Wanted], env: dict[str, str], python: str | None = sys.executable) -> list[str]:
    logged: list[str] = []
    ensure_local(wanted, python=python, log=logged.append, env=env)
    return logged


def test_a_missing_model_is_fetched_once_then_found_in_the_cache(hub: HubServer, hub_env: dict[str, str]) -> None:
    wanted = Wanted("org/tiny", "model", (MODEL, GATEWAY_TOKENIZER))
    assert look(wanted, hub_env).action == "fetch"
    logged = _ensure([wanted], hub_env)
    # Every file but the weights no vLLM load reads.
    assert sorted(hub.downloads()) == ["README.md", "config.json", "generation_config.json", "model.safetensors",
                                       "original/params.json", "pytorch_model.bin", "tokenizer.json",
                                       "tokenizer_config.json"]
    step = look(wanted, hub_env)
    assert step.action == "cached" and step.path is not None
    assert step.path.startswith(str(Path(hub_env["HF_HOME"]) / "hub" / "models--org--tiny" / "snapshots"))
    assert logged[0] == (f"fetching org/tiny (--model and the gateway's tokenizer) from {hub.endpoint} into "
                         f"{Path(hub_env['HF_HOME']) / 'hub'} with the huggingface_hub of {sys.executable}")
    assert logged[1].startswith("fetched org/tiny (--model and the gateway's tokenizer) in ")
    assert logged[1].endswith(step.path)
    # A second `up` asks the hub nothing.
    before = len(hub.requests)
    assert _ensure([wanted], hub_env) == [f"org/tiny (--model and the gateway's tokenizer): in the Hugging Face "
                                          f"cache, used offline ({step.path})"]
    assert len(hub.requests) == before


def test_a_tokenizer_alone_comes_without_weights_and_the_gateway_loads_it_offline(
        hub: HubServer, hub_env: dict[str, str]) -> None:
    _ensure([Wanted("org/tiny", "tokenizer", (GATEWAY_TOKENIZER,))], hub_env)
    assert not [f for f in hub.downloads() if f.endswith((".safetensors", ".bin", ".pth"))]
    assert look(_model(), hub_env).action == "fetch"  # no model yet: its weights are still missing
    # The gateway child runs offline; its guard loads the tokenizer from the files up made local.
    code = ("from kvtether.gateway.guard.tokenizer import LocalTokenizer\n"
            "print(LocalTokenizer.load('org/tiny').encode_sync({'prompt': 'hello world !'}))")
    env = {**hub_env, "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[2, 3, 4]"


def test_the_gateway_child_runs_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtether.cli import serve

    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "0")  # restored after the test
    seen: list[tuple[str | None, str | None]] = []
    monkeypatch.setattr(serve, "run_gateway_until_stopped", lambda _cfg, **_kw: seen.append(
        (os.environ.get("HF_HUB_OFFLINE"), os.environ.get("TRANSFORMERS_OFFLINE"))))
    gateway_child.run_gateway_child(['{"prefill":["http://127.0.0.1:1"],"decode":["http://127.0.0.1:2"]}'])
    assert seen == [("1", "1")]


def test_a_gated_model_needs_a_token_that_may_read_it(hub: HubServer, hub_env: dict[str, str]) -> None:
    wanted = [Wanted("org/gated", "model", (MODEL,))]
    with pytest.raises(ModelFilesError) as no_token:
        _ensure(wanted, hub_env)
    assert no_token.value.exit_code == EXIT_FAILED
    assert str(no_token.value) == (
        f"cannot fetch org/gated (--model) from {hub.endpoint}: org/gated is gated and no token was found: accept "
        f"its conditions at {hub.endpoint}/org/gated, then set HF_TOKEN (or run `hf auth login`) for the user that "
        "runs kvtether up")
    assert hub.downloads() == []  # said before any download was tried
    with pytest.raises(ModelFilesError, match="org/gated is gated and the token found may not read it"):
        _ensure(wanted, {**hub_env, "HF_TOKEN": "hf_other"})
    _ensure(wanted, {**hub_env, "HF_TOKEN": "hf_good"})
    assert look(wanted[0], hub_env).action == "cached"


def test_a_hub_that_cannot_help_is_one_line_before_anything_starts(hub: HubServer, hub_env: dict[str, str]) -> None:
    cases = {
        "org/absent": "no model org/absent on the hub: check the name (set HF_TOKEN if it is private)",
        "org/readme-only": "lacks a config.json: not a model vLLM can load",
    }
    for name, expected in cases.items():
        with pytest.raises(ModelFilesError) as e:
            _ensure([_model(name)], hub_env)
        assert expected in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ModelFilesError) as e:
        _ensure([_model(revision="v9")], hub_env)
    assert "org/tiny has no revision 'v9'" in str(e.value)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(ModelFilesError) as e:
        _ensure([_model()], {**hub_env, "HF_ENDPOINT": closed})
    assert e.value.exit_code == EXIT_FAILED
    assert str(e.value).startswith(f"cannot fetch org/tiny (--model) from {closed}: the hub cannot be reached (")
    assert "docs/real-vllm.md#first-run-on-a-gpu-machine" in str(e.value)


def test_refusals_come_before_any_fetch(hub: HubServer, hub_env: dict[str, str], tmp_path: Path) -> None:
    offline = {**hub_env, "HF_HUB_OFFLINE": "1"}
    with pytest.raises(ModelFilesError) as e:
        _ensure([_model()], offline)
    assert e.value.exit_code == EXIT_USAGE
    assert str(e.value).startswith("org/tiny (--model) is not in the Hugging Face cache")
    with pytest.raises(ModelFilesError, match="no such file or directory"):
        _ensure([_model(), Wanted(str(tmp_path / "no-tokenizer"), "tokenizer", (VLLM_TOKENIZER,))], hub_env)
    assert hub.requests == []


def test_a_stand_in_python_is_not_asked_to_fetch(hub: HubServer, hub_env: dict[str, str]) -> None:
    """As preflight.py starts a vLLM python it could not ask (a wrapper, a fake), `up` says what it would fetch."""
    logged = _ensure([_model()], hub_env, python=None)
    assert logged == [f"org/tiny (--model): not in the Hugging Face cache {Path(hub_env['HF_HOME']) / 'hub'}: fetch "
                      f"the model (configuration, tokenizer, weights) from {hub.endpoint} (the vLLM python could not "
                      "be asked to): starting anyway"]
    assert hub.requests == []


# ---- the command ---------------------------------------------------------------------------------------------


def test_dry_run_shows_the_fetch_step_for_a_pair_and_a_pool(hub_env: dict[str, str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    for k in [k for k in os.environ if k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_"))]:
        monkeypatch.delenv(k)
    for k in ("HF_HOME", "HF_ENDPOINT"):
        monkeypatch.setenv(k, hub_env[k])
    cache = Path(hub_env["HF_HOME"]) / "hub"
    for counts in (["--prefill", "1", "--decode", "1"], ["--nodes", "2"]):
        r = CliRunner().invoke(app, ["up", "--model", "org/tiny", *counts, "--device", "cuda", "--vllm-python",
                                     "/v/python", "--dry-run"])
        assert r.exit_code == 0, r.output
        lines = r.stdout.splitlines()
        assert lines[1] == (f"# org/tiny (--model and the gateway's tokenizer): not in the Hugging Face cache {cache}: "
                            f"fetch the model (configuration, tokenizer, weights) from {hub_env['HF_ENDPOINT']} with "
                            "the huggingface_hub of /v/python")
        # The instances run offline all the same: they find what the step fetched.
        commands = [ln for ln in lines if "vllm.entrypoints.openai.api_server" in ln]
        assert len(commands) == 2 and all("HF_HUB_OFFLINE=1 " in ln for ln in commands)


def test_the_cpu_pair_uses_its_local_model_and_starts_offline(tmp_path: Path) -> None:
    model = tmp_path / "tiny-llama"
    model.mkdir()
    opts = ClusterOptions(model=str(model), cpu_count=2)
    (wanted,) = wanted_files(opts, served_tokenizer(opts))
    assert look(wanted, {"HF_HUB_OFFLINE": "1"}).action == "local"
    assert _ensure([wanted], {}) == [f"{model} (--model and the gateway's tokenizer): a local path, used as it is"]
    for inst in plan_cluster(opts).instances:
        assert inst.command.env["HF_HUB_OFFLINE"] == "1" and inst.command.env["TRANSFORMERS_OFFLINE"] == "1"


# A stand-in for vLLM's OpenAI server, as a package the vLLM python finds: it resolves the model by name as vLLM
# does offline (the configuration with transformers' per-file lookup, the weights with `download_weights_from_hf`'s
# snapshot_download of every format it may load), records what it found and how, and serves /health.
FAKE_API_SERVER = textwrap.dedent(
    """
    import http.server, json, os, sys
    args = sys.argv[1:]
    port, model = int(args[args.index("--port") + 1]), args[args.index("--model") + 1]
    from huggingface_hub import constants, hf_hub_download, snapshot_download
    record = {"offline": constants.HF_HUB_OFFLINE}
    try:
        config = hf_hub_download(model, "config.json")
        record["snapshot"] = snapshot_download(model, allow_patterns=["*.safetensors", "*.bin", "*.pt"],
                                               ignore_patterns=["original/**/*"], local_files_only=True)
        assert os.path.dirname(config) == record["snapshot"]
    except Exception as e:
        record["error"] = repr(e)
    with open(os.environ["FAKE_RECORD"], "a") as f:
        f.write(json.dumps(record) + "\\n")
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
    """
)


def _fake_vllm_python(tmp_path: Path) -> Path:
    pkg = tmp_path / "site" / "vllm" / "entrypoints" / "openai"
    pkg.mkdir(parents=True)
    for d in (pkg, pkg.parent, pkg.parent.parent):
        (d / "__init__.py").write_text("")
    (pkg / "api_server.py").write_text(FAKE_API_SERVER)
    python = tmp_path / "vllm-python"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={tmp_path / 'site'} exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    return python


def _free_base(offsets: tuple[int, ...]) -> int:
    """A port p with p + each offset free (for a moment)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        try:
            with contextlib.ExitStack() as stack:
                for o in offsets:
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", base + o))
            return base
        except OSError:
            continue
    raise AssertionError("no free port block")


def _up(spawn: Spawn, tmp_path: Path, env: dict[str, str], model: str) -> subprocess.Popen[str]:
    base = _free_base((0, 1, 50, 51))
    return spawn(
        [sys.executable, "-c", "from kvtether.cli.up.command import main; main()",
         "--model", model, "--device", "cuda", "--vllm-python", str(_fake_vllm_python(tmp_path)), "--no-gateway",
         "--json", "--vllm-base-port", str(base), "--side-channel-base-port", str(base + 50),
         "--log-dir", str(tmp_path / "logs")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=start_with_sigint_default,
        env={**env, "FAKE_RECORD": str(tmp_path / "record")},
    )  # fmt: skip


def test_up_fetches_once_then_its_instances_start_offline_on_the_files(
        spawn: Spawn, tmp_path: Path, hub: HubServer, hub_env: dict[str, str]) -> None:
    proc = _up(spawn, tmp_path, hub_env, "org/tiny")
    line = read_line(proc, 120)
    if not line:
        proc.wait(timeout=30)
        pytest.fail(f"kvtether up exited {proc.returncode}: {proc.stderr.read() if proc.stderr else ''}")
    assert len(json.loads(line)["prefill"]) == 1
    proc.send_signal(signal.SIGTERM)
    assert wait_exit(proc, 30) == 0
    records = [json.loads(r) for r in (tmp_path / "record").read_text().splitlines()]
    snapshot = look(_model(), hub_env).path
    assert snapshot is not None
    assert records == [{"offline": True, "snapshot": snapshot}] * 2
    assert hub.downloads().count("model.safetensors") == 1  # once, for both instances
    err = proc.stderr.read() if proc.stderr else ""
    assert f"fetching org/tiny (--model) from {hub.endpoint}" in err


def test_up_stops_in_one_line_before_any_instance_starts(spawn: Spawn, tmp_path: Path, hub: HubServer,
                                                         hub_env: dict[str, str]) -> None:
    proc = _up(spawn, tmp_path, hub_env, "org/gated")
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_FAILED
    errors = [ln for ln in err.splitlines() if ln.startswith("kvtether up: ")]
    assert errors == [f"kvtether up: cannot fetch org/gated (--model) from {hub.endpoint}: org/gated is gated and no "
                      f"token was found: accept its conditions at {hub.endpoint}/org/gated, then set HF_TOKEN (or run "
                      "`hf auth login`) for the user that runs kvtether up"]
    assert not (tmp_path / "record").exists() and not (tmp_path / "logs").exists()
