"""`kvtether replay` end to end against a tiny fake OpenAI server (no simulator, no gateway)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import typer
import uvicorn
from kvtether.cli import sessions as cmd_sessions
from kvtether.cli.gen import command as cmd_gen
from kvtether.cli.gen.generate import GenParams, generate_sessions
from kvtether.cli.replay import ReplayOptions, ThinkTime, parse_think_time, run_replay
from kvtether.cli.replay import command as cmd_replay
from kvtether.protocol.contract import PREFIX_HEADER, SESSION_HEADER, TURN_HEADER
from kvtether.sdk.sessionfile import write_sessions
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from typer.testing import CliRunner


@dataclass
class FakeOpenAI:
    """Streams a role-only chunk, then ``words`` content chunks, then a usage chunk.

    ``fail`` maps (session id prefix, turn header) → HTTP status, to check that errors are counted
    and never retried. Every request is recorded (headers + body).
    """

    words: int = 3
    fail: dict[tuple[str, str], int] = field(default_factory=dict)
    # (session id prefix, turn header) → "empty" (200, no visible token) or "error" (error event mid-stream)
    odd: dict[tuple[str, str], str] = field(default_factory=dict)
    reuse_header: bool = True
    requests: list[dict[str, Any]] = field(default_factory=list)
    sessions: list[dict[str, Any]] = field(default_factory=list)

    def app(self) -> Starlette:
        async def chat(request: Request) -> Response:
            body = await request.json()
            headers = {k.lower(): v for k, v in request.headers.items()}
            self.requests.append({"headers": headers, "body": body})
            sid, turn = headers.get(SESSION_HEADER, ""), headers.get(TURN_HEADER, "")
            for (prefix, t), status in self.fail.items():
                if sid.startswith(prefix) and t == turn:
                    return JSONResponse({"error": {"message": "injected failure"}}, status_code=status)
            n_prompt = sum(len(str(m.get("content") or "").split()) for m in body["messages"])
            odd = next((v for (prefix, t), v in self.odd.items() if sid.startswith(prefix) and t == turn), None)

            async def gen() -> Any:
                def sse(obj: dict[str, Any]) -> bytes:
                    return f"data: {json.dumps(obj)}\n\n".encode()

                base = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": body["model"]}
                yield sse({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
                if odd == "error":
                    yield sse({"error": {"message": "KV load failure"}})
                    return
                for i in range(0 if odd == "empty" else self.words):
                    yield sse({**base, "choices": [{"index": 0, "delta": {"content": f"w{turn}_{i} "}}]})
                yield sse({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
                usage = {
                    "prompt_tokens": n_prompt,
                    "completion_tokens": self.words,
                    "total_tokens": n_prompt + self.words,
                    "prompt_tokens_details": {"cached_tokens": n_prompt // 2},
                }
                yield sse({**base, "choices": [], "usage": usage})
                yield b"data: [DONE]\n\n"

            out_headers = {"x-kvtether-reuse-source": "decode_pull", "x-kvtether-reuse-tokens": "10"}
            return StreamingResponse(
                gen(), media_type="text/event-stream", headers=out_headers if self.reuse_header else {}
            )

        async def models(request: Request) -> Response:
            return JSONResponse({"object": "list", "data": [{"id": "fake", "object": "model"}]})

        async def admin(request: Request) -> Response:
            return JSONResponse(self.sessions)

        return Starlette(
            routes=[
                Route("/v1/chat/completions", chat, methods=["POST"]),
                Route("/v1/models", models),
                Route("/admin/sessions", admin),
            ]
        )


@pytest.fixture
def fake() -> Iterator[tuple[FakeOpenAI, str]]:
    """The fake server on a free port in a thread: the CLI under test runs its own event loop."""
    f = FakeOpenAI()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(f.app(), log_level="error", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.01)
    yield f, f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(5)
    sock.close()


def dead_url() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens here now
    return f"http://127.0.0.1:{port}"


def make_app() -> typer.Typer:
    app = typer.Typer(add_completion=False)
    for mod in (cmd_replay, cmd_sessions, cmd_gen):
        mod.register(app)
    return app


runner = CliRunner()


@pytest.fixture
def session_file(tmp_path: Path) -> Path:
    p = tmp_path / "s.jsonl"
    params = GenParams(sessions=3, turns=4, new_tokens="5-20", output_tokens="4", think_ms=0, system_tokens=20)
    write_sessions(p, generate_sessions(params))
    return p


def test_replay_json_result(fake: tuple[FakeOpenAI, str], session_file: Path) -> None:
    server, url = fake
    r = runner.invoke(make_app(), ["replay", str(session_file), "--gateway", url, "--json", "--no-progress"])
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["schema"] == "kvtether.replay/1"
    assert doc["definitions"]["ttft"].startswith("request sent → first chunk with content")
    (run,) = doc["runs"]
    assert run["requests"] == 12 and run["ok"] == 12 and run["errors"] == 0
    assert [row["turn"] for row in run["per_turn_ttft_ms"]] == [0, 1, 2, 3]
    assert all(row["n"] == 3 for row in run["per_turn_ttft_ms"])
    for m in ("ttfc_ms", "ttft_ms", "tpot_ms", "e2e_ms"):
        assert run[m]["n"] == 12
    # TTFC (role-only chunk) can only come before or with TTFT.
    for t in run["turn_results"]:
        assert t["ttfc_ms"] <= t["ttft_ms"] <= t["e2e_ms"]
        assert t["completion_tokens"] == 3
    assert run["reuse"]["source"].startswith("gateway response headers")
    assert run["reuse"]["headers"]["x-kvtether-reuse-tokens"] == {"sum": 120, "n": 12}
    assert run["reuse"]["headers"]["x-kvtether-reuse-source"] == {"decode_pull": 12}
    assert run["reuse"]["cached_tokens"] > 0
    # With --json, stdout is the document alone and the report goes to stderr.
    assert "TTFT by turn index" in r.stderr and "TTFT by turn index" not in r.stdout
    # Every request carried the session and contract stamps; the session id got a run suffix.
    assert len(server.requests) == 12
    for req in server.requests:
        assert req["headers"][SESSION_HEADER].startswith("gen-0-000")
        assert "~" in req["headers"][SESSION_HEADER]
        assert PREFIX_HEADER in req["headers"]
        assert req["body"]["stream"] is True
        assert req["body"]["tools"], "the session's tools are sent"
    turns = sorted(int(req["headers"][TURN_HEADER]) for req in server.requests)
    assert turns == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]


def test_recorded_vs_live_history(fake: tuple[FakeOpenAI, str], session_file: Path) -> None:
    server, url = fake
    app = make_app()
    # Live history is the default against a gateway too.
    r = runner.invoke(app, ["replay", str(session_file), "--gateway", url, "--limit", "1", "--keep-session-ids"])
    assert r.exit_code == 0, r.stderr
    assert "history: live" in r.stderr  # the note before the runs
    assert "history: live" in r.stdout  # and again under the report
    last = next(q for q in server.requests if q["headers"][TURN_HEADER] == "3")["body"]["messages"]
    answers = [m["content"] for m in last if m["role"] == "assistant"]
    assert answers == ["w0_0 w0_1 w0_2 ", "w1_0 w1_1 w1_2 ", "w2_0 w2_1 w2_2 "]  # what the server streamed
    assert [q["headers"][SESSION_HEADER] for q in server.requests] == ["gen-0-0000"] * 4
    server.requests.clear()
    r = runner.invoke(app, ["replay", str(session_file), "--gateway", url, "--limit", "1", "--history", "recorded"])
    assert r.exit_code == 0, r.stderr
    last = next(q for q in server.requests if q["headers"][TURN_HEADER] == "3")["body"]["messages"]
    assert not any(str(m.get("content")).startswith("w0_0") for m in last)  # recorded answers instead
    assert sum(1 for m in last if m.get("tool_calls")) == 3


def test_errors_counted_not_retried(fake: tuple[FakeOpenAI, str], session_file: Path) -> None:
    server, url = fake
    server.fail[("gen-0-0001", "1")] = 500
    r = runner.invoke(
        make_app(),
        ["replay", str(session_file), "--gateway", url, "--json", "--max-error-rate", "0.5", "--no-progress"],
    )
    assert r.exit_code == 0, r.stderr
    (run,) = json.loads(r.stdout)["runs"]
    assert run["errors"] == 1 and run["errors_by_kind"] == {"http_500": 1}
    assert run["skipped"] == 2  # turns 2 and 3 of the failed session are not sent
    assert run["requests"] == 10
    assert len(server.requests) == 10  # exactly one attempt at the failing turn: no hidden retry
    # With the default --max-error-rate 0 the same run is a failed run.
    r = runner.invoke(make_app(), ["replay", str(session_file), "--gateway", url, "--no-progress"])
    assert r.exit_code == 1
    assert "error rate above" in r.stderr


def test_empty_and_stream_errors(fake: tuple[FakeOpenAI, str], session_file: Path) -> None:
    server, url = fake
    server.odd[("gen-0-0000", "2")] = "empty"
    server.odd[("gen-0-0002", "0")] = "error"
    argv = ["replay", str(session_file), "--gateway", url, "--json", "--max-error-rate", "1"]
    r = runner.invoke(make_app(), argv)
    assert r.exit_code == 0, r.stderr
    (run,) = json.loads(r.stdout)["runs"]
    assert run["errors_by_kind"] == {"server_error": 1} and run["skipped"] == 3
    assert run["empty"] == 1 and run["ok"] == 8
    assert run["ttft_ms"]["n"] == 7 and run["e2e_ms"]["n"] == 8  # the empty answer has no TTFT
    assert any("no visible token" in w for w in run["warnings"])
    assert "KV load failure" in run["first_errors"][0]


def test_slo_exit_code(fake: tuple[FakeOpenAI, str], session_file: Path) -> None:
    _, url = fake
    app = make_app()
    r = runner.invoke(app, ["replay", str(session_file), "--gateway", url, "--slo", "ttft_p95=0.000001"])
    assert r.exit_code == 3, r.stderr
    assert "MISSED" in r.stdout  # the SLO lines are the report's
    assert "SLO missed" in r.stderr and "SLO missed" not in r.stdout  # why the command fails: an error
    r = runner.invoke(app, ["replay", str(session_file), "--gateway", url, "--slo", "ttft_p95<=600000", "--json"])
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["slo"]["auto"][0] == {
        "slo": "ttft_p95",
        "limit": 600000.0,
        "actual": json.loads(r.stdout)["runs"][0]["ttft_ms"]["p95"],
        "ok": True,
    }


def test_unreachable_gateway_one_line(session_file: Path) -> None:
    r = runner.invoke(make_app(), ["replay", str(session_file), "--gateway", dead_url()])
    assert r.exit_code == 1
    assert "cannot reach" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = runner.invoke(make_app(), ["sessions", "--gateway", dead_url()])
    assert r.exit_code == 1
    assert "cannot reach" in r.stderr and "Traceback" not in r.stderr


def test_malformed_file_names_line(tmp_path: Path, session_file: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    lines = session_file.read_text().splitlines()
    bad.write_text(lines[0] + "\n" + '{"v": 1, "kind": "session", "session_id": "x"}\n')
    r = runner.invoke(make_app(), ["replay", str(bad), "--gateway", "http://127.0.0.1:9"])
    assert r.exit_code == 2
    assert f"{bad}:2" in r.stderr and "'model' must be a non-empty string" in r.stderr
    assert "Traceback" not in r.stderr
    bad.write_text("{not json\n")
    r = runner.invoke(make_app(), ["replay", str(bad), "--gateway", "http://127.0.0.1:9"])
    assert r.exit_code == 2 and f"{bad}:1: not valid JSON" in r.stderr


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--sim", "nope"], "unknown preset 'nope'"),
        ([], "exactly one of --gateway URL or --sim PRESET"),
        (["--gateway", "http://x", "--sim", "toy"], "exactly one of"),
        (["--gateway", "http://x", "--compare"], "--compare needs --sim"),
        (["--gateway", "http://x", "--think-time", "sometimes"], "bad think time"),
        (["--gateway", "http://x", "--slo", "ttft_p42=1"], "bad SLO"),
        (["--gateway", "http://x", "--history", "made-up"], "--history must be"),
        (["--gateway", "http://x", "auto"], "without --compare"),
    ],
)
def test_usage_errors(session_file: Path, argv: list[str], message: str) -> None:
    r = runner.invoke(make_app(), ["replay", str(session_file), *argv])
    assert r.exit_code == 2, r.stderr
    assert message in r.stderr
    assert "Traceback" not in r.stderr


def test_missing_file_is_usage_error(tmp_path: Path) -> None:
    r = runner.invoke(make_app(), ["replay", str(tmp_path / "none.jsonl"), "--gateway", "http://x"])
    assert r.exit_code == 2 and "no such file" in r.stderr


def test_sessions_command(fake: tuple[FakeOpenAI, str]) -> None:
    server, url = fake
    server.sessions = [
        {"session_id": "b", "decode": "http://d1", "held_tokens": 1234, "handle_age_s": 1.5, "turns": 3,
         "expires_in_s": 440.0, "has_handle": True},
        {"session_id": "a", "decode": "http://d2", "held_tokens": 10, "handle_age_s": None, "turns": 1,
         "expires_in_s": 449.0, "has_handle": False},
    ]
    r = runner.invoke(make_app(), ["sessions", "--gateway", url])
    assert r.exit_code == 0, r.stderr
    assert "http://d1" in r.stdout and "1,234" in r.stdout and "2 pinned session(s)" in r.stdout
    assert r.stdout.index("http://d2") < r.stdout.index("http://d1")  # sorted by session id
    r = runner.invoke(make_app(), ["sessions", "--gateway", url, "--json"])
    assert json.loads(r.stdout) == server.sessions


def test_think_time_parsing() -> None:
    assert parse_think_time("none").delay_ms(500) == 0
    assert parse_think_time("recorded").delay_ms(500) == 500
    assert parse_think_time("scale:0.5").delay_ms(500) == 250
    assert parse_think_time("fixed:20").delay_ms(500) == 20
    for bad in ("scale:", "scale:-1", "fixed:x", "often"):
        with pytest.raises(ValueError):
            parse_think_time(bad)


@pytest.mark.anyio
async def test_engine_concurrency_and_time_scale(fake: tuple[FakeOpenAI, str]) -> None:
    _server, url = fake
    sessions = generate_sessions(GenParams(sessions=4, turns=2, new_tokens="3", output_tokens="2", think_ms=0))
    seen: list[str] = []
    opts = ReplayOptions(concurrency=2, think_time=ThinkTime("none"), time_scale=10.0)
    run = await run_replay(sessions, url, opts, on_result=lambda r: seen.append(r.session_id))
    assert len(run.results) == len(seen) == 8 and all(r.ok for r in run.results)
    # With speed 10 every reported duration is 10 × the measured one; e2e covers the stream at least.
    assert all(r.e2e_ms is not None and r.ttft_ms is not None and r.e2e_ms >= r.ttft_ms for r in run.results)
    # A session's turns are sequential: turn 1 starts after turn 0 ended.
    by_sid: dict[str, list[Any]] = {}
    for r in run.results:
        by_sid.setdefault(r.session_id, []).append(r)
    for rs in by_sid.values():
        assert [r.turn for r in rs] == [0, 1]
        assert rs[1].start_ms >= rs[0].start_ms + rs[0].e2e_ms - 1e-6


def test_policies_after_file() -> None:
    files, policies = cmd_replay._split_args(["s.jsonl", "no-pull", "reference", "auto"])
    assert files == ["s.jsonl"] and policies == ["no-pull", "reference", "auto"]
    assert cmd_replay._split_args(["no-pull,auto", "s.jsonl"]) == (["s.jsonl"], ["no-pull", "auto"])


def test_replay_imports_vllm_on_the_fly(fake: tuple[FakeOpenAI, str], tmp_path: Path) -> None:
    server, url = fake
    src = tmp_path / "v.json"
    convs = [{"id": "c1", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                                       {"role": "user", "content": "more"}]}]
    src.write_text(json.dumps(convs))
    argv = ["replay", str(src), "--format", "vllm", "--gateway", url, "--model", "fake", "--history", "recorded"]
    r = runner.invoke(make_app(), argv)
    assert r.exit_code == 0, r.stderr
    assert [q["body"]["messages"] for q in server.requests][1] == [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "more"}]
    assert {q["body"]["model"] for q in server.requests} == {"fake"}
