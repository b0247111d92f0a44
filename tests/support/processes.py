"""Processes the tests start: each in a process group of its own, and none left behind.

`spawn` (the conftest fixture of the same name) starts a command in a new session; on teardown `kill_tree`
SIGKILLs its process group and every process descended from it, also those that moved to groups of their own
(`kvtether up` starts each child in one). A test that stops its process itself (and checks how it stopped)
does so first; the teardown then finds nothing left, or whatever that stop missed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

Spawn = Callable[..., "subprocess.Popen[Any]"]


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process visible in /proc (empty where there is no /proc)."""
    out: dict[int, int] = {}
    for d in Path("/proc").glob("[0-9]*"):
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after its last ")".
        fields = stat[stat.rfind(")") + 2 :].split()
        with contextlib.suppress(IndexError, ValueError):
            out[int(d.name)] = int(fields[1])
    return out


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (children, their children, ...), whatever their process group."""
    children: dict[int, list[int]] = {}
    for child, parent in _parents().items():
        children.setdefault(parent, []).append(child)
    out: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_tree(proc: subprocess.Popen[Any], timeout_s: float = 10.0) -> None:
    """SIGKILL `proc`, its process group, and every descendant and the groups they lead; then reap `proc`.

    Never signals this process or its own group. Safe to call on a process that has already exited."""
    own_group = os.getpgid(0)
    pids = [proc.pid, *descendants(proc.pid)] if proc.poll() is None else []
    groups = {proc.pid}  # spawned with a session of its own, so it leads its group
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            groups.add(os.getpgid(pid))
    groups.discard(own_group)
    for group in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGKILL)
    for pid in pids:
        if pid != os.getpid():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=timeout_s)
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()


@contextlib.contextmanager
def spawned() -> Iterator[Spawn]:
    """Yields `start(argv, **popen_kwargs)`, a Popen in a new session; everything started is killed on exit."""
    started: list[subprocess.Popen[Any]] = []

    def start(argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        kwargs.setdefault("start_new_session", True)
        proc: subprocess.Popen[Any] = subprocess.Popen(list(argv), **kwargs)
        started.append(proc)
        return proc

    try:
        yield start
    finally:
        for proc in reversed(started):
            kill_tree(proc)


def start_with_sigint_ignored() -> None:
    """A Popen `preexec_fn`: the child starts with SIGINT ignored, as a background job of a non-interactive
    shell does (`cmd &` in a script, nohup, many CI runners)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def start_with_sigint_default() -> None:
    """A Popen `preexec_fn`: the child starts with SIGINT's default action, as from an interactive shell, even
    when the tests themselves run with it ignored (which children would inherit)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def read_line(proc: subprocess.Popen[str], timeout_s: float) -> str:
    """The next line `proc` writes on stdout ("" at EOF), or AssertionError after `timeout_s` without one."""
    box: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        box.append(proc.stdout.readline())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not box:
        raise AssertionError(f"no line on stdout within {timeout_s:.0f} s (exit code {proc.poll()})")
    return box[0]


def wait_exit(proc: subprocess.Popen[Any], timeout_s: float) -> int | None:
    """The exit code once `proc` has exited within `timeout_s`, else None (it is still running)."""
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return proc.poll()
