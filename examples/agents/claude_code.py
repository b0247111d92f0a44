"""Claude Code, unchanged, through kvtether on the simulator: a multi-turn tool session in a scratch directory.

Installs Claude Code from npm (once, into ``.cache/agents``), starts a simulated P/D cluster and the gateway in
this process, and runs ``claude -p`` against it (``ANTHROPIC_BASE_URL``) in a scratch directory with only
read-only tools allowed (the simulated model's tool calls are noise: Read, Glob and Grep of a scratch
directory are harmless; Bash, Write and Edit are refused). Three prompts in one Claude Code session
(the later two ``--resume`` it). Prints Claude Code's results, then the gateway's turns: how many, where
each one's KV came from, and the tokens reused.

    .venv/bin/python examples/agents/claude_code.py [--turns 6] [--speed 20] [--json]

Needs Node.js ≥ 18 and npm (the npm registry); no network otherwise: Claude Code's non-essential traffic is
off and its home directory is a scratch one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import anyio
from common import agent_env, gateway_summary, npm_install, simulated_gateway

PACKAGE = "@anthropic-ai/claude-code@2.1.197"  # the version these runs were checked with


def install() -> Path:
    return npm_install(PACKAGE, "claude")


PROMPTS = (
    "Read README.txt and summarise the project.",
    "Look for other files in this directory and say what they are for.",
    "Sum up what you found in one sentence.",
)


async def run(turns: int = 6, speed: float = 20.0, binary: Path | None = None, *,
              learn_estimates: bool = True) -> dict[str, Any]:
    """One Claude Code session through a gateway on a simulated 1P 1D cluster, three prompts long (the second
    and third resume the session, so the history grows whatever the simulated model answers); what Claude Code
    and the gateway saw. ``learn_estimates=False``: the cost policy decides from its seeds alone (a test's choice,
    so that a busy machine's timings do not change which turns reuse)."""
    binary = binary or install()
    session = str(uuid.uuid4())
    runs: list[dict[str, Any]] = []
    async with simulated_gateway(speed, learn_estimates=learn_estimates) as (url, client):
        with tempfile.TemporaryDirectory(prefix="kvtether-claude-") as scratch:
            work, home = Path(scratch, "work"), Path(scratch, "home")
            await anyio.Path(work).mkdir()
            await anyio.Path(home).mkdir()
            await anyio.Path(work / "README.txt").write_text("A scratch project: one file, nothing to change.\n")
            env = agent_env(dict(os.environ), home, ("ANTHROPIC_", "CLAUDE_"), ANTHROPIC_BASE_URL=url,
                            ANTHROPIC_MODEL="kvtether-sim", ANTHROPIC_API_KEY="sk-kvtether-local",
                            CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", DISABLE_AUTOUPDATER="1",
                            DISABLE_TELEMETRY="1")
            for i, prompt in enumerate(PROMPTS):
                which = ["--session-id", session] if i == 0 else ["--resume", session]
                done = await anyio.run_process(
                    [str(binary), "-p", prompt, *which, "--max-turns", str(turns), "--output-format", "json",
                     "--allowedTools", "Read,Glob,Grep",
                     "--disallowedTools", "Bash,Write,Edit,NotebookEdit,WebFetch,WebSearch"],
                    cwd=work, env=env, check=False)
                runs.append({"exit_code": done.returncode, "result": _result(done.stdout),
                             "stderr": done.stderr.decode(errors="replace")[-2000:]})
        seen = await gateway_summary(client, url, "messages")
    return {"session": session, "runs": runs, **seen}


def _result(stdout: bytes) -> dict[str, Any]:
    lines = stdout.decode(errors="replace").strip().splitlines()
    try:
        out = json.loads(lines[-1]) if lines else {}
    except ValueError:
        return {"raw": lines[-1][:2000]}
    return out if isinstance(out, dict) else {"raw": str(out)[:2000]}


def completed(run: dict[str, Any]) -> bool:
    """Claude Code ran the prompt to its end: an answer, or its own --max-turns limit (the noise of a simulated
    model may call tools until then; the turns still went through the gateway)."""
    return run["result"].get("subtype") in ("success", "error_max_turns")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=6, help="Claude Code's --max-turns")
    ap.add_argument("--speed", type=float, default=20.0, help="simulated seconds per real second")
    ap.add_argument("--json", action="store_true", help="print everything as JSON")
    args = ap.parse_args()
    out = anyio.run(run, args.turns, args.speed)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for i, r in enumerate(out["runs"]):
            res = r["result"]
            print(f"prompt {i + 1}: claude exit {r['exit_code']}, {res.get('subtype')}, {res.get('num_turns')} "
                  f"turns, stop {res.get('stop_reason')}")
        for s in out["sessions"]:
            print(f"session {s['session_id']}: {s['turns']} turns on {s['decode']}")
        print("gateway turns by reuse source:", {k: int(v) for k, v in out["turns_by_source"].items() if v})
        print(f"tokens reused from decode handles: {int(out['reused_tokens'])}")
    sys.exit(0 if all(completed(r) for r in out["runs"]) else 1)


if __name__ == "__main__":
    main()
