"""The gateway's open-file limit: `kvtether serve` started under a low soft limit raises it to what its upstream
pool and their clients need (gateway/shell/limits.py), as far as the hard limit allows, and says when that is
short."""

from __future__ import annotations

import re
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kvtether.gateway.config import GatewayConfig
from kvtether.gateway.shell.limits import RESERVED_FILES, TARGET_FILES, OpenFilesPlan, files_needed, plan

from tests.support.processes import kill_tree
from tests.support.redis_server import free_port

INF = resource.RLIM_INFINITY


def test_the_default_pool_needs_more_than_the_common_soft_limit() -> None:
    # 2,048 legs, their 2,048 clients and the process's own files: far above the 1,024 a shell or systemd starts
    # with.
    assert files_needed(GatewayConfig().max_connections) == 4096 + RESERVED_FILES > 1024


@pytest.mark.parametrize(("soft", "hard", "needed", "expected"), [
    (1024, 1_048_576, 1280, OpenFilesPlan(TARGET_FILES, False)),  # raised to vLLM's target
    (1024, 4096, 1280, OpenFilesPlan(4096, False)),  # as far as the hard limit
    (1024, 1100, 1280, OpenFilesPlan(1100, True)),  # still short: said
    (1024, 1024, 1280, OpenFilesPlan(1024, True)),
    (20_000, 1_048_576, 1280, OpenFilesPlan(20_000, False)),  # enough already: untouched
    (1024, 1_048_576, 100_000, OpenFilesPlan(100_000, False)),  # a pool above the target gets what it needs
    (INF, INF, 1280, OpenFilesPlan(INF, False)),
    (1024, INF, 1280, OpenFilesPlan(TARGET_FILES, False)),
])
def test_the_plan_raises_the_soft_limit_to_what_is_needed_and_never_lowers_it(
        soft: int, hard: int, needed: int, expected: OpenFilesPlan) -> None:
    assert plan(soft, hard, needed, unlimited=INF) == expected


def _soft_limit(pid: int) -> int:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[3])
    raise AssertionError("no open-file limit in /proc")


def _serve_under(soft: int, hard: int, log: Path, said: str) -> tuple[int, str]:
    """`kvtether serve` started with these limits (nodes that do not exist: the limit is set before any poll):
    its soft limit once it has logged a line matching `said`, and that line."""
    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    argv = [sys.executable, "-c", "from kvtether.cli.main import app; app()", "serve", "--prefill",
            "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", "--port", str(free_port()), "--log-level", "info"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=limited, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = re.search(f"^.*{said}.*$", log.read_text(errors="replace"), re.MULTILINE)
            if line:
                return _soft_limit(proc.pid), line.group(0)
            assert proc.poll() is None, log.read_text(errors="replace")
            time.sleep(0.1)
        raise AssertionError(f"serve said nothing of its open-file limit: {log.read_text(errors='replace')}")
    finally:
        kill_tree(proc)


@pytest.mark.skipif(not Path("/proc/self/limits").exists(), reason="reads the limit from /proc")
def test_serve_raises_a_low_soft_limit_to_the_hard_one(tmp_path: Path) -> None:
    soft, line = _serve_under(512, 8192, tmp_path / "serve.log", "open-file limit raised")
    assert soft == 8192
    assert "raised from 512 to 8192" in line and "need 4352" in line
    assert "WARNING" not in (tmp_path / "serve.log").read_text(errors="replace")


@pytest.mark.skipif(not Path("/proc/self/limits").exists(), reason="reads the limit from /proc")
def test_serve_says_when_the_hard_limit_is_below_what_it_needs(tmp_path: Path) -> None:
    soft, line = _serve_under(512, 1000, tmp_path / "serve.log", "the hard limit")
    assert soft == 1000
    assert "WARNING" in line and "open-file limit 1000 (the hard limit) is below the 4352" in line
