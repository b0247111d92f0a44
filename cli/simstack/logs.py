"""Where the logs of an in-process simulated cluster go while ``replay --sim`` and ``assess`` run.

The simulated vLLM nodes log what vLLM logs (a hold released at its TTL, a read of blocks already freed, …) and
the gateway in front of them logs its own warnings. On a replay of a few hundred turns that is hundreds of lines,
written into the progress bar and the tables the user asked for. They go to the file ``--engine-log`` names
(``-``: stderr), from INFO up, else nowhere; errors still reach stderr either way (a failure must be seen).
"""

from __future__ import annotations

import logging
from types import TracebackType

# The simulator's loggers (kvtether.sim.engine, kvtether.sim.node) and the in-process gateway's.
CLUSTER_LOGGERS = ("kvtether.sim", "kvtether.gateway")
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
STDERR = "-"


class ClusterLogs:
    """A context manager: while it is entered, the cluster's loggers write to `target` only (a path, ``-`` for
    stderr, None for nowhere but errors to stderr); on exit they are as they were. It may be entered once per
    simulated run: the runs of one command append to one file.

    The file is truncated here, so a path that cannot be written fails before any run starts."""

    def __init__(self, target: str | None) -> None:
        self.target = target
        if target is not None and target != STDERR:
            open(target, "w", encoding="utf-8").close()  # truncated now; each run appends
        self._handlers: list[logging.Handler] = []
        self._saved: list[tuple[logging.Logger, int, bool]] = []

    def _open(self) -> list[logging.Handler]:
        """INFO and up to the file (or stderr); errors to stderr unless all of it goes there already. Created on
        entry, not at import: stderr is whatever it is while the command runs (a test runner's capture, say)."""
        out: list[logging.Handler] = []
        if self.target is not None:
            out.append(logging.StreamHandler() if self.target == STDERR
                       else logging.FileHandler(self.target, mode="a", encoding="utf-8"))
        if self.target != STDERR:
            errors = logging.StreamHandler()
            errors.setLevel(logging.ERROR)
            out.append(errors)
        for h in out:
            h.setFormatter(logging.Formatter(FORMAT))
        return out

    def __enter__(self) -> ClusterLogs:
        self._handlers = self._open()
        for name in CLUSTER_LOGGERS:
            logger = logging.getLogger(name)
            self._saved.append((logger, logger.level, logger.propagate))
            logger.propagate = False  # not to the root's handlers, nor Python's last-resort stderr handler
            for h in self._handlers:
                logger.addHandler(h)
            if self.target is not None and logger.getEffectiveLevel() > logging.INFO:
                logger.setLevel(logging.INFO)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for logger, level, propagate in self._saved:
            for h in self._handlers:
                logger.removeHandler(h)
            logger.setLevel(level)
            logger.propagate = propagate
        self._saved.clear()
        for h in self._handlers:
            h.close()  # the file's; a stream handler leaves stderr open
        self._handlers = []
