"""A throw-away Redis (or Valkey) server for the shared-store tests: its own port, its own temporary directory,
no persistence, stopped at the end. Restartable on the same port, and pausable (SIGSTOP) to play a slow store.

``scripts/test`` installs ``redis-server`` first (scripts/ensure-redis.sh); on a machine without it the tests
that need a real server are skipped with that reason.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

SKIP_REASON = "no redis-server or valkey-server on PATH (scripts/ensure-redis.sh installs it; scripts/test runs it)"


def server_binary() -> str | None:
    return shutil.which("redis-server") or shutil.which("valkey-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    def __init__(self, binary: str, workdir: Path, port: int | None = None) -> None:
        self.binary = binary
        self.workdir = workdir
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = open(self.workdir / "server.log", "ab")  # noqa: SIM115 - the child keeps it open
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir), "--daemonize", "no", "--loglevel", "warning"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + 10
        while not self.ping():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start on port {self.port}: "
                                   + (self.workdir / "server.log").read_text(errors="replace")[-500:])
            time.sleep(0.02)

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        """Stop the server (its data goes with it: no persistence)."""
        if self.proc is None:
            return
        self.resume()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def pause(self) -> None:
        """A store that does not answer: accepted connections, no replies (SIGSTOP)."""
        if self.proc is not None:
            os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)


@contextlib.contextmanager
def running_redis(workdir: Path) -> Iterator[RedisServer]:
    binary = server_binary()
    if binary is None:
        pytest.skip(SKIP_REASON)
    server = RedisServer(binary, workdir)
    server.start()
    try:
        yield server
    finally:
        server.stop()
