"""The Mooncake trace importer (AIPerf's mooncake_trace): sessions rebuilt from hash-id chains or named by
session_id, block ids as shared text, errors with line numbers, `kvtether convert` on the bundled sample and a
replay of the converted sample on the simulator."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import typer
from kvtether.cli.gen import command as cmd_gen
from kvtether.cli.gen.importers import (
    BLOCK_WORDS,
    ImportFormatError,
    block_words,
    import_file,
    import_mooncake,
)
from kvtether.cli.replay import command as cmd_replay
from kvtether.sdk.sessionfile import SessionRecord, read_sessions
from kvtether.sim.template import render_chat
from kvtether.sim.tokenizer import default_tokenizer
from typer.testing import CliRunner

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "examples" / "traces" / "mooncake-conversation-sample.jsonl"
SAMPLE_SCRIPT = REPO / "examples" / "traces" / "make_mooncake_sample.py"


def _lines(*rows: dict[str, Any]) -> list[str]:
    return [json.dumps(r) for r in rows]


def _row(ts: int, n: int, ids: list[int], out: int = 100, **more: Any) -> dict[str, Any]:
    return {"timestamp": ts, "input_length": n, "output_length": out, "hash_ids": ids, **more}


def _text(turn_messages: list[dict[str, Any]] | None) -> str:
    assert turn_messages is not None and len(turn_messages) == 1 and turn_messages[0]["role"] == "user"
    return str(turn_messages[0]["content"])


def _by_lines(sessions: list[SessionRecord]) -> dict[tuple[int, ...], SessionRecord]:
    return {tuple(s.metadata["trace_lines"]): s for s in sessions}


def _load_sample_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_mooncake_sample", SAMPLE_SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_block_words_are_one_simulator_token_each() -> None:
    tok = default_tokenizer()
    for w in BLOCK_WORDS:
        assert len(tok.encode(w)) == 1 and len(tok.encode(" " + w)) == 1, w
    words = block_words(7, 512)
    assert len(tok.encode(" ".join(words))) == 512
    assert block_words(7, 512) == words and block_words(8, 512) != words
    assert block_words(7, 16) == words[:16]  # another block size: the same words, fewer of them


def test_sessions_rebuilt_from_hash_id_chains() -> None:
    lines = _lines(
        _row(0, 1200, [1, 2, 3]),  # 1: full blocks [1, 2]
        _row(1000, 600, [7, 8]),  # 2: unrelated
        _row(5000, 1800, [1, 2, 4, 5]),  # 3: continues 1 (1800 = 1200 + 100 answer + 500 new)
        _row(6000, 2000, [1, 2, 9, 10]),  # 4: covers 1's full blocks, but 1 is continued already: a new session
        _row(9000, 2600, [1, 2, 4, 5, 11, 12], out=50),  # 5: continues 3 (full blocks [1, 2, 4])
        _row(10000, 700, [20, 21]),  # 6
        _row(10500, 650, [20, 22]),  # 7: covers 6's full block but is shorter: not its next turn
        _row(12000, 1600, [20, 23, 24, 25]),  # 8: 6 and 7 both fit; the most recent (7) wins
        _row(14000, 1400, [30, 31, 32]),  # 9
        _row(14000, 2000, [30, 31, 33, 34]),  # 10: arrives with 9, so it cannot be 9's next turn
        _row(15000, 1400, [30, 31, 32]),  # 11: 9's prompt again (a retry): not its next turn
    )
    sessions = import_mooncake(lines, model="m", where="t.jsonl")
    by = _by_lines(sessions)
    assert set(by) == {(1, 3, 5), (2,), (4,), (6,), (7, 8), (9,), (10,), (11,)}
    # In order of first arrival, numbered as they start.
    assert [s.metadata["trace_lines"][0] for s in sessions] == [1, 2, 4, 6, 7, 9, 10, 11]
    assert [s.session_id for s in sessions][:3] == ["mooncake-00000", "mooncake-00001", "mooncake-00002"]
    s = by[(1, 3, 5)]
    assert s.model == "m" and [t.index for t in s.turns] == [0, 1, 2]
    assert s.metadata["start_offset_ms"] == 0 and s.metadata["arrival_ms"] == [0, 5000, 9000]
    assert s.metadata["imported_from"] == "mooncake" and s.metadata["block_size"] == 512
    assert [t.delay_ms for t in s.turns] == [0.0, 5000.0, 4000.0]  # arrival to arrival
    assert s.turns[0].messages is not None and s.turns[1].new_messages is not None
    # Turn 0 is the whole prompt; a later turn the part after the previous prompt and its answer.
    assert len(_text(s.turns[0].messages).split()) == 1200
    assert len(_text(s.turns[1].new_messages).split()) == 1800 - 1200 - 100
    assert len(_text(s.turns[2].new_messages).split()) == 2600 - 1800 - 100
    assert s.turns[2].params == {"max_tokens": 50, "min_tokens": 50, "ignore_eos": True}
    rec = s.turns[1].recorded
    assert rec is not None and (rec.prompt_tokens, rec.completion_tokens, rec.answer) == (1800, 100, None)
    # The new text is the request's own blocks' words at those positions (block 3 = id 5, from offset 1300-1024).
    assert _text(s.turns[1].new_messages).split()[:10] == list(block_words(4, 512)[276:286])
    assert by[(7, 8)].metadata["start_offset_ms"] == 10500


def test_rows_out_of_time_order_chain_by_timestamp() -> None:
    lines = _lines(_row(5000, 1800, [1, 2, 4, 5]), _row(0, 1200, [1, 2, 3]))
    (s,) = import_mooncake(lines, model="m")
    assert s.metadata["trace_lines"] == [2, 1] and s.metadata["start_offset_ms"] == 0


def test_a_prompt_shorter_than_one_block_starts_every_time() -> None:
    # No full block: nothing a continuation is known to start with.
    lines = _lines(_row(0, 300, [1]), _row(1000, 900, [1, 2]))
    assert [s.metadata["trace_lines"] for s in import_mooncake(lines, model="m")] == [[1], [2]]


def test_shared_blocks_become_identical_text() -> None:
    # Two conversations with a common 2-block system prompt (ids 1, 2), then their own blocks.
    lines = _lines(_row(0, 1500, [1, 2, 3]), _row(100, 1400, [1, 2, 4]), _row(200, 700, [1, 5]))
    a, b, c = import_mooncake(lines, model="m")
    ta, tb, tc = (_text(s.turns[0].messages).split() for s in (a, b, c))
    assert ta[:1024] == tb[:1024] == list(block_words(1, 512)) + list(block_words(2, 512))
    assert ta[1024:] != tb[1024 : len(ta)]
    assert ta[1024:] == list(block_words(3, 512)[: 1500 - 1024])  # the last, partial block
    assert tc[:512] == ta[:512] and tc[512:] == list(block_words(5, 512)[:188])
    # Through the chat template and the simulator's tokenizer the shared blocks are a shared token prefix.
    tok = default_tokenizer()
    ids_a, ids_b = (tok.encode(render_chat(s.turns[0].messages or [], add_generation_prompt=True)) for s in (a, b))
    shared = next(i for i, (x, y) in enumerate(zip(ids_a, ids_b, strict=False)) if x != y)
    assert 1024 <= shared <= 1024 + 8
    assert 0 <= len(ids_a) - 1500 <= 16  # one token a word, plus the template's few


def test_tokens_past_the_hash_ids_are_private_to_the_line() -> None:
    # AIPerf's prefix-only rows: the ids cover the cached prefix, the rest of the prompt is the line's own.
    lines = _lines(_row(0, 1500, [1]), _row(0, 1500, [1]), _row(0, 40, []))
    a, b, c = import_mooncake(lines, model="m")
    ta, tb = (_text(s.turns[0].messages).split() for s in (a, b))
    assert len(ta) == len(tb) == 1500 and ta[:512] == tb[:512] and ta[512:] != tb[512:]
    assert len(_text(c.turns[0].messages).split()) == 40


def test_sessions_by_session_id() -> None:
    lines = _lines(
        {"session_id": "b", "timestamp": 500, "input_length": 600, "output_length": 20, "hash_ids": [1, 2]},
        {"session_id": "a", "timestamp": 0, "input_length": 30, "output_length": 10},
        {"session_id": "a", "delay": 2500, "input_length": 8, "output_length": 5, "extra": {"temperature": 0}},
        {"session_id": "b", "timestamp": 4500, "text_input": "what next then", "output_length": 7},
        {"session_id": 7, "input_length": 5, "output_length": 5},
        _row(100, 1200, [1, 2, 3]),  # no session_id: chained among the rows without one
    )
    sessions = import_mooncake(lines, model="m", pin_output=False)
    # By first arrival; a session without a timestamp starts with the trace.
    assert [s.session_id for s in sessions] == ["a", "7", "mooncake-00000", "b"]
    a, seven, chained, b = sessions
    assert a.metadata["sessions_from"] == "session_id" and a.metadata["trace_lines"] == [2, 3]
    assert a.metadata["start_offset_ms"] == 0 and "arrival_ms" not in a.metadata  # turn 2 has only a delay
    assert len(_text(a.turns[0].messages).split()) == 30
    # AIPerf's reading: each row is the turn's new text; the history grows with the answers received.
    assert len(_text(a.turns[1].new_messages).split()) == 8 and a.turns[1].delay_ms == 2500.0
    assert a.turns[1].params == {"max_tokens": 5, "temperature": 0}
    assert b.metadata["arrival_ms"] == [500, 4500] and b.turns[1].delay_ms == 4000.0
    assert _text(b.turns[1].new_messages) == "what next then"
    # Block ids mean the same words whichever way the sessions are formed.
    assert _text(b.turns[0].messages).split()[:512] == _text(chained.turns[0].messages).split()[:512]
    assert "start_offset_ms" not in seven.metadata
    rec = b.turns[0].recorded
    assert rec is not None and rec.prompt_tokens is None and rec.completion_tokens == 20


def test_session_ids_do_not_collide_with_rebuilt_names() -> None:
    lines = _lines({"session_id": "mooncake-00000", "input_length": 5, "output_length": 1}, _row(0, 10, [1]))
    assert sorted(s.session_id for s in import_mooncake(lines, model="m")) == ["mooncake-00000", "mooncake-00001"]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{bad", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"timestamp": 0, "output_length": 3}', "needs 'input_length' (or 'text_input')"),
        ('{"timestamp": 0, "input_length": 0, "output_length": 3}', "'input_length' must be a positive integer"),
        ('{"timestamp": -5, "input_length": 10, "output_length": 3}', "'timestamp' must be a non-negative number"),
        ('{"timestamp": NaN, "input_length": 10, "output_length": 3}', "'timestamp' must be a non-negative number"),
        ('{"input_length": 10, "output_length": 0}', "'output_length' must be a positive integer"),
        ('{"input_length": 10, "output_length": 3, "hash_ids": [1, "x"]}', "'hash_ids' must be a list of integers"),
        ('{"input_length": 600, "output_length": 3, "hash_ids": [1, 2, 3]}', "3 hash_ids of 512-token blocks"),
        ('{"input_length": 10, "output_length": 3, "session_id": ""}', "'session_id' must be a non-empty string"),
        ('{"input_length": 10, "output_length": 3, "delay": "soon"}', "'delay' must be a non-negative number"),
        ('{"messages": [], "output_length": 3}', "rows with 'messages' are not supported"),
        ('{"input_length": 10, "extra": [1]}', "'extra' must be an object"),
    ],
)
def test_malformed_lines_name_the_line(line: str, message: str) -> None:
    good = json.dumps(_row(0, 10, [1]))
    with pytest.raises(ImportFormatError, match=r"^t\.jsonl:3: ") as e:
        import_mooncake([good, "", line], model="m", where="t.jsonl")
    assert message in str(e.value)


def test_empty_trace_and_block_size() -> None:
    with pytest.raises(ImportFormatError, match="no requests"):
        import_mooncake(["", "\n"], model="m")
    row = json.dumps(_row(0, 600, [1, 2, 3]))  # three 256-token blocks
    with pytest.raises(ImportFormatError, match="--block-size"):
        import_mooncake([row], model="m")
    (s,) = import_mooncake([row], model="m", block_size=256)
    assert _text(s.turns[0].messages).split()[:256] == list(block_words(1, 256))


def test_the_sample_is_what_its_script_writes() -> None:
    mod = _load_sample_script()
    assert SAMPLE.read_text(encoding="utf-8") == "\n".join(mod.trace_lines(mod.make_trace(0))) + "\n"


def test_convert_the_sample(tmp_path: Path) -> None:
    app = typer.Typer()
    cmd_gen.register(app)
    out = tmp_path / "s.jsonl"
    r = CliRunner().invoke(app, ["convert", str(SAMPLE), "--from", "mooncake", "--model", "kimi", "-o", str(out)])
    assert r.exit_code == 0, r.stderr
    sessions = read_sessions(out)
    truth = _load_sample_script().make_trace(0)
    # The chains give back the generator's conversations exactly: same arrivals, same turn counts.
    assert sorted(tuple(s.metadata["arrival_ms"]) for s in sessions) == sorted(
        tuple(row["timestamp"] for row in conv) for conv in truth)
    assert len(sessions) == 40 and all(3 <= len(s.turns) <= 10 for s in sessions)
    # Shared system prompts: some first turns start with the same 512 words.
    heads = [" ".join(_text(s.turns[0].messages).split()[:512]) for s in sessions]
    assert len(set(heads)) < len(heads)
    tok = default_tokenizer()
    for s in sessions[:3]:
        answers = [{"role": "assistant", "content": " ".join(["ok"] * t.params["max_tokens"])} for t in s.turns]
        requests = s.requests("live", answers)
        prompts = [len(tok.encode(render_chat(m, add_generation_prompt=True))) for _, m, _ in requests]
        assert prompts == sorted(prompts) and len(set(prompts)) == len(prompts)  # growing every turn
        for n, t in zip(prompts, s.turns, strict=True):
            assert t.recorded is not None and t.recorded.prompt_tokens is not None
            assert 0 <= n - t.recorded.prompt_tokens <= 16 * (t.index + 1)  # the template's few tokens a turn
    assert import_file(SAMPLE, "mooncake", model="kimi")[0].to_json() == sessions[0].to_json()
    r = CliRunner().invoke(app, ["convert", str(SAMPLE), "--from", "mooncake", "--no-pin-output", "--max-tokens", "9"])
    assert r.exit_code == 0, r.stderr
    first = json.loads(r.stdout.splitlines()[0])
    assert first["turns"][0]["params"] == {"max_tokens": first["turns"][0]["recorded"]["completion_tokens"]}


def test_convert_reports_a_malformed_trace(tmp_path: Path) -> None:
    app = typer.Typer()
    cmd_gen.register(app)
    src = tmp_path / "t.jsonl"
    src.write_text(json.dumps(_row(0, 10, [1])) + '\n{"timestamp": 1}\n')
    r = CliRunner().invoke(app, ["convert", str(src), "--from", "mooncake"])
    assert r.exit_code == 2
    assert f"malformed mooncake file: {src}:2: needs 'input_length'" in r.stderr and "Traceback" not in r.stderr


def test_replay_the_converted_sample_on_the_simulator(tmp_path: Path) -> None:
    conv = typer.Typer()
    cmd_gen.register(conv)
    out = tmp_path / "s.jsonl"
    assert CliRunner().invoke(conv, ["convert", str(SAMPLE), "--from", "mooncake", "-o", str(out)]).exit_code == 0
    sessions = read_sessions(out)[:2]
    app = typer.Typer()
    app.callback()(lambda: None)  # keep "replay" a sub-command, as in kvtether's app
    cmd_replay.register(app)
    argv = ["replay", str(out), "--sim", "toy", "--speed", "50", "--limit", "2", "--think-time", "none",
            "--policy", "auto", "--json", "--no-progress"]
    r = CliRunner().invoke(app, argv)
    assert r.exit_code == 0, r.stderr
    (run,) = json.loads(r.stdout)["runs"]
    n_turns = sum(len(s.turns) for s in sessions)
    assert (run["requests"], run["ok"], run["errors"]) == (n_turns, n_turns, 0)
    # Pinned answers have the trace's lengths, so every prompt is the trace's, give or take the template.
    want = {(s.session_id, t.index): t for s in sessions for t in s.turns}
    for res in run["turn_results"]:
        t = want[(res["session_id"].split("~")[0], res["turn"])]
        assert t.recorded is not None and t.recorded.prompt_tokens is not None
        assert res["completion_tokens"] == t.recorded.completion_tokens
        assert 0 <= res["prompt_tokens"] - t.recorded.prompt_tokens <= 16 * (t.index + 1)
