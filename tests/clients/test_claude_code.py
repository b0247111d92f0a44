"""Claude Code (npm, unchanged) completes a multi-turn session through kvtether on the simulator, its later
turns served from the decode node's KV (examples/agents/claude_code.py)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "agents"))
import claude_code

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(600)]


@pytest.mark.skipif(shutil.which("npm") is None, reason="Claude Code installs from npm: no npm here")
async def test_claude_code_runs_a_multi_turn_session_with_later_turns_reusing() -> None:
    out = await claude_code.run(turns=6, speed=20.0, learn_estimates=False)
    for run in out["runs"]:
        assert claude_code.completed(run), (run["result"], run["stderr"])
    sessions = {s["session_id"]: s for s in out["sessions"]}
    # Claude Code's own session id pins every turn of the three prompts (a subagent it starts is its own).
    main = sessions[out["session"]]
    assert main["turns"] >= len(claude_code.PROMPTS)
    assert all(sid == out["session"] or sid.startswith(out["session"] + ":agent:") for sid in sessions)
    total = sum(s["turns"] for s in sessions.values())
    # Every request the gateway answered is a turn of those sessions. The others it refused as the API does: when
    # a run lasts long enough, Claude Code also asks for a model of its own (`claude-opus-4-8`), which the cluster
    # does not serve (404 model_not_found, counted 4xx); counted as turns, they failed one run in a few under load.
    statuses = out["requests_by_status"]
    assert total == statuses.get("2xx", 0) == out["requests"] - statuses.get("4xx", 0), statuses
    by_source = out["turns_by_source"]
    # Only each session's first turn computed its whole prompt; every later one reused the decode node's KV.
    assert by_source["none"] == len(sessions), by_source
    assert by_source["decode_local"] + by_source["decode_pull"] == total - len(sessions), by_source
