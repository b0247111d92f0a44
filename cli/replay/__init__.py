"""``kvtether replay``: recorded sessions replayed against a gateway or a simulated cluster, every turn timed.

As a library (docs/replay.md, *As a library*): ``run_replay`` against a running gateway, ``replay_sim`` on a fresh
simulated cluster per call, ``SessionHistory`` for one session's requests turn by turn.
"""

from kvtether.cli.replay.engine import (
    ReplayOptions,
    ReplayRun,
    ThinkTime,
    TurnResult,
    parse_think_time,
    run_replay,
)
from kvtether.cli.replay.history import SessionHistory
from kvtether.cli.replay.sim import SimTarget, replay_sim

__all__ = [
    "ReplayOptions",
    "ReplayRun",
    "SessionHistory",
    "SimTarget",
    "ThinkTime",
    "TurnResult",
    "parse_think_time",
    "replay_sim",
    "run_replay",
]
