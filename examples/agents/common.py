"""What the agent runs share: an agent installed from npm once, a simulated P/D cluster with the gateway in front
of it in this process, and what the gateway saw of the agent's turns."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
from kvtether.cli.simstack import StackSpec, sim_stack
from kvtether.gateway import telemetry as T
from kvtether.gateway.nodes.cluster import sample_sum
from opentelemetry import trace

CACHE = Path(__file__).resolve().parents[2] / ".cache" / "agents"
SOURCES = ("decode_pull", "decode_local", "prefill_cache", "none")


def npm_install(package: str, binary: str) -> Path:
    """`binary` of the npm `package` (name@version), installed into .cache/agents the first time."""
    home = CACHE / package.rsplit("@", 1)[0].replace("/", "_").lstrip("@")
    path = home / "node_modules" / ".bin" / binary
    if path.exists():
        return path
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError(f"npm is needed to install {package} (Node.js ≥ 18)")
    home.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--prefix", str(home), package],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"npm install {package} failed: {done.stderr[-2000:]}")
    if not path.exists():
        raise RuntimeError(f"npm installed {package} but {path} is missing")
    return path


@contextlib.asynccontextmanager
async def simulated_gateway(speed: float, *, learn_estimates: bool = True,
                            tracer_provider: trace.TracerProvider | None = None,
                            callable_tools: tuple[str, ...] | None = None,
                            ) -> AsyncIterator[tuple[str, httpx.AsyncClient]]:
    """A gateway (policy auto) on a simulated 1P 1D cluster; its URL and a client. ``learn_estimates=False``: the
    cost policy decides from its seeds alone, so a busy machine's timings do not change which turns reuse.
    ``tracer_provider``: where the gateway's spans go (``traced_turns`` reads the turns back from them).
    ``callable_tools``: the only functions the simulated model calls (the agent still offers all of its own)."""
    # The gateway's own defaults under these settings, not the stack's calibrated ones.
    spec = StackSpec(preset="toy", speed=speed, cluster={"callable_tools": callable_tools})
    gateway = {"metrics_poll_interval_s": 0.5, "learn_estimates": learn_estimates}
    async with sim_stack(spec, "auto", gateway=gateway, calibrated=False, tracer_provider=tracer_provider) as stack, \
            httpx.AsyncClient(timeout=30) as client:
        yield stack.url, client


async def gateway_summary(client: httpx.AsyncClient, url: str, route: str) -> dict[str, Any]:
    """The gateway's sessions, its turns by where their KV came from, its requests on `route`, and the hosted
    tools it left out of them, by type."""
    text = (await client.get(f"{url}/metrics")).text
    dropped = {kind: sample_sum(text, T.M_DROPPED_TOOLS, type=kind) for kind in T.DROPPED_TOOL_TYPES}
    return {
        "sessions": (await client.get(f"{url}/admin/sessions")).json(),
        "turns_by_source": {s: sample_sum(text, "kvtether_ttft_seconds_count", reuse_source=s) for s in SOURCES},
        "reused_tokens": sample_sum(text, "kvtether_reused_tokens_total"),
        "requests": sample_sum(text, "kvtether_requests_total", route=route),
        # By status class: a request the gateway refused (an unknown model, a prompt over the context) is no turn.
        "requests_by_status": {status: int(n) for status in ("2xx", "4xx", "5xx")
                               if (n := sample_sum(text, "kvtether_requests_total", route=route, status=status))},
        "dropped_tools": {kind: int(n) for kind, n in dropped.items() if n},
    }


def traced_turns(exporter: Any, path: str) -> list[dict[str, Any]]:
    """The gateway's turns on `path` in the order they arrived, from its request spans (an
    ``InMemorySpanExporter`` of ``telemetry.in_memory_provider``): the session id the client named (None when the
    gateway made one up or found it by the history's hash), how the gateway found the session, where the turn's
    KV came from and how many of its prompt tokens that KV covered. The metrics have the totals only."""
    spans = [s for s in exporter.get_finished_spans()
             if s.kind == trace.SpanKind.SERVER and (s.attributes or {}).get(T.HTTP_ROUTE) == path]
    turns = []
    for s in sorted(spans, key=lambda s: s.start_time or 0):
        a = s.attributes or {}
        turns.append({"session": a.get(T.GEN_AI_CONVERSATION_ID), "session_source": a.get(T.ATTR_SESSION_SOURCE),
                      "reuse_source": a.get(T.ATTR_REUSE_SOURCE), "reused_tokens": a.get(T.ATTR_REUSE_TOKENS),
                      "plan": a.get(T.ATTR_PLAN_ACTION)})
    return turns


def print_turns(turns: list[dict[str, Any]]) -> None:
    """``traced_turns`` as a table: one line a turn."""
    print(f"{'turn':>4}  {'session (as the gateway saw it)':<44} {'found by':<8} {'reuse source':<13} {'reused':>7}")
    for i, t in enumerate(turns, 1):
        print(f"{i:>4}  {t['session'] or '-':<44} {t['session_source'] or '-':<8} {t['reuse_source'] or '-':<13} "
              f"{t['reused_tokens'] if t['reused_tokens'] is not None else '-':>7}")


def agent_env(environ: dict[str, str], home: Path, drop: tuple[str, ...], **extra: str) -> dict[str, str]:
    """The agent's environment: this one without the variables that would point it elsewhere, a scratch home."""
    return {**{k: v for k, v in environ.items() if not k.startswith(drop)}, "HOME": str(home), **extra}
