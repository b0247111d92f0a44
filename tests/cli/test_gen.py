"""The synthetic session generator: determinism, shape, token counts, and `kvtether gen`."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import typer
from kvtether.cli.gen import command as cmd_gen
from kvtether.cli.gen.generate import GenParams, generate_sessions, parse_mix
from kvtether.sdk.sessionfile import read_sessions
from typer.testing import CliRunner


def _dump(params: GenParams) -> list[dict]:
    return [s.to_json() for s in generate_sessions(params)]


def test_deterministic_given_seed() -> None:
    assert _dump(GenParams(seed=7)) == _dump(GenParams(seed=7))
    assert _dump(GenParams(seed=7)) != _dump(GenParams(seed=8))


def test_session_shape() -> None:
    p = GenParams(sessions=2, turns=5, new_tokens="100-200", output_tokens="30", think_ms=1000, user_message_prob=0)
    sessions = generate_sessions(p)
    assert len(sessions) == 2
    for s in sessions:
        assert s.tools and {t["function"]["name"] for t in s.tools} >= {"read_file", "run_shell"}
        first = s.turns[0]
        assert first.messages is not None and [m["role"] for m in first.messages] == ["system", "user"]
        assert first.delay_ms == 0
        for prev, turn in zip(s.turns, s.turns[1:], strict=False):
            assert turn.new_messages is not None and turn.new_messages[0]["role"] == "tool"
            assert prev.recorded is not None and prev.recorded.answer is not None
            assert turn.new_messages[0]["tool_call_id"] == prev.recorded.answer["tool_calls"][0]["id"]
            assert 100 <= len(turn.new_messages[0]["content"].split()) <= 200
            assert 500 <= turn.delay_ms <= 1500
        assert all(t.params["max_tokens"] == 30 and t.params["ignore_eos"] for t in s.turns)
        last = s.turns[-1].recorded
        assert last is not None and last.answer is not None and "tool_calls" not in last.answer
    # The system prompt is shared: one agent, many tasks.
    assert sessions[0].turns[0].messages[0] == sessions[1].turns[0].messages[0]  # type: ignore[index]


def test_history_grows() -> None:
    (s,) = generate_sessions(GenParams(sessions=1, turns=4, think_ms=0))
    sizes = [len(msgs) for _, msgs, _ in s.requests("recorded")]
    # Each turn appends the previous answer and at least one tool result.
    assert all(b >= a + 2 for a, b in itertools.pairwise(sizes)) and sizes[0] == 2


def test_parse_mix() -> None:
    mix = parse_mix("50-500:0.85,2000-8000:0.15")
    assert [(m.lo, m.hi, m.weight) for m in mix] == [(50, 500, 0.85), (2000, 8000, 0.15)]
    assert [(m.lo, m.hi) for m in parse_mix("300")] == [(300, 300)]
    for bad in ("", "a-b", "500-50", "10:0", "-5"):
        with pytest.raises(ValueError):
            parse_mix(bad)


def test_gen_command_roundtrip(tmp_path: Path) -> None:
    app = typer.Typer()
    cmd_gen.register(app)
    out = tmp_path / "g.jsonl"
    argv = ["gen", "--sessions", "3", "--turns", "4", "--seed", "5", "--new-tokens", "10-20", "-o", str(out)]
    r = CliRunner().invoke(app, argv)
    assert r.exit_code == 0, r.stderr
    assert "wrote 3 sessions, 12 turns" in r.stderr
    sessions = read_sessions(out)
    assert [len(s.turns) for s in sessions] == [4, 4, 4]
    r2 = CliRunner().invoke(app, argv[:-2])  # to stdout
    from_stdout = [json.loads(line) for line in r2.stdout.splitlines()]
    assert from_stdout == [json.loads(x) for x in out.read_text().splitlines()]
    bad = CliRunner().invoke(app, ["gen", "--new-tokens", "lots"])
    assert bad.exit_code == 2 and "bad token range" in bad.stderr


EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "sessions"


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("agent-small.jsonl", GenParams(sessions=4, turns=6, seed=1, new_tokens="50-500:0.9,2000-3000:0.1")),
        (
            "agent-long.jsonl",
            GenParams(sessions=2, turns=16, seed=2, new_tokens="100-600", output_tokens="30-200", think_ms=2000),
        ),
    ],
)
def test_examples_are_regenerable(name: str, params: GenParams) -> None:
    """The checked-in examples are exactly what docs/replay.md says made them (the generator is stable)."""
    on_disk = [s.to_json() for s in read_sessions(EXAMPLES / name)]
    assert on_disk == _dump(params)


def test_arrivals_are_a_seeded_poisson_process_that_leaves_the_sessions_as_they_were() -> None:
    base = GenParams(sessions=400, turns=2, seed=7)
    plain = generate_sessions(base)
    timed = generate_sessions(GenParams(sessions=400, turns=2, seed=7, arrival_rate=4.0))
    assert [s.turns for s in timed] == [s.turns for s in plain]  # the content does not depend on the arrivals
    assert all("start_offset_ms" not in s.metadata for s in plain)
    starts = [s.metadata["start_offset_ms"] for s in timed]
    assert starts[0] == 0.0 and starts == sorted(starts)
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert 200.0 < sum(gaps) / len(gaps) < 300.0  # mean gap 1/rate = 250 ms
    assert starts == [s.metadata["start_offset_ms"]
                      for s in generate_sessions(GenParams(sessions=400, turns=2, seed=7, arrival_rate=4.0))]
    with pytest.raises(ValueError, match="arrival rate"):
        generate_sessions(GenParams(sessions=1, arrival_rate=0.0))
