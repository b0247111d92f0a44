"""One simulated engine on its own, as the simulator's tests drive it: a toy-preset engine with no KV transport,
a greedy request, and running requests to their finish."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from kvtether.sim.clock import SimClock
from kvtether.sim.config import NodeConfig
from kvtether.sim.engine import Engine, EngineRequest, FinishEvent, TokenEvent
from kvtether.sim.metrics import NodeMetrics
from kvtether.sim.model import GenerationSpec
from kvtether.sim.nixl import BlockData, RemoteRef
from kvtether.sim.presets import get_preset
from kvtether.sim.tokenizer import Tokenizer

TOK = Tokenizer()


class NoTransport:
    async def read(self, ref: RemoteRef, block_ids: list[int]) -> list[BlockData]:
        raise AssertionError("no remote reads expected")

    async def notify(self, ref: RemoteRef) -> None:
        return None

    async def heartbeat(self, ref: RemoteRef) -> None:
        return None

    async def aclose(self) -> None:
        return None


def make_engine(budget: int = 64, max_seqs: int = 16, capacity: int = 4096) -> Engine:
    preset = dataclasses.replace(
        get_preset("toy"), max_num_batched_tokens=budget, max_num_seqs=max_seqs, kv_capacity_tokens=capacity
    )
    cfg = NodeConfig(speed=1000.0)
    metrics = NodeMetrics(cfg.model_name, block_size=16, num_blocks=capacity // 16, engine_id=cfg.engine_id)
    return Engine(cfg, preset, TOK, NoTransport(), metrics, SimClock(cfg.speed))


def request(prompt: list[int], max_tokens: int = 8, **spec: Any) -> EngineRequest:
    return EngineRequest(
        request_id=f"r{id(prompt)}-{len(prompt)}",
        prompt_ids=prompt,
        spec=GenerationSpec(temperature=0, **spec),
        max_tokens=max_tokens,
    )


async def run(engine: Engine, *reqs: EngineRequest) -> list[tuple[list[int], FinishEvent]]:
    for r in reqs:
        engine.submit(r)
    out = []
    for r in reqs:
        ids: list[int] = []
        while True:
            ev = await asyncio.wait_for(r.events.get(), 10)
            if isinstance(ev, TokenEvent):
                ids.append(ev.token_id)
            else:
                assert isinstance(ev, FinishEvent)
                out.append((ids, ev))
                break
    return out
