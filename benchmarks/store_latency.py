"""What the shared (Redis/Valkey) session store costs: its added latency per turn against the memory store, its size
per session, and the gateway's aggregate throughput with one and with two worker processes sharing it.

1. **Store time per turn.** The store calls one gateway turn makes, in its order (``get`` when the turn is
   identified, ``take_handle``, then ``get``, ``put`` and ``count`` when it is remembered), timed end to end per
   turn, on the memory store and on Redis behind the fail-safe wrapper the gateway uses. Sessions carry an
   ``--tokens``-token history: a held sequence and a cached one (the ``auto`` policy keeps both), a vLLM handle
   with one block id per block.
2. **Size.** Keys and server memory per session (``INFO memory`` before and after ``--sessions`` of them).
3. **Throughput.** ``kvtether serve --workers 1`` and ``--workers 2`` on the Redis store, in front of a simulated
   1P 1D cluster (``kvtether sim``, its own process), each driven for ``--seconds`` by ``--concurrency``
   sessions of short turns in a closed loop; completed turns per second.

Starts its own ``redis-server`` (``scripts/ensure-redis.sh`` installs it) on a free port and stops everything
it started. Everything shares this machine's cores, the load generator and the simulator included.

    .venv/bin/python benchmarks/store_latency.py [--turns 2000] [--tokens 8192] [--seconds 12]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import redis.asyncio as aioredis
from kvtether.gateway.guard.verify import HeldSequence
from kvtether.gateway.stores import FailSafeStore, MemorySessionStore
from kvtether.gateway.stores.redis import RedisSessionStore, connect
from kvtether.gateway.stores.sessions import SessionState, SessionStore

CLI = [sys.executable, "-c", "from kvtether.cli.main import app; app()"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    binary = shutil.which("redis-server") or shutil.which("valkey-server")
    if binary is None:
        raise SystemExit("no redis-server or valkey-server on PATH: run scripts/ensure-redis.sh first")
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="kvtether-bench-redis-") as tmp:
        proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                                 "no", "--dir", tmp], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            for _ in range(200):
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
                time.sleep(0.02)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.terminate()
            proc.wait(timeout=10)


# ---- 1. store time per turn ------------------------------------------------------------------------------


def session_state(sid: str, tokens: int, now: float) -> SessionState:
    """A session as the gateway stores it after a turn of a ``tokens``-token history (block size 16)."""
    seed = zlib.crc32(sid.encode())
    history = [(i * 7919 + seed) % 151_000 for i in range(tokens)]
    handle = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": "0f3c9a7e-decode",
              "remote_request_id": f"chatcmpl-{sid}", "remote_host": "10.0.0.12", "remote_port": 5601,
              "remote_block_ids": [list(range(1000, 1000 + tokens // 16 + 1))], "remote_num_tokens": tokens - 1,
              "remote_blocks_expiry_time": 1234.5, "tp_size": 1, "dcp_size": 1, "pp_size": 1,
              "transfer_mode": "pull"}
    return SessionState(sid, decode="http://10.0.0.12:8000", handle=handle,
                        held=HeldSequence.from_tokens(history[: tokens - 1], 16), handle_at=now,
                        expires_at=now + 450.0, turns=12, created_at=now - 60.0, prefix_key=f"pk-{sid}",
                        cached=HeldSequence.from_tokens(history, 16), last_tokens=tokens,
                        last_prefill="http://10.0.0.11:8000", avg_output_tokens=180.0, avg_suffix_tokens=320.0)


async def turn_times(store: SessionStore, versions: list[list[SessionState]],
                     turns: int) -> tuple[list[float], dict[str, list[float]]]:
    """Seconds of store calls per turn, a turn being the gateway's sequence of calls for one session, and each
    call's seconds. Each session alternates between two histories, so that no turn reads chains a recent turn
    already decoded."""
    states = versions[0]
    for s in states:
        await store.put(s)
    per_turn: list[float] = []
    calls: dict[str, list[float]] = {name: [] for name in CALLS}
    for i in range(turns):
        state = versions[(i // len(states)) % len(versions)][i % len(states)]
        sid = state.session_id
        fresh = state.with_(expires_at=time.monotonic() + 450.0, handle_at=time.monotonic())
        steps = (store.get(sid), store.take_handle(sid), store.get(sid), store.put(fresh), store.count())
        total = 0.0
        for name, step in zip(CALLS, steps, strict=True):
            t0 = time.perf_counter()
            await step
            took = time.perf_counter() - t0
            calls[name].append(took)
            total += took
        per_turn.append(total)
    return per_turn, calls


# The calls of one turn, in the gateway's order: identify (get), gather (take_handle), remember (get, put, count).
CALLS = ("get", "take_handle", "get again", "put", "count")


def pct(xs: list[float], q: int) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if q < 100 else max(xs)


async def latency(url: str, turns: int, tokens: int, sessions: int) -> None:
    now = time.monotonic()
    versions = [[session_state(f"tenant/bench-{i}", tokens + v * 64, now) for i in range(sessions)] for v in (0, 1)]
    memory, _ = await turn_times(MemorySessionStore(), versions, turns)
    inner = RedisSessionStore(connect(url, timeout_s=0.1), key_prefix="bench", handle_ttl_s=450.0)
    shared = FailSafeStore(inner, timeout_s=0.1)
    await turn_times(shared, versions, min(200, turns))  # warm the connection and the scripts
    redis_times, calls = await turn_times(shared, versions, turns)
    await shared.aclose()
    print(f"1. store time per turn ({turns} turns, {sessions} sessions of {tokens} tokens; "
          "get, take_handle, get, put, count)")
    print(f"   {'store':<8}{'p50 ms':>10}{'p99 ms':>10}")
    for name, xs in (("memory", memory), ("redis", redis_times)):
        print(f"   {name:<8}{pct(xs, 50) * 1e3:>10.3f}{pct(xs, 99) * 1e3:>10.3f}")
    print(f"   added by redis: p50 {(pct(redis_times, 50) - pct(memory, 50)) * 1e3:.3f} ms, "
          f"p99 {(pct(redis_times, 99) - pct(memory, 99)) * 1e3:.3f} ms per turn")
    print("   redis, p50 per call: " + ", ".join(f"{n} {pct(xs, 50) * 1e3:.3f}" for n, xs in calls.items()) + " ms")


# ---- 2. size per session -------------------------------------------------------------------------------


async def size(url: str, tokens: int, sessions: int) -> None:
    client = aioredis.Redis.from_url(url)
    await client.flushdb()
    before = int((await client.info("memory"))["used_memory"])
    store = RedisSessionStore(connect(url, timeout_s=1.0), key_prefix="size", handle_ttl_s=450.0)
    now = time.monotonic()
    for i in range(sessions):
        await store.put(session_state(f"tenant/size-{i}", tokens, now))
    after = int((await client.info("memory"))["used_memory"])
    keys = int(await client.dbsize())
    one = session_state("tenant/size-0", tokens, now)
    pull = one.with_(cached=None)  # the pull policy keeps no cached sequence
    await store.put(pull.with_(session_id="tenant/pull"))
    rec = await client.hget("size:s:tenant/size-0", "rec")
    handle = await client.get("size:h:tenant/size-0")
    pull_rec = await client.hget("size:s:tenant/pull", "rec")
    print(f"2. size ({sessions} sessions of {tokens} tokens, policy auto: held + cached sequence)")
    print(f"   keys per session {(keys - 1) / sessions:.1f} (+1 index for all); server memory per session "
          f"{(after - before) / sessions / 1024:.1f} KiB; records: session {len(rec or b'')} B "
          f"(pull policy: {len(pull_rec or b'')} B), handle {len(handle or b'')} B")
    await store.aclose()
    await client.flushdb()
    await client.aclose()


# ---- 3. throughput with 1 and 2 workers ----------------------------------------------------------------


def _spawn(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:  # its own process group: a stop reaches uvicorn's workers too
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


@contextlib.asynccontextmanager
async def child(argv: list[str], log: Path) -> AsyncIterator[subprocess.Popen[bytes]]:
    proc = _spawn(argv, log)
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextlib.asynccontextmanager
async def sim_nodes(tmp: Path) -> AsyncIterator[dict[str, list[str]]]:
    """A simulated 1P 1D cluster in a process of its own; yields its node URLs."""
    out = tmp / "sim.log"
    async with child([*CLI, "sim", "--prefill", "1", "--decode", "1", "--speed", "1000", "--json"], out):
        for _ in range(600):
            lines = [ln for ln in (out.read_text() if out.exists() else "").splitlines() if ln.startswith("{")]
            if lines:
                yield json.loads(lines[0])
                return
            await asyncio.sleep(0.05)
        raise RuntimeError(f"the simulator did not start: {out.read_text()[-500:]}")


async def closed_loop(url: str, concurrency: int, seconds: float) -> int:
    done = 0
    deadline = time.monotonic() + seconds

    async def session(i: int, client: httpx.AsyncClient) -> None:
        nonlocal done
        messages = [{"role": "system", "content": f"agent {i}: " + "word " * 200}]
        turn = 0
        while time.monotonic() < deadline:
            messages.append({"role": "user", "content": f"step {turn} of session {i}"})
            r = await client.post(f"{url}/v1/chat/completions", headers={"x-session-id": f"load-{i}-{seconds}"},
                                  json={"model": "kvtether-sim", "messages": messages, "max_tokens": 16})
            r.raise_for_status()
            messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
            turn += 1
            if time.monotonic() < deadline:
                done += 1
            if len(messages) > 40:
                messages = messages[:1]

    async with httpx.AsyncClient(timeout=60) as client, asyncio.TaskGroup() as tg:
        for i in range(concurrency):
            tg.create_task(session(i, client))
    return done


async def throughput(url: str, concurrency: int, seconds: float, tmp: Path) -> None:
    rates: dict[int, float] = {}
    async with sim_nodes(tmp) as nodes:
        for workers in (1, 2):
            port = _free_port()
            argv = [*CLI, "serve", "--port", str(port), "--store", url, "--workers", str(workers), "--policy",
                    "pull", "--log-level", "warning", *[a for u in nodes["prefill"] for a in ("-p", u)],
                    *[a for u in nodes["decode"] for a in ("-d", u)]]
            async with child(argv, tmp / f"gateway-{workers}.log"):
                gw = f"http://127.0.0.1:{port}"
                await _ready(gw)
                await closed_loop(gw, concurrency, 2.0)  # warm-up
                rates[workers] = await closed_loop(gw, concurrency, seconds) / seconds
    print(f"3. aggregate throughput, Redis store, policy pull, {concurrency} concurrent sessions, {seconds:g} s each "
          f"({os.cpu_count()} cores shared with the simulator and the load generator)")
    for workers, rate in rates.items():
        print(f"   --workers {workers}: {rate:7.1f} req/s")
    print(f"   2 workers / 1 worker: {rates[2] / rates[1]:.2f}x")


async def _ready(url: str) -> None:
    async with httpx.AsyncClient(timeout=2) as client:
        for _ in range(600):
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(f"{url}/ready")).status_code == 200:
                    return
            await asyncio.sleep(0.1)
    raise RuntimeError(f"gateway at {url} not ready")


async def main_async(args: argparse.Namespace) -> None:
    with redis_server() as url, tempfile.TemporaryDirectory(prefix="kvtether-bench-") as tmp:
        await latency(url, args.turns, args.tokens, args.sessions)
        await size(url, args.tokens, args.sessions)
        if args.seconds > 0:
            await throughput(url, args.concurrency, args.seconds, Path(tmp))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=2000)
    parser.add_argument("--tokens", type=int, default=8192, help="history length of each session")
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=12.0, help="per worker count; 0 skips part 3")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
