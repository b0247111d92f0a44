"""The exit codes of every `kvtether` command, declared once (docs/replay.md lists replay's).

A command exits with the first that applies: usage (nothing was run), failed (the run could not be done, or did
not hold up: an unreachable gateway, a port something else holds, a child that died, errors above the allowed
rate, a demo whose answers differ), SLO (replay: the run was done, an objective was missed), else ok.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_SLO = 3
