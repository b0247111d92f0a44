"""What a replay's turns carry (`--history live|recorded`) and the prefill prefix-caching switch of `--sim`.

The end-to-end tests run the real simulator and gateway in process and check what the decode nodes received
and what the gateway and the nodes counted; the `SessionHistory` tests check how histories written as full
message lists get their earlier answers replaced.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import typer
from kvtether.cli.gen.generate import GenParams, generate_sessions
from kvtether.cli.replay import (
    ReplayOptions,
    ReplayRun,
    SessionHistory,
    SimTarget,
    ThinkTime,
    TurnResult,
    replay_sim,
)
from kvtether.cli.replay import command as cmd_replay
from kvtether.sdk.sessionfile import History, Recorded, SessionRecord, TurnRecord, write_sessions
from typer.testing import CliRunner

# Answers that end where the model ends them: with gen's default --pin-output (ignore_eos) the simulated model
# writes on past its answer, and the text after a tool call comes back as content, which the chat template puts
# before the call on the next turn. 60+ tokens: no tool call is cut off by max_tokens.
NATURAL = dict(new_tokens="40-120", output_tokens="60-120", think_ms=0, system_tokens=80, pin_output=False)


def sessions_for(n: int, turns: int, seed: int = 3) -> list[SessionRecord]:
    return generate_sessions(GenParams(sessions=n, turns=turns, seed=seed, **NATURAL))  # type: ignore[arg-type]


def opts(history: History) -> ReplayOptions:
    return ReplayOptions(concurrency=4, think_time=ThinkTime("none"), history=history, timeout_s=60)


# -- what the decode nodes received --------------------------------------------------------------------------------


@dataclass
class DecodeLog:
    """Every chat request a decode node received, with the answer it streamed back (content and tool calls)."""

    exchanges: list[tuple[dict[str, Any], dict[str, Any]]] = field(default_factory=list)


def _answer_of(sse: str) -> dict[str, Any]:
    content: list[str] = []
    calls: dict[int, dict[str, str]] = {}
    for line in sse.splitlines():
        if not line.startswith("data: {"):
            continue
        chunk = json.loads(line[len("data: "):])
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            content.append(delta.get("content") or "")
            for tc in delta.get("tool_calls") or ():
                call = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
                fn = tc.get("function") or {}
                call["name"] += fn.get("name") or ""
                call["arguments"] += fn.get("arguments") or ""
    return {"content": "".join(content), "calls": [calls[i] for i in sorted(calls)]}


def _seen(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message as the answer comparison sees it."""
    calls = [
        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        for c in message.get("tool_calls") or ()
    ]
    return {"content": message.get("content") or "", "calls": calls}


@pytest.fixture
def decode_log(monkeypatch: pytest.MonkeyPatch) -> Iterator[DecodeLog]:
    """Wrap every simulated node's app (as it is built) to log the decode nodes' chat requests and answers."""
    import kvtether.sim.node as node_mod

    log = DecodeLog()
    build = node_mod.build_app

    def logged(node: Any) -> Callable[..., Any]:
        app = build(node)

        async def asgi(scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
            if scope["type"] != "http" or scope["path"] != "/v1/chat/completions" or node.cfg.role != "decode":
                await app(scope, receive, send)
                return
            body, out = bytearray(), bytearray()

            async def rcv() -> dict[str, Any]:
                message: dict[str, Any] = await receive()
                body.extend(message.get("body", b""))
                return message

            async def snd(message: dict[str, Any]) -> None:
                if message["type"] == "http.response.body":
                    out.extend(message.get("body", b""))
                await send(message)

            await app(scope, rcv, snd)
            log.exchanges.append((json.loads(body), _answer_of(out.decode())))

        return asgi

    monkeypatch.setattr(node_mod, "build_app", logged)
    yield log


def _by_session(log: DecodeLog) -> dict[str, dict[int, tuple[dict[str, Any], dict[str, Any]]]]:
    """(task message → turn → (request, answer)); the turn is the number of answers the request carries."""
    out: dict[str, dict[int, tuple[dict[str, Any], dict[str, Any]]]] = {}
    for request, answer in log.exchanges:
        msgs = request["messages"]
        task = next(m["content"] for m in msgs if m["role"] == "user")
        out.setdefault(task, {})[sum(1 for m in msgs if m["role"] == "assistant")] = (request, answer)
    return out


@pytest.mark.anyio
@pytest.mark.parametrize("history", ["live", "recorded"])
async def test_each_turn_carries_the_answers_of_its_history_mode(decode_log: DecodeLog, history: History) -> None:
    sessions = sessions_for(2, 4)
    run = await replay_sim(sessions, SimTarget("toy", speed=20), "no-pull", opts(history))
    assert all(r.ok for r in run.results) and len(run.results) == 8
    seen = _by_session(decode_log)
    assert len(seen) == 2 and all(sorted(turns) == [0, 1, 2, 3] for turns in seen.values())
    for session in sessions:
        task = next(m["content"] for m in session.turns[0].messages or () if m["role"] == "user")
        turns = seen[task]
        recorded = [_seen(t.recorded.answer) for t in session.turns if t.recorded and t.recorded.answer]
        streamed = [turns[k][1] for k in range(4)]
        assert all(a["calls"] or a["content"] for a in streamed), "the simulated model answered every turn"
        assert streamed[:3] != recorded[:3], "the simulator answers otherwise than the recording"
        for k in range(1, 4):
            request = turns[k][0]
            carried = [_seen(m) for m in request["messages"] if m["role"] == "assistant"]
            assert carried == (streamed[:k] if history == "live" else recorded[:k]), (history, k)
            if history == "live":
                # A tool result after a live tool call answers it: its id is the one the model gave.
                calls: list[str] = []
                for m in request["messages"]:
                    if m["role"] == "assistant":
                        calls = [c["id"] for c in m.get("tool_calls") or ()]
                    elif m["role"] == "tool" and calls:
                        assert m["tool_call_id"] in calls, (k, m["tool_call_id"], calls)


def _later_turns(run: ReplayRun) -> list[tuple[TurnResult, TurnResult]]:
    by_session: dict[str, dict[int, TurnResult]] = {}
    for r in run.results:
        by_session.setdefault(r.session_id, {})[r.turn] = r
    return [(turns[k - 1], turns[k]) for turns in by_session.values() for k in sorted(turns) if k > 0]


@pytest.mark.anyio
async def test_auto_reuses_the_answers_with_live_history_and_truncates_with_recorded() -> None:
    """On GLM-5 (where `auto` pulls long histories back from D), the live history extends what D holds, the
    model's answer included; the recorded one departs from it at the answer, so every handle is truncated."""
    sessions = sessions_for(3, 5, seed=2)
    target = SimTarget("glm-5-fp8-h200-tp8", speed=10)
    live = await replay_sim(sessions, target, "auto", opts("live"))
    recorded = await replay_sim(sessions, target, "auto", opts("recorded"))
    for run in (live, recorded):
        assert all(r.ok for r in run.results) and len(run.results) == 15
    assert live.counters is not None and recorded.counters is not None

    def answer_reused(pairs: list[tuple[TurnResult, TurnResult]]) -> list[bool]:
        # More than the previous prompt reused: the KV of the previous answer came along (a pull after a
        # decode-local turn reuses the older handle D still holds, so not every turn can).
        out = []
        for prev, cur in pairs:
            assert prev.prompt_tokens is not None
            out.append(int(cur.reuse["x-kvtether-reuse-tokens"]) > prev.prompt_tokens)
        return out

    def carries_answer(prev: TurnResult, cur: TurnResult) -> bool:
        # Where the previous answer's KV is on D for this turn: D's prefix cache (a local turn), or the handle a P/D
        # turn left (a pull after it). After a local turn D holds no fresh handle: a pull reads the older one.
        src, before = cur.reuse.get("x-kvtether-reuse-source"), prev.reuse.get("x-kvtether-reuse-source")
        return src == "decode_local" or (src == "decode_pull" and before != "decode_local")

    live_pairs = _later_turns(live)
    assert len(live_pairs) == 12
    expected = [carries_answer(p, c) for p, c in live_pairs]
    assert sum(expected) >= 0.5 * len(live_pairs), "most later turns run on D or pull a P/D turn's handle"
    assert all(got for got, want in zip(answer_reused(live_pairs), expected, strict=True) if want)
    share = sum(int(c.reuse["x-kvtether-reuse-tokens"]) for _, c in live_pairs) / sum(
        c.prompt_tokens or 0 for _, c in live_pairs
    )
    assert share > 0.8
    assert "truncated" not in live.counters["handle_outcomes"]
    assert live.counters["handle_outcomes"].get("attached", 0) >= 1, "auto pulled at least one history"

    assert not any(answer_reused(_later_turns(recorded)))
    assert "attached" not in recorded.counters["handle_outcomes"]
    pulled = sum(1 for r in recorded.results if r.reuse.get("x-kvtether-reuse-source") == "decode_pull")
    assert recorded.counters["handle_outcomes"].get("truncated", 0) >= min(pulled, 1)


# -- prefix caching on P ---------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_prefill_prefix_caching_switch_changes_p_cache_hits() -> None:
    sessions = sessions_for(2, 4)
    counts = {}
    for caching in (False, True):
        run = await replay_sim(
            sessions, SimTarget("toy", speed=20, prefill_prefix_caching=caching), "no-pull", opts("live")
        )
        assert all(r.ok for r in run.results) and run.counters is not None
        counts[caching] = run.counters
    off, on = counts[False], counts[True]
    assert off["prefix_cache_hits"]["prefill"] == 0
    assert off["prompt_tokens_by_source"]["prefill"]["local_cache_hit"] == 0
    # With it on, P recomputes only what is new: the system prompt, tools and the earlier turns come from its cache.
    assert on["prefix_cache_hits"]["prefill"] > 0.5 * on["prefix_cache_queries"]["prefill"]
    assert on["prompt_tokens_by_source"]["prefill"]["local_cache_hit"] == on["prefix_cache_hits"]["prefill"]
    assert SimTarget("toy").prefill_prefix_caching is False, "the documented default"


# -- the command line ------------------------------------------------------------------------------------------------


def _app() -> typer.Typer:
    app = typer.Typer()
    app.callback()(lambda: None)  # keep "replay" a sub-command, as in kvtether's app
    cmd_replay.register(app)
    return app


@pytest.fixture
def small_file(tmp_path: Path) -> Path:
    f = tmp_path / "s.jsonl"
    write_sessions(f, sessions_for(2, 3))
    return f


def test_cli_states_history_and_prefix_caching_defaults(small_file: Path) -> None:
    argv = ["replay", str(small_file), "--sim", "toy", "--speed", "50", "--policy", "no-pull", "--json"]
    r = CliRunner().invoke(_app(), argv)
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["options"]["history"] == "live"
    assert doc["target"]["prefill_prefix_caching"] is False
    (run,) = doc["runs"]
    assert run["cluster"]["prompt_tokens_by_source"]["prefill"]["local_cache_hit"] == 0
    err = " ".join(r.stderr.split())
    assert "history: live: each turn resends the answers this replay received" in err
    assert "prefix caching on P off" in err

    r = CliRunner().invoke(_app(), [*argv, "--history", "recorded", "--prefill-prefix-caching"])
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["options"]["history"] == "recorded" and doc["target"]["prefill_prefix_caching"] is True
    assert doc["runs"][0]["cluster"]["prompt_tokens_by_source"]["prefill"]["local_cache_hit"] > 0
    err = " ".join(r.stderr.split())
    assert "history: recorded: each turn resends the file's recorded answers" in err
    assert "prefix caching on P on" in err


# -- histories written as full message lists -------------------------------------------------------------------------


def _call(call_id: str, name: str, args: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


SYSTEM = {"role": "system", "content": "You are an agent."}
TASK = {"role": "user", "content": "Fix the bug."}
REC0 = {"role": "assistant", "content": None, "tool_calls": [_call("rec_0", "read_file", '{"path": "a.py"}')]}
TOOL0 = {"role": "tool", "tool_call_id": "rec_0", "content": "def f(): pass"}
REC1 = {"role": "assistant", "content": "Found it.", "tool_calls": [_call("rec_1", "write_file", '{"path": "a.py"}')]}
TOOL1 = {"role": "tool", "tool_call_id": "rec_1", "content": "ok"}
LIVE0 = {"role": "assistant", "content": None, "tool_calls": [_call("live_0", "search_code", '{"query": "f"}')]}
LIVE1 = {"role": "assistant", "content": "Done.", "tool_calls": [_call("live_1", "run_shell", '{"command": "make"}')]}


def _full_session(answers: bool = True) -> SessionRecord:
    """Three turns, each written with its full messages (as the recorder writes an edited history)."""
    turns = [
        TurnRecord(index=0, messages=[SYSTEM, TASK], recorded=Recorded(answer=REC0) if answers else None),
        TurnRecord(index=1, messages=[SYSTEM, TASK, REC0, TOOL0], recorded=Recorded(answer=REC1) if answers else None),
        TurnRecord(index=2, messages=[SYSTEM, TASK, REC0, TOOL0, REC1, TOOL1]),
    ]
    return SessionRecord(session_id="s", model="m", turns=turns)


def _walk(session: SessionRecord, history: History, answers: list[dict[str, Any] | None]) -> list[list[dict[str, Any]]]:
    h = SessionHistory(session, history)
    sent = []
    for i in range(len(session.turns)):
        sent.append(h.request(i)[1])
        h.answered(i, answers[i] if i < len(answers) else None)
    return sent


@pytest.mark.parametrize("with_recorded_answers", [True, False])
def test_full_message_turns_get_the_live_answers(with_recorded_answers: bool) -> None:
    # Found by content (recorded answers) or, without them, by structure (each turn extends the previous request).
    sent = _walk(_full_session(with_recorded_answers), "live", [LIVE0, LIVE1])
    assert sent[0] == [SYSTEM, TASK]
    assert sent[1] == [SYSTEM, TASK, LIVE0, {**TOOL0, "tool_call_id": "live_0"}]
    assert sent[2] == [*sent[1], LIVE1, {**TOOL1, "tool_call_id": "live_1"}]


def test_recorded_history_is_the_file() -> None:
    session = _full_session()
    assert _walk(session, "recorded", [LIVE0, LIVE1]) == [msgs for _, msgs, _ in session.requests("recorded")]


def test_an_edited_answer_and_an_edited_history_stay_as_sent() -> None:
    edited = {**REC1, "content": "Found it (shortened)."}
    summary = {"role": "user", "content": "Summary of the work so far: read a.py."}
    session = _full_session()
    session.turns[2].messages = [SYSTEM, TASK, REC0, TOOL0, edited, TOOL1]
    session.turns.append(TurnRecord(index=3, messages=[SYSTEM, summary, REC1, TOOL1]))
    sent = _walk(session, "live", [LIVE0, LIVE1, LIVE0])
    # The agent edited answer 1 before resending it: what it would have done to the live answer is unknown.
    assert sent[2] == [SYSTEM, TASK, LIVE0, {**TOOL0, "tool_call_id": "live_0"}, edited, TOOL1]
    # A summarised history: no earlier request is its prefix, but answer 1 is there unedited, found by content.
    assert sent[3] == [SYSTEM, summary, LIVE1, {**TOOL1, "tool_call_id": "live_1"}]


def test_new_message_turns_failed_turns_and_reasoning() -> None:
    with_reasoning = {**REC0, "reasoning_content": "look at a.py"}
    session = SessionRecord(
        session_id="s",
        model="m",
        turns=[
            TurnRecord(index=0, messages=[SYSTEM, TASK], recorded=Recorded(answer=with_reasoning)),
            TurnRecord(index=1, new_messages=[TOOL0], recorded=Recorded(answer=REC1)),
            TurnRecord(index=2, new_messages=[TOOL1]),
        ],
    )
    live0 = {**LIVE0, "reasoning_content": "search first"}
    live1 = {**LIVE1, "reasoning_content": "then build"}
    sent = _walk(session, "live", [live0, live1])
    # Reasoning is resent where the recording resent it (answer 0), not elsewhere (answer 1).
    assert sent[1] == [SYSTEM, TASK, live0, {**TOOL0, "tool_call_id": "live_0"}]
    assert sent[2][-2:] == [LIVE1, {**TOOL1, "tool_call_id": "live_1"}]
    # A turn without a live answer (it failed) falls back to the recorded one.
    fallback = _walk(session, "live", [None, live1])
    assert fallback[1] == [SYSTEM, TASK, with_reasoning, TOOL0]


def test_out_of_order_use_is_refused() -> None:
    h = SessionHistory(_full_session(), "live")
    with pytest.raises(ValueError):
        h.request(1)
    with pytest.raises(ValueError):
        SessionHistory(_full_session(), "made-up")  # type: ignore[arg-type]


def test_a_tool_call_cut_off_by_max_tokens_is_not_resent() -> None:
    # vLLM parses a resent call's arguments to render the history and refuses the request when they are cut off.
    cut = {"role": "assistant", "content": "Let me look.", "tool_calls": [_call("live_0", "read_file", '{"path": "a.')]}
    session = SessionRecord(
        session_id="s",
        model="m",
        turns=[
            TurnRecord(index=0, messages=[SYSTEM, TASK], recorded=Recorded(answer=REC0)),
            TurnRecord(index=1, new_messages=[TOOL0]),
        ],
    )
    sent = _walk(session, "live", [cut])
    assert sent[1] == [SYSTEM, TASK, {"role": "assistant", "content": "Let me look."}, TOOL0]
    only_call = {**cut, "content": None}
    assert _walk(session, "live", [only_call])[1][2] == {"role": "assistant", "content": ""}
