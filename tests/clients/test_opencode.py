"""OpenCode (npm, unchanged) completes a multi-turn session through kvtether on the simulator, under its own
session id, its later turns served from the decode node's KV (examples/agents/opencode.py)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "agents"))
import opencode

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(600)]


@pytest.mark.skipif(shutil.which("npm") is None, reason="OpenCode installs from npm: no npm here")
async def test_opencode_runs_a_multi_turn_session_under_its_own_id_with_later_turns_reusing() -> None:
    out = await opencode.run(steps=4, speed=20.0, learn_estimates=False)
    assert out["version"] == opencode.PACKAGE.rsplit("@", 1)[1]  # a cached install of another version: remove it
    assert len(out["runs"]) == len(opencode.PROMPTS), out["runs"]
    for run in out["runs"]:
        assert opencode.completed(run), (run["steps"], run["errors"], run["stderr"])
    # OpenCode made the session (its ids start with "ses_") and every prompt after the first continued it.
    session = out["session"]
    assert session is not None and session.startswith("ses_"), session
    assert all(run["sessions"] == [session] for run in out["runs"]), [run["sessions"] for run in out["runs"]]
    # Only `read` is offered to the model, whatever tools its noise picks.
    assert {call["tool"] for run in out["runs"] for call in run["tools"]} <= {"read"}
    turns = out["turns"]
    # Every model call OpenCode made went to the gateway (none to its hosted provider), and the gateway pinned
    # each one to OpenCode's own session id, named by a header: not an id of its own or a history-hash match.
    assert len(turns) == sum(len(run["steps"]) for run in out["runs"]) == out["requests"]
    assert len(turns) >= len(opencode.PROMPTS)
    assert [s["session_id"] for s in out["sessions"]] == [session]
    assert out["sessions"][0]["turns"] == len(turns)
    assert all(t["session"] == session and t["session_source"] == "header" for t in turns), turns
    # Only the first turn computed its whole prompt; every later one reused the decode node's KV.
    assert turns[0]["reuse_source"] == "none", turns
    assert all(t["reuse_source"] in ("decode_local", "decode_pull") and t["reused_tokens"] > 0
               for t in turns[1:]), turns
    by_source = out["turns_by_source"]
    assert by_source["none"] == 1, by_source
    assert by_source["decode_local"] + by_source["decode_pull"] == len(turns) - 1, by_source
