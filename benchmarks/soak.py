"""Soak: many agent sessions through one gateway process, printing its memory (RSS) as sessions come and expire.

A simulated 1P 2D cluster (`kvtether sim`, its own process) and the gateway (`kvtether serve`, its own
process, so its RSS is its own) run on this machine. `--sessions` agent sessions of `--turns` turns each run
in `--waves` waves, `--concurrency` sessions at a time; after each wave the script waits until the gateway's
sessions have expired (a short `session_ttl_s`) and swept. It prints the gateway's RSS at the start, halfway
through each wave, at its end and after its sessions expired, with the sessions held and the errors: once
sessions expire the memory must stop growing — every wave ends where the first ended.

    .venv/bin/python benchmarks/soak.py [--sessions 1000] [--turns 20] [--waves 2] [--concurrency 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

MODEL = "kvtether-sim"
SPEED = 100.0  # simulated seconds per real second: the engines' compute is not what is measured here


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def metric(client: httpx.AsyncClient, url: str, name: str) -> float:
    text = (await client.get(f"{url}/metrics")).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")
               or line.startswith(name + "{"))


async def session(client: httpx.AsyncClient, url: str, sid: str, turns: int, rng: random.Random,
                  errors: list[str], done: list[int]) -> None:
    words = [f"w{rng.randrange(5000)}" for _ in range(120)]
    messages = [{"role": "system", "content": " ".join(words)},
                {"role": "user", "content": f"task {sid}: look around"}]
    for turn in range(turns):
        body = {"model": MODEL, "messages": messages, "max_tokens": 16, "temperature": 0, "stream": turn % 2 == 0}
        try:
            if body["stream"]:
                async with client.stream("POST", f"{url}/v1/chat/completions", json=body,
                                         headers={"x-session-id": sid}) as resp:
                    text = (await resp.aread()).decode()
                    if resp.status_code != 200 or '"error"' in text:
                        raise RuntimeError(f"HTTP {resp.status_code}: {text[:200]}")
                    answer = "".join(json.loads(line[5:]).get("choices", [{}])[0].get("delta", {}).get("content") or ""
                                     for line in text.splitlines()
                                     if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"))
            else:
                resp = await client.post(f"{url}/v1/chat/completions", json=body, headers={"x-session-id": sid})
                if resp.status_code != 200:
                    raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:200]}")
                answer = resp.json()["choices"][0]["message"].get("content") or ""
        except (httpx.HTTPError, RuntimeError, ValueError) as exc:
            errors.append(f"{sid} turn {turn}: {exc}")
            return
        done[0] += 1
        messages = [*messages, {"role": "assistant", "content": answer},
                    {"role": "user", "content": " ".join(f"r{rng.randrange(5000)}" for _ in range(30))}]


def start(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log.open("wb"), start_new_session=True)


async def run(args: argparse.Namespace) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="kvtether-soak-"))
    exe = [str(Path(sys.executable).parent / "kvtether")]
    # The engines keep handles 3× the gateway's session TTL (real seconds; the sim counts simulated ones).
    sim = start([*exe, "sim", "--prefill", "1", "--decode", "2", "--speed", str(SPEED), "--json",
                 "--decode-ttl", str(3 * args.session_ttl_s * SPEED)], tmp / "sim.log")
    procs = [sim]
    try:
        assert sim.stdout is not None
        urls = json.loads(sim.stdout.readline())
        cfg = tmp / "gateway.toml"
        cfg.write_text(f"session_ttl_s = {args.session_ttl_s}\nengine_kv_ttl_s = {3 * args.session_ttl_s}\n"
                       f"sweep_interval_s = 1.0\nmetrics_poll_interval_s = 1.0\n")
        port = 18000 + os.getpid() % 1000
        gw = start([*exe, "serve", "--port", str(port), "--config", str(cfg), "--log-level", "warning",
                    *(a for u in urls["prefill"] for a in ("--prefill", u)),
                    *(a for u in urls["decode"] for a in ("--decode", u))], tmp / "gateway.log")
        procs.append(gw)
        url = f"http://127.0.0.1:{port}"
        limits = httpx.Limits(max_connections=args.concurrency * 2, keepalive_expiry=2.0)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            for _ in range(300):
                try:
                    if (await client.get(f"{url}/ready")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.1)
            rng = random.Random(args.seed)
            errors: list[str] = []
            done = [0]
            print(f"{'point':<26} {'RSS MiB':>8} {'sessions held':>14} {'turns done':>11} {'errors':>7}")

            async def report(point: str) -> None:
                held = await metric(client, url, "kvtether_pinned_sessions")
                print(f"{point:<26} {rss_mib(gw.pid):>8.1f} {held:>14.0f} {done[0]:>11} {len(errors):>7}",
                      flush=True)

            await report("start")
            per_wave = args.sessions // args.waves
            sem = asyncio.Semaphore(args.concurrency)
            started = time.perf_counter()
            for wave in range(args.waves):
                halfway = asyncio.Event()
                finished = [0]

                async def one(i: int, wave: int = wave, halfway: asyncio.Event = halfway,
                              finished: list[int] = finished) -> None:
                    async with sem:
                        await session(client, url, f"soak-{wave}-{i}", args.turns, rng, errors, done)
                    finished[0] += 1
                    if finished[0] == per_wave // 2:
                        halfway.set()

                tasks = [asyncio.create_task(one(i)) for i in range(per_wave)]
                await halfway.wait()
                await report(f"wave {wave + 1}: halfway")
                await asyncio.gather(*tasks)
                await report(f"wave {wave + 1}: end")
                await asyncio.sleep(args.session_ttl_s + 3.0)  # every session expires and is swept
                await report(f"wave {wave + 1}: sessions expired")
            took = time.perf_counter() - started
        print(f"{done[0]} turns of {args.sessions} sessions in {took:.0f} s ({done[0] / took:.0f} turns/s, "
              f"{args.concurrency} sessions at a time), {len(errors)} errors")
        for e in errors[:5]:
            print("  error:", e)
        return 0 if not errors else 1
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=1000)
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--waves", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--session-ttl-s", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    sys.exit(asyncio.run(run(ap.parse_args())))


if __name__ == "__main__":
    main()
