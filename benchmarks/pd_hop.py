"""The P→D hop of a turn through the gateway: from P's prompt done (engine event) to D's request in.

One session on a simulated 1P 1D GLM-5-FP8 cluster (speed 0.25), a 16k-token history plus 150-token tool results,
P/D turns only (``max_local_suffix_tokens`` 0), sequential. Prints each turn's hop in simulated ms for
``reference`` (no guard, no /tokenize) and ``auto`` (the guard's /tokenize before every prefill leg): what the
guard adds between P's answer and D's request.

    .venv/bin/python benchmarks/pd_hop.py [--turns 8]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from typing import Any

import httpx
from kvtether.cli.simstack import StackSpec, sim_stack

PRESET, SPEED = "glm-5-fp8-h200-tp8", 0.25


async def hops(policy: str, turns: int) -> list[float]:
    spec = StackSpec(preset=PRESET, prefill=1, decode=1, speed=SPEED, prefill_prefix_caching=True,
                     cluster={"kv_lease_duration": 600.0})
    events: list[tuple[str, Any]] = []
    settings = {"metrics_poll_interval_s": 1.0, "max_local_suffix_tokens": 0}
    async with sim_stack(spec, policy, gateway=settings) as stack:
        assert stack.cluster is not None
        for n in stack.cluster.nodes:
            n.engine.on_event = lambda e, role=n.cfg.role: events.append((role, e))
        url = stack.url
        async with httpx.AsyncClient(timeout=120) as client:
            messages = [{"role": "system", "content": " ".join(f"w{i}" for i in range(12000))},
                        {"role": "user", "content": "go"}]
            for t in range(turns):
                r = await client.post(url + "/v1/chat/completions", headers={"x-session-id": "hop"},
                                      json={"model": "kvtether-sim", "messages": messages, "max_tokens": 32,
                                            "min_tokens": 32, "ignore_eos": True})
                r.raise_for_status()
                answer = r.json()["choices"][0]["message"].get("content") or ""
                messages += [{"role": "assistant", "content": answer},
                             {"role": "user", "content": " ".join(f"t{t}x{i}" for i in range(150))}]
    done = [e for role, e in events if role == "prefill" and e.kind == "prompt_done"]
    arrived = [e for role, e in events if role == "decode" and e.kind == "submit"]
    out = []
    for p in done[1:]:  # turn 0 has nothing to tokenize
        later = [d.at for d in arrived if d.at >= p.at and d.prompt_tokens == p.prompt_tokens]
        if later:
            out.append((min(later) - p.at) * 1000)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=8)
    args = ap.parse_args()
    print(f"P→D hop per turn after the first, simulated ms ({PRESET}, speed {SPEED}: real ms = sim / {SPEED})")
    for policy in ("reference", "auto"):
        hs = asyncio.run(hops(policy, args.turns))
        print(f"- {policy}: median {statistics.median(hs):.2f} ms; " + ", ".join(f"{h:.1f}" for h in hs))


if __name__ == "__main__":
    main()
