"""The replay engine: send recorded sessions to an OpenAI-compatible endpoint and time every turn.

- One ``AsyncOpenAI`` client with ``max_retries=0``: a hidden retry would inflate TTFT; a failure is
  counted as an error instead.
- Timestamps come from ``time.perf_counter_ns()`` taken before any other work on a chunk.
  TTFC = first SSE chunk of any kind; TTFT = first chunk carrying content, a tool-call delta,
  a refusal or a reasoning delta (a role-only first delta is not a token). TPOT = (last token
  chunk − first token chunk) / (completion tokens − 1).
- Arrivals. ``closed`` (the default): ``--concurrency`` is the number of sessions in flight; a session
  holds its slot through its think times, like a user at a keyboard. ``trace`` (open loop): each session
  starts at its ``metadata.start_offset_ms`` (the importers keep a trace's arrivals there; 0 without one)
  divided by ``rate``, whatever the others are doing, as the field's sessions arrive; only a safety cap
  (``OPEN_LOOP_CAP``) bounds the sessions in flight. Think times between turns are as in closed loop.
- History (``SessionHistory``): under ``live`` (the default) each turn resends the answers this replay
  received for the earlier turns, as the agent would have; under ``recorded`` the file's answers. A
  server whose answers differ from the recording holds KV for its own answer, so a recorded history
  departs from it at the first differing token and understates what reuse an agent would get.
- A turn that fails ends its session: the next turn's history would be wrong (live) or the
  server is in trouble (recorded); the remaining turns are reported as skipped.
- ``time_scale``: on the simulator, simulated time = real time × speed. Measured durations are
  multiplied by it and think-time sleeps divided by it, so every reported number is in simulated time.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, cast

import anyio
import httpx
import openai
from kvtether.cli.replay.history import _REASONING_FIELDS, DEFAULT_HISTORY, SessionHistory
from kvtether.sdk.contract import SESSION_HEADER, stamps_for_body
from kvtether.sdk.sessionfile import History, SessionRecord

# Request fields the engine owns; a recorded value would break streaming or the measurement.
_OWNED_PARAMS = frozenset({"model", "messages", "tools", "stream", "stream_options", "n"})
# Response headers the gateway may set to attribute reuse; any x-kvtether-* header is kept.
REUSE_HEADER_PREFIX = "x-kvtether-"

ThinkMode = Literal["recorded", "none", "scale", "fixed"]
Arrivals = Literal["closed", "trace"]
ARRIVALS: tuple[Arrivals, ...] = ("closed", "trace")
# Open loop: sessions in flight at most, so a trace far beyond the target's capacity cannot exhaust this
# process's sockets; past it, later sessions wait for a slot and no longer arrive as the trace's did.
OPEN_LOOP_CAP = 1024



@dataclass(frozen=True, slots=True)
class ThinkTime:
    mode: ThinkMode = "recorded"
    value: float = 1.0  # scale factor for "scale", milliseconds for "fixed"

    def delay_ms(self, recorded_ms: float) -> float:
        if self.mode == "none":
            return 0.0
        if self.mode == "scale":
            return recorded_ms * self.value
        if self.mode == "fixed":
            return self.value
        return recorded_ms

    def __str__(self) -> str:
        if self.mode == "scale":
            return f"scale:{self.value:g}"
        if self.mode == "fixed":
            return f"fixed:{self.value:g}"
        return self.mode


def parse_think_time(spec: str) -> ThinkTime:
    """``recorded`` | ``none`` | ``scale:F`` | ``fixed:MS``."""
    s = spec.strip().lower()
    if s in ("recorded", "none"):
        return ThinkTime(cast(ThinkMode, s))
    kind, _, num = s.partition(":")
    if kind in ("scale", "fixed") and num:
        try:
            v = float(num)
        except ValueError:
            v = -1.0
        if v >= 0:
            return ThinkTime(cast(ThinkMode, kind), v)
    raise ValueError(f"bad think time {spec!r} (expected recorded, none, scale:F or fixed:MS with F, MS >= 0)")


@dataclass(slots=True)
class ReplayOptions:
    concurrency: int = 8
    think_time: ThinkTime = field(default_factory=ThinkTime)
    history: History = DEFAULT_HISTORY
    max_think_ms: float | None = None  # cap on one think time (after scaling)
    timeout_s: float = 600.0  # per request
    model: str | None = None  # overrides the sessions' model
    time_scale: float = 1.0
    # Appended to every session id so that a second replay against a long-lived gateway does not
    # land on the sessions (and pinned KV) of the first. Empty keeps the recorded ids.
    session_suffix: str = ""
    extra_headers: dict[str, str] = field(default_factory=dict)
    api_key: str = "kvtether-replay"
    arrivals: Arrivals = "closed"
    rate: float = 1.0  # open loop: start offsets are divided by this (think times are not)


@dataclass(slots=True)
class TurnResult:
    session_id: str
    turn: int
    ok: bool
    skipped: bool = False
    # A 200 stream that ended without a visible token (e.g. a cut-off tool call that the server's
    # tool parser held back): a success without a TTFT, counted apart so it cannot hide in the stats.
    empty: bool = False
    error_kind: str | None = None  # connection, timeout, http_<status>, server_error, stream, skipped
    error: str | None = None
    start_ms: float = 0.0  # since the start of the run
    ttfc_ms: float | None = None
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None
    prompt_messages: int = 0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    reuse: dict[str, str] = field(default_factory=dict)  # the response's x-kvtether-* headers
    request_id: str | None = None
    response_id: str | None = None  # the stream's `id` (vLLM: chatcmpl-<16 hex>)
    # The engine's own TPOT for this answer (simulated runs: cost-model step times, free of this machine's load).
    engine_tpot_ms: float | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class ReplayRun:
    results: list[TurnResult]
    wall_s: float  # real seconds
    # A simulated run's counters, read from the gateway and the nodes before teardown (`SimGateway.counters`).
    counters: dict[str, Any] | None = None
    # Whether `TurnResult.engine_tpot_ms` was joined from the decoding engines (simulated runs).
    engine_tpot: bool = False


def new_session_suffix() -> str:
    return "~" + uuid.uuid4().hex[:6]


def openai_base_url(url: str) -> str:
    u = url.rstrip("/")
    return u if u.endswith("/v1") else u + "/v1"


class Unreachable(RuntimeError):
    """The endpoint does not answer at all (connection refused, DNS, timeout)."""


async def check_reachable(url: str, timeout_s: float = 5.0) -> None:
    """Fail fast with one clear line instead of N connection errors; any HTTP answer counts as reachable."""
    target = openai_base_url(url) + "/models"
    try:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            await client.get(target)
    except httpx.HTTPError as e:
        raise Unreachable(f"cannot reach {url} ({type(e).__name__}: {e or 'no answer'})") from None


def _has_token(delta: Any) -> bool:
    if delta.content or delta.tool_calls or getattr(delta, "refusal", None):
        return True
    extra = delta.model_extra or {}
    return bool(extra.get("reasoning_content") or extra.get("reasoning"))


class _Answer:
    """Accumulates the streamed assistant message, for --history live."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.reasoning_key = "reasoning_content"  # the server's name for it (vLLM has used both)
        self.calls: dict[int, dict[str, Any]] = {}

    def add(self, delta: Any) -> None:
        if delta.content:
            self.content.append(delta.content)
        extra = delta.model_extra or {}
        for key in _REASONING_FIELDS:  # a server may send both names for the same text: take the first
            if extra.get(key):
                self.reasoning.append(str(extra[key]))
                self.reasoning_key = key
                break
        for tc in delta.tool_calls or ():
            call = self.calls.setdefault(
                tc.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
            )
            if tc.id:
                call["id"] = tc.id
            if tc.function is not None:
                if tc.function.name:
                    call["function"]["name"] += tc.function.name
                if tc.function.arguments:
                    call["function"]["arguments"] += tc.function.arguments

    def message(self) -> dict[str, Any]:
        text = "".join(self.content)
        # A tool-call-only answer has content null, as the server's non-streamed message and the SDK recorder have.
        msg: dict[str, Any] = {"role": "assistant", "content": text if text or not self.calls else None}
        if self.reasoning:
            msg[self.reasoning_key] = "".join(self.reasoning)
        if self.calls:
            msg["tool_calls"] = [self.calls[i] for i in sorted(self.calls)]
        return msg


def _ms(ns: int, scale: float) -> float:
    return ns / 1e6 * scale


def _take_usage(res: TurnResult, usage: Any) -> None:
    if usage is not None:
        res.prompt_tokens = usage.prompt_tokens
        res.completion_tokens = usage.completion_tokens
        details = getattr(usage, "prompt_tokens_details", None)
        if details is not None and details.cached_tokens is not None:
            res.cached_tokens = details.cached_tokens


def _failure(e: Exception) -> tuple[str, str]:
    """A failed request's kind and message (docs/replay.md, *Errors*)."""
    if isinstance(e, openai.APITimeoutError):
        return "timeout", str(e)
    if isinstance(e, openai.APIConnectionError):
        cause = e.__cause__
        return "connection", f"{e}" + (f" ({type(cause).__name__}: {cause})" if cause else "")
    if isinstance(e, openai.APIStatusError):
        return f"http_{e.status_code}", str(e)[:300]
    if isinstance(e, openai.APIError):  # an error event inside a 200 stream
        return "server_error", str(e)[:300]
    return "stream", f"{type(e).__name__}: {e}"[:300]  # a broken stream mid-way


async def _one_turn(
    client: openai.AsyncOpenAI,
    sid: str,
    turn_index: int,
    model: str,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    params: dict[str, Any],
    opts: ReplayOptions,
    run_t0: int,
) -> tuple[TurnResult, dict[str, Any] | None]:
    body_for_stamps: dict[str, Any] = {"model": model, "messages": messages}
    extra_body = {k: v for k, v in params.items() if k not in _OWNED_PARAMS}
    if tools:
        body_for_stamps["tools"] = tools
        extra_body["tools"] = tools
    headers = {**opts.extra_headers, SESSION_HEADER: sid, **stamps_for_body(body_for_stamps).headers()}
    res = TurnResult(session_id=sid, turn=turn_index, ok=False, prompt_messages=len(messages))
    answer = _Answer()
    scale = opts.time_scale
    t_first_chunk: int | None = None
    t_first_token: int | None = None
    t_last_token: int | None = None
    token_chunks = 0
    chunks = 0
    finish_reason: str | None = None
    usage: Any = None
    t0 = time.perf_counter_ns()
    res.start_ms = _ms(t0 - run_t0, scale)
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=cast(Any, messages),
            stream=True,
            stream_options={"include_usage": True},
            extra_headers=headers,
            extra_body=extra_body,
            timeout=opts.timeout_s,
        )
        async with stream:
            res.reuse = {
                k.lower(): v for k, v in stream.response.headers.items() if k.lower().startswith(REUSE_HEADER_PREFIX)
            }
            res.request_id = stream.response.headers.get("x-request-id")
            async for chunk in stream:
                now = time.perf_counter_ns()  # first: nothing else may sit between arrival and stamp
                if t_first_chunk is None:
                    t_first_chunk = now
                    res.response_id = getattr(chunk, "id", None) or None
                chunks += 1
                if chunk.choices:
                    finish_reason = chunk.choices[0].finish_reason or finish_reason
                    delta = chunk.choices[0].delta
                    if _has_token(delta):
                        if t_first_token is None:
                            t_first_token = now
                        t_last_token = now
                        token_chunks += 1
                        answer.add(delta)
                if chunk.usage is not None:
                    usage = chunk.usage
        t_end = time.perf_counter_ns()
    except Exception as e:  # recorded, never raised out of the run
        res.error_kind, res.error = _failure(e)
        return res, None

    res.e2e_ms = _ms(t_end - t0, scale)
    if t_first_chunk is not None:
        res.ttfc_ms = _ms(t_first_chunk - t0, scale)
    _take_usage(res, usage)
    if t_first_token is None or t_last_token is None:
        res.ok = res.empty = True
        res.error = f"no visible token ({chunks} chunks, finish_reason {finish_reason})"
        return res, answer.message()
    res.ttft_ms = _ms(t_first_token - t0, scale)
    n_tokens = res.completion_tokens if res.completion_tokens else token_chunks
    if n_tokens > 1:
        res.tpot_ms = _ms(t_last_token - t_first_token, scale) / (n_tokens - 1)
    res.ok = True
    return res, answer.message()


async def _one_session(
    client: openai.AsyncOpenAI,
    session: SessionRecord,
    opts: ReplayOptions,
    run_t0: int,
    emit: Callable[[TurnResult], None],
) -> None:
    sid = session.session_id + opts.session_suffix
    model = opts.model or session.model
    history = SessionHistory(session, opts.history)
    failed = False
    for i, turn in enumerate(session.turns):
        if failed:
            emit(TurnResult(session_id=sid, turn=turn.index, ok=False, skipped=True, error_kind="skipped"))
            continue
        if turn.index > 0 or turn.delay_ms > 0:
            delay = opts.think_time.delay_ms(turn.delay_ms)
            if opts.max_think_ms is not None:
                delay = min(delay, opts.max_think_ms)
            if delay > 0:
                await anyio.sleep(delay / 1000.0 / opts.time_scale)
        _, messages, tools = history.request(i)
        result, answer = await _one_turn(client, sid, turn.index, model, messages, tools, turn.params, opts, run_t0)
        history.answered(i, answer)
        emit(result)
        failed = not result.ok


def start_offset_ms(session: SessionRecord) -> float:
    """When the session arrived, ms since the trace's start (``metadata.start_offset_ms``); 0 if unknown."""
    v = session.metadata.get("start_offset_ms")
    if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0:
        return 0.0
    return float(v)


def arrival_delays_s(sessions: Sequence[SessionRecord], rate: float, time_scale: float) -> list[float]:
    """Open loop: each session's start, real seconds after the run's start (offsets ÷ rate, in simulated time)."""
    return [start_offset_ms(s) / rate / time_scale / 1000.0 for s in sessions]


def join_engine_tpot(results: Sequence[TurnResult], tpot_by_request: dict[str, float]) -> int:
    """Set each result's ``engine_tpot_ms`` from the engines' per-request TPOT; returns how many were joined.

    vLLM's engine request id is the response id the client sees plus ``-<8 hex>`` (``sim/api.py`` does the
    same), so a request whose id starts with ``<response id>-`` served that answer."""
    by_response: dict[str, float] = {}
    for rid, tpot in tpot_by_request.items():
        base, sep, _ = rid.rpartition("-")
        if sep:
            by_response[base] = tpot
    joined = 0
    for r in results:
        if r.response_id is not None and r.response_id in by_response:
            r.engine_tpot_ms = by_response[r.response_id]
            joined += 1
    return joined


async def run_replay(
    sessions: Sequence[SessionRecord],
    base_url: str,
    opts: ReplayOptions,
    on_result: Callable[[TurnResult], None] | None = None,
) -> ReplayRun:
    if opts.concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    if opts.time_scale <= 0:
        raise ValueError("time scale must be > 0")
    if opts.arrivals not in ARRIVALS:
        raise ValueError(f"arrivals must be one of {ARRIVALS}, not {opts.arrivals!r}")
    if opts.rate <= 0:
        raise ValueError("rate must be > 0")
    results: list[TurnResult] = []

    def emit(r: TurnResult) -> None:
        results.append(r)
        if on_result is not None:
            on_result(r)

    client = openai.AsyncOpenAI(
        base_url=openai_base_url(base_url),
        api_key=opts.api_key,
        max_retries=0,
        timeout=opts.timeout_s,
    )
    open_loop = opts.arrivals == "trace"
    limit = anyio.Semaphore(OPEN_LOOP_CAP if open_loop else opts.concurrency)
    starts = arrival_delays_s(sessions, opts.rate, opts.time_scale) if open_loop else [0.0] * len(sessions)
    run_t0 = time.perf_counter_ns()

    async def guarded(s: SessionRecord, start_s: float) -> None:
        if start_s > 0:
            # From the run's start, not from now: the task group may start this task late.
            await anyio.sleep(max(0.0, start_s - (time.perf_counter_ns() - run_t0) / 1e9))
        async with limit:
            await _one_session(client, s, opts, run_t0, emit)

    try:
        async with anyio.create_task_group() as tg:
            for s, start_s in zip(sessions, starts, strict=True):
                tg.start_soon(guarded, s, start_s)
    finally:
        await client.close()
    return ReplayRun(results=results, wall_s=(time.perf_counter_ns() - run_t0) / 1e9)
