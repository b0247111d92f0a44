"""Goodput at equal GPU count: which serving option keeps the most turns within their objectives, and up to which load.

For each workload and each option, the sessions are replayed open loop on a fresh simulated cluster. Load ×k is
k times the users: k × --sessions sessions (the workload's generator or trace, further on) arriving k times as
densely, so in the same window, each with its think times as recorded; below ×1, --sessions sessions arriving
1/k times further apart. (Compressing arrivals alone, or think times too, stops raising the load once every
session is under way: each has one request out at a time, so 64 coding sessions all at once still met every
objective on three nodes and no knee could be measured.)

Per run: the share of turns that meet both objectives (TTFT from the client, TPOT from the decoding engine's own
step times, which this machine's load does not inflate), late-turn TTFT p50/p95/p99 and engine TPOT p95. Goodput
is the highest load multiplier at which at least 90 % of turns meet both (DistServe's measure).

Clock. By default every run is on a virtual clock (sim/virtual.py): the cluster, the gateway and the clients in
one process, time jumping from event to event, the gateway's own CPU modelled (cli/simstack/gateway_cost.py). So
the figures are the cost model's to the microsecond and the same in every run, and a run costs the CPU its
Python needs, not the simulated seconds it covers; runs go one per process (--jobs) without changing a figure.
--realtime runs on the wall clock × --speed instead, where this machine's load is in every TTFT.

Options (one GPU count: P prefill + D decode nodes, P+D colocated nodes, or a pool of P+D instances; 1P 2D by
default, --prefill/--decode):

  no-pull    classic P/D: P recomputes the history
  reference  vLLM's reference proxy: round-robin, the handle attached whenever held
  pull       kvtether, always pulling a verified handle
  dynamo     Dynamo's conditional disaggregation (isl_bounding), no pull
  llm-d      llm-d's prefix decider (nonCachedTokens 16), no pull
  auto       kvtether's per-turn choice
  colocated  3 aggregated nodes, sessions pinned to one (session affinity), prefix caching on
  hybrid     3 pool instances (kv_both) behind kvtether's auto: each turn local on the session's instance or
             prefilled on another that pulls the history (docs/pool.md)

Workloads: short-append chat; coding-agent sessions (long contexts, appends of 0.2–6k tokens, answers of
50–2.5k, tool gaps of seconds); long documents (examples/sessions/aiperf-long-docs.jsonl); a production-style
conversation trace in mooncake_trace format (examples/traces/mooncake-conversation-sample.jsonl). Generated
workloads get Poisson session arrivals; the trace keeps its own. On request only (--workloads coding-long): the
coding sessions with file-sized tool results too (12-24k tokens in one turn of ten).

    python benchmarks/goodput.py                       # every workload, 3 loads, virtual time
    python benchmarks/goodput.py --workloads chat --loads 1,2 --options auto,colocated --sessions 4
    python benchmarks/goodput.py --prefill 2 --decode 6 --sessions 64 --loads 1,2,4,8,16 --jobs 2
    python benchmarks/goodput.py --seed 2 --out /tmp/s2 ...          # more seeds, then one table of all:
    python benchmarks/goodput.py --pool /tmp/s1/goodput.json /tmp/s2/goodput.json /tmp/s3/goodput.json
Writes benchmarks/results/goodput.json (or goodput-pooled.json) and goodput.png.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import anyio

ROOT = Path(__file__).resolve().parents[1]
OPTIONS = ("no-pull", "reference", "pull", "dynamo", "llm-d", "auto", "colocated", "hybrid")
PD_OPTIONS = OPTIONS[:-2]
WORKLOADS = ("chat", "coding", "long-docs", "trace")
EXTRA_WORKLOADS = ("coding-long",)  # on request (--workloads) only
LATE_TURN = 3  # turns from this index on are "late": their history is what reuse is for


@dataclass(frozen=True)
class Settings:
    preset: str = "qwen3-32b-h200-tp8"
    # On the wall clock (realtime): simulated seconds per real second. TTFT is the client's clock × speed, so
    # whatever this machine's load delays (the event loop, the other core's work) is multiplied too: keep it low,
    # the machine quiet. In virtual time (the default) the speed is 1 and the figures exact.
    speed: float = 4.0
    virtual: bool = True
    prefill: int = 1
    decode: int = 2
    ttft_ms: float = 2000.0
    tpot_ms: float = 25.0
    sessions: int = 8
    seed: int = 1
    # The trace workload's file (mooncake_trace format): by default the synthetic sample committed here; the
    # whole published conversation trace for the table in docs/pool.md (--trace).
    trace: str = str(ROOT / "examples/traces/mooncake-conversation-sample.jsonl")
    # Gateway processes, each modelled in virtual time as a server of measured per-turn cost
    # (cli/simstack/gateway_cost.py): at high load one process's CPU, not the GPUs, is the knee.
    gateway_workers: int = 1
    # [gateway.tuning] overrides for the options kvtether places (not colocated serving), e.g. a rule under
    # evaluation switched on: (key, value) pairs, as --tuning KEY=VALUE gave them.
    tuning: tuple[tuple[str, Any], ...] = ()


def _with_arrivals(sessions: list[Any], mean_gap_ms: float, seed: int) -> list[Any]:
    """Poisson session arrivals (start offsets in each session's metadata), for workloads that have none."""
    rng, t, out = random.Random(seed), 0.0, []
    for s in sessions:
        out.append(replace(s, metadata={**(s.metadata or {}), "start_offset_ms": t}))
        t += rng.expovariate(1.0 / mean_gap_ms)
    return out


def workload(name: str, st: Settings, load: float = 1.0) -> list[Any]:
    """The sessions of `name` at `load`: round(load × st.sessions) of them (below load 1, st.sessions: the same
    users arriving further apart), their start offsets as at load 1 (the replay divides them by the load)."""
    from kvtether.cli.gen.generate import GenParams, generate_sessions
    from kvtether.cli.gen.importers import import_file

    model = "kvtether-sim"
    st = replace(st, sessions=max(1, round(st.sessions * max(1.0, load))))
    if name == "chat":
        s = generate_sessions(GenParams(sessions=st.sessions, turns=8, new_tokens="20-200", output_tokens="30-200",
                                        system_tokens=1500, think_ms=4000.0, user_message_prob=1.0, seed=st.seed))
        return _with_arrivals(s, 2000.0, st.seed)
    if name == "coding":
        s = generate_sessions(GenParams(sessions=st.sessions, turns=9, new_tokens="200-1500:0.8,3000-6000:0.2",
                                        output_tokens="50-400:0.8,1000-2500:0.2", system_tokens=8000,
                                        think_ms=6000.0, seed=st.seed + 1, id_prefix="code"))
        return _with_arrivals(s, 3000.0, st.seed + 1)
    if name == "coding-long":
        # The coding sessions with file-sized tool results too (a whole source file or a test log: 12-24k tokens
        # in one turn of ten): a local prefill of one costs an answer beside it about its whole TPOT slack.
        s = generate_sessions(GenParams(sessions=st.sessions, turns=9,
                                        new_tokens="200-1500:0.7,3000-6000:0.2,12000-24000:0.1",
                                        output_tokens="50-400:0.8,1000-2500:0.2", system_tokens=8000,
                                        think_ms=6000.0, seed=st.seed + 3, id_prefix="code"))
        return _with_arrivals(s, 3000.0, st.seed + 3)
    if name == "long-docs":
        s = import_file(ROOT / "examples/sessions/aiperf-long-docs.jsonl", "aiperf", model=model)
        if st.sessions > len(s):
            # More sessions than the file's four: generated in its shape (a 4k-token system prompt, five
            # appends of 5-6.5k tokens a few hundred ms apart, six-token answers), each session its own text.
            s = generate_sessions(GenParams(sessions=st.sessions, turns=5, new_tokens="5000-6500",
                                            output_tokens="6", system_tokens=4000, think_ms=200.0,
                                            user_message_prob=1.0, seed=st.seed + 2, id_prefix="doc"))
        return _with_arrivals(s[: st.sessions], 4000.0, st.seed + 2)
    if name == "trace":
        return _trace_window(st)
    raise SystemExit(f"unknown workload {name!r}")


@functools.lru_cache(maxsize=1)
def _trace_sessions(path: str) -> list[Any]:
    """The trace's sessions, rebuilt once per process (the whole published trace takes ~10 s)."""
    from kvtether.cli.gen.importers import import_file

    return import_file(path, "mooncake", model="kvtether-sim")


def _trace_window(st: Settings) -> list[Any]:
    """`st.sessions` consecutive sessions of the trace, the seed-th window (wrapping), their arrivals as
    recorded from the window's first; think times capped so a run fits here."""
    every = _trace_sessions(st.trace)
    # Seeds take windows far apart in a large trace (a sixth of it), so a seed's larger loads do not replay
    # another seed's sessions; in a small one, consecutive windows, wrapping.
    start = ((st.seed - 1) * max(st.sessions, len(every) // 6)) % max(1, len(every))
    window = (every + every)[start: start + min(st.sessions, len(every))]
    t0 = min((x.metadata or {}).get("start_offset_ms", 0.0) for x in window)
    return [replace(x, metadata={**(x.metadata or {}),
                                 "start_offset_ms": (x.metadata or {}).get("start_offset_ms", 0.0) - t0},
                    turns=[replace(t, delay_ms=min(t.delay_ms, 20_000.0)) for t in x.turns]) for x in window]


async def run_one(option: str, sessions: list[Any], shape: Any, rate: float, st: Settings) -> dict[str, Any]:
    from kvtether.cli.assess.topology import option_gateway
    from kvtether.cli.replay.engine import (
        OPEN_LOOP_CAP,
        ReplayOptions,
        join_engine_tpot,
        new_session_suffix,
        run_replay,
    )
    from kvtether.cli.replay.report import Objectives, attainment, judge
    from kvtether.cli.simstack.decode_times import DecodeTimes
    from kvtether.cli.streaming import loop_clock_ns, now_ns

    decode_times = DecodeTimes()
    t0, cpu0 = time.perf_counter(), time.process_time()
    speed = 1.0 if st.virtual else st.speed
    async with option_gateway(option, shape, speed, False, decode_times, st.tpot_ms, st.ttft_ms,
                              gateway_workers=st.gateway_workers, tuning=dict(st.tuning)) as stack:
        opts = ReplayOptions(arrivals="trace", rate=rate, time_scale=speed, model=stack.model, history="live",
                             timeout_s=300.0, session_suffix="" if st.virtual else new_session_suffix(),
                             open_loop_cap=None if st.virtual else OPEN_LOOP_CAP)
        run = await run_replay(sessions, stack.url, opts, clock_ns=loop_clock_ns() if st.virtual else now_ns,
                               lean_http=st.virtual)
        gateway = stack.gateway_model()
    join_engine_tpot(run.results, decode_times.tpot_by_request())
    objectives = Objectives(st.ttft_ms, st.tpot_ms)
    a = attainment(run.results, objectives, "engine")
    missed = [r for r in run.results if not judge(r, objectives, "engine").met]
    late = sorted(r.ttft_ms for r in run.results if r.ok and r.ttft_ms is not None and r.turn >= LATE_TURN)
    tpots = sorted(r.engine_tpot_ms for r in run.results if r.engine_tpot_ms is not None)
    return {"option": option, "rate": rate, "attainment": a["attainment"], "met": a["met"], "turns": a["turns"],
            "errors": sum(1 for r in run.results if not r.ok and not r.skipped),
            "late_ttft_ms": {q: _pct(late, q) for q in ("p50", "p95", "p99")},
            "tpot_p95_ms": _pct(tpots, "p95"), "wall_s": round(time.perf_counter() - t0, 1),
            "clock": "virtual" if st.virtual else f"real × {st.speed:g}", "cpu_s": round(time.process_time() - cpu0, 1),
            "simulated_s": None if run.clock_s is None else round(run.clock_s, 3),
            # The modelled gateway process (virtual time): its utilisation, and whether it saturated (above 70 %
            # its queue is part of every turn's TTFT).
            "gateway_utilisation": None if gateway is None else gateway["utilisation"],
            "gateway_saturated": None if gateway is None else gateway["saturated"],
            # Sessions the client's cap on sessions in flight held past their arrival (the wall clock only): not 0,
            # the load was below the one the row names.
            "arrivals_late": run.arrivals_late,
            # Its busiest 10 simulated seconds (the mean hides a ramp's peak) and what turns waited for it.
            "gateway_peak_utilisation": None if gateway is None else gateway["peak_utilisation"],
            "gateway_queue_ms": None if gateway is None else gateway["queue_ms"],
            # The samples, so runs of several seeds pool into one table (--pool).
            "late_ttft_samples": [round(x, 1) for x in late], "tpot_samples": [round(x, 2) for x in tpots],
            # Which turns missed, and what the gateway chose for them: where a policy loses its turns.
            "missed": [_missed(r) for r in missed]}


def _missed(r: Any) -> dict[str, Any]:
    h = r.reuse
    return {"session": r.session_id.split("~")[0], "turn": r.turn, "start_ms": round(r.start_ms),
            "ttft_ms": None if r.ttft_ms is None else round(r.ttft_ms, 1), "engine_tpot_ms": r.engine_tpot_ms,
            "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens, "error": r.error_kind,
            "plan": h.get("x-kvtether-plan"), "reason": h.get("x-kvtether-plan-reason"),
            "source": h.get("x-kvtether-reuse-source")}


def _pct(xs: list[float], q: str) -> float | None:
    if not xs:
        return None
    k = {"p50": 0.5, "p95": 0.95, "p99": 0.99}[q]
    return round(xs[min(len(xs) - 1, int(k * len(xs)))], 1)


def settings_of(args: argparse.Namespace) -> Settings:
    return Settings(preset=args.preset, speed=args.speed, ttft_ms=args.ttft, tpot_ms=args.tpot,
                    sessions=args.sessions, seed=args.seed, virtual=not getattr(args, "realtime", False),
                    trace=str(getattr(args, "trace", Settings.trace)),
                    prefill=getattr(args, "prefill", Settings.prefill), decode=getattr(args, "decode", Settings.decode),
                    gateway_workers=getattr(args, "gateway_workers", Settings.gateway_workers),
                    tuning=tuple(getattr(args, "tuning", None) or ()))


def tuning_pair(text: str) -> tuple[str, Any]:
    """--tuning KEY=VALUE: true/false for a rule's switch, else a number."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    if value.lower() in ("true", "false"):
        return key, value.lower() == "true"
    try:
        return key, int(value) if value.lstrip("-").isdigit() else float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{key}: expected true, false or a number, got {value!r}") from None


def run_job(job: tuple[str, str, float, Settings]) -> dict[str, Any]:
    """One run (workload, option, load) in an event loop of its own: a fresh virtual one in virtual time. A
    process of a pool runs it as well as this one: the workload is rebuilt from its seed and load."""
    from kvtether.cli.assess.cluster import build_shape
    from kvtether.cli.simstack.logs import ClusterLogs

    w, option, rate, st = job
    shape = build_shape(st.preset, prefill=st.prefill, decode=st.decode)
    # The simulated nodes' and the gateway's warnings (a lease expiring, …) stay off the table; errors still show.
    with ClusterLogs(None):
        if st.virtual:
            from kvtether.sim.virtual import run_virtual

            return run_virtual(run_one, option, workload(w, st, rate), shape, rate, st)
        return anyio.run(run_one, option, workload(w, st, rate), shape, rate, st)


def main_sync(args: argparse.Namespace) -> dict[str, Any]:
    """Every (workload, option, load) run, `args.jobs` at a time (virtual time only: live runs would share the
    machine's cores and each other's noise), in the order of the table."""
    from kvtether.cli.replay.report import goodput

    st = settings_of(args)
    loads = [float(x) for x in args.loads.split(",")]
    options = args.options.split(",")
    n = st.prefill + st.decode
    out: dict[str, Any] = {"settings": st.__dict__, "loads": loads, "workloads": {},
                           "shape": f"{st.prefill}P {st.decode}D (P/D options) vs {n} colocated nodes vs a pool of {n}"}
    jobs = [(w, o, rate, st) for w in args.workloads.split(",") for o in options for rate in loads]
    jobs_at_once = max(1, getattr(args, "jobs", 1)) if st.virtual else 1
    if jobs_at_once > 1:
        import multiprocessing

        rows = []
        with multiprocessing.get_context("spawn").Pool(jobs_at_once) as procs:
            for job, row in zip(jobs, procs.imap(run_job, jobs), strict=True):  # in order, each as it is done
                rows.append(row)
                _say(job[0], row)
    else:
        rows = []
        for job in jobs:
            rows.append(run_job(job))
            _say(job[0], rows[-1])
    for w in args.workloads.split(","):
        mine = [r for (jw, *_), r in zip(jobs, rows, strict=True) if jw == w]
        sessions = workload(w, st)
        gp = {o: goodput([(r["rate"], r["attainment"]) for r in mine if r["option"] == o]) for o in options}
        out["workloads"][w] = {"sessions": len(sessions), "turns": sum(len(s.turns) for s in sessions),
                               "runs": mine, "goodput": gp}
    return out


def _say(w: str, row: dict[str, Any]) -> None:
    print(f"{w:9} {row['option']:9} ×{row['rate']:<4g} attainment {_share(row['attainment'])} "
          f"late TTFT p95 {row['late_ttft_ms']['p95']} ms, TPOT p95 {row['tpot_p95_ms']} ms, "
          f"errors {row['errors']} ({row['clock']}: {row['wall_s']} s wall, {row['cpu_s']} s CPU)"
          + (f"; {row['arrivals_late']} sessions held past their arrival: below ×{row['rate']:g}"
             if row.get("arrivals_late") else ""), flush=True)


def pool(outs: list[dict[str, Any]]) -> dict[str, Any]:
    """Runs of several seeds as one: per workload, option and load, the turns and their samples together."""
    from kvtether.cli.replay.report import goodput

    first = outs[0]
    pooled: dict[str, Any] = {**first, "seeds": sorted({o["settings"]["seed"] for o in outs}), "workloads": {}}
    # Every workload any file has (a seed's workloads may come from several runs, at loads of their own).
    for w in dict.fromkeys(w for o in outs for w in o["workloads"]):
        groups: dict[tuple[str, float], list[dict[str, Any]]] = {}
        for o in outs:
            for r in o["workloads"].get(w, {}).get("runs", []):
                groups.setdefault((r["option"], r["rate"]), []).append(r)
        rows = []
        for (option, rate), rs in groups.items():
            late = sorted(x for r in rs for x in r["late_ttft_samples"])
            tpots = sorted(x for r in rs for x in r["tpot_samples"])
            met, turns = sum(r["met"] for r in rs), sum(r["turns"] for r in rs)
            rows.append({"option": option, "rate": rate, "attainment": met / turns if turns else None, "met": met,
                         "turns": turns, "errors": sum(r["errors"] for r in rs),
                         "late_ttft_ms": {q: _pct(late, q) for q in ("p50", "p95", "p99")},
                         "tpot_p95_ms": _pct(tpots, "p95"), "runs": len(rs)})
        options = list(dict.fromkeys(r["option"] for r in rows))
        # A seed's sessions once, though its options may come from several runs (files) of it.
        per_seed = {o["settings"]["seed"]: o["workloads"][w] for o in outs if w in o["workloads"]}
        pooled["workloads"][w] = {
            "sessions": sum(x["sessions"] for x in per_seed.values()),
            "turns": sum(x["turns"] for x in per_seed.values()),
            "runs": rows,
            "goodput": {o: goodput([(r["rate"], r["attainment"]) for r in rows if r["option"] == o]) for o in options},
        }
    return pooled


def _load(g: float | None) -> str:
    return "none" if g is None else f"×{g:g}"


def _share(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f} %"


def render(out: dict[str, Any]) -> str:
    lines = []
    tuning = (out.get("settings") or {}).get("tuning") or ()
    if tuning:  # a table of runs with a rule switched on says so
        lines.append("[gateway.tuning] for every option but colocated: "
                     + ", ".join(f"{k} = {str(v).lower()}" for k, v in tuning))
    for w, res in out["workloads"].items():
        loads = sorted({r["rate"] for r in res["runs"]})  # a workload's own loads (runs may differ per workload)
        lines.append(f"\n## {w} ({res['sessions']} sessions, {res['turns']} turns at ×1; ×k: k times the users)\n")
        lines.append("| option | " + " | ".join(f"attain. ×{x:g}" for x in loads)
                     + " | goodput | late TTFT p50/p95/p99 ms (×1) | TPOT p95 ms (×1) | failed turns |")
        lines.append("|---" * (len(loads) + 5) + "|")
        for o, g in res["goodput"].items():
            runs = {r["rate"]: r for r in res["runs"] if r["option"] == o}
            base = runs.get(1.0) or next(iter(runs.values()))
            t = base["late_ttft_ms"]
            # Completion: turns that got no answer (an error, a timeout), per load.
            failed = " / ".join(str(runs[x].get("errors", 0)) if x in runs else "–" for x in loads)
            lines.append(f"| {o} | " + " | ".join(_share(runs[x]["attainment"]) if x in runs else "–" for x in loads)
                         + f" | {_load(g)} | {t['p50']} / {t['p95']} / {t['p99']} | "
                         f"{base['tpot_p95_ms']} | {failed} |")
    return "\n".join(lines)


def plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(out["workloads"])
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.6), squeeze=False)
    # One colour per option in every panel (and the one legend), whatever order each workload's runs came in:
    # matplotlib's default cycle, C0 to C9.
    colour = {o: f"C{i % 10}" for i, o in enumerate(OPTIONS)}
    shown: dict[str, Any] = {}
    for ax, w in zip(axes[0], names, strict=True):
        runs = out["workloads"][w]["runs"]
        for o in sorted(dict.fromkeys(r["option"] for r in runs), key=lambda x: OPTIONS.index(x)):
            pts = sorted((r["rate"], r["attainment"] or 0.0) for r in runs if r["option"] == o)
            (line,) = ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker="o", label=o, color=colour[o])
            shown.setdefault(o, line)
        ax.axhline(90, color="grey", linestyle=":", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_title(w)
        ax.set_xlabel("load (× the users, in one window)")
        ax.set_ylim(0, 102)
    axes[0][0].set_ylabel("turns meeting TTFT and TPOT (%)")
    axes[0][-1].legend(list(shown.values()), list(shown), fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--options", default=",".join(OPTIONS))
    ap.add_argument("--loads", default="0.5,1,2")
    ap.add_argument("--preset", default=Settings.preset)
    ap.add_argument("--realtime", action="store_true",
                    help="run on the wall clock × --speed (default: virtual time, exact and repeatable)")
    ap.add_argument("--speed", type=float, default=Settings.speed, help="--realtime: simulated s per real s")
    ap.add_argument("--prefill", type=int, default=Settings.prefill, help="P/D options' prefill nodes")
    ap.add_argument("--decode", type=int, default=Settings.decode,
                    help="P/D options' decode nodes (colocated and the pool: prefill + decode instances)")
    ap.add_argument("--jobs", type=int, default=1, help="virtual time: runs in parallel processes")
    ap.add_argument("--gateway-workers", type=int, default=Settings.gateway_workers,
                    help="virtual time: gateway processes, each a modelled server of its measured per-turn CPU")
    ap.add_argument("--ttft", type=float, default=Settings.ttft_ms, help="TTFT objective, ms")
    ap.add_argument("--tpot", type=float, default=Settings.tpot_ms, help="TPOT objective, ms")
    ap.add_argument("--sessions", type=int, default=Settings.sessions)
    ap.add_argument("--seed", type=int, default=Settings.seed)
    ap.add_argument("--trace", type=Path, default=Path(Settings.trace),
                    help="the trace workload's file, mooncake_trace format (default: the synthetic sample; the "
                         "table in docs/pool.md used the whole published conversation trace)")
    ap.add_argument("--tuning", type=tuning_pair, action="append", metavar="KEY=VALUE",
                    help="a [gateway.tuning] override for every option but colocated serving (repeatable), e.g. "
                         "release_lost_answers=true: a rule under evaluation (docs/placement.md)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--pool", type=Path, nargs="+", metavar="JSON",
                    help="pool the goodput.json of runs with different --seed into one table and plot")
    args = ap.parse_args()
    if args.pool:
        out = pool([json.loads(f.read_text()) for f in args.pool])
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "goodput-pooled.json").write_text(json.dumps(out, indent=1))
        plot(out, args.out / "goodput.png")
        print(render(out))
        print(f"\nseeds {out['seeds']} pooled; written {args.out / 'goodput-pooled.json'} and goodput.png")
        return 0
    unknown = set(args.options.split(",")) - set(OPTIONS)
    if unknown:
        ap.error(f"unknown options {sorted(unknown)}; known: {', '.join(OPTIONS)}")
    if not args.realtime and args.speed != Settings.speed:
        ap.error("--speed is for --realtime runs: virtual time is exact at speed 1")
    if args.tuning:  # a misspelt constant fails now, not in the first run's gateway
        from kvtether.gateway.config import ConfigError, load_config

        try:
            load_config(None, nodes=["http://n:1"], tuning=dict(args.tuning))
        except ConfigError as exc:
            ap.error(f"--tuning: {exc}")
    out = main_sync(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "goodput.json").write_text(json.dumps(out, indent=1))
    plot(out, args.out / "goodput.png")
    print(render(out))
    print(f"\nobjectives: TTFT <= {args.ttft:g} ms and TPOT <= {args.tpot:g} ms (engine); goodput: the highest load "
          f"with >= 90 % of turns meeting both; written {args.out / 'goodput.json'} and goodput.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
