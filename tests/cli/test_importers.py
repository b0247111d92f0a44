"""Importers on small hand-made files in each format, and `kvtether convert`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from kvtether.cli.gen import command as cmd_gen
from kvtether.cli.gen.importers import ImportFormatError, import_aiperf, import_file, import_vllm
from kvtether.sdk.sessionfile import read_sessions
from typer.testing import CliRunner

VLLM = [
    {
        "id": "c1",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hello there"},
            {"role": "assistant", "content": "hi how can I help"},
            {"role": "user", "content": "tell me more"},
            {"role": "assistant", "content": "sure"},
            {"role": "user", "content": "thanks"},
        ],
    },
    {"id": "c2", "messages": [{"role": "user", "content": [{"type": "text", "text": "parts"}]}]},
]

AIPERF = [
    {"session_id": "s1", "turns": [{"role": "system", "text": "sys"}, {"text": "q1", "output_length": 40},
                                   {"text": "q2", "delay": 1500, "extra": {"temperature": 0}}]},
    {"session_id": "s2", "turns": [{"texts": ["a", "b"], "timestamp": 0}, {"text": "c", "timestamp": 2500}]},
    {"session_id": "s1", "turns": [{"texts": [{"name": "f", "contents": ["q3"]}], "delay": 10}]},
]


def test_vllm_import() -> None:
    s1, s2 = import_vllm(VLLM, model="m")
    assert s1.session_id == "c1" and s1.model == "m" and len(s1.turns) == 3
    system, user = {"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}
    assert s1.turns[0].messages == [system, user]
    assert s1.turns[0].recorded is not None and s1.turns[0].recorded.answer == {
        "role": "assistant", "content": "hi how can I help"}
    assert s1.turns[0].params == {"max_tokens": 5}  # words of the recorded answer
    assert s1.turns[2].recorded is None and s1.turns[2].params == {"max_tokens": 256}
    reqs = [msgs for _, msgs, _ in s1.requests("recorded")]
    assert [m["role"] for m in reqs[2]] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert s2.turns[0].messages == [{"role": "user", "content": "parts"}]


def test_vllm_import_errors() -> None:
    with pytest.raises(ImportFormatError, match="expected a JSON list"):
        import_vllm({"id": 1}, model="m")
    with pytest.raises(ImportFormatError, match=r"conversation #0 \(id 'x'\), message #0: an assistant message before"):
        import_vllm([{"id": "x", "messages": [{"role": "assistant", "content": "a"}]}], model="m")
    with pytest.raises(ImportFormatError, match="message #1: needs 'role'"):
        import_vllm([{"id": "x", "messages": [{"role": "user", "content": "a"}, {"content": "b"}]}], model="m")


def test_aiperf_import() -> None:
    lines = [json.dumps(x) for x in AIPERF]
    s1, s2 = import_aiperf(lines, model="m")
    assert s1.session_id == "s1" and len(s1.turns) == 3  # lines of one session are joined
    assert s1.turns[0].messages == [{"role": "system", "content": "sys"}, {"role": "user", "content": "q1"}]
    assert s1.turns[0].params == {"max_tokens": 40}
    assert s1.turns[1].new_messages == [{"role": "user", "content": "q2"}]
    assert s1.turns[1].delay_ms == 1500 and s1.turns[1].params == {"max_tokens": 256, "temperature": 0}
    assert s1.turns[2].new_messages == [{"role": "user", "content": "q3"}] and s1.turns[2].delay_ms == 10
    assert s2.turns[0].messages == [{"role": "user", "content": "a\nb"}]
    assert s2.turns[1].delay_ms == 2500  # from the timestamps


def test_aiperf_import_errors() -> None:
    with pytest.raises(ImportFormatError, match=r"aiperf:2: not valid JSON"):
        import_aiperf(['{"turns": [{"text": "a"}]}', "{oops"], model="m")
    with pytest.raises(ImportFormatError, match=r"aiperf:1: turn #0: a turn needs 'text'"):
        import_aiperf(['{"turns": [{"delay": 1}]}'], model="m")
    with pytest.raises(ImportFormatError, match=r"aiperf:1: turn #1: 'delay' must be"):
        import_aiperf(['{"turns": [{"text": "a"}, {"text": "b", "delay": -1}]}'], model="m")


def test_convert_command(tmp_path: Path) -> None:
    app = typer.Typer()
    cmd_gen.register(app)
    src = tmp_path / "v.json"
    src.write_text(json.dumps(VLLM))
    out = tmp_path / "s.jsonl"
    r = CliRunner().invoke(app, ["convert", str(src), "--from", "vllm", "--model", "llama", "-o", str(out)])
    assert r.exit_code == 0, r.stderr
    assert [s.session_id for s in read_sessions(out)] == ["c1", "c2"]
    assert import_file(src, "vllm", model="llama")[0].to_json() == read_sessions(out)[0].to_json()
    a = tmp_path / "a.jsonl"
    a.write_text("\n".join(json.dumps(x) for x in AIPERF) + "\n{bad\n")
    r = CliRunner().invoke(app, ["convert", str(a), "--from", "aiperf"])
    assert r.exit_code == 2
    assert f"{a}:4: not valid JSON" in r.stderr and "Traceback" not in r.stderr
    r = CliRunner().invoke(app, ["convert", str(a), "--from", "sharegpt"])
    assert r.exit_code == 2 and "unknown format" in r.stderr
