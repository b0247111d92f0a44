"""Codex CLI (npm, unchanged, configured as a user configures it: a provider and nothing turned off) completes a
multi-turn session through kvtether's /v1/responses on the simulator, its later turns served from the decode
node's KV, the web_search tool it sends on every call left out by the gateway (examples/agents/codex.py)."""

from __future__ import annotations

import logging
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "agents"))
import codex

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(600)]


@pytest.mark.skipif(shutil.which("npm") is None, reason="Codex installs from npm: no npm here")
async def test_codex_runs_a_multi_turn_session_with_later_turns_reusing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvtether.gateway.api.hosted")
    # The configuration turns no tool of Codex's off: what it sends is what a user's Codex sends.
    assert not any(word in codex.CONFIG for word in ("web_search", "shell_tool", "goals", "apps", "[agents]"))
    out = await codex.run(speed=20.0, learn_estimates=False)
    assert len(out["runs"]) == len(codex.PROMPTS), out["runs"]
    for run in out["runs"]:
        assert codex.completed(run), codex.errors(run)
    # Codex names its thread (the session-id header) and the resumed prompts keep it: every model call of the three
    # prompts, tool-call rounds included, was pinned to that one session by the client's own id.
    turns = out["turns"]
    assert out["thread"] and len(turns) >= len(codex.PROMPTS)
    assert [(t["session"], t["session_source"]) for t in turns] == [(out["thread"], "header")] * len(turns)
    assert [(s["session_id"], s["turns"]) for s in out["sessions"]] == [(out["thread"], len(turns))]
    assert out["requests"] == len(turns)
    # Only the first model call computed its whole prompt; every later one reused the decode node's KV.
    assert turns[0]["reuse_source"] == "none"
    assert all(t["reuse_source"] in ("decode_local", "decode_pull") and t["reused_tokens"] > 0 for t in turns[1:]), \
        turns
    # The model reasoned (model_reasoning_effort): Codex kept the gateway's reasoning items, encrypted_content and
    # all, and resent them on the calls after (which the gateway accepted, and reused KV across).
    assert out["reasoning_items"] >= len(turns), out["reasoning_items"]
    # What Codex itself was told: the resumed prompts' calls found their history cached.
    assert all(codex.cached_tokens(run) > 0 for run in out["runs"][1:])
    # Codex sent its hosted web_search tool on every call: each time the gateway left it out of the turn (the
    # model behind it cannot call it) instead of refusing the call, and said so once for the thread.
    assert out["dropped_tools"].get("web_search") == len(turns), out["dropped_tools"]
    [warned] = [r.getMessage() for r in caplog.records if r.name == "kvtether.gateway.api.hosted"]
    assert out["thread"] in warned and "web_search" in warned
