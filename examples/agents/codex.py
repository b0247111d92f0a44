"""Codex CLI, unchanged, through kvtether on the simulator: a multi-turn tool session in a scratch directory.

Installs the Codex CLI from npm (once, into ``.cache/agents``), starts a simulated P/D cluster and the gateway in
this process, and runs ``codex exec`` against the gateway's ``/v1/responses`` in a scratch directory, configured
only through a scratch ``CODEX_HOME/config.toml`` (``CONFIG`` below: the configuration a user writes, a custom
model provider with ``wire_api = "responses"`` and nothing else of Codex's turned off). Three prompts in one
Codex thread (the later two ``codex exec resume <thread>`` it), so every model call of the session resends a
growing history. Prints what Codex answered, then the gateway's turns: how many, where each one's KV came from,
the tokens reused, and the hosted tools the gateway left out (Codex sends ``web_search`` on every call; the
gateway drops it, ``hosted_tools = "drop"``).

    .venv/bin/python examples/agents/codex.py [--speed 20] [--json]

Codex offers all of its tools (shell, sub-agents, goals, web search…). The simulated model calls a random tool
on about 60 % of its answers, with random words as arguments, so it is told to call only two harmless ones
(``CALLABLE``): ``view_image`` (a random word as the path names no image in the scratch directory) and
``request_user_input`` (refused outside Plan mode). A random shell command (``yes``, ``find``) or sub-agent would
make the run Codex's experiment, not the gateway's; the sandbox is read-only anyway. The model reasons
(``model_reasoning_effort``), so Codex keeps and resends reasoning items too. Needs Node.js and npm (the npm
registry); no network otherwise: with analytics, the update check and the plugin marketplace off, Codex connects
to nothing but the gateway.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import anyio
from common import agent_env, gateway_summary, npm_install, print_turns, simulated_gateway, traced_turns
from kvtether.gateway import telemetry as T

PACKAGE = "@openai/codex@0.171.0"  # the version these runs were checked with

# CODEX_HOME/config.toml. The first two lines and the [model_providers.kvtether] table are all a user needs to
# point Codex at kvtether (docs/clients/codex.md). The rest is this example's, and turns no tool off: the
# simulated model reasons (so the reasoning items Codex resends, with their encrypted_content, go through the
# gateway too), Codex runs unattended in a read-only sandbox, and it stays off the network (no update check, no
# analytics, and no plugin marketplace sync, which is a `git ls-remote` of github.com at start-up).
CONFIG = """\
model = "{model}"
model_provider = "kvtether"
model_reasoning_effort = "low"
approval_policy = "never"
sandbox_mode = "read-only"
check_for_update_on_startup = false

[model_providers.kvtether]
name = "kvtether"
base_url = "{base_url}"
wire_api = "responses"

[features]
plugins = false

[analytics]
enabled = false
"""
# The only tools the simulated model calls (see the module's docstring); Codex offers all of its own.
CALLABLE = ("view_image", "request_user_input")

PROMPTS = (
    "Read README.txt and summarise the project.",
    "Look at the other files in this directory and say what they are for.",
    "Sum up what you found in one sentence.",
)


def install() -> Path:
    return npm_install(PACKAGE, "codex")


async def run(speed: float = 20.0, binary: Path | None = None, *, learn_estimates: bool = True,
              timeout_s: float = 120.0) -> dict[str, Any]:
    """One Codex thread through a gateway on a simulated 1P 1D cluster, three prompts long (the second and third
    resume the thread, so the history grows whatever the simulated model answers); what Codex and the gateway
    saw. ``learn_estimates=False``: the cost policy decides from its seeds alone (a test's choice, so that a busy
    machine's timings do not change which turns reuse). ``timeout_s`` bounds each ``codex exec``."""
    binary = binary or install()
    runs: list[dict[str, Any]] = []
    thread: str | None = None
    tracer, spans = T.in_memory_provider()  # the gateway's spans: each turn's session and KV reuse
    async with simulated_gateway(speed, learn_estimates=learn_estimates, tracer_provider=tracer,
                                 callable_tools=CALLABLE) as (url, client):
        with tempfile.TemporaryDirectory(prefix="kvtether-codex-") as scratch:
            work, home = Path(scratch, "work"), Path(scratch, "home")
            codex_home = home / ".codex"
            await anyio.Path(work).mkdir()
            await anyio.Path(codex_home).mkdir(parents=True)
            await anyio.Path(work / "README.txt").write_text("A scratch project: a few files, nothing to change.\n")
            await anyio.Path(work / "notes.txt").write_text("Notes: the project has no code yet.\n")
            config = CONFIG.format(model="kvtether-sim", base_url=f"{url}/v1")
            await anyio.Path(codex_home / "config.toml").write_text(config)
            env = agent_env(dict(os.environ), home, ("OPENAI_", "CODEX_"), CODEX_HOME=str(codex_home), NO_COLOR="1")
            for i, prompt in enumerate(PROMPTS):
                # `codex exec [options] resume <thread> <prompt>`: every prompt runs with the same options.
                argv = [str(binary), "exec", "--json", "--skip-git-repo-check", "--strict-config", "-C", str(work)]
                if i > 0:
                    if thread is None:  # the first prompt failed before Codex named its thread
                        break
                    argv += ["resume", thread]
                code, stdout, stderr = await _codex([*argv, prompt], work, env, timeout_s)
                events = _events(stdout)
                thread = thread or next((e.get("thread_id") for e in events if e.get("type") == "thread.started"),
                                        None)
                timed_out = f"timed out after {timeout_s} s and killed\n" if code is None else ""
                runs.append({"exit_code": code, "events": events,
                             "stderr": timed_out + stderr.decode(errors="replace")[-2000:]})
                if code is None:
                    break
            reasoning = _reasoning_items(codex_home)
        seen = await gateway_summary(client, url, "responses")
    return {"thread": thread, "runs": runs, "reasoning_items": reasoning,
            "turns": traced_turns(spans, "/v1/responses"), **seen}


async def _codex(argv: list[str], work: Path, env: dict[str, str], timeout_s: float) -> tuple[int | None, bytes, bytes]:
    """Run one ``codex exec``: its exit code (None when it ran past ``timeout_s`` and was killed), stdout, stderr."""
    out, err = bytearray(), bytearray()

    async def drain(stream: Any, into: bytearray) -> None:
        async for chunk in stream:
            into.extend(chunk)

    # stdin closed: Codex appends piped stdin to the prompt, and would wait for an inherited one. A session of its
    # own: the npm launcher (node) runs the native binary as its child, and a timeout must end both.
    async with await anyio.open_process(argv, cwd=work, env=env, stdin=subprocess.DEVNULL,
                                        start_new_session=True) as proc:
        with anyio.move_on_after(timeout_s) as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(drain, proc.stdout, out)
                tg.start_soon(drain, proc.stderr, err)
                await proc.wait()
        if scope.cancelled_caught:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            return None, bytes(out), bytes(err)
    return proc.returncode, bytes(out), bytes(err)


def _reasoning_items(codex_home: Path) -> int:
    """Reasoning items with encrypted_content that Codex recorded in its session log (CODEX_HOME/sessions): what
    it resends on every later model call, for the gateway to read back."""
    count = 0
    for log in codex_home.glob("sessions/**/*.jsonl"):
        for line in log.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            item = record.get("payload") if isinstance(record, dict) and record.get("type") == "response_item" else None
            count += isinstance(item, dict) and item.get("type") == "reasoning" and bool(item.get("encrypted_content"))
    return count


def _events(stdout: bytes) -> list[dict[str, Any]]:
    """``codex exec --json`` output: one JSON event a line."""
    out = []
    for line in stdout.decode(errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict):
            out.append(event)
    return out


def answer(run: dict[str, Any]) -> str | None:
    """The last message Codex gave for the prompt, or None."""
    texts = [e["item"].get("text") for e in run["events"]
             if e.get("type") == "item.completed" and (e.get("item") or {}).get("type") == "agent_message"]
    return texts[-1] if texts else None


def cached_tokens(run: dict[str, Any]) -> int:
    """Prompt tokens the gateway's answers to this prompt's model calls said were cached (Codex's own count)."""
    return sum(int((e.get("usage") or {}).get("cached_input_tokens") or 0)
               for e in run["events"] if e.get("type") == "turn.completed")


def completed(run: dict[str, Any]) -> bool:
    """Codex ran the prompt to its end: exit 0, its turn completed (not failed), and an answer."""
    return (run["exit_code"] == 0 and any(e.get("type") == "turn.completed" for e in run["events"])
            and not any(e.get("type") == "turn.failed" for e in run["events"]) and bool(answer(run)))


def errors(run: dict[str, Any]) -> list[str]:
    """What Codex reported as errors (reconnects, failed turns), for a failure's message."""
    out = [str(e.get("message") or e.get("error")) for e in run["events"] if e.get("type") in ("error", "turn.failed")]
    return [*out, run["stderr"][-800:]] if run["stderr"].strip() else out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--speed", type=float, default=20.0, help="simulated seconds per real second")
    ap.add_argument("--json", action="store_true", help="print everything as JSON")
    args = ap.parse_args()
    out = anyio.run(run, args.speed)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for i, r in enumerate(out["runs"]):
            state = "completed" if completed(r) else "FAILED " + "; ".join(errors(r))[-300:]
            print(f"prompt {i + 1}: codex exit {r['exit_code']}, {state}, {cached_tokens(r)} cached prompt tokens: "
                  f"{(answer(r) or '')[:50]!r}")
        print_turns(out["turns"])
        print("gateway turns by reuse source:", {k: int(v) for k, v in out["turns_by_source"].items() if v})
        print(f"tokens pulled back from decode handles (decode_pull turns): {int(out['reused_tokens'])}; reasoning "
              f"items Codex kept and resent: {out['reasoning_items']}")
        print("hosted tools the gateway left out of Codex's calls (x-kvtether-dropped-tools):",
              out["dropped_tools"] or "none")
    sys.exit(0 if out["runs"] and len(out["runs"]) == len(PROMPTS) and all(completed(r) for r in out["runs"])
             else 1)


if __name__ == "__main__":
    main()
