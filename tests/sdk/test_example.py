"""examples/agent_loop.py runs end to end against an OpenAI-compatible server and records."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from kvtether.sdk.sessionfile import read_sessions

from tests.support.fake_openai import FakeOpenAI

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "agent_loop.py"


@pytest.mark.anyio
async def test_agent_loop_example(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("agent_loop_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    fake = FakeOpenAI().start()
    try:
        rec = tmp_path / "agent.jsonl"
        session = await module.run_agent(fake.url, record_to=str(rec))
    finally:
        fake.stop()
    # The fake model calls the first tool, then answers with the tool's result.
    assert len(session.turns) == 2 and all(t.done and t.ttft_ms is not None for t in session.turns)
    out = capsys.readouterr().out
    assert "answer: Done:" in out and '"city": "x"' in out
    [recorded] = read_sessions(rec)
    assert recorded.session_id == session.id and recorded.model == "fake-model"
    assert [t.recorded and t.recorded.finish_reason for t in recorded.turns] == ["tool_calls", "stop"]
    seen = fake.chat_requests()
    assert all(s.headers["x-session-id"] == session.id for s in seen)
    assert [s.headers["x-kvtether-turn"] for s in seen] == ["0", "1"]
