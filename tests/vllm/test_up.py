"""`kvtether up` for real: the CLI brings up a real vLLM CPU prefill/decode pair and the gateway in front, the
cluster serves multi-turn sessions with the reverse KV pull, and Ctrl-C stops every process it started.

Marker `vllm` (opt-in, see tests/support/vllm_fixtures.py) and `vllm_first`: it runs before the shared pair of the
other real-vLLM tests is started, so two pairs never share the two cores.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from tests.support.processes import Spawn
from tests.support.vllm_fixtures import (
    TINY_MODEL,
    VLLM_PYTHON,
    _free_port_run,
    completion_mismatch,
    opted_in,
    vllm_unavailable_reason,
)

pytestmark = [pytest.mark.vllm_first, pytest.mark.timeout(600)]

KVTETHER = Path(sys.executable).with_name("kvtether")


def _read_json_line(proc: subprocess.Popen[str], timeout_s: float) -> dict[str, Any]:
    """The one JSON line `kvtether up --json` prints once everything is healthy."""
    box: dict[str, Any] = {}

    def read() -> None:
        assert proc.stdout is not None
        box["line"] = proc.stdout.readline()

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(timeout_s)
    line = box.get("line")
    if not line:
        raise AssertionError(f"kvtether up printed no JSON line within {timeout_s:.0f} s (rc {proc.poll()})")
    return dict(json.loads(line))


async def _completion_mismatch(prefill_url: str, body: dict[str, Any], out: list[int]) -> str | None:
    async with httpx.AsyncClient(timeout=180, trust_env=False) as c:
        return await completion_mismatch(c, prefill_url, body, out)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _processes_with(marker: str) -> list[int]:
    """PIDs whose command line contains `marker` (every vLLM child of this run carries its own port)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmd and int(d.name) != os.getpid():
            pids.append(int(d.name))
    return pids


def test_kvtether_up_serves_sessions_with_the_pull_and_stops_cleanly(pytestconfig: pytest.Config, spawn: Spawn,
                                                                      tmp_path: Path) -> None:
    if not opted_in(pytestconfig):
        pytest.skip("real vLLM tests are opt-in: pytest -m vllm (or KVTETHER_VLLM_TESTS=1)")
    reason = vllm_unavailable_reason()
    if reason:
        pytest.skip(reason)
    # One run of free ports for all five servers (three HTTP, two NIXL side channels): separate picks collide.
    base = _free_port_run(5)
    gw_port, vllm_port, side_port = base, base + 1, base + 3
    cmd = [str(KVTETHER), "up", "--model", str(TINY_MODEL.resolve()), "--prefill", "1", "--decode", "1",
           "--device", "cpu", "--vllm-python", str(VLLM_PYTHON), "--decode-ttl", "60", "--port", str(gw_port),
           "--vllm-base-port", str(vllm_port), "--side-channel-base-port", str(side_port), "--json",
           "--log-dir", str(tmp_path / "logs"), "--", "--max-model-len", "2048", "--max-num-seqs", "4"]
    # Its own session; on teardown the fixture kills whatever of its tree is left (vLLM's children included).
    proc = spawn(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        urls = _read_json_line(proc, 300)
        gw = f"http://127.0.0.1:{gw_port}"
        assert urls == {"gateway": gw, "prefill": [f"http://127.0.0.1:{vllm_port}"],
                        "decode": [f"http://127.0.0.1:{vllm_port + 1}"]}
        model = str(TINY_MODEL.resolve())
        with httpx.Client(timeout=180, trust_env=False) as c:
            assert c.get(f"{gw}/health").status_code == 200
            assert model in {m["id"] for m in c.get(f"{gw}/v1/models").json()["data"]}
            # A chat turn (what the README's users send first).
            r = c.post(f"{gw}/v1/chat/completions", json={
                "model": model, "max_tokens": 8, "temperature": 0,
                "messages": [{"role": "user", "content": "Say something about prefill and decode."}]})
            assert r.status_code == 200, r.text
            assert isinstance(r.json()["choices"][0]["message"]["content"], str)
            assert "kv_transfer_params" not in r.json()
            # An exact token-id session through the default policy: turn 2 reuses what D holds, by pulling it
            # back to P or by running the short suffix on D itself; either way the answer equals the reference.
            rng = random.Random(7)
            hdr = {"x-session-id": f"up-{uuid.uuid4().hex[:6]}"}
            prompt = [rng.randrange(16, 4000) for _ in range(400)]
            body = {"model": model, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
            first = c.post(f"{gw}/v1/completions", json={**body, "prompt": prompt}, headers=hdr)
            assert first.status_code == 200, first.text
            prompt = prompt + list(first.json()["choices"][0]["token_ids"]) + [rng.randrange(16, 4000)
                                                                                for _ in range(30)]
            second = c.post(f"{gw}/v1/completions", json={**body, "prompt": prompt}, headers=hdr)
            assert second.status_code == 200, second.text
            assert second.headers["x-kvtether-reuse-source"] in ("decode_pull", "decode_local")
            assert int(second.headers["x-kvtether-reuse-tokens"]) >= 256
            out = [int(t) for t in second.json()["choices"][0]["token_ids"]]
            why = anyio.run(_completion_mismatch, urls["prefill"][0], {**body, "prompt": prompt}, out)
            assert why is None, f"turn 2 differs from the reference {why}"
        assert _processes_with(f"--port {vllm_port} "), "no vLLM child found while the cluster runs"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # Ctrl-C
        rc = proc.wait(timeout=90)  # on a timeout the spawn fixture kills it, and vLLM's processes below it
        err = proc.stderr.read() if proc.stderr else ""
    assert rc in (0, 130), f"kvtether up exited {rc}: {err[-2000:]}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (
        _processes_with(f"--port {vllm_port} ") or _processes_with(f"--port {vllm_port + 1} ")
        or _listening(gw_port) or _listening(vllm_port) or _listening(vllm_port + 1)
    ):
        time.sleep(0.5)
    assert not _processes_with(f"--port {vllm_port} ") and not _processes_with(f"--port {vllm_port + 1} "), \
        "vLLM processes outlived kvtether up"
    assert not any(_listening(p) for p in (gw_port, vllm_port, vllm_port + 1)), "a port is still served"
