"""Can a command listen where it was told to: the check every server command makes before it starts anything.

Each describes a problem in a few words for the command's one-line message, which adds the fix in terms of its
own flags. A failure found here costs the user a second; the same failure after start-up costs a banner that
lies, or a half-started cluster.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Sequence

IN_USE = "already in use"
NOT_LOCAL = "not an address of this machine"
PRIVILEGED = "needs privileges (ports below 1024)"


def listen_problem(host: str, port: int) -> str | None:
    """Why a server could not listen on `host:port` (None when it can), found by binding a socket there as the
    servers do (SO_REUSEADDR: a port left in TIME_WAIT by a server that just stopped is free to them)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except OSError as e:
        return describe_bind_error(e)
    except OverflowError:
        return "not a port (0-65535)"
    return None


def describe_bind_error(e: OSError) -> str:
    """The common bind failures in words (the errno text alone names neither the address nor the cause)."""
    if isinstance(e, socket.gaierror):
        return f"unknown host ({e.strerror or e})"
    if e.errno == errno.EADDRINUSE:
        return IN_USE
    if e.errno == errno.EADDRNOTAVAIL:
        return NOT_LOCAL
    if e.errno == errno.EACCES:
        return PRIVILEGED
    return e.strerror or str(e)


def listen_fix(problem: str, *, port_flag: str = "--port", host_flag: str = "--host") -> str:
    """What to do about a `listen_problem`, in terms of the command's own flags."""
    if problem == IN_USE:
        return f"stop what listens there or pass another {port_flag}"
    if problem == PRIVILEGED:
        return f"pass a {port_flag} of 1024 or more"
    if problem == NOT_LOCAL or problem.startswith("unknown host"):
        return f"check {host_flag}"
    return f"check {host_flag} and {port_flag}"


def busy_ports(host: str, ports: Sequence[int]) -> list[tuple[int, str]]:
    """(port, problem) for each of `ports` a server could not listen on; port 0 (any free port) never fails."""
    out = []
    for port in ports:
        if port:
            problem = listen_problem(host, port)
            if problem is not None:
                out.append((port, problem))
    return out
