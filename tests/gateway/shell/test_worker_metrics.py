"""The workers' merged /metrics (gateway/shell/workers.py) with real worker processes writing their files: counters
add up over every worker that ever ran, a live gauge counts only workers still running, and the directory is the
run's own."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from kvtether.gateway.nodes.cluster import sample_sum
from kvtether.gateway.shell.workers import MULTIPROC_ENV, merged_metrics, metrics_directory

# A stand-in worker: the gateway's own metrics, in multiprocess mode (the variable set before the import).
WORKER = textwrap.dedent("""
    import sys
    from kvtether.gateway import telemetry as T
    m = T.Metrics()
    m.requests.labels("chat", "2xx").inc(int(sys.argv[1]))
    m.pinned_sessions.set(float(sys.argv[2]))
    m.held_kv_budget.set(0.5)
    if len(sys.argv) > 3:  # stays running until its stdin closes
        print("ready", flush=True)
        sys.stdin.read()
""")


def worker(directory: str, requests: int, pinned: int, *, stay: bool = False) -> subprocess.Popen[str]:
    argv = [sys.executable, "-c", WORKER, str(requests), str(pinned), *(["stay"] if stay else [])]
    proc = subprocess.Popen(argv, env={**os.environ, MULTIPROC_ENV: directory}, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    if stay:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    else:
        assert proc.wait(timeout=60) == 0
    return proc


def test_counters_add_up_over_workers_and_gauges_count_running_ones() -> None:
    with metrics_directory() as directory:
        assert os.environ[MULTIPROC_ENV] == directory and os.listdir(directory) == []
        running = worker(directory, 4, 2, stay=True)
        try:
            worker(directory, 3, 7)  # set its gauge last, then exited without saying so (as a killed worker)
            text = merged_metrics(directory).decode()
            assert sample_sum(text, "kvtether_requests_total", route="chat", status="2xx") == 7
            # The exited worker's sessions count is gone; the running one's is not doubled or summed.
            assert sample_sum(text, "kvtether_pinned_sessions") == 2
            assert sample_sum(text, "kvtether_held_kv_budget") == 0.5
            assert "pid=" not in text  # no per-worker series
        finally:
            assert running.stdin is not None
            running.stdin.close()
            running.wait(timeout=60)
        text = merged_metrics(directory).decode()
        assert sample_sum(text, "kvtether_requests_total", route="chat", status="2xx") == 7
        assert sample_sum(text, "kvtether_pinned_sessions") == 0
    assert MULTIPROC_ENV not in os.environ and not Path(directory).exists()
