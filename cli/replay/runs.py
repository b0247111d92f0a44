"""The runs of `kvtether replay`: one per policy and rate, each on a fresh simulated cluster or against the gateway
given, with a progress bar on a terminal and, once the target answers, one note of what is replayed and how."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
from kvtether.cli.common.document import started_at
from kvtether.cli.common.exits import EXIT_FAILED, EXIT_USAGE
from kvtether.cli.common.failures import fail
from kvtether.cli.replay.engine import (
    ReplayRun,
    TurnResult,
    Unreachable,
    check_reachable,
    new_session_suffix,
    run_replay,
)
from kvtether.cli.replay.history import HISTORY_NOTES
from kvtether.cli.replay.plan import ReplayPlan
from kvtether.cli.replay.sim import replay_sim
from kvtether.cli.simstack.logs import ClusterLogs
from kvtether.sdk.sessionfile import SessionRecord
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class _Announcement:
    """Said once, before the first run (once the gateway answers): both notes change the numbers more than any
    policy does."""

    def __init__(self, err: Console, plan: ReplayPlan, sessions: Sequence[SessionRecord]) -> None:
        self.err, self.plan, self.sessions = err, plan, sessions
        self.done = plan.flags.quiet

    def __call__(self) -> None:
        if self.done:
            return
        self.done = True
        n_turns = sum(len(s.turns) for s in self.sessions)
        say = self.err.print
        say(f"replaying {len(self.sessions)} sessions, {n_turns} turns, on {self.plan.describe_target()}",
            highlight=False, soft_wrap=True)
        say(f"history: {HISTORY_NOTES[self.plan.opts.history]}", highlight=False, soft_wrap=True)
        say(f"arrivals: {self.plan.arrivals_note}", highlight=False, soft_wrap=True)


def _progress(err: Console, plan: ReplayPlan) -> Progress:
    shown = plan.flags.progress and not plan.flags.quiet and err.is_terminal
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("turns · {task.fields[errors]} errors"), TimeElapsedColumn(), console=err,
                    disable=not shown)


class _Ticker:
    """Advances one run's progress bar by a turn, counting the failed ones."""

    def __init__(self, progress: Progress, task: Any) -> None:
        self.progress, self.task, self.errors = progress, task, 0

    def __call__(self, r: TurnResult) -> None:
        self.errors += 0 if r.ok or r.skipped else 1
        self.progress.update(self.task, advance=1, errors=self.errors)


async def _run_one(plan: ReplayPlan, sessions: Sequence[SessionRecord], policy: str, tick: _Ticker,
                   announce: _Announcement) -> ReplayRun:
    gateway = plan.flags.gateway
    if gateway is not None:
        await check_reachable(gateway)
        announce()
        return await run_replay(sessions, gateway, plan.opts, tick)
    assert plan.target is not None
    announce()
    return await replay_sim(sessions, plan.target, policy, plan.opts, tick)


def _run_all(err: Console, plan: ReplayPlan, sessions: Sequence[SessionRecord]) -> list[tuple[str, ReplayRun]]:
    """Each job in an event loop of its own: on a virtual target a fresh virtual clock and network, so that a run's
    figures do not depend on the runs before it."""
    out: list[tuple[str, ReplayRun]] = []
    announce = _Announcement(err, plan, sessions)
    n_turns = sum(len(s.turns) for s in sessions)
    virtual = plan.target is not None and plan.target.virtual
    with _progress(err, plan) as progress:
        for policy, rate in plan.jobs:
            label = plan.label(policy, rate)
            description = label if plan.target is not None else plan.flags.gateway or ""
            tick = _Ticker(progress, progress.add_task(description, total=n_turns, errors=0))
            # A fresh simulated cluster per run needs no suffix to keep runs apart; a virtual run's ids stay as
            # recorded, so that two runs give the same document.
            keep = plan.flags.keep_session_ids or virtual
            plan.opts.session_suffix = "" if keep else new_session_suffix()
            plan.opts.rate = rate
            if virtual:
                from kvtether.sim.virtual import run_virtual

                run = run_virtual(_run_one, plan, sessions, policy, tick, announce)
            else:
                run = anyio.run(_run_one, plan, sessions, policy, tick, announce)
            out.append((label, run))
    return out


def run_jobs(err: Console, plan: ReplayPlan,
             sessions: Sequence[SessionRecord]) -> tuple[list[tuple[str, ReplayRun]], str]:
    """Every run of the plan, in order, as (label, run); and when they started. A target that cannot be reached
    or started fails the command (exit 1); options the engine refuses are a usage error (exit 2)."""
    engine_log = plan.flags.engine_log
    try:
        cluster_logs = ClusterLogs(engine_log)
    except OSError as e:
        fail(err, EXIT_USAGE, f"--engine-log: cannot write {engine_log} ({e})")
    started = started_at()
    try:
        with cluster_logs:
            runs = _run_all(err, plan, sessions)
    except Unreachable as e:
        fail(err, EXIT_FAILED, f"{e}; is the gateway running? (kvtether serve …)")
    except ModuleNotFoundError as e:
        fail(err, EXIT_FAILED, f"--sim needs the simulator and gateway, not available in this build ({e})")
    except ValueError as e:
        fail(err, EXIT_USAGE, str(e))
    return runs, started
