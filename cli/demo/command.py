"""``kvtether demo``: the reverse KV pull, end to end, in one command and without a GPU.

Starts an in-process simulated P/D cluster (1 prefill + 2 decode of a realistic preset), the gateway in
front of it, and runs a small bundled set of agent sessions through the SDK three times: with the gateway
policy ``no-pull`` (every turn recomputes its history on prefill), with ``pull`` (vLLM's reverse pull: P
pulls the verified history back from the decode node and computes only the suffix), and with ``auto``
(kvtether's per-turn cost-based choice between the suffix on the pinned decode node, the pull, and a cold
prefill). Each run gets a fresh cluster, so none sees another's caches. Prints one row per turn with the
three TTFTs side by side.

Times are *simulated* milliseconds: the simulator's clock runs at ``--speed`` × real time, and every
client-side measurement is multiplied by it. A clock slower than real time (speed < 1) makes the
simulator's own CPU work (HTTP hops, tokenizing, JSON) a small share of what it reports.
"""

from __future__ import annotations

import time

import anyio
import typer
from kvtether.cli.common.exits import EXIT_FAILED, EXIT_USAGE
from kvtether.cli.common.failures import fail
from kvtether.cli.common.options import FLAG
from kvtether.cli.common.signals import stop_signals_interrupt
from kvtether.cli.demo.render import render
from kvtether.cli.demo.run import DEFAULT_SPEED, DEMO_PRESET, DemoRun, demo_sessions, run_policy
from kvtether.gateway.policy.registry import names, policy_named
from kvtether.sdk.sessionfile import SessionRecord
from rich.console import Console

POLICY_BASELINE = "no-pull"
POLICY_PULL = "pull"
POLICY_KVTETHER = "auto"


# The command's options, in the order of its help.
_QUICK = typer.Option(False, "--quick/--no-quick", metavar=FLAG,
                      help="One short session (5 turns) instead of three of ten.")
_SPEED = typer.Option(DEFAULT_SPEED, "--speed", min=0.01, max=100.0,
                      help="Simulated time = real time × speed; reported times are simulated.")
_PRESET = typer.Option(DEMO_PRESET, "--preset", help="Simulator preset (see `kvtether sim --help`).")
_TRACE = typer.Option(False, "--trace/--no-trace", metavar=FLAG,
                      help="Capture the gateway's spans and print a per-turn phase timeline of the kvtether run.")
_POLICY = typer.Option(POLICY_KVTETHER, "--policy",
                       help="The kvtether side's gateway policy: auto (cost-based), pull (always pull D's KV back when "
                       "the guard verifies it) or reference.")
_PREFILL_CACHE = typer.Option(False, "--prefill-cache/--no-prefill-cache", metavar=FLAG,
                              help="Keep prefix caching on the prefill node (off by default, as in the vLLM blog's "
                              "runs: a busy P rarely still holds a history).")


def demo(
    quick: bool = _QUICK, speed: float = _SPEED, preset: str = _PRESET, trace: bool = _TRACE, policy: str = _POLICY,
    prefill_cache: bool = _PREFILL_CACHE,
) -> None:
    """Run bundled agent sessions on a simulated 1P+2D cluster: no pull, reverse pull, and kvtether's choice."""
    console = Console()
    pulling = _pulling_policies()
    if policy not in pulling:
        fail(Console(stderr=True), EXIT_USAGE,
             f"--policy must be {', '.join(pulling[:-1])} or {pulling[-1]}; got {policy!r}")
    if not console.is_terminal:
        # Piped or captured (CI, tests, README snippets): the turn table fits 80 columns, but the --trace timeline
        # (a column per phase) needs more than rich's default of 80.
        console = Console(width=max(console.width, 120))
    sessions = demo_sessions(quick)
    policies = [POLICY_BASELINE] + ([POLICY_PULL] if policy != POLICY_PULL else []) + [policy]
    _announce(console, sessions, preset, prefill_cache, speed, policy)
    t0 = time.perf_counter()
    # Ctrl-C and SIGTERM abort the demo (exit code 130, typer's for KeyboardInterrupt), also when the process started
    # with SIGINT ignored.
    with stop_signals_interrupt():
        runs = anyio.run(_run_all, console, policies, sessions, speed, preset, trace, prefill_cache)
    base, ours = runs[0], runs[-1]
    summary = render(console, base, ours, speed, preset, pulled=runs[1] if len(runs) == 3 else None)
    if trace:
        from kvtether.cli.demo.trace_view import render_timeline

        render_timeline(console, ours.spans, speed)
    console.print(f"[dim]wall time {time.perf_counter() - t0:.1f} s[/]")
    if summary["failed_turns"] or summary["answers_identical"] != summary["answers_compared"]:
        raise typer.Exit(EXIT_FAILED)


def _pulling_policies() -> list[str]:
    """The policies the kvtether side may run: those that pull D's KV back (the demo compares them with no pull)."""
    return [name for name in names() if policy_named(name).pulls]


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)


def _announce(console: Console, sessions: list[SessionRecord], preset: str, prefill_cache: bool, speed: float,
              policy: str) -> None:
    n_turns = sum(len(s.turns) for s in sessions)
    console.print(f"kvtether demo: {len(sessions)} agent session(s), {n_turns} turns, on a simulated "
                  f"{preset} cluster (1 prefill + 2 decode; prefix caching on P "
                  f"{'on' if prefill_cache else 'off'}), clock = real × {speed:g}. "
                  f"Policies {POLICY_BASELINE} (P recomputes the history)"
                  + (f", {POLICY_PULL} (reverse pull of the verified history)" if policy != POLICY_PULL else "")
                  + f" and {policy} (kvtether), each on a fresh cluster.")


async def _run_all(console: Console, policies: list[str], sessions: list[SessionRecord], speed: float, preset: str,
                   trace: bool, prefill_cache: bool) -> list[DemoRun]:
    """The policies one after the other, each on a fresh cluster; the spans of the last (kvtether's) when traced."""
    runs = []
    for p in policies:
        with console.status(f"running policy {p} …"):
            runs.append(await run_policy(p, sessions, speed=speed, preset=preset, trace=trace and p == policies[-1],
                                         prefill_cache=prefill_cache))
    return runs
