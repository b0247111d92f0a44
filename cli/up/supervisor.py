"""The processes of `kvtether up`: every child in its own process group (vLLM's engine-core processes
included), one log file per child, and every group stopped (SIGTERM, then SIGKILL) together.

How every long-running command takes its stop signals is common/signals.py's."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx
from kvtether.cli.common.signals import STOP_SIGNALS
from kvtether.cli.up.cluster_spec import ChildCommand


class ChildDied(RuntimeError):
    def __init__(self, name: str, returncode: int | None, log_path: Path | None, what: str | None = None) -> None:
        what = what or f"exited with code {returncode}"
        super().__init__(f"{name} {what}" + (f" (log: {log_path})" if log_path else ""))
        self.name = name
        self.returncode = returncode
        self.log_path = log_path


class ChildStuck(ChildDied):
    """A child that logged a failure it does not exit on: vLLM's API server stays up, never healthy, when a
    worker cannot bind its NIXL side-channel port."""

    def __init__(self, name: str, line: str, log_path: Path | None) -> None:
        super().__init__(name, None, log_path, f"cannot start: {line}")
        self.line = line


# Log lines after which a starting child never becomes healthy, though it keeps running.
STUCK_MARKERS = ("Address already in use",)


@dataclass
class Child:
    command: ChildCommand
    proc: subprocess.Popen[bytes]
    log_path: Path | None
    log_file: IO[bytes] | None = None
    log_scanned: int = 0  # bytes of the log already searched for STUCK_MARKERS

    def stuck_line(self) -> str | None:
        """The first new log line with a STUCK_MARKERS entry, reading only what was written since last asked."""
        if self.log_path is None:
            return None
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self.log_scanned)
                chunk = f.read()
        except OSError:
            return None
        # Only whole lines: a marker split across two reads is found on the next.
        end = chunk.rfind(b"\n") + 1
        self.log_scanned += end
        for line in chunk[:end].decode(errors="replace").splitlines():
            if any(m in line for m in STUCK_MARKERS):
                return line.strip()
        return None

    @property
    def name(self) -> str:
        return self.command.name

    def alive(self) -> bool:
        return self.proc.poll() is None


def tail(path: Path | None, n: int = 30) -> str:
    if path is None or not path.exists():
        return ""
    with contextlib.suppress(OSError):
        lines = path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])
    return ""


@dataclass
class Supervisor:
    """Starts children in their own process groups and stops them all, children of children included."""

    log_dir: Path | None = None
    log: Callable[[str], None] = lambda _msg: None
    children: list[Child] = field(default_factory=list)
    stop_timeout_s: float = 20.0

    def start(self, cmd: ChildCommand) -> Child:
        env = {**os.environ, **cmd.env}
        log_path: Path | None = None
        out: IO[bytes] | int = subprocess.DEVNULL
        log_file: IO[bytes] | None = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log_path = self.log_dir / f"{cmd.name}.log"
            log_file = open(log_path, "ab")  # noqa: SIM115 - closed in stop_all
            out = log_file
        proc = subprocess.Popen(
            list(cmd.argv),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: killpg reaches vLLM's engine-core children too
            preexec_fn=_die_with_parent,
        )
        child = Child(command=cmd, proc=proc, log_path=log_path, log_file=log_file)
        self.children.append(child)
        self.log(f"started {cmd.name} (pid {proc.pid})" + (f", log {log_path}" if log_path else ""))
        return child

    def check(self) -> None:
        """Raise ChildDied when any child has exited."""
        for c in self.children:
            rc = c.proc.poll()
            if rc is not None:
                raise ChildDied(c.name, rc, c.log_path)

    def wait_healthy(self, child: Child, timeout_s: float = 300.0, interval_s: float = 0.5) -> float:
        """Poll the child's health URL until 200; raise ChildDied if any child exits, ChildStuck when one logs a
        failure it stays up through (a port taken), TimeoutError on timeout."""
        assert child.command.url is not None
        url = child.command.url + child.command.health_path
        t0 = time.monotonic()
        with httpx.Client(timeout=5.0, trust_env=False) as client:
            while True:
                self.check()
                for c in self.children:
                    line = c.stuck_line()
                    if line is not None:
                        raise ChildStuck(c.name, line, c.log_path)
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(url).status_code == 200:
                        return time.monotonic() - t0
                if time.monotonic() - t0 > timeout_s:
                    raise TimeoutError(f"{child.name} not healthy at {url} after {timeout_s:.0f} s")
                time.sleep(interval_s)

    def stop_all(self) -> None:
        """SIGTERM every process group (newest first), wait, then SIGKILL what is left. Idempotent.

        A stop signal that arrives meanwhile (a second Ctrl-C) does not interrupt it, which would leave process
        groups behind: it cuts the wait short and goes straight to SIGKILL."""
        with _stop_signals_hurry() as hurried:
            for c in reversed(self.children):
                _signal_group(c.proc, signal.SIGTERM)
            deadline = time.monotonic() + self.stop_timeout_s
            for c in reversed(self.children):
                while c.proc.poll() is None and not hurried.is_set() and time.monotonic() < deadline:
                    time.sleep(0.05)
            if hurried.is_set() and any(c.alive() for c in self.children):
                self.log("stop signal while stopping: killing what is left")
            for c in self.children:
                # The leader may be gone while its group (engine core, NIXL workers) lingers: kill the group anyway.
                _signal_group(c.proc, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    c.proc.wait(timeout=5)
                if c.log_file is not None:
                    c.log_file.close()
                    c.log_file = None
            if self.children:
                self.log("stopped " + ", ".join(c.name for c in self.children))
            self.children.clear()


@contextlib.contextmanager
def _stop_signals_hurry() -> Iterator[threading.Event]:
    """While the context runs, a stop signal (or SIGHUP) sets the yielded event instead of running its handler
    (which may raise, or end the process); the handlers are restored after. Handlers set to SIG_IGN, or not set
    from Python, are left alone, and so is everything outside the main thread."""
    hurried = threading.Event()
    previous: dict[signal.Signals, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (*STOP_SIGNALS, signal.SIGHUP):
            handler = signal.getsignal(sig)
            if handler is None or handler == signal.SIG_IGN:
                continue
            previous[sig] = handler
            signal.signal(sig, lambda _sig, _frame: hurried.set())
    try:
        yield hurried
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the supervisor dies, even by SIGKILL (Linux; best effort)."""
    with contextlib.suppress(Exception):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)
