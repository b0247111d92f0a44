"""Importers from other tools' multi-turn formats into kvtether sessions (pure, no network).

- ``vllm``: the input of vLLM's ``benchmarks/multi_turn/benchmark_serving_multi_turn.py`` (as written
  by its ``convert_sharegpt_to_openai.py``): one JSON list of ``{"id", "messages": [{"role",
  "content"}, ...]}``. Each user message starts a turn; the assistant message after it is that
  turn's recorded answer; leading system messages go into turn 0.
- ``aiperf``: AIPerf's ``multi_turn`` custom dataset, JSONL, one ``{"session_id", "turns": [...]}``
  per line; a turn has ``text`` or ``texts`` (strings, or ``{"name", "contents"}`` objects), optional
  ``role`` (a leading ``system`` turn becomes the system prompt, as AIPerf hoists it), ``delay`` (ms),
  ``timestamp`` (ms), ``output_length``/``max_tokens`` and ``extra`` (extra body fields). Lines with
  the same ``session_id`` are joined in file order. AIPerf files carry no answers: replay them with
  ``--history live`` (with ``recorded`` the requests contain only the user messages).

- ``mooncake``: the Mooncake trace format (AIPerf's ``mooncake_trace``), JSONL, one request per line:
  ``{"timestamp", "input_length", "output_length", "hash_ids"}`` with AIPerf's optional ``session_id``,
  ``delay``, ``text_input`` and ``extra``. The trace holds no text: prompts are synthesised from the
  block ids (see ``import_mooncake``).

Token counts are not known without a tokenizer; ``max_tokens`` for a vLLM turn is the word count of
its recorded answer (about one token per word for English), else ``default_max_tokens``.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import pairwise
from pathlib import Path
from typing import Any

from kvtether.sdk.sessionfile import Recorded, SessionRecord, TurnRecord

FORMATS = ("vllm", "aiperf", "mooncake")


class ImportFormatError(ValueError):
    """A file that does not match the importer's format: names where and what."""

    def __init__(self, where: str, problem: str) -> None:
        super().__init__(f"{where}: {problem}")
        self.where = where
        self.problem = problem


def _json_lines(lines: Iterable[str], where: str) -> Iterator[tuple[int, str, Any]]:
    """A JSONL file's objects: (line number, "where:line" for errors, the parsed value); blank lines skipped."""
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        at = f"{where}:{n}"
        try:
            yield n, at, json.loads(line)
        except json.JSONDecodeError as e:
            raise ImportFormatError(at, f"not valid JSON ({e.msg} at column {e.colno})") from None


def _text_content(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # OpenAI content parts: keep the text parts
        parts = [p.get("text", "") for p in value if isinstance(p, dict) and p.get("type") == "text"]
        return "\n".join(parts)
    raise ValueError("message content must be a string or a list of content parts")


def import_vllm(data: Any, *, model: str, default_max_tokens: int = 256, where: str = "vllm") -> list[SessionRecord]:
    if not isinstance(data, list):
        raise ImportFormatError(where, "expected a JSON list of conversations ({'id', 'messages'})")
    sessions: list[SessionRecord] = []
    seen: set[str] = set()
    for k, conv in enumerate(data):
        at = f"{where}: conversation #{k}"
        if not isinstance(conv, dict):
            raise ImportFormatError(at, "not a JSON object")
        sid = str(conv.get("id", f"conv-{k}"))
        at = f"{at} (id {sid!r})"
        msgs = conv.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ImportFormatError(at, "'messages' must be a non-empty list")
        if sid in seen:
            raise ImportFormatError(at, "duplicate id")
        seen.add(sid)
        system: list[dict[str, Any]] = []
        turns: list[TurnRecord] = []
        for j, m in enumerate(msgs):
            if not isinstance(m, dict) or m.get("role") not in {"system", "user", "assistant"}:
                raise ImportFormatError(f"{at}, message #{j}", "needs 'role' system, user or assistant")
            try:
                content = _text_content(m.get("content"))
            except ValueError as e:
                raise ImportFormatError(f"{at}, message #{j}", str(e)) from None
            role = m["role"]
            if role == "system":
                if turns:
                    raise ImportFormatError(f"{at}, message #{j}", "a system message after the first user message")
                system.append({"role": "system", "content": content})
            elif role == "user":
                msg = {"role": "user", "content": content}
                if not turns:
                    turns.append(TurnRecord(index=0, messages=[*system, msg]))
                else:
                    turns.append(TurnRecord(index=len(turns), new_messages=[msg]))
            else:
                if not turns:
                    raise ImportFormatError(f"{at}, message #{j}", "an assistant message before any user message")
                if turns[-1].recorded is not None:
                    raise ImportFormatError(f"{at}, message #{j}", "two assistant messages in a row")
                answer = {"role": "assistant", "content": content}
                turns[-1].recorded = Recorded(answer=answer, completion_tokens=len(content.split()) or None)
        if not turns:
            raise ImportFormatError(at, "no user message")
        for t in turns:
            n = t.recorded.completion_tokens if t.recorded else None
            t.params = {"max_tokens": n or default_max_tokens}
        sessions.append(SessionRecord(session_id=sid, model=model, turns=turns, metadata={"imported_from": "vllm"}))
    return sessions


def _aiperf_text(turn: dict[str, Any]) -> str:
    if "text" in turn:
        if not isinstance(turn["text"], str):
            raise ValueError("'text' must be a string")
        return turn["text"]
    texts = turn.get("texts")
    if not isinstance(texts, list) or not texts:
        raise ValueError("a turn needs 'text' or a non-empty 'texts' list")
    out: list[str] = []
    for t in texts:
        if isinstance(t, str):
            out.append(t)
        elif isinstance(t, dict) and isinstance(t.get("contents"), list):
            out.extend(str(c) for c in t["contents"])
        else:
            raise ValueError("'texts' items must be strings or {'name', 'contents'} objects")
    # A batched AIPerf turn sends several prompts at once; a chat request has one user message.
    return "\n".join(out)


def import_aiperf(
    lines: Iterable[str], *, model: str, default_max_tokens: int = 256, where: str = "aiperf"
) -> list[SessionRecord]:
    by_id: dict[str, SessionRecord] = {}
    last_ts: dict[str, float] = {}
    n_anon = 0
    for _, at, obj in _json_lines(lines, where):
        if not isinstance(obj, dict) or not isinstance(obj.get("turns"), list) or not obj["turns"]:
            raise ImportFormatError(at, "expected an object with a non-empty 'turns' list")
        sid = obj.get("session_id")
        if sid is None:
            sid = f"aiperf-{n_anon}"
            n_anon += 1
        sid = str(sid)
        rec = by_id.setdefault(sid, SessionRecord(session_id=sid, model=model, metadata={"imported_from": "aiperf"}))
        system: list[dict[str, Any]] = []
        for j, turn in enumerate(obj["turns"]):
            tat = f"{at}: turn #{j}"
            if not isinstance(turn, dict):
                raise ImportFormatError(tat, "not a JSON object")
            try:
                text = _aiperf_text(turn)
            except ValueError as e:
                raise ImportFormatError(tat, str(e)) from None
            role = turn.get("role") or "user"
            if role not in {"system", "user"}:
                raise ImportFormatError(tat, f"unsupported role {role!r} (expected user or system)")
            if role == "system":
                if rec.turns or system:
                    raise ImportFormatError(tat, "only a leading system turn is supported")
                system.append({"role": "system", "content": text})
                continue
            delay = turn.get("delay")
            ts = turn.get("timestamp")
            for name, v in (("delay", delay), ("timestamp", ts)):
                if v is not None and (not isinstance(v, int | float) or v < 0):
                    raise ImportFormatError(tat, f"'{name}' must be a non-negative number of milliseconds")
            delay_ms = float(delay) if delay is not None else 0.0
            if delay is None and ts is not None and sid in last_ts:
                # A schedule, not a think time: the gap also holds the previous response. Kept as an
                # upper bound; --think-time scale:F can shrink it.
                delay_ms = max(0.0, float(ts) - last_ts[sid])
            if ts is not None:
                last_ts[sid] = float(ts)
            max_tokens = turn.get("output_length", turn.get("max_tokens"))
            if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
                raise ImportFormatError(tat, "'output_length' must be a positive integer")
            params: dict[str, Any] = {"max_tokens": max_tokens or default_max_tokens}
            extra = turn.get("extra")
            if extra is not None:
                if not isinstance(extra, dict):
                    raise ImportFormatError(tat, "'extra' must be an object")
                params.update(extra)
            msg = {"role": "user", "content": text}
            if not rec.turns:
                rec.turns.append(TurnRecord(index=0, messages=[*system, msg], params=params))
            else:
                rec.turns.append(
                    TurnRecord(index=len(rec.turns), new_messages=[msg], delay_ms=delay_ms, params=params)
                )
        if not rec.turns:
            raise ImportFormatError(at, "a session with no user turn")
    return list(by_id.values())


# --- mooncake ------------------------------------------------------------------------------------------

MOONCAKE_BLOCK_SIZE = 512  # tokens per hash id in the published Mooncake traces (AIPerf's default too)

# What a synthesised prompt is made of: each word is one token in the simulator's vocabulary, with or without
# a leading space (a test checks it), and one token in the common BPE vocabularies, so a prompt of N words is
# about N tokens.
BLOCK_WORDS: tuple[str, ...] = tuple(
    """
    the of and to in is it for on with as at by from this that be are was or an not but all can will one has
    have had its more new file code test run build data list map set get add key value type name path line word
    time user tool call read write open close start stop next last first end step node port host error check
    push pull move find search show make use need want try keep give take send back left right up down out over
    under into about model block cache token task server client route proxy table row column index field method
    function true false null small large fast slow high long short old good bad same other each every some many
    few most hot cold warm day week month year
    """.split()  # noqa: SIM905 - a word block reads better than 140 quoted strings
)


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One line of a Mooncake trace."""

    line: int
    input_length: int  # prompt tokens (with session_id: the turn's new tokens, as AIPerf replays it)
    output_length: int | None
    hash_ids: tuple[int, ...] = ()
    timestamp: float | None = None  # ms since the trace's start
    delay: float | None = None  # ms after the previous turn of its session (AIPerf)
    session_id: str | None = None
    text_input: str | None = None
    extra: dict[str, Any] | None = None

    def full_blocks(self, block_size: int) -> int:
        """Its blocks that are full: those a continuation's prompt starts with unchanged."""
        return min(len(self.hash_ids), self.input_length // block_size)


def _millis(obj: dict[str, Any], name: str, at: str) -> float | None:
    v = obj.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
        raise ImportFormatError(at, f"'{name}' must be a non-negative number of milliseconds")
    return v


def _count(obj: dict[str, Any], name: str, at: str) -> int | None:
    v = obj.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ImportFormatError(at, f"'{name}' must be a positive integer")
    return v


def _hash_ids(obj: dict[str, Any], length: int, block_size: int, at: str) -> tuple[int, ...]:
    ids = obj.get("hash_ids") or []
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ImportFormatError(at, "'hash_ids' must be a list of integers")
    # Fewer ids than blocks is allowed (AIPerf: the ids name the cached prefix, the rest is private);
    # more ids than the prompt has blocks means another block size.
    if ids and (len(ids) - 1) * block_size >= length:
        raise ImportFormatError(
            at,
            f"{len(ids)} hash_ids of {block_size}-token blocks need more than {(len(ids) - 1) * block_size} "
            f"tokens, but input_length is {length} (is the trace's block size another one? --block-size)",
        )
    return tuple(ids)


def parse_trace_line(obj: Any, *, line: int, block_size: int, at: str) -> TraceRequest:
    if not isinstance(obj, dict):
        raise ImportFormatError(at, "expected a JSON object")
    for prebuilt in ("messages", "payload"):
        if prebuilt in obj:
            raise ImportFormatError(at, f"rows with '{prebuilt}' are not supported (only input_length or text_input)")
    text = obj.get("text_input")
    if text is not None and (not isinstance(text, str) or not text.strip()):
        raise ImportFormatError(at, "'text_input' must be a non-empty string")
    length = _count(obj, "input_length", at)
    if length is None:
        if text is None:
            raise ImportFormatError(at, "needs 'input_length' (or 'text_input')")
        length = len(text.split())
    sid = obj.get("session_id")
    if sid is not None and (isinstance(sid, bool) or not isinstance(sid, str | int) or sid == ""):
        raise ImportFormatError(at, "'session_id' must be a non-empty string")
    extra = obj.get("extra")
    if extra is not None and not isinstance(extra, dict):
        raise ImportFormatError(at, "'extra' must be an object")
    return TraceRequest(
        line=line,
        input_length=length,
        output_length=_count(obj, "output_length", at),
        hash_ids=_hash_ids(obj, length, block_size, at),
        timestamp=_millis(obj, "timestamp", at),
        delay=_millis(obj, "delay", at),
        session_id=None if sid is None else str(sid),
        text_input=text,
        extra=extra,
    )


@lru_cache(maxsize=4096)
def block_words(block_id: int, block_size: int) -> tuple[str, ...]:
    """The words of one block: the same id, the same words, in every trace, process and file (a string seed is
    hashed with SHA-512, not Python's salted hash). A partial block is a prefix of these."""
    return tuple(random.Random(f"kvtether-block-{block_id}").choices(BLOCK_WORDS, k=block_size))


def _private_words(line: int, start: int, n: int) -> list[str]:
    """Words no other line shares, for the tokens of a line that no hash id covers."""
    return random.Random(f"kvtether-line-{line}").choices(BLOCK_WORDS, k=start + n)[start:]


def prompt_words(req: TraceRequest, start: int, end: int, block_size: int) -> list[str]:
    """The words at token positions ``[start, end)`` of a request's prompt: the words of the block a hash id
    names where one covers the position, words private to the line past the last one."""
    covered = len(req.hash_ids) * block_size
    words: list[str] = []
    pos = start
    while pos < min(end, covered):
        j, offset = divmod(pos, block_size)
        take = min(block_size - offset, end - pos)
        words.extend(block_words(req.hash_ids[j], block_size)[offset : offset + take])
        pos += take
    if pos < end:
        words.extend(_private_words(req.line, max(0, pos - covered), end - pos))
    return words


@dataclass(slots=True)
class _PrefixNode:
    """A node of the trie of hash-id prefixes; ``tails`` are open requests whose full blocks end here."""

    children: dict[int, _PrefixNode] = field(default_factory=dict)
    tails: list[TraceRequest] = field(default_factory=list)


def _may_continue(parent: TraceRequest, child: TraceRequest) -> bool:
    # The trace has no completion times: "before" is the arrival. A prompt that does not grow is a retry or
    # a regeneration, not the next turn.
    if parent.timestamp is not None and child.timestamp is not None and parent.timestamp >= child.timestamp:
        return False
    return child.input_length > parent.input_length


def _chainable(req: TraceRequest) -> bool:
    return req.text_input is None and bool(req.hash_ids)


def _find_parent(root: _PrefixNode, child: TraceRequest) -> tuple[TraceRequest, _PrefixNode] | None:
    best: tuple[TraceRequest, _PrefixNode] | None = None
    node = root
    for hid in child.hash_ids:
        nxt = node.children.get(hid)
        if nxt is None:
            break
        node = nxt
        # Deeper is better (a longer shared history); at one depth the most recent tail (appended last) wins.
        for tail in reversed(node.tails):
            if _may_continue(tail, child):
                best = (tail, node)
                break
    return best


def chain_requests(requests: Sequence[TraceRequest], block_size: int) -> list[list[TraceRequest]]:
    """Rebuild conversations from hash-id prefix chains, in arrival order (timestamp, then line).

    In a conversation, turn N+1's prompt is turn N's prompt + its answer + new user text, so its hash ids
    start with all of turn N's *full* blocks (turn N's last, partial block changes as it fills). A request's
    parent is the open request (one no other request has continued yet) whose full blocks (at least one) are
    all a prefix of its hash ids, that arrived strictly before it and whose prompt is shorter; of several, the
    one with the most full blocks, then the most recent. A request without one starts a conversation. Rows
    with ``text_input`` or without ``hash_ids`` always start one and are never continued."""
    order = sorted(requests, key=lambda r: (r.timestamp if r.timestamp is not None else 0.0, r.line))
    root = _PrefixNode()
    chains: list[list[TraceRequest]] = []
    chain_of: dict[int, int] = {}  # line -> index in chains
    for req in order:
        found = _find_parent(root, req) if _chainable(req) else None
        if found is None:
            chain_of[req.line] = len(chains)
            chains.append([req])
        else:
            parent, node = found
            node.tails.remove(parent)
            chain_of[req.line] = chain_of[parent.line]
            chains[chain_of[req.line]].append(req)
        full = req.full_blocks(block_size)
        if _chainable(req) and full > 0:
            node = root
            for hid in req.hash_ids[:full]:
                node = node.children.setdefault(hid, _PrefixNode())
            node.tails.append(req)
    return chains


def _turn_params(req: TraceRequest, default_max_tokens: int, pin_output: bool) -> dict[str, Any]:
    n = req.output_length or default_max_tokens
    params: dict[str, Any] = {"max_tokens": n}
    if pin_output:  # the trace's answer length, so the next prompt grows as the trace's did (vLLM's extras)
        params.update(min_tokens=n, ignore_eos=True)
    if req.extra:
        params.update(req.extra)
    return params


def _gap_ms(prev: TraceRequest, req: TraceRequest) -> float:
    if req.delay is not None:
        return float(req.delay)
    if prev.timestamp is not None and req.timestamp is not None:
        # Arrival to arrival: also holds the previous turn's response time, so an upper bound on the think time.
        return float(max(0.0, req.timestamp - prev.timestamp))
    return 0.0


def _recorded(prompt_tokens: int | None, completion_tokens: int | None) -> Recorded | None:
    if prompt_tokens is None and completion_tokens is None:
        return None
    return Recorded(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)


def _trace_metadata(reqs: Sequence[TraceRequest], block_size: int, sessions_from: str) -> dict[str, Any]:
    meta: dict[str, Any] = {"imported_from": "mooncake", "sessions_from": sessions_from, "block_size": block_size,
                            "trace_lines": [r.line for r in reqs]}
    # The trace's arrival times: `replay --arrivals trace` starts each session at its start offset.
    if reqs[0].timestamp is not None:
        meta["start_offset_ms"] = reqs[0].timestamp
    if all(r.timestamp is not None for r in reqs):
        meta["arrival_ms"] = [r.timestamp for r in reqs]
    return meta


@dataclass(frozen=True, slots=True)
class _TraceOptions:
    model: str
    default_max_tokens: int
    block_size: int
    pin_output: bool


def _chain_session(sid: str, chain: Sequence[TraceRequest], o: _TraceOptions) -> SessionRecord:
    """A rebuilt conversation: ``input_length`` is the whole prompt of each turn."""
    turns: list[TraceRequest] = list(chain)
    first = turns[0]
    text = first.text_input or " ".join(prompt_words(first, 0, first.input_length, o.block_size))
    records = [TurnRecord(index=0, messages=[{"role": "user", "content": text}],
                          params=_turn_params(first, o.default_max_tokens, o.pin_output),
                          recorded=_recorded(first.input_length, first.output_length))]
    for i, (parent, req) in enumerate(pairwise(turns), start=1):
        # The replay resends the parent's prompt and its answer (output_length tokens when pinned): the new user
        # message is the rest of the prompt, the last tokens of the request's own blocks.
        answer = parent.output_length or o.default_max_tokens
        new = max(1, req.input_length - parent.input_length - answer)
        text = " ".join(prompt_words(req, req.input_length - new, req.input_length, o.block_size))
        records.append(TurnRecord(index=i, new_messages=[{"role": "user", "content": text}],
                                  delay_ms=_gap_ms(parent, req),
                                  params=_turn_params(req, o.default_max_tokens, o.pin_output),
                                  recorded=_recorded(req.input_length, req.output_length)))
    return SessionRecord(session_id=sid, model=o.model, turns=records,
                         metadata=_trace_metadata(turns, o.block_size, "hash_ids"))


def _id_session(sid: str, reqs: Sequence[TraceRequest], o: _TraceOptions) -> SessionRecord:
    """A session named by ``session_id``: each row is one turn's new text, as AIPerf replays it (the history
    grows with the answers received)."""
    records: list[TurnRecord] = []
    for i, req in enumerate(reqs):
        msg = {"role": "user",
               "content": req.text_input or " ".join(prompt_words(req, 0, req.input_length, o.block_size))}
        params = _turn_params(req, o.default_max_tokens, o.pin_output)
        rec = _recorded(None, req.output_length)
        if i == 0:
            records.append(TurnRecord(index=0, messages=[msg], params=params, recorded=rec))
        else:
            records.append(TurnRecord(index=i, new_messages=[msg], delay_ms=_gap_ms(reqs[i - 1], req),
                                      params=params, recorded=rec))
    return SessionRecord(session_id=sid, model=o.model, turns=records,
                         metadata=_trace_metadata(reqs, o.block_size, "session_id"))


def _parse_trace(lines: Iterable[str], where: str, block_size: int) -> list[TraceRequest]:
    out: list[TraceRequest] = []
    for n, at, obj in _json_lines(lines, where):
        out.append(parse_trace_line(obj, line=n, block_size=block_size, at=at))
    return out


def import_mooncake(
    lines: Iterable[str],
    *,
    model: str,
    default_max_tokens: int = 256,
    block_size: int = MOONCAKE_BLOCK_SIZE,
    pin_output: bool = True,
    where: str = "mooncake",
) -> list[SessionRecord]:
    """Sessions from a Mooncake trace, in order of their first arrival.

    Rows with a ``session_id`` form that session in file order, each row one turn's new text (AIPerf's
    reading); the others are chained into conversations by ``chain_requests``. A block id becomes the same
    ``block_size`` words wherever it appears, so prompts that share block ids (a common system prompt) share
    their text; tokens no id covers get words private to their line. Prompts are one user message per turn.
    ``pin_output`` adds vLLM's ``min_tokens`` and ``ignore_eos`` so answers have the trace's length."""
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    requests = _parse_trace(lines, where, block_size)
    if not requests:
        raise ImportFormatError(where, "no requests")
    named: dict[str, list[TraceRequest]] = {}
    loose: list[TraceRequest] = []
    for r in requests:
        if r.session_id is None:
            loose.append(r)
        else:
            named.setdefault(r.session_id, []).append(r)
    groups: list[tuple[str | None, list[TraceRequest]]] = [*named.items()]
    groups += [(None, chain) for chain in chain_requests(loose, block_size)]
    groups.sort(key=lambda g: (g[1][0].timestamp if g[1][0].timestamp is not None else 0.0, g[1][0].line))
    o = _TraceOptions(model, default_max_tokens, block_size, pin_output)
    sessions: list[SessionRecord] = []
    k = 0
    for sid, reqs in groups:
        if sid is not None:
            sessions.append(_id_session(sid, reqs, o))
            continue
        while f"mooncake-{k:05d}" in named:
            k += 1
        sessions.append(_chain_session(f"mooncake-{k:05d}", reqs, o))
        k += 1
    return sessions


def import_file(
    path: str | Path,
    fmt: str,
    *,
    model: str,
    default_max_tokens: int = 256,
    block_size: int = MOONCAKE_BLOCK_SIZE,
    pin_output: bool = True,
) -> list[SessionRecord]:
    """``block_size`` and ``pin_output`` apply to ``mooncake`` only."""
    p = Path(path)
    if fmt == "vllm":
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ImportFormatError(f"{p}:{e.lineno}", f"not valid JSON ({e.msg} at column {e.colno})") from None
        return import_vllm(data, model=model, default_max_tokens=default_max_tokens, where=str(p))
    if fmt == "aiperf":
        with p.open(encoding="utf-8") as f:
            return import_aiperf(f, model=model, default_max_tokens=default_max_tokens, where=str(p))
    if fmt == "mooncake":
        with p.open(encoding="utf-8") as f:
            return import_mooncake(f, model=model, default_max_tokens=default_max_tokens, block_size=block_size,
                                   pin_output=pin_output, where=str(p))
    raise ValueError(f"unknown format {fmt!r}; known: {', '.join(FORMATS)}")
