"""OpenCode, unchanged, through kvtether on the simulator: a multi-turn tool session in a scratch directory.

Installs OpenCode from npm (once, into ``.cache/agents``), starts a simulated P/D cluster and the gateway in
this process, and runs ``opencode run`` against it: an OpenAI-compatible provider (``@ai-sdk/openai-compatible``,
chat completions) whose base URL is the gateway, given in ``OPENCODE_CONFIG_CONTENT``. Every permission is
denied but ``read`` (the simulated model's tool calls are noise: reading a scratch directory is harmless; edit,
bash, webfetch, subagents and paths outside the directory are refused, and OpenCode does not even offer the
model a denied tool). Three prompts in one OpenCode session (the later two continue it with ``--session``).
Prints what OpenCode did per prompt, then the gateway's turns: the session each named, where its KV came from,
and the tokens reused.

    .venv/bin/python examples/agents/opencode.py [--steps 6] [--speed 20] [--json]

Needs Node.js ≥ 18 and npm (the npm registry); no network otherwise: OpenCode's models.dev fetch, autoupdate,
sharing and background plugin install are off, its home and XDG directories are scratch ones, and its only
provider is the gateway.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterable
from pathlib import Path
from typing import Any

import anyio
from common import agent_env, gateway_summary, npm_install, print_turns, simulated_gateway, traced_turns
from kvtether.gateway import telemetry as T

PACKAGE = "opencode-ai@1.18.33"  # the version these runs were checked with
PROVIDER, MODEL = "kvtether", "kvtether-sim"
RUN_TIMEOUT_S = 120.0  # one prompt (a few seconds here); OpenCode keeps retrying a provider it cannot reach

PROMPTS = (
    "Read README.txt and summarise the project.",
    "Look for other files in this directory and say what they are for.",
    "Sum up what you found in one sentence.",
)


def install() -> Path:
    return npm_install(PACKAGE, "opencode")


def opencode_config(base_url: str, steps: int) -> dict[str, Any]:
    """OpenCode's configuration: the gateway as its one provider, read-only tools, nothing that phones home.

    OpenCode falls back to its own hosted provider (``opencode/big-pickle``, which needs no key) whenever the
    configuration that names another provider is not loaded — no project ``opencode.json`` found from the working
    directory, ``OPENCODE_DISABLE_PROJECT_CONFIG`` set, another ``XDG_CONFIG_HOME`` — and then retries a host it
    cannot reach. Handed over in ``OPENCODE_CONFIG_CONTENT``, this one is loaded wherever OpenCode runs, and
    ``--model provider/model`` on the command line turns any such fallback into an immediate "Model not found";
    ``enabled_providers`` keeps the hosted provider out even of a merged configuration."""
    return {
        "$schema": "https://opencode.ai/config.json",
        "model": f"{PROVIDER}/{MODEL}",
        "small_model": f"{PROVIDER}/{MODEL}",
        "enabled_providers": [PROVIDER],
        "provider": {PROVIDER: {
            "npm": "@ai-sdk/openai-compatible",
            "name": "kvtether",
            "options": {"baseURL": f"{base_url}/v1", "apiKey": "sk-kvtether-local"},
            "models": {MODEL: {"name": MODEL, "tool_call": True}},
        }},
        # The last matching rule wins: everything denied, then `read` allowed (which keeps external_directory
        # denied, so a read outside the working directory is refused too).
        "permission": {"*": "deny", "read": "allow"},
        # The simulated model calls a tool 60 % of the time: a bound on the steps of one prompt, as a real
        # model's own stop would be.
        "agent": {"build": {"steps": steps}},
        "autoupdate": False,
        "share": "disabled",
    }


def _sandbox_home(home: Path) -> None:
    """OpenCode installs its plugin SDK (``@opencode-ai/plugin``, from the npm registry) into each config
    directory in the background unless that directory already has ``node_modules`` and a lock file listing it.
    No plugins are configured, so an empty listing is all it needs."""
    config = home / ".config" / "opencode"
    (config / "node_modules").mkdir(parents=True)
    (config / "package.json").write_text(json.dumps({"dependencies": {"@opencode-ai/plugin": "*"}}))
    (config / "package-lock.json").write_text(json.dumps(
        {"lockfileVersion": 3, "packages": {"": {"dependencies": {"@opencode-ai/plugin": "*"}}}}))


def opencode_env(home: Path, config: dict[str, Any]) -> dict[str, str]:
    xdg = {f"XDG_{k.upper()}_HOME": str(home / d) for k, d in
           (("config", ".config"), ("data", ".local/share"), ("state", ".local/state"), ("cache", ".cache"))}
    return agent_env(dict(os.environ), home, ("OPENCODE_", "XDG_"), **xdg,
                     OPENCODE_CONFIG_CONTENT=json.dumps(config),
                     # No project or parent-directory opencode.json can add to (or replace) the one above.
                     OPENCODE_DISABLE_PROJECT_CONFIG="1",
                     OPENCODE_DISABLE_MODELS_FETCH="1",  # models.dev: the bundled snapshot does
                     OPENCODE_DISABLE_AUTOUPDATE="1", OPENCODE_DISABLE_SHARE="1",
                     OPENCODE_DISABLE_LSP_DOWNLOAD="1", OPENCODE_DISABLE_CLAUDE_CODE="1")


async def run(steps: int = 6, speed: float = 20.0, binary: Path | None = None, *,
              learn_estimates: bool = True) -> dict[str, Any]:
    """One OpenCode session through a gateway on a simulated 1P 1D cluster, three prompts long (the second and
    third continue the session OpenCode made for the first, so the history grows whatever the simulated model
    answers); what OpenCode and the gateway saw. ``learn_estimates=False``: the cost policy decides from its
    seeds alone (a test's choice, so that a busy machine's timings do not change which turns reuse)."""
    binary = binary or install()
    version = (await anyio.run_process([str(binary), "--version"], stdin=subprocess.DEVNULL)).stdout.decode().strip()
    provider, exporter = T.in_memory_provider()
    runs: list[dict[str, Any]] = []
    session: str | None = None
    async with simulated_gateway(speed, learn_estimates=learn_estimates, tracer_provider=provider) as (url, client):
        with tempfile.TemporaryDirectory(prefix="kvtether-opencode-") as scratch:
            work, home = Path(scratch, "work"), Path(scratch, "home")
            await anyio.Path(work).mkdir()
            await anyio.Path(work / "README.txt").write_text("A scratch project: one file, nothing to change.\n")
            _sandbox_home(home)
            env = opencode_env(home, opencode_config(url, steps))
            for i, prompt in enumerate(PROMPTS):
                # A title of our own: otherwise the first prompt also asks the model for one, a turn that is
                # not part of the conversation but carries its session id.
                which = ["--title", "kvtether scratch"] if i == 0 else ["--session", session or ""]
                t0 = time.monotonic()
                code, stdout, stderr = await _opencode(
                    [str(binary), "run", prompt, *which, "--model", f"{PROVIDER}/{MODEL}", "--format", "json",
                     "--print-logs", "--log-level", "WARN"], work, env)
                runs.append({"exit_code": code, "seconds": round(time.monotonic() - t0, 1),
                             **_events(stdout.decode(errors="replace")),
                             "stderr": stderr.decode(errors="replace")[-2000:]})
                session = session or runs[-1]["session"]
                if session is None:
                    break  # nothing to continue
        seen = await gateway_summary(client, url, "chat")
    return {"version": version, "session": session, "runs": runs,
            "turns": traced_turns(exporter, "/v1/chat/completions"), **seen}


async def _opencode(command: list[str], cwd: Path, env: dict[str, str]) -> tuple[int | None, bytes, bytes]:
    """One ``opencode run``: its exit code (None: killed after RUN_TIMEOUT_S) and what it wrote so far."""
    out, err = bytearray(), bytearray()

    async def drain(stream: AsyncIterable[bytes], into: bytearray) -> None:
        async for chunk in stream:
            into += chunk

    code: int | None = None
    with anyio.move_on_after(RUN_TIMEOUT_S):  # cancelling kills the process (anyio's Process.aclose)
        # No stdin: `opencode run` reads a piped stdin to its end as part of the prompt.
        async with (await anyio.open_process(command, cwd=cwd, env=env, stdin=subprocess.DEVNULL) as process,
                    anyio.create_task_group() as tg):
            assert process.stdout is not None and process.stderr is not None
            tg.start_soon(drain, process.stdout, out)
            tg.start_soon(drain, process.stderr, err)
            code = await process.wait()
    return code, bytes(out), bytes(err)


def _events(stdout: str) -> dict[str, Any]:
    """What ``opencode run --format json`` reported: its session, its steps (one model call each: why it ended and
    the prompt tokens the server said were cached), its tool calls and their outcome, its answer, its errors."""
    sessions: list[str] = []
    steps: list[dict[str, Any]] = []
    tools: list[dict[str, Any]] = []
    text: list[str] = []
    errors: list[Any] = []
    for line in stdout.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if not isinstance(event, dict):
            continue
        if event.get("sessionID") and event["sessionID"] not in sessions:
            sessions.append(event["sessionID"])
        part = event.get("part") or {}
        kind = event.get("type")
        if kind == "step_finish":
            tokens = part.get("tokens") or {}
            steps.append({"reason": part.get("reason"), "input": tokens.get("input"),
                          "cached": (tokens.get("cache") or {}).get("read")})
        elif kind == "tool_use":
            state = part.get("state") or {}
            tools.append({"tool": part.get("tool"), "status": state.get("status"),
                          "error": (state.get("error") or "")[:200] or None})
        elif kind == "text":
            text.append(part.get("text") or "")
        elif kind == "error":
            errors.append(event.get("error") or event)
    return {"session": sessions[0] if sessions else None, "sessions": sessions, "steps": steps, "tools": tools,
            "text": "".join(text)[-500:], "errors": errors}


def completed(run: dict[str, Any]) -> bool:
    """OpenCode ran the prompt to its end: exit 0, no error event, and a last step that stopped on an answer."""
    return (run["exit_code"] == 0 and not run["errors"] and bool(run["steps"])
            and run["steps"][-1]["reason"] == "stop")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6, help="OpenCode's steps per prompt (agent.build.steps)")
    ap.add_argument("--speed", type=float, default=20.0, help="simulated seconds per real second")
    ap.add_argument("--json", action="store_true", help="print everything as JSON")
    args = ap.parse_args()
    out = anyio.run(run, args.steps, args.speed)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"OpenCode {out['version']}, session {out['session']}")
        for i, r in enumerate(out["runs"]):
            calls = ", ".join(f"{t['tool']} {t['status']}" for t in r["tools"]) or "none"
            last = r["steps"][-1]["reason"] if r["steps"] else None
            print(f"prompt {i + 1}: opencode exit {r['exit_code']} after {r['seconds']} s, {len(r['steps'])} steps, "
                  f"last {last}, tool calls: {calls}")
        print_turns(out["turns"])
        print("gateway turns by reuse source:", {k: int(v) for k, v in out["turns_by_source"].items() if v})
        print(f"tokens reused: {sum(t['reused_tokens'] or 0 for t in out['turns'])}")
    sys.exit(0 if out["runs"] and all(completed(r) for r in out["runs"]) else 1)


if __name__ == "__main__":
    main()
