"""Synthetic agent sessions: a system prompt + tools, a task, then tool-call loops with growing history.

Deterministic given the seed (one ``random.Random`` per file, nothing else consulted). Text is made
of short English words from a built-in list so that one word is about one token for common
tokenizers, and the simulator's "tokens" match without a tokenizer.

Shape of one session (turn i ≥ 1 carries ``new_messages``; the history is rebuilt by the replay):

    turn 0: [system, user task]                        recorded answer: assistant text + tool call
    turn i: [tool result of N words] (+ user note, p)  recorded answer: assistant text + tool call
    last turn's recorded answer has no tool call (the agent's final answer)
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

from kvtether.sdk.sessionfile import Recorded, SessionRecord, TurnRecord

DEFAULT_NEW_TOKENS = "50-500:0.85,2000-8000:0.15"
DEFAULT_OUTPUT_TOKENS = "20-120"

# Common short words: most are one token in the BPE vocabularies of Llama/Qwen/GPT tokenizers.
WORDS: tuple[str, ...] = tuple(
    """
    the of and to in is it for on with as at by from this that be are was or an not but all can
    will one has have had its more new file code test run build data list map set get put add key
    value type name path line word time user tool call read write open close start stop wait next
    last first end loop step node port host log error warn info debug trace check fix patch merge
    branch commit push pull fetch load save copy move find search sort split join parse print show
    make use need want try keep give take send back left right up down out over under into about
    model layer block cache token batch queue task job worker server client route proxy table row
    column index field class method function module package import return yield true false none null
    small large fast slow high low long short old good bad same other each every some many few most
    red blue green black white gray light dark hot cold warm cool day week month year hour minute
    """.split()  # noqa: SIM905 - a word block reads better than 200 quoted strings
)

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a text file from the workspace and return its contents.",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "Path relative to the workspace root."},
                    "max_lines": {"type": "integer", "minimum": 1},
                },
                "required": ["path"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_shell",
            "description": "Run a shell command in the workspace and return stdout and stderr.",
            "parameters": {
                "type": "object",
                "properties": {
                    "command": {"type": "string"},
                    "timeout_s": {"type": "number", "minimum": 1},
                },
                "required": ["command"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search_code",
            "description": "Search the repository for a pattern; return matching lines with file and line number.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string"},
                    "max_results": {"type": "integer", "minimum": 1, "maximum": 200},
                },
                "required": ["query"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "description": "Replace the contents of a file in the workspace.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                "required": ["path", "content"],
            },
        },
    },
]


@dataclass(frozen=True, slots=True)
class TokenRange:
    lo: int
    hi: int
    weight: float


def parse_mix(spec: str) -> list[TokenRange]:
    """Parse ``"N"``, ``"LO-HI"`` or a weighted mix ``"LO-HI:W,LO-HI:W"`` (weights need not sum to 1)."""
    ranges: list[TokenRange] = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        body, _, weight_s = part.partition(":")
        try:
            weight = float(weight_s) if weight_s else 1.0
            lo_s, _, hi_s = body.partition("-")
            lo = int(lo_s)
            hi = int(hi_s) if hi_s else lo
        except ValueError:
            raise ValueError(f"bad token range {part!r} (expected N, LO-HI or LO-HI:WEIGHT)") from None
        if lo < 0 or hi < lo or weight <= 0:
            raise ValueError(f"bad token range {part!r} (need 0 <= LO <= HI and WEIGHT > 0)")
        ranges.append(TokenRange(lo, hi, weight))
    if not ranges:
        raise ValueError(f"empty token range spec {spec!r}")
    return ranges


def _draw(rng: random.Random, mix: list[TokenRange]) -> int:
    r = rng.choices(mix, weights=[m.weight for m in mix])[0]
    return rng.randint(r.lo, r.hi)


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choices(WORDS, k=max(n, 1)))


@dataclass(frozen=True, slots=True)
class GenParams:
    sessions: int = 8
    turns: int = 6
    new_tokens: str = DEFAULT_NEW_TOKENS  # tool result size per turn
    output_tokens: str = DEFAULT_OUTPUT_TOKENS  # answer length per turn (max_tokens)
    think_ms: float = 500.0  # mean tool/think time between an answer and the next request
    user_message_prob: float = 0.15  # chance that a turn also carries a new user message
    system_tokens: int = 400
    task_tokens: int = 60
    model: str = "kvtether-sim"
    seed: int = 0
    id_prefix: str = "gen"
    pin_output: bool = True  # add vLLM's min_tokens + ignore_eos so every engine emits exactly max_tokens
    # Sessions per second arriving as a Poisson process (metadata.start_offset_ms, what `replay --arrivals trace`
    # reads); None: no arrival times (a closed-loop replay starts them as slots free up).
    arrival_rate: float | None = None

    def validate(self) -> None:
        if self.sessions < 1 or self.turns < 1:
            raise ValueError("sessions and turns must be >= 1")
        if self.think_ms < 0:
            raise ValueError("think time must be >= 0")
        if self.arrival_rate is not None and not self.arrival_rate > 0:
            raise ValueError("arrival rate must be > 0 sessions per second")
        if not 0.0 <= self.user_message_prob <= 1.0:
            raise ValueError("user message probability must be in [0, 1]")
        parse_mix(self.new_tokens)
        parse_mix(self.output_tokens)


def _tool_call(rng: random.Random, call_id: str) -> dict[str, Any]:
    tool = rng.choice(TOOLS)["function"]
    name = tool["name"]
    if name == "read_file":
        args: dict[str, Any] = {"path": f"src/{rng.choice(WORDS)}/{rng.choice(WORDS)}.py"}
    elif name == "run_shell":
        args = {"command": f"pytest -q tests/test_{rng.choice(WORDS)}.py", "timeout_s": 60}
    elif name == "search_code":
        args = {"query": f"{rng.choice(WORDS)} {rng.choice(WORDS)}", "max_results": 20}
    else:
        args = {"path": f"src/{rng.choice(WORDS)}.py", "content": _words(rng, 12)}
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def generate_sessions(p: GenParams) -> list[SessionRecord]:
    p.validate()
    rng = random.Random(p.seed)
    new_mix = parse_mix(p.new_tokens)
    out_mix = parse_mix(p.output_tokens)
    # One agent, many tasks: every session shares the system prompt and tools, as real agent
    # fleets do, so cross-session prefix reuse of the system prompt is part of the workload.
    system = {"role": "system", "content": "You are a coding agent. " + _words(rng, p.system_tokens)}
    sessions: list[SessionRecord] = []
    # Arrivals from a generator of their own: the sessions' content is the same with or without them.
    arrivals = random.Random(f"{p.seed}/arrivals")
    start_ms = 0.0
    for s in range(p.sessions):
        sid = f"{p.id_prefix}-{p.seed}-{s:04d}"
        turns: list[TurnRecord] = []
        prev_call_id: str | None = None
        for i in range(p.turns):
            out_tokens = _draw(rng, out_mix)
            params: dict[str, Any] = {"max_tokens": out_tokens}
            if p.pin_output:
                params.update(min_tokens=out_tokens, ignore_eos=True)
            last = i == p.turns - 1
            call_id = f"call_{s:04d}_{i:03d}"
            answer: dict[str, Any] = {"role": "assistant", "content": _words(rng, max(out_tokens - 12, 1))}
            if not last:
                answer["tool_calls"] = [_tool_call(rng, call_id)]
            recorded = Recorded(answer=answer, completion_tokens=out_tokens, finish_reason="length")
            if i == 0:
                task = {"role": "user", "content": "Task: " + _words(rng, p.task_tokens)}
                turns.append(TurnRecord(index=0, messages=[system, task], params=params, recorded=recorded))
            else:
                new: list[dict[str, Any]] = [
                    {"role": "tool", "tool_call_id": prev_call_id, "content": _words(rng, _draw(rng, new_mix))}
                ]
                if rng.random() < p.user_message_prob:
                    new.append({"role": "user", "content": "Also: " + _words(rng, rng.randint(10, 60))})
                delay = round(p.think_ms * rng.uniform(0.5, 1.5), 1) if p.think_ms > 0 else 0.0
                turns.append(
                    TurnRecord(index=i, new_messages=new, delay_ms=delay, params=params, recorded=recorded)
                )
            prev_call_id = call_id
        sessions.append(
            SessionRecord(
                session_id=sid,
                model=p.model,
                turns=turns,
                tools=TOOLS,
                metadata={"generator": "kvtether gen", "seed": p.seed, "session": s,
                          **({"start_offset_ms": round(start_ms, 3)} if p.arrival_rate is not None else {})},
            )
        )
        if p.arrival_rate is not None:
            start_ms += arrivals.expovariate(p.arrival_rate) * 1000.0
    return sessions
