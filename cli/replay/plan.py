"""What `kvtether replay` was asked (``ReplayFlags``, the command line as given) and what it will run
(``ReplayPlan``, once the flags are checked: the target, the replay options, one job per policy and rate)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvtether.cli.replay.engine import ReplayOptions
from kvtether.cli.replay.report import Objectives, Slo
from kvtether.cli.replay.sim import SimTarget
from kvtether.gateway.config import POLICIES

# The gateway's policies; the three compared by default: no reverse pull, the reference proxy's behaviour, and
# kvtether's own choice.
KNOWN_POLICIES: tuple[str, ...] = POLICIES
DEFAULT_COMPARE: tuple[str, ...] = ("no-pull", "reference", "auto")


@dataclass(frozen=True, slots=True)
class ReplayFlags:
    """The command line as given: one field per parameter of the command, of the same name."""

    file: str
    policies_given: list[str] | None
    gateway: str | None
    sim: str | None
    compare: bool
    policy: str
    prefill: int
    decode: int
    speed: float
    virtual: bool
    stream_interval: int
    input_format: str
    concurrency: int
    arrivals: str
    rate: float
    objective: list[str] | None
    goodput_rates: str | None
    think_time: str
    max_think_ms: float | None
    history: str
    prefill_prefix_caching: bool
    model: str | None
    limit: int | None
    timeout: float
    slo: list[str] | None
    max_error_rate: float
    keep_session_ids: bool
    as_json: bool
    progress: bool
    quiet: bool
    engine_log: str | None


@dataclass(frozen=True, slots=True)
class ReplayPlan:
    """What the checked flags ask for. ``opts`` is shared by the runs: each sets its own rate and session suffix."""

    flags: ReplayFlags
    path: Path
    target: SimTarget | None  # None: the gateway at flags.gateway
    opts: ReplayOptions
    policies: list[str]  # the policies run (one without --compare)
    rates: list[float] | None  # --goodput's rate multipliers
    objectives: Objectives
    slos: list[Slo]

    @property
    def open_loop(self) -> bool:
        return self.opts.arrivals == "trace"

    @property
    def jobs(self) -> list[tuple[str, float]]:
        """One run per policy, or per policy and rate multiplier for --goodput."""
        return [(p, r) for p in self.policies for r in (self.rates or [self.flags.rate])]

    def label(self, policy: str, rate: float) -> str:
        return f"{policy} ×{rate:g}" if self.rates is not None else policy

    @property
    def time_note(self) -> str:
        if self.target is None:
            return "real time"
        if self.target.virtual:
            return "virtual time: exact, the gateway's CPU modelled"
        return f"simulated time = real × {self.flags.speed:g}"

    @property
    def arrivals_note(self) -> str:
        if not self.open_loop:
            return f"closed loop, {self.flags.concurrency} sessions at a time"
        divided = (f"÷ {', '.join(f'{r:g}' for r in self.rates)} (one run per rate)" if self.rates is not None
                   else f"÷ {self.flags.rate:g}")
        return "open loop: each session starts at its start_offset_ms " + divided

    def describe_target(self) -> str:
        return self.target.describe() if self.target is not None else f"the gateway at {self.flags.gateway}"
