"""The replay engine: send recorded sessions to an OpenAI-compatible endpoint and time every turn.

- One streaming client (``kvtether.cli.streaming``), never a retry: a hidden retry would inflate TTFT; a
  failure is counted as an error instead. TTFC, TTFT and TPOT are that client's (its docstring defines them:
  TTFT is the first token of any kind, content, reasoning, refusal or tool call; TPOT is (last token − first
  token) / (completion tokens − 1)).
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
from kvtether.cli.replay.history import DEFAULT_HISTORY, SessionHistory
from kvtether.cli.streaming import CHAT, PATHS, StreamedAnswer, StreamFailure, now_ns, stream_answer
from kvtether.gateway.transport.upstream import Upstream, UpstreamLimits
from kvtether.protocol.contract import SESSION_HEADER, stamps_for_body
from kvtether.sdk.sessionfile import History, SessionRecord

# Request fields the engine owns; a recorded value would break streaming or the measurement.
_OWNED_PARAMS = frozenset({"model", "messages", "tools", "stream", "stream_options", "n"})
# Response headers the gateway may set to attribute reuse; any x-kvtether-* header is kept.
REUSE_HEADER_PREFIX = "x-kvtether-"

ThinkMode = Literal["recorded", "none", "scale", "fixed"]
Arrivals = Literal["closed", "trace"]
ARRIVALS: tuple[Arrivals, ...] = ("closed", "trace")
# Open loop on the wall clock: sessions in flight at most, so a trace far beyond the target's capacity cannot
# exhaust this process's sockets; past it, later sessions wait for a slot and no longer arrive as the trace's did
# (counted: ReplayRun.arrivals_late). A run in virtual time has no sockets (the network is in memory) and no cap:
# a cap there would hold the load below the one asked for (chat at ×64 and more has over a thousand sessions in
# flight) while every figure said otherwise.
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
    # Open loop: sessions in flight at most (OPEN_LOOP_CAP); None: no cap (virtual time).
    open_loop_cap: int | None = OPEN_LOOP_CAP


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


@dataclass(frozen=True, slots=True)
class RunClock:
    """The clock a replay reads (nanoseconds) and when its run started on it."""

    now_ns: Callable[[], int]
    t0: int

    def since_ms(self) -> float:
        return (self.now_ns() - self.t0) / 1e6


@dataclass(slots=True)
class ReplayRun:
    results: list[TurnResult]
    wall_s: float  # real seconds
    # Seconds of the run on the clock it read when that was not the wall clock (virtual time); None: the wall's.
    clock_s: float | None = None
    # Virtual time: the gateway's modelled CPU and what it did (cli/simstack/gateway_cost.py), and the CPU seconds
    # this process really took for the run (measured, reported beside the model, never fed back).
    gateway_model: dict[str, Any] | None = None
    cpu_s: float | None = None
    # A simulated run's counters, read from the gateway and the nodes before teardown (`SimStack.counters`).
    counters: dict[str, Any] | None = None
    # Whether `TurnResult.engine_tpot_ms` was joined from the decoding engines (simulated runs).
    engine_tpot: bool = False
    # Open loop: sessions that started after their arrival because the cap on sessions in flight held them, and
    # the longest such wait (s). Not 0: the load was below the one asked for.
    arrivals_late: int = 0
    arrival_lag_max_s: float = 0.0


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


def _request(model: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
             params: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The request's body (streamed, usage asked for, the recorded parameters the engine does not own) and the
    part of it the contract's stamps are computed over."""
    stamped: dict[str, Any] = {"model": model, "messages": messages}
    extra = {k: v for k, v in params.items() if k not in _OWNED_PARAMS}
    if tools:
        stamped["tools"] = tools
        extra["tools"] = tools
    body = {"messages": messages, "model": model, "stream": True, "stream_options": {"include_usage": True}, **extra}
    return body, stamped


def _reuse_headers(headers: httpx.Headers | None) -> dict[str, str]:
    return {k.lower(): v for k, v in (headers or {}).items() if k.lower().startswith(REUSE_HEADER_PREFIX)}


def _measured(res: TurnResult, answer: StreamedAnswer, scale: float) -> None:
    """The turn's times (scaled to the replay's clock) and token counts, from its answer."""
    r = answer.reader
    res.e2e_ms = answer.e2e_ms(scale)
    res.ttfc_ms = answer.ttfc_ms(scale)
    res.response_id = r.response_id
    res.prompt_tokens, res.completion_tokens = r.prompt_tokens, r.completion_tokens
    res.cached_tokens = r.cached_tokens
    res.ttft_ms = answer.ttft_ms(scale)
    if res.ttft_ms is None:
        res.empty = True
        res.error = f"no visible token ({answer.clock.events} chunks, finish_reason {r.finish_reason})"
    else:
        res.tpot_ms = answer.tpot_ms(scale)
    res.ok = True


async def _one_turn(
    client: httpx.AsyncClient | Upstream,
    url: str,
    sid: str,
    turn_index: int,
    model: str,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    params: dict[str, Any],
    opts: ReplayOptions,
    clock: RunClock,
) -> tuple[TurnResult, dict[str, Any] | None]:
    """One turn streamed and timed (kvtether.cli.streaming); a failure is recorded, never raised out of the run."""
    body, stamped = _request(model, messages, tools, params)
    headers = {**opts.extra_headers, SESSION_HEADER: sid, **stamps_for_body(stamped).headers()}
    if isinstance(client, Upstream) and not any(k.lower() == "authorization" for k in headers):
        headers["authorization"] = f"Bearer {opts.api_key}"  # what the httpx client sends by default
    res = TurnResult(session_id=sid, turn=turn_index, ok=False, prompt_messages=len(messages))
    res.start_ms = clock.since_ms() * opts.time_scale
    try:
        answer = await stream_answer(client, url, body, headers, request_timeout_s=opts.timeout_s,
                                     clock_ns=clock.now_ns)
    except StreamFailure as e:
        res.error_kind, res.error = e.kind, e.message
        res.reuse = _reuse_headers(e.headers)
        res.request_id = e.headers.get("x-request-id") if e.headers is not None else None
        return res, None
    res.reuse = _reuse_headers(answer.headers)
    res.request_id = answer.headers.get("x-request-id")
    _measured(res, answer, opts.time_scale)
    return res, answer.message()


async def _one_session(
    client: httpx.AsyncClient | Upstream,
    url: str,
    session: SessionRecord,
    opts: ReplayOptions,
    clock: RunClock,
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
        result, answer = await _one_turn(client, url, sid, turn.index, model, messages, tools, turn.params, opts,
                                         clock)
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
    *,
    clock_ns: Callable[[], int] = now_ns,
    lean_http: bool = False,
) -> ReplayRun:
    """Replay `sessions` against `base_url`. `clock_ns`: the clock every time is read on (nanoseconds), the
    arrivals' schedule included: the wall clock live, the virtual loop's in virtual time (``loop_clock_ns``).
    `lean_http`: stream through the gateway's own lean HTTP/1.1 client instead of httpx, for a run in virtual
    time, where the client's CPU is no part of any figure but was a sixth of a long replay's (profiled)."""
    if opts.concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    if opts.time_scale <= 0:
        raise ValueError("time scale must be > 0")
    if opts.arrivals not in ARRIVALS:
        raise ValueError(f"arrivals must be one of {ARRIVALS}, not {opts.arrivals!r}")
    if opts.rate <= 0:
        raise ValueError("rate must be > 0")
    if opts.open_loop_cap is not None and opts.open_loop_cap < 1:
        raise ValueError("open_loop_cap must be >= 1 (or None: no cap)")
    wall_t0 = time.perf_counter()
    results: list[TurnResult] = []

    def emit(r: TurnResult) -> None:
        results.append(r)
        if on_result is not None:
            on_result(r)

    open_loop = opts.arrivals == "trace"
    in_flight = (opts.open_loop_cap if open_loop else opts.concurrency) or len(sessions) or 1
    # Room for every session in flight at once (each has at most one request out); 100 kept idle.
    connections, keepalive = max(1000, in_flight), 100
    client: httpx.AsyncClient | Upstream
    if lean_http:
        client = Upstream(UpstreamLimits(connect_timeout_s=opts.timeout_s, write_timeout_s=opts.timeout_s,
                                         pool_timeout_s=opts.timeout_s, max_connections=connections,
                                         max_keepalive_connections=keepalive),
                          clock=lambda: clock_ns() / 1e9)
    else:
        client = httpx.AsyncClient(timeout=opts.timeout_s, headers={"Authorization": f"Bearer {opts.api_key}"},
                                   limits=httpx.Limits(max_connections=connections,
                                                       max_keepalive_connections=keepalive))
    url = openai_base_url(base_url) + PATHS[CHAT]
    limit = anyio.Semaphore(in_flight)
    starts = arrival_delays_s(sessions, opts.rate, opts.time_scale) if open_loop else [0.0] * len(sessions)
    clock = RunClock(clock_ns, clock_ns())
    late: list[float] = []  # open loop: how long each session the cap held waited for a slot (s)

    async def guarded(s: SessionRecord, start_s: float) -> None:
        if start_s > 0:
            # From the run's start, not from now: the task group may start this task late.
            await anyio.sleep(max(0.0, start_s - clock.since_ms() / 1e3))
        asked, held = clock.since_ms(), limit.value == 0  # every slot taken: this session waits for one
        async with limit:
            if open_loop and held:
                late.append((clock.since_ms() - asked) / 1e3)
            await _one_session(client, url, s, opts, clock, emit)

    try:
        async with anyio.create_task_group() as tg:
            for s, start_s in zip(sessions, starts, strict=True):
                tg.start_soon(guarded, s, start_s)
    finally:
        await client.aclose()
    return ReplayRun(results=results, wall_s=time.perf_counter() - wall_t0,
                     clock_s=clock.since_ms() / 1e3 if clock_ns is not now_ns else None,
                     arrivals_late=len(late), arrival_lag_max_s=max(late, default=0.0))
