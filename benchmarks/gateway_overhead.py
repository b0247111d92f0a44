"""What kvtether adds to a streamed turn, next to vLLM's Rust router, a bare Python proxy and no proxy at all.

Fake vLLM backends (benchmarks/overhead_backends.py: a P, a D and an aggregated replica, plain asyncio, 0.33-style
streams) answer as fast as they can, so every millisecond above the direct client is the proxy's. Each contender
runs 2 closed-loop streams for --seconds, in alternating rounds (the order rotates each round); TTFB is the time
to the first SSE data line, "added" is over the direct client (in P/D mode the direct client sends the prefill
leg itself, then streams the decode leg). Contenders:

* kvtether: `kvtether serve` (policy auto; in P/D mode it asks D for token ids and reads D's handle);
* vllm-router: PyPI `vllm-router` (Rust), installed by this script into .cache/bench-vllm-router (round_robin;
  `--vllm-pd-disaggregation` in P/D mode); left out, with the reason, when it cannot be installed;
* bare: Starlette + httpx, the request to the replica and its bytes back (aggregated only);
* direct: the client talks to the backends itself.

Then the same in P/D mode with growing multi-turn histories (a ~14.5k-token document, 8 turns of ~0.3k tokens
each, so prompts of 15-17k tokens) where kvtether pins the session, tokenizes with its local tokenizer (an HF
tokenizer this script trains, which the fake backends use too) and verifies D's held tokens on every turn; and
a traced pass that reads the gateway's own time per guarded turn (tokenize + guard + plan spans).

    python benchmarks/gateway_overhead.py [--seconds 5] [--rounds 3] [--skip-router]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead_backends import MODEL, Client

ROOT = Path(__file__).resolve().parents[1]
ROUTER_VERSION = "0.1.17"
ROUTER_VENV = ROOT / ".cache" / "bench-vllm-router"
STREAMS = 2
Call = Callable[[Client, Client | None, int], Awaitable[float]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Procs:
    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, argv: list[str], port: int,
              env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        out = open(self.logs / f"{name}.out", "wb")  # noqa: SIM115 - closed with the process
        p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        self.procs.append(p)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited: {(self.logs / f'{name}.out').read_text()[-2000:]}")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return p
            time.sleep(0.1)
        raise RuntimeError(f"{name} did not listen on {port}")

    def stop(self, p: subprocess.Popen[bytes]) -> None:
        p.terminate()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
        self.procs.remove(p)

    def stop_all(self) -> None:
        for p in list(self.procs):
            self.stop(p)


def install_router() -> tuple[Path | None, str]:
    """vllm-router from PyPI in an environment of its own; (None, why) when that fails."""
    exe = ROUTER_VENV / "bin" / "vllm-router"
    if exe.exists():
        return exe, f"vllm-router {ROUTER_VERSION}"
    try:
        subprocess.run([sys.executable, "-m", "pip", "index", "versions", "vllm-router"], check=True,
                       capture_output=True, timeout=120)
        subprocess.run([sys.executable, "-m", "venv", str(ROUTER_VENV)], check=True, capture_output=True)
        subprocess.run([str(ROUTER_VENV / "bin" / "pip"), "install", "-q", f"vllm-router=={ROUTER_VERSION}"],
                       check=True, capture_output=True, timeout=900)
    except (subprocess.SubprocessError, OSError) as exc:
        return None, f"vllm-router not installed: {exc}"
    return (exe, f"vllm-router {ROUTER_VERSION}") if exe.exists() else (None, "vllm-router: no executable")


def kvtether_argv(args: list[str]) -> list[str]:
    exe = Path(sys.executable).with_name("kvtether")
    head = [str(exe)] if exe.exists() else [sys.executable, "-c", "from kvtether.cli.main import app; app()"]
    return [*head, "serve", *args, "--log-level", "warning"]


# ---- workloads ---------------------------------------------------------------------------------------------


def chat_body(max_tokens: int, messages: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"model": MODEL, "messages": messages or [{"role": "user", "content": "Say something, please."}],
            "max_tokens": max_tokens, "stream": True, "temperature": 0}


async def via_proxy(proxy: Client, body: dict[str, Any], headers: dict[str, str] | None = None) -> float:
    first, _ = await proxy.post("/v1/chat/completions", json.dumps(body).encode(), headers)
    assert first is not None
    return first


async def direct_pd(p: Client, d: Client, body: dict[str, Any]) -> float:
    """The reference proxy's two legs, sent by the client itself: TTFB from the prefill leg's start."""
    t0 = time.perf_counter()
    cold = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None}
    leg = {**body, "stream": False, "max_tokens": 1, "kv_transfer_params": cold}
    _, raw = await p.post("/v1/chat/completions", json.dumps(leg).encode())
    params = json.loads(raw)["kv_transfer_params"]
    sent = time.perf_counter()
    first, _ = await d.post("/v1/chat/completions", json.dumps({**body, "kv_transfer_params": params}).encode())
    assert first is not None
    return sent - t0 + first


Turn = Callable[[], Awaitable[float]]


async def closed_loop(streams: list[Turn], seconds: float) -> tuple[list[float], float]:
    """Each stream's turns back to back for `seconds`: the TTFBs, and completed turns per second."""
    samples: list[float] = []
    end = time.perf_counter() + seconds

    async def loop(turn: Turn) -> None:
        while time.perf_counter() < end:
            samples.append(await turn())

    t0 = time.perf_counter()
    await asyncio.gather(*(loop(t) for t in streams))
    return samples, len(samples) / (time.perf_counter() - t0)


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


# ---- contenders --------------------------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace, logs: Path) -> None:
        self.args = args
        self.procs = Procs(logs)
        self.fake = [free_port() for _ in range(3)]  # P, D, aggregated replica
        self.pids: dict[int, int] = {}  # a proxy's port -> its process
        self.router, self.router_note = (None, "vllm-router: skipped (--skip-router)") if args.skip_router \
            else install_router()

    def fakes(self, tokenizer: Path | None = None) -> None:
        extra = ["--tokenizer", str(tokenizer)] if tokenizer else []
        for port in self.fake:
            self.procs.start(f"fake-{port}", [sys.executable, str(Path(__file__).with_name("overhead_backends.py")),
                                              "backend", "--port", str(port), *extra], port)

    def url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.fake[i]}"

    def start(self, name: str, mode: str, tokenizer: Path | None = None,
              env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], int]:
        port = free_port()
        if name == "kvtether":
            nodes = ["--aggregated", self.url(2)] if mode == "agg" else [
                "--prefill", self.url(0), "--decode", self.url(1)]
            extra = ["--tokenizer", str(tokenizer)] if tokenizer else []
            argv = kvtether_argv([*nodes, "--port", str(port), *extra])
        elif name == "vllm-router":
            assert self.router is not None
            nodes = ["--worker-urls", self.url(2)] if mode == "agg" else [
                "--vllm-pd-disaggregation", "--prefill", self.url(0), "--decode", self.url(1)]
            argv = [str(self.router), *nodes, "--port", str(port), "--policy", "round_robin", "--log-level", "warning",
                    "--prometheus-port", str(free_port())]
        else:  # bare
            argv = [sys.executable, str(Path(__file__).with_name("overhead_backends.py")), "bare", "--port",
                    str(port), "--upstream", self.url(2)]
        proc = self.procs.start(f"{name}-{mode}", argv, port, env)
        self.pids[port] = proc.pid
        return proc, port

    def contenders(self, mode: str) -> list[str]:
        names = ["direct", "kvtether"] + (["vllm-router"] if self.router else [])
        return names + (["bare"] if mode == "agg" else [])


def streams_for(name: str, mode: str, port: int | None, bench: Bench, chunks: int,
                histories: Any = None) -> list[Turn]:
    """One turn function per closed-loop stream, each with connections of its own."""
    out: list[Turn] = []
    for _ in range(STREAMS):
        if name == "direct":
            p, d, a = (Client("127.0.0.1", bench.fake[i]) for i in range(3))
            if histories is not None:
                out.append(_session_turns(name, None, (p, d), histories))
            else:
                out.append(_fixed_turn(None, (p, d) if mode == "pd" else None, a, chunks))
        else:
            assert port is not None
            proxy = Client("127.0.0.1", port)
            out.append(_session_turns(name, proxy, None, histories) if histories is not None
                       else _fixed_turn(proxy, None, None, chunks))
    return out


def _fixed_turn(proxy: Client | None, pd: tuple[Client, Client] | None, replica: Client | None, chunks: int) -> Turn:
    async def turn() -> float:
        if pd is not None:
            return await direct_pd(pd[0], pd[1], chat_body(chunks))
        target = proxy or replica
        assert target is not None
        return await via_proxy(target, chat_body(chunks))

    return turn


def _session_turns(name: str, proxy: Client | None, pd: tuple[Client, Client] | None, histories: Any) -> Turn:
    state = {"s": histories.session()}

    async def turn() -> float:
        s = state["s"]
        if s.done:
            s = state["s"] = histories.session()
        body = s.body()
        if pd is not None:
            took = await direct_pd(pd[0], pd[1], body)
        else:
            assert proxy is not None
            headers = {"x-session-id": s.sid} if name == "kvtether" else None
            took = await via_proxy(proxy, body, headers)
        s.advance()
        return took

    return turn


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


Results = dict[str, tuple[list[float], list[float], list[float]]]  # name -> (TTFBs, req/s per round, CPU s)


async def measure(bench: Bench, mode: str, chunks: int, ports: dict[str, int | None],
                  histories: Any = None) -> Results:
    """Alternating rounds: name -> (TTFBs, req/s per round, the proxy's CPU seconds per round)."""
    names = list(ports)
    results: Results = {n: ([], [], []) for n in names}
    for n in names:  # warm-up: connections, caches, the local tokenizer's start-up check
        await warm_up(bench, n, mode, ports[n], chunks, histories)
    for r in range(bench.args.rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            port = ports[n]
            pid = bench.pids.get(port) if port is not None else None
            cpu0 = cpu_seconds(pid) if pid else 0.0
            ttfb, rps = await closed_loop(streams_for(n, mode, port, bench, chunks, histories), bench.args.seconds)
            results[n][0].extend(ttfb)
            results[n][1].append(rps)
            results[n][2].append(cpu_seconds(pid) - cpu0 if pid else 0.0)
    return results


async def warm_up(bench: Bench, name: str, mode: str, port: int | None, chunks: int, histories: Any) -> None:
    """A second of turns; for kvtether on guarded histories, until its local tokenizer serves them (it loads and
    checks itself against /tokenize in the background after start-up)."""
    deadline = time.monotonic() + 90
    while True:
        await closed_loop(streams_for(name, mode, port, bench, chunks, histories), 1.0)
        if histories is None or name != "kvtether" or port is None or time.monotonic() > deadline:
            return
        if local_turns(port) > 0:
            return


def local_turns(port: int) -> float:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as r:
        return sum(s.value for fam in text_string_to_metric_families(r.read().decode()) for s in fam.samples
                   if s.name == "kvtether_guard_tokenize_total" and s.labels.get("source") == "local")


def rows(label: str, results: Results) -> list[str]:
    base = results["direct"][0]
    out = []
    for n, (ttfb, rps, cpu) in results.items():
        p50, p99 = pct(ttfb, 0.5), pct(ttfb, 0.99)
        if n == "direct":
            cell, per = f"TTFB {p50 * 1e3:.1f} / {p99 * 1e3:.1f} ms", "–"
        else:
            cell = f"+{(p50 - pct(base, 0.5)) * 1e3:.1f} / +{(p99 - pct(base, 0.99)) * 1e3:.1f} ms"
            per = f"{sum(cpu) / len(ttfb) * 1e3:.2f} ms"
        out.append(f"| {label} | {n} | {cell} | {statistics.mean(rps):.0f} req/s | {per} | n={len(ttfb)} |")
    return out


def guarded(bench: Bench, logs: Path) -> list[str]:
    """P/D turns of growing histories (the guard verifies every turn after a session's first), then a traced
    pass for the gateway's own time per guarded turn."""
    import urllib.request

    import uvloop
    from overhead_sessions import Histories, build_tokenizer, gateway_times, spans
    from prometheus_client.parser import text_string_to_metric_families

    tok = build_tokenizer(ROOT / ".cache" / "bench-tokenizer")
    histories = Histories(tok)
    bench.fakes(tok)
    ports: dict[str, int | None] = {"direct": None, "kvtether": bench.start("kvtether", "pd", tok)[1]}
    if bench.router:
        ports["vllm-router"] = bench.start("vllm-router", "pd")[1]
    res = uvloop.run(measure(bench, "pd", 16, ports, histories))
    lines = rows("guarded ~16k-token histories, P/D", res)
    print("\n".join(lines), flush=True)
    with urllib.request.urlopen(f"http://127.0.0.1:{ports['kvtether']}/metrics") as r:
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for fam in text_string_to_metric_families(r.read().decode()) for s in fam.samples}

    def m(name: str, **labels: str) -> int:
        return int(sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls)))

    notes = [f"kvtether: guarded turns tokenized locally {m('kvtether_guard_tokenize_total', source='local')}, by "
             f"/tokenize {m('kvtether_guard_tokenize_total', source='remote')}; tokenizer mismatches "
             f"{m('kvtether_tokenizer_mismatches_total')}; handles attached "
             f"{m('kvtether_handle_outcomes_total', outcome='attached')}, truncated "
             f"{m('kvtether_handle_outcomes_total', outcome='truncated')}, refused "
             f"{m('kvtether_handle_outcomes_total', outcome='refused_by_guard')}"]
    bench.procs.stop_all()
    # The traced pass: the same turns through a kvtether whose spans go to its stdout.
    bench.fakes(tok)
    env = {"OTEL_TRACES_EXPORTER": "console", "OTEL_BSP_SCHEDULE_DELAY": "500"}
    proc, port = bench.start("kvtether", "pd-traced", tok, env)
    uvloop.run(warm_up(bench, "kvtether", "pd", port, 16, histories))
    since = time.time()  # turns before this ran while the tokenizer was loading: left out
    uvloop.run(closed_loop(streams_for("kvtether", "pd", port, bench, 16, histories), bench.args.seconds * 2))
    bench.procs.stop(proc)
    times = gateway_times(spans((logs / "kvtether-pd-traced.out").read_text()), since)
    warm = [t for t in times if t[3] > 1]  # later turns: the history's pieces are in the tokenizer's cache
    cold = [t for t in times if t[3] == 1]  # a session's first guarded turn: its whole history is new
    for label, group in (("guarded turn", warm), ("first guarded turn of a session", cold)):
        local = [t[0] for t in group if not t[2]]
        if local:
            toks = [t[1] for t in group]
            notes.append(f"kvtether {label} gateway time (tokenize + guard + plan), local ids: p50 "
                         f"{pct(local, 0.5) * 1e3:.2f} ms, p90 {pct(local, 0.9) * 1e3:.2f} ms, max "
                         f"{max(local) * 1e3:.2f} ms over {len(local)} turns of {min(toks)}-{max(toks)} tokens "
                         f"({len(group) - len(local)} more asked /tokenize)")
    return [*lines, "", *notes]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=5.0, help="per contender per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-router", action="store_true")
    ap.add_argument("--only", choices=("chunks", "guarded"), help="run one part only")
    args = ap.parse_args()
    import uvloop

    logs = Path(tempfile.mkdtemp(prefix="kvtether-overhead-"))
    bench = Bench(args, logs)
    print(f"# gateway overhead: {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}; {bench.router_note}; "
          f"{STREAMS} closed-loop streams, {args.rounds} rounds x {args.seconds:g} s; logs in {logs}")
    table = ["| stream | contender | added TTFB p50 / p99 (direct: absolute) | req/s | proxy CPU / request | samples |",
             "|---|---|---|---|---|---|"]
    try:
        if args.only != "guarded":
            bench.fakes()
            for mode in ("agg", "pd"):
                ports: dict[str, int | None] = {"direct": None}
                for n in bench.contenders(mode)[1:]:
                    ports[n] = bench.start(n, mode)[1]
                for chunks in (16, 256):
                    res = uvloop.run(measure(bench, mode, chunks, ports))
                    table += rows(f"{chunks} chunks, {'aggregated' if mode == 'agg' else 'P/D'}", res)
                    print("\n".join(table[-len(res):]), flush=True)
            bench.procs.stop_all()
        if args.only != "chunks":
            table += guarded(bench, logs)
    finally:
        bench.procs.stop_all()
    print("\n" + "\n".join(table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
