"""Several workers on one port (`kvtether serve --workers N`, uvicorn's supervisor): one ``/metrics`` for all of
them, and a Ctrl-C that stops them cleanly.

Metrics. Each worker would keep its own registry, and a scrape reaches whichever worker accepts the connection:
counters would jump back and forth between the workers' counts. Instead each worker writes its values to files
of its own (prometheus_client's multiprocess mode, which ``PROMETHEUS_MULTIPROC_DIR`` switches on when set
before the worker imports prometheus_client) in a directory ``run_gateway`` creates for the run and removes
after it. Whichever worker answers a scrape merges every worker's files: counters and histograms add up, over
exited workers too (so a total never goes down when uvicorn replaces a worker), and each gauge merges as its
``multiprocess_mode`` says (telemetry.py). One process (``kvtether serve`` without ``--workers``, tests, the
demo) keeps its own registry, as before.

Ctrl-C sends SIGINT to the whole process group: the supervisor, which stops every worker with SIGTERM, and each
worker. A worker still starting (unpickling its job, importing uvicorn and the app) has no handler yet and dies
of it with a KeyboardInterrupt traceback. So the workers never see SIGINT: the supervisor starts them with it
blocked (a signal mask, unlike a handler, survives fork and exec) and stops them with SIGTERM.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from multiprocessing import resource_tracker

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
# prometheus_client's files of the live gauge modes (livemostrecent, livemax, ...), one per process.
_LIVE_GAUGES = re.compile(r"gauge_live[a-z]+_(\d+)\.db")


@contextlib.contextmanager
def metrics_directory() -> Iterator[str]:
    """A new (so empty: no file of an earlier run is merged) directory for the workers' metric files, named to
    the workers they start by ``PROMETHEUS_MULTIPROC_DIR``; removed, and the variable restored, afterwards."""
    path = tempfile.mkdtemp(prefix="kvtether-metrics-")
    previous = os.environ.get(MULTIPROC_ENV)
    os.environ[MULTIPROC_ENV] = path
    try:
        yield path
    finally:
        if previous is None:
            os.environ.pop(MULTIPROC_ENV, None)
        else:
            os.environ[MULTIPROC_ENV] = previous
        shutil.rmtree(path, ignore_errors=True)


def merged_metrics(path: str) -> bytes:
    """The Prometheus text of every worker's metrics, merged (for whichever worker answers the scrape)."""
    forget_exited_workers(path)
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=path)
    return generate_latest(registry)


def forget_exited_workers(path: str) -> None:
    """Drop the live gauges of workers that are gone without saying so (killed; uvicorn starts another): the
    live modes merge running workers only. A worker that stops normally calls `worker_exited` itself."""
    with contextlib.suppress(OSError):
        pids = {int(m.group(1)) for name in os.listdir(path) if (m := _LIVE_GAUGES.fullmatch(name))}
        for pid in pids:
            if not _running(pid):
                mark_process_dead(pid, path)


def worker_exited(path: str) -> None:
    """This worker is stopping: its gauges stop counting (its counters and histograms still do)."""
    mark_process_dead(os.getpid(), path)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a process of someone else's: the pid was reused, not ours to judge
        return True
    return True


@contextlib.contextmanager
def sigint_to_supervisor_only() -> Iterator[None]:
    """While uvicorn's supervisor runs in it, every worker it starts (at start-up, or in place of one that died)
    has SIGINT blocked for its whole life; the supervisor itself still takes SIGINT, and stops them with SIGTERM.

    Workers are spawned from this (the main) thread, so its signal mask is theirs: it blocks SIGINT. A thread
    started first keeps SIGINT unblocked, so the kernel delivers the signal to that thread; Python then runs the
    handler (uvicorn's supervisor's, or KeyboardInterrupt before it is installed) in the main thread, as always.
    """
    if not hasattr(signal, "pthread_sigmask") or threading.current_thread() is not threading.main_thread():
        yield
        return
    # multiprocessing starts its resource tracker at the first spawn, blocking SIGINT around that and
    # unblocking it after (resource_tracker.ensure_running), which would undo the mask: so it is started first.
    resource_tracker.ensure_running()
    done = threading.Event()
    receiver = threading.Thread(target=done.wait, name="kvtether-sigint", daemon=True)
    receiver.start()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        done.set()
        receiver.join()
