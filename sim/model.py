"""The simulated model: its output is a deterministic function of the KV content it attends to.

KV content is tracked per block as the token ids whose keys/values the block holds plus the digest of
everything before them *where the block was computed* (see ``kv.Block``). A request's sampling state is
the digest chain over the content it actually attends to, so:

* reusing correct KV (local prefix cache, pull of the right history) gives exactly the cold answer;
* attending to KV of other tokens (a positional pull of an edited history, a polluted cache block)
  gives a different answer, as a real model silently would.

From that state the model derives a *plan*: optional reasoning, then a tool call or a short answer made
of vocabulary words, then eos. The plan is text first and tokenized once, so the generated ids are the
canonical encoding of the text the client will send back.
"""

from __future__ import annotations

import hashlib
import json
import random
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtether.sim.template import HERMES, render_assistant_body
from kvtether.sim.tokenizer import Tokenizer

DIGEST_SIZE = 16
ROOT_DIGEST = b"\x00" * DIGEST_SIZE


def chain(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Digest of `tokens` computed after context `parent`: both the prefix-cache block hash (over the
    request's token ids) and the KV content digest (over the tokens a block really holds) use it, so
    correctly computed KV has content digest == block hash."""
    h = hashlib.blake2b(parent, digest_size=DIGEST_SIZE)
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return h.digest()


@dataclass(frozen=True, slots=True)
class GenerationSpec:
    """What the model needs from a request besides the KV it attends to."""

    chat: bool = True
    tools: tuple[Mapping[str, Any], ...] = ()
    tool_choice: Any = "auto"  # "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}
    enable_thinking: bool = False
    temperature: float = 1.0
    seed: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    tool_format: str = HERMES  # how the served model writes a tool call (vLLM --tool-call-parser)


@dataclass(slots=True)
class Plan:
    """The tokens the model will emit, indexable lazily (ignore_eos can ask for any length)."""

    body: list[int]
    eos_id: int
    min_tokens: int
    ignore_eos: bool
    filler: list[int] = field(default_factory=list)
    seed: int = 0

    def token(self, i: int) -> int:
        if i < len(self.body):
            return self.body[i]
        if not self.ignore_eos and i >= self.min_tokens:
            return self.eos_id
        # Eos suppressed: keep talking in standalone vocabulary words (each one token, canonical).
        return self.filler[(self.seed + i * 7919) % len(self.filler)]


class Model:
    def __init__(self, tokenizer: Tokenizer, seed: int = 0) -> None:
        self.tok = tokenizer
        self.seed = seed  # the cluster's: an unseeded sample is drawn from it and the KV state

    def rng(self, state: bytes, spec: GenerationSpec) -> random.Random:
        if spec.temperature <= 0:
            return random.Random(state)
        if spec.seed is None:
            # vLLM draws an unseeded sample from its own generator, a different one per run. The simulator draws
            # it from the cluster's seed and the KV content the request attends to: the same request gets the
            # same answer in any order and in any run (a replay repeats exactly), another cluster seed another.
            return random.Random(state + struct.pack("<qd", self.seed, spec.temperature) + b"unseeded")
        return random.Random(state + struct.pack("<qd", spec.seed, spec.temperature))

    def plan(self, state: bytes, spec: GenerationSpec) -> Plan:
        rng = self.rng(state, spec)
        text = self.plan_text(rng, spec)
        return Plan(
            body=self.tok.encode(text),
            eos_id=self.tok.eos_id,
            min_tokens=spec.min_tokens,
            ignore_eos=spec.ignore_eos,
            filler=[self.tok.word_ids[w] for w in self.tok.answer_words[:500]],
            seed=rng.randrange(1 << 30),
        )

    def plan_text(self, rng: random.Random, spec: GenerationSpec) -> str:
        if not spec.chat:
            return self._sentences(rng, rng.randint(8, 24), leading_space=True)
        reasoning = self._sentences(rng, rng.randint(6, 16)) if spec.enable_thinking else None
        tool = self._pick_tool(rng, spec)
        if tool is not None:
            fn = tool.get("function", tool)
            name = str(fn.get("name", "tool"))
            args = json.dumps(self._arguments(rng, fn.get("parameters") or {}), ensure_ascii=False)
            return render_assistant_body("", reasoning, [(name, args)], spec.tool_format)
        return render_assistant_body(self._sentences(rng, rng.randint(8, 30)), reasoning, [])

    def _pick_tool(self, rng: random.Random, spec: GenerationSpec) -> Mapping[str, Any] | None:
        if not spec.tools or spec.tool_choice == "none":
            return None
        choice = spec.tool_choice
        if isinstance(choice, Mapping):
            wanted = (choice.get("function") or {}).get("name")
            for t in spec.tools:
                if t.get("function", t).get("name") == wanted:
                    return t
            return None
        if choice == "required" or rng.random() < 0.6:
            return spec.tools[rng.randrange(len(spec.tools))]
        return None

    def _word(self, rng: random.Random) -> str:
        return self.tok.answer_words[rng.randrange(len(self.tok.answer_words))]

    def _sentences(self, rng: random.Random, n_words: int, *, leading_space: bool = False) -> str:
        words: list[str] = []
        for i in range(n_words):
            w = self._word(rng).strip().lower()
            if i == 0 or words[-1].endswith("."):
                w = w.capitalize()
            if i == n_words - 1 or rng.random() < 0.1:
                w += "."
            elif rng.random() < 0.08:
                w += ","
            words.append(w)
        text = " ".join(words)
        return (" " + text) if leading_space else text

    def _arguments(self, rng: random.Random, schema: Mapping[str, Any]) -> dict[str, Any]:
        props = schema.get("properties") or {}
        required = set(schema.get("required") or [])
        args: dict[str, Any] = {}
        for name, prop in props.items():
            if name in required or rng.random() < 0.5:
                args[name] = self._value(rng, prop if isinstance(prop, Mapping) else {})
        return args

    def _value(self, rng: random.Random, prop: Mapping[str, Any]) -> Any:
        if prop.get("enum"):
            return rng.choice(list(prop["enum"]))
        kind = prop.get("type", "string")
        if isinstance(kind, list):
            kind = next((k for k in kind if k != "null"), "string")
        if kind == "integer":
            return rng.randint(0, 100)
        if kind == "number":
            return round(rng.uniform(0, 100), 1)
        if kind == "boolean":
            return rng.random() < 0.5
        if kind == "array":
            return [self._value(rng, prop.get("items") or {}) for _ in range(rng.randint(1, 2))]
        if kind == "object":
            return self._arguments(rng, prop)
        return " ".join(self._word(rng).strip().lower() for _ in range(rng.randint(1, 2)))
