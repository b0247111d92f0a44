"""Growing agent histories for benchmarks/gateway_overhead.py's guarded runs, the HF tokenizer they use, and the
gateway's own time per turn read from its spans (console exporter).

A session starts with a long document (distinct per session, so no cache is shared between sessions) and grows
by the fake decode node's answer plus a user message every turn; the fake backends answer with the same ids the
next prompt re-tokenizes to, so kvtether's guard verifies D's held tokens on every turn after the first.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import sysconfig
from datetime import datetime
from pathlib import Path
from typing import Any

from overhead_backends import MODEL

ROOT = Path(__file__).resolve().parents[1]
DOC_TOKENS = 14_500
TURNS = 8
USER_CHARS = 800
ANSWER_CHUNKS = 16


def corpus(limit: int = 4_000_000) -> str:
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    out, size = [], 0
    for f in files:
        text = f.read_text(errors="replace")
        out.append(text)
        size += len(text)
        if size >= limit:
            break
    return "".join(out)


def build_tokenizer(out: Path) -> Path:
    """A byte-level BPE tokenizer (vocab 8192) trained on stdlib source, with the tiny model's chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if (out / "tokenizer.json").exists():
        return out
    spec = importlib.util.spec_from_file_location("build_tiny_model", ROOT / "scripts" / "build_tiny_model.py")
    assert spec is not None and spec.loader is not None
    tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    text = corpus(3_000_000)
    tok.train_from_iterator([text[i:i + 100_000] for i in range(0, len(text), 100_000)], trainers.BpeTrainer(
        vocab_size=8192, special_tokens=tiny.SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<pad>",
                                   additional_special_tokens=["<|endoftext|>", "<|im_start|>"])
    fast.chat_template = tiny.CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    return out


class Histories:
    """Sessions of TURNS turns each, one after another; every session has its own document."""

    def __init__(self, tokenizer_dir: Path) -> None:
        from kvtether.gateway.guard.tokenizer import LocalTokenizer

        self.text = corpus()
        local = LocalTokenizer.load(str(tokenizer_dir))
        sample = self.text[:200_000]
        per_char = len(local.encode_sync({"model": MODEL, "prompt": sample, "add_special_tokens": False})) / len(sample)
        self.doc_chars = int(DOC_TOKENS / per_char)
        self.answer = "".join(f"word{i} " for i in range(ANSWER_CHUNKS))
        self._ids = itertools.count()

    def session(self) -> Session:
        k = next(self._ids)
        start = (k * 7919 * 97) % max(1, len(self.text) - self.doc_chars - USER_CHARS * TURNS)
        return Session(f"bench-{k}", self.text[start:start + self.doc_chars],
                       self.text[start + self.doc_chars:start + self.doc_chars + USER_CHARS * TURNS], self.answer)


class Session:
    def __init__(self, sid: str, doc: str, users: str, answer: str) -> None:
        self.sid, self.answer, self.users = sid, answer, users
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": doc},
                                               {"role": "user", "content": users[:USER_CHARS]}]
        self.turn = 0

    @property
    def done(self) -> bool:
        return self.turn >= TURNS

    def body(self) -> dict[str, Any]:
        return {"model": MODEL, "messages": list(self.messages), "max_tokens": ANSWER_CHUNKS, "stream": True,
                "temperature": 0}

    def advance(self) -> None:
        self.turn += 1
        user = self.users[self.turn * USER_CHARS:(self.turn + 1) * USER_CHARS]
        self.messages += [{"role": "assistant", "content": self.answer}, {"role": "user", "content": user}]


def spans(text: str) -> list[dict[str, Any]]:
    """The span objects in a console exporter's output (indented JSON, one after another)."""
    decoder = json.JSONDecoder()
    out: list[dict[str, Any]] = []
    i = 0
    while True:
        i = text.find("{", i)
        if i < 0:
            return out
        try:
            obj, end = decoder.raw_decode(text, i)
        except ValueError:
            i += 1
            continue
        if isinstance(obj, dict) and "name" in obj and "context" in obj:
            out.append(obj)
        i = end


def _at(stamp: str) -> datetime:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def _seconds(span: dict[str, Any]) -> float:
    return (_at(span["end_time"]) - _at(span["start_time"])).total_seconds()


def gateway_times(all_spans: list[dict[str, Any]], since: float = 0.0) -> list[tuple[float, int, bool, int]]:
    """Per guarded turn that started after `since` (epoch seconds): tokenize + guard + plan seconds, the prompt's
    tokens, whether /tokenize was asked, and the turn's index in its session."""
    by_trace: dict[str, list[dict[str, Any]]] = {}
    for s in all_spans:
        by_trace.setdefault(s["context"]["trace_id"], []).append(s)
    out = []
    for group in by_trace.values():
        names = [s["name"] for s in group]
        if "kvtether.guard" not in names or min(_at(s["start_time"]).timestamp() for s in group) < since:
            continue
        steps = [s for s in group if s["name"] in ("kvtether.tokenize", "kvtether.guard", "kvtether.plan")]
        tokens = max(int(s["attributes"].get("kvtether.prompt.tokens", 0)) for s in steps)
        remote = any(s["attributes"].get("kvtether.tokenize.source") == "remote" for s in steps)
        turn = max(int(s["attributes"].get("kvtether.turn.index", 0)) for s in group)
        out.append((sum(_seconds(s) for s in steps), tokens, remote, turn))
    return out
