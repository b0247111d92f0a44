"""Replay on a simulated cluster: a fresh simulated stack per run (cli/simstack: the cluster and the gateway in
front), its counters read before it stops, each answer's TPOT joined from the decoding engine."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvtether.cli.replay.engine import ReplayOptions, ReplayRun, TurnResult, join_engine_tpot, run_replay
from kvtether.cli.simstack import DEFAULT_PREFILL_PREFIX_CACHING, StackSpec, sim_stack
from kvtether.cli.simstack.decode_times import DecodeTimes
from kvtether.cli.streaming import loop_clock_ns, now_ns
from kvtether.sdk.sessionfile import SessionRecord

LEARNING_OFF = {"learn_estimates": False}


@dataclass(frozen=True, slots=True)
class SimTarget:
    """A simulated P/D cluster (a hardware preset and its shape) behind an in-process gateway, fresh per run."""

    preset: str
    prefill: int = 1
    decode: int = 2
    speed: float = 1.0  # simulated seconds per real second; a replay on it reports simulated time
    prefill_prefix_caching: bool = DEFAULT_PREFILL_PREFIX_CACHING
    # On one virtual clock (sim/virtual.py): the cluster, the gateway and the clients; speed 1, exact figures.
    virtual: bool = False
    # The nodes' vLLM --stream-interval (and the gateway's setting of it): a chunk every this many tokens.
    stream_interval: int = 1

    def describe(self) -> str:
        caching = "on" if self.prefill_prefix_caching else "off"
        clock = "virtual clock" if self.virtual else f"clock = real × {self.speed:g}"
        chunks = f", a chunk every {self.stream_interval} tokens" if self.stream_interval > 1 else ""
        return (
            f"simulated {self.preset}, {self.prefill} prefill + {self.decode} decode, "
            f"prefix caching on P {caching}, {clock}{chunks}"
        )

    def to_json(self) -> dict[str, Any]:
        return {"kind": "sim", **asdict(self)}

    def stack(self) -> StackSpec:
        """The simulated stack this target stands for: the stack's times (the gateway's TTLs ÷ speed) and seeds
        (calibrated on the preset), as `assess` runs it (there, too, with the estimator's learning off)."""
        return StackSpec(preset=self.preset, prefill=self.prefill, decode=self.decode, speed=self.speed,
                         prefill_prefix_caching=self.prefill_prefix_caching,
                         cluster={"stream_interval": self.stream_interval} if self.stream_interval > 1 else {})


async def replay_sim(
    sessions: Sequence[SessionRecord],
    target: SimTarget,
    policy: str,
    opts: ReplayOptions,
    on_result: Callable[[TurnResult], None] | None = None,
) -> ReplayRun:
    """Replay `sessions` on a fresh simulated stack whose gateway runs `policy`.

    Times are simulated (``opts.time_scale`` is set to the target's speed; on a virtual loop the client reads the
    loop's clock, as the stack does, and the run reports its CPU and the gateway's model); the model name
    defaults to the simulator's (it serves one). The run's ``counters`` are read before the cluster stops. Each answer's
    ``engine_tpot_ms`` is the decoding engine's own (``simstack.decode_times.DecodeTimes``), which this machine's
    load does not inflate as it does the client's.
    """
    decode_times = DecodeTimes()
    # As assess runs its options: auto decides from the seeds calibrated on the cost model, as a gateway does on a
    # cluster whose speed it has measured; learning from this process's timings would teach it the machine's load.
    async with sim_stack(target.stack(), policy, gateway=LEARNING_OFF) as stack:
        assert stack.cluster is not None
        decode_times.watch_decoding(stack.cluster)
        # In virtual time the network is in memory: no cap on sessions in flight (engine.OPEN_LOOP_CAP).
        run_opts = dataclasses.replace(opts, model=opts.model or stack.model, time_scale=target.speed,
                                       open_loop_cap=None if stack.virtual else opts.open_loop_cap)
        cpu0 = time.process_time()
        run = await run_replay(sessions, stack.url, run_opts, on_result,
                               clock_ns=loop_clock_ns() if stack.virtual else now_ns, lean_http=stack.virtual)
        run.counters = stack.counters()
        if stack.virtual:
            run.cpu_s, run.gateway_model = time.process_time() - cpu0, stack.gateway_model()
    join_engine_tpot(run.results, decode_times.tpot_by_request())
    run.engine_tpot = True
    return run
