"""Stop signals of the long-running commands. `kvtether serve` stops on SIGINT and SIGTERM with exit code 0, also
when it was started with SIGINT ignored (a background job of a non-interactive shell: `nohup kvtether serve ... &`,
a CI runner's step), and with several workers on Ctrl-C without a traceback; `kvtether demo`'s in-process gateway
leaves both signals to the demo.

`kvtether sim`'s are in test_sim.py, `kvtether up`'s in test_up_launcher.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from kvtether.cli.common.signals import STOP_SIGNALS
from kvtether.cli.demo.run import demo_gateway

from tests.support.processes import Spawn, descendants, start_with_sigint_default, start_with_sigint_ignored, wait_exit


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_serve(spawn: Spawn, *, sigint_ignored: bool) -> tuple[subprocess.Popen[str], str]:
    """`kvtether serve` in front of a node nobody listens on (it serves /health all the same), once healthy."""
    port = _free_port()
    argv = [sys.executable, "-c", "from kvtether.cli.main import app; app()", "serve", "--aggregated",
            f"http://127.0.0.1:{_free_port()}", "--port", str(port), "--log-level", "warning"]
    preexec = start_with_sigint_ignored if sigint_ignored else start_with_sigint_default
    proc: subprocess.Popen[str] = spawn(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, preexec_fn=preexec)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            pytest.fail(f"kvtether serve exited {proc.returncode}: {proc.stderr.read() if proc.stderr else ''}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", trust_env=False, timeout=2).status_code == 200:
                return proc, url
        assert time.monotonic() < deadline, "kvtether serve not healthy within 60 s"
        time.sleep(0.1)


@pytest.mark.parametrize("sigint_ignored", [False, True], ids=["from-a-terminal", "as-a-background-job"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_serve_stops_on_signal_with_exit_code_0(spawn: Spawn, sig: signal.Signals, sigint_ignored: bool) -> None:
    proc, url = _start_serve(spawn, sigint_ignored=sigint_ignored)
    proc.send_signal(sig)
    rc = wait_exit(proc, 15)
    assert rc is not None, f"kvtether serve still runs 15 s after {sig.name}"
    err = proc.stderr.read() if proc.stderr else ""
    # uvicorn stops gracefully, then raises the signal again: that must end as a normal stop, not a
    # KeyboardInterrupt ("Aborted!", exit 1) or SIGTERM's default action (killed, exit -15).
    assert rc == 0, err
    assert "Traceback" not in err and "Aborted" not in err, err
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", trust_env=False)


@pytest.mark.parametrize("when", ["while-the-workers-start", "while-serving"])
def test_serve_workers_stop_on_ctrl_c_without_a_traceback(spawn: Spawn, when: str) -> None:
    """Ctrl-C signals the whole process group: uvicorn's supervisor and every worker. The supervisor stops the
    workers; none dies of the SIGINT with a KeyboardInterrupt traceback, not even one still importing."""
    port = _free_port()
    # A store nobody listens on: the workers start all the same (a turn would run cold without it).
    argv = [sys.executable, "-c", "from kvtether.cli.main import app; app()", "serve", "--aggregated",
            f"http://127.0.0.1:{_free_port()}", "--port", str(port), "--workers", "2", "--store",
            f"redis://127.0.0.1:{_free_port()}/0", "--log-level", "warning"]
    proc: subprocess.Popen[str] = spawn(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, preexec_fn=start_with_sigint_default)
    if when == "while-the-workers-start":
        # Python is up in both (its SIGINT handler is in) and they are importing uvicorn and the app.
        _until(lambda: [_catches_sigint(w) for w in _workers(proc.pid)] == [True, True], proc, "two workers started")
    else:
        # Serving: each worker has built its app (and written its metric files), and one answers /health.
        _until(lambda: len(_metric_pids(proc.pid)) == 2 and _healthy(port), proc, "two workers serving")
    metrics_dir = _metrics_dir(proc.pid)
    os.killpg(proc.pid, signal.SIGINT)
    rc = wait_exit(proc, 30)
    assert rc is not None, "kvtether serve --workers 2 still runs 30 s after Ctrl-C"
    err = proc.stderr.read() if proc.stderr else ""
    assert rc == 0, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert not descendants(proc.pid), "workers left behind"
    assert metrics_dir is not None and not metrics_dir.exists(), metrics_dir


def _until(ready: Callable[[], bool], proc: subprocess.Popen[str], what: str) -> None:
    deadline = time.monotonic() + 60
    while not ready():
        if proc.poll() is not None:
            pytest.fail(f"kvtether serve exited {proc.returncode}: {proc.stderr.read() if proc.stderr else ''}")
        assert time.monotonic() < deadline, f"not within 60 s: {what}"
        time.sleep(0.01)


def _workers(supervisor: int) -> list[int]:
    """uvicorn's worker processes (multiprocessing's spawn; not its resource tracker)."""
    return [pid for pid in descendants(supervisor) if b"spawn_main" in _read(f"/proc/{pid}/cmdline")]


def _catches_sigint(pid: int) -> bool:
    """The process has a handler for SIGINT (Python installs its own when the interpreter starts)."""
    for line in _read(f"/proc/{pid}/status").decode().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGINT - 1)))
    return False


def _metrics_dir(supervisor: int) -> Path | None:
    for pid in _workers(supervisor):
        for item in _read(f"/proc/{pid}/environ").split(b"\0"):
            if item.startswith(b"PROMETHEUS_MULTIPROC_DIR="):
                return Path(item.split(b"=", 1)[1].decode())
    return None


def _metric_pids(supervisor: int) -> set[str]:
    path = _metrics_dir(supervisor)
    return {f.stem.rsplit("_", 1)[1] for f in path.glob("counter_*.db")} if path is not None else set()


def _healthy(port: int) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(f"http://127.0.0.1:{port}/health", trust_env=False, timeout=2).status_code == 200
    return False


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError:
        return b""


def _stop_handlers() -> dict[int, object]:
    return {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}


@pytest.mark.anyio
async def test_demo_gateway_leaves_the_stop_signals_to_the_demo() -> None:
    """uvicorn takes SIGINT and SIGTERM for the server it runs; the demo's gateway gives them back, or Ctrl-C
    would stop only the gateway and the demo would carry on against it."""
    before = _stop_handlers()
    async with demo_gateway("pull", 1.0, "toy") as url:
        assert _stop_handlers() == before
        async with httpx.AsyncClient(trust_env=False) as client:
            assert (await client.get(f"{url}/health")).status_code == 200
    assert _stop_handlers() == before
