"""The gateway process's open-file limit: raised at start to what its connections need.

A relayed stream holds two sockets, the client's and its upstream leg's, so a gateway at its upstream pool's
bound (``max_connections``) holds about twice that many, plus its own: the Redis pool, the node polls, the
guard's ``/tokenize`` calls, logs. Linux starts a process with the soft limit its parent had, often 1,024 (a shell,
a systemd service), which the default pool alone (2,048 legs and their clients) overruns: past it ``accept()`` and
``connect()`` fail with EMFILE, and turns fail as 5xx while the machine is idle. So ``kvtether serve`` raises its
soft limit, as vLLM's API server does its own (to 65,536), up to the hard limit the system allows, and says so
when even that is short. A Kubernetes container's limit is usually far above either (its runtime's default).

The decision is pure (:func:`plan`); :func:`raise_open_files_limit` applies it to this process, whose worker
processes inherit it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)

# What a gateway process opens besides its relayed streams: the Redis pool (256 connections at most,
# stores/redis.py), a poll and a health probe per node, the guard's /tokenize calls, log files.
RESERVED_FILES = 256
# The soft limit asked for when the current one is short: vLLM's own choice for its API server, far above what
# one gateway process streams, yet not the system's whole table (a hard limit of a million is common).
TARGET_FILES = 65_536


def files_needed(max_connections: int) -> int:
    """Open files a gateway process needs at its upstream pool's bound: each leg and its client, and its own."""
    return 2 * max_connections + RESERVED_FILES


@dataclass(frozen=True, slots=True)
class OpenFilesPlan:
    soft: int  # the soft limit to set (the current one when it already suffices)
    short: bool  # even so below what is needed: the hard limit is too low


def plan(soft: int, hard: int, needed: int, *, unlimited: int = -1) -> OpenFilesPlan:
    """The soft limit for a process that needs `needed` open files, under the current `soft` and `hard` limits
    (`unlimited`: the value that stands for no limit, ``resource.RLIM_INFINITY``). Never lowered; raised to
    ``max(needed, TARGET_FILES)``, no higher than the hard limit."""
    if soft == unlimited or soft >= needed:
        return OpenFilesPlan(soft, False)
    target = max(needed, TARGET_FILES)
    # Above `soft` either way: the target exceeds `needed`, which exceeds `soft`, and the hard limit is never below it.
    new = target if hard == unlimited else min(hard, target)
    return OpenFilesPlan(new, new < needed)


def raise_open_files_limit(max_connections: int) -> None:
    """Raise this process's soft limit on open files as :func:`plan` says, and log what it did; nothing where the
    platform has no such limit (no ``resource`` module)."""
    try:
        import resource
    except ImportError:  # Windows
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = files_needed(max_connections)
    p = plan(soft, hard, needed, unlimited=resource.RLIM_INFINITY)
    if p.soft != soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (p.soft, hard))
        except (ValueError, OSError) as exc:
            log.warning("open-file limit %d is below the %d that %d upstream connections and their clients need, "
                        "and raising it failed (%s): raise `ulimit -n` or lower max_connections", soft, needed,
                        max_connections, exc)
            return
        log.info("open-file limit raised from %d to %d (%d upstream connections and their clients need %d)",
                 soft, p.soft, max_connections, needed)
    if p.short:
        log.warning("open-file limit %d (the hard limit) is below the %d that %d upstream connections and their "
                    "clients need: past it connections fail; raise the hard limit (`ulimit -Hn`, systemd's "
                    "LimitNOFILE) or lower max_connections", p.soft, needed, max_connections)
