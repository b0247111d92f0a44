"""The OpenAI Agents SDK's default model (Responses API) completes a multi-turn conversation through kvtether on
the simulator, its later model calls served from the decode node's KV (examples/agents/agents_sdk.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "agents"))
import agents_sdk

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]


@pytest.mark.parametrize("identity", ["sdk", "header"])
async def test_agents_sdk_default_model_runs_a_conversation_with_later_turns_reusing(identity: str) -> None:
    out = await agents_sdk.run(speed=20.0, identity=identity, learn_estimates=False)
    assert out["model_class"] == "OpenAIResponsesModel"
    assert len(out["runs"]) == len(agents_sdk.PROMPTS)
    for run in out["runs"]:
        assert agents_sdk.completed(run), run
    # The session id the client sent (StampedAsyncOpenAI's, or the extra header) pinned every model call of the
    # conversation, tool-call rounds included, and the gateway saw no other session.
    turns = out["turns"]
    assert len(turns) == sum(run["model_calls"] for run in out["runs"]) == out["requests"]
    assert [(t["session"], t["session_source"]) for t in turns] == [(out["session"], "header")] * len(turns)
    assert [(s["session_id"], s["turns"]) for s in out["sessions"]] == [(out["session"], len(turns))]
    if identity == "sdk":  # and kvtether's client recorded each of those calls for the session
        assert out["sdk_recorded_calls"] == len(turns)
    # Only the first model call computed its whole prompt; every later one reused the decode node's KV.
    assert turns[0]["reuse_source"] == "none"
    assert all(t["reuse_source"] in ("decode_local", "decode_pull") and t["reused_tokens"] > 0 for t in turns[1:]), \
        turns
    # What the SDK itself was told: every run after the first found the conversation so far cached.
    assert all(run["cached_tokens"] > 0 for run in out["runs"][1:]), out["runs"]
