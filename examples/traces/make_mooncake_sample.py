"""Write ``mooncake-conversation-sample.jsonl``: a small synthetic trace in the Mooncake trace format.

Synthetic, with the structure of the published conversation trace (Mooncake, FAST'25: Kimi's chat traffic),
not a line of it: 40 conversations of 3 to 10 turns; each turn's prompt is the previous prompt, the previous
answer and the user's new text, from 2k to 32k tokens; four system prompts shared between conversations, so
their full blocks carry the same hash ids across sessions; human think times between turns (median ~90 s);
the conversations start within a 5-minute window.

Hash ids are assigned as Mooncake's are: one per 512-token block, the same id for the same block content *after
the same prefix* (chained), so a turn's ids start with all of the previous turn's full blocks and its last,
partial block gets a new id as it fills. No line carries a ``session_id``: ``kvtether convert --from mooncake``
rebuilds the conversations from the hash-id chains. Same seed, same file::

    python examples/traces/make_mooncake_sample.py --seed 0
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path
from typing import Any

BLOCK = 512
SESSIONS = 40
WINDOW_S = 300.0  # conversations start within the first five minutes
MAX_PROMPT = 32_000
SYSTEM_PROMPTS = (700, 1150, 1600, 2300)  # tokens: 1, 2, 3 and 4 full blocks shared by their sessions
SYSTEM_WEIGHTS = (4, 3, 2, 1)
OUT = Path(__file__).with_name("mooncake-conversation-sample.jsonl")

Segment = tuple[str, int]  # (content id, tokens)


class BlockIds:
    """Chained block ids: (previous block's id, this block's content) -> id, numbered in order of first use."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, tuple[tuple[str, int, int], ...]], int] = {}

    def of(self, content: list[Segment], tokens: int) -> list[int]:
        ids: list[int] = []
        prev = -1
        for start in range(0, tokens, BLOCK):
            block = _slice(content, start, min(start + BLOCK, tokens))
            prev = self._ids.setdefault((prev, block), len(self._ids))
            ids.append(prev)
        return ids


def _slice(content: list[Segment], start: int, end: int) -> tuple[tuple[str, int, int], ...]:
    """The pieces of the segments that fall in token positions [start, end)."""
    out: list[tuple[str, int, int]] = []
    pos = 0
    for uid, n in content:
        lo, hi = max(start, pos), min(end, pos + n)
        if lo < hi:
            out.append((uid, lo - pos, hi - pos))
        pos += n
    return tuple(out)


def _think_s(rng: random.Random) -> float:
    """A human's time between reading an answer and sending the next message: log-normal, median 90 s."""
    return min(600.0, max(5.0, math.exp(rng.gauss(math.log(90.0), 0.7))))


def _conversation(k: int, rng: random.Random) -> list[tuple[list[Segment], int, int, float]]:
    """One conversation's turns as (content, prompt tokens, answer tokens, arrival s)."""
    system = rng.choices(range(len(SYSTEM_PROMPTS)), weights=SYSTEM_WEIGHTS)[0]
    content: list[Segment] = [(f"system-{system}", SYSTEM_PROMPTS[system]), (f"c{k}-user-0", rng.randint(1500, 8000))]
    at = rng.uniform(0.0, WINDOW_S)
    turns: list[tuple[list[Segment], int, int, float]] = []
    for i in range(rng.randint(3, 10)):
        prompt = sum(n for _, n in content)
        answer = rng.randint(80, 700)
        turns.append((list(content), prompt, answer, at))
        # The next turn: this answer, then the user's text (now and then a pasted document).
        paste = rng.randint(1500, 6000)
        user = paste if rng.random() < 0.2 and prompt + answer + paste + 1100 * 9 < MAX_PROMPT else rng.randint(30, 400)
        content += [(f"c{k}-answer-{i}", answer), (f"c{k}-user-{i + 1}", user)]
        at += 1.0 + answer * 0.03 + _think_s(rng)  # the answer streams (~30 ms a token), then the user thinks
    return turns


def make_trace(seed: int = 0) -> list[list[dict[str, Any]]]:
    """The conversations, each a list of Mooncake trace rows in turn order."""
    rng = random.Random(seed)
    ids = BlockIds()
    sessions = []
    for k in range(SESSIONS):
        rows = [{"timestamp": round(at * 1000), "input_length": prompt, "output_length": answer,
                 "hash_ids": ids.of(content, prompt)} for content, prompt, answer, at in _conversation(k, rng)]
        sessions.append(rows)
    return _renumber(sessions)


def _renumber(sessions: list[list[dict[str, Any]]]) -> list[list[dict[str, Any]]]:
    """Number the block ids in order of first appearance in the trace, as the published traces do."""
    new: dict[int, int] = {}
    for row in _by_arrival(sessions):
        row["hash_ids"] = [new.setdefault(i, len(new)) for i in row["hash_ids"]]
    return sessions


def _by_arrival(sessions: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return sorted((r for s in sessions for r in s), key=lambda r: r["timestamp"])


def trace_lines(sessions: list[list[dict[str, Any]]]) -> list[str]:
    """All rows in arrival order, as the published traces are."""
    return [json.dumps(r) for r in _by_arrival(sessions)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0, help="same seed, same file")
    ap.add_argument("--out", type=Path, default=OUT, help=f"output JSONL (default: {OUT.name} next to this script)")
    args = ap.parse_args()
    args.out.write_text("\n".join(trace_lines(make_trace(args.seed))) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
