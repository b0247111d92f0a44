"""From session records to the per-turn token facts the analyses read (``TurnFacts``).

For every turn: the prompt's token ids as the served model's chat template renders them, and how many of them
equal, position by position, what the decode node holds after the previous turn (that turn's prompt and its
answer). This is exactly the prefix a pull could reuse (the gateway's guard verifies the same thing). The ids
come from the model's own tokenizer and chat template when one is given (``--tokenizer``: a Hugging Face name or
path, loaded by transformers), else from the simulator's tokenizer and ChatML template (about one token per
English word).

A turn without a recorded answer (AIPerf files hold none) gets a stand-in answer of its ``max_tokens`` words,
threaded into the next turn's history as an agent would: the prefix a pull could reuse then includes it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

from kvtether.cli.assess.analysis import TurnFacts
from kvtether.sdk.sessionfile import SessionRecord

# messages, tools, add_generation_prompt -> token ids
Encoder = Callable[[list[dict[str, Any]], list[dict[str, Any]] | None, bool], list[int]]
DEFAULT_ANSWER_TOKENS = 128


def sim_encoder(tool_format: str = "hermes") -> Encoder:
    """The simulator's ChatML rendering and tokenizer (what a simulated node counts)."""
    from kvtether.sim.template import render_chat
    from kvtether.sim.tokenizer import default_tokenizer

    tok = default_tokenizer()

    def encode(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, gen: bool) -> list[int]:
        return tok.encode(render_chat(messages, tools=tools, add_generation_prompt=gen, tool_format=tool_format))

    return encode


def hf_encoder(name: str) -> Encoder:
    """The model's own tokenizer and chat template (transformers; no weights are loaded). Raises on failure."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(name)

    def encode(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, gen: bool) -> list[int]:
        ids: Any = tok.apply_chat_template(messages, tools=cast(Any, tools), add_generation_prompt=gen, tokenize=True)
        if not isinstance(ids, list):  # newer transformers return a BatchEncoding
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    return encode


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _stand_in(max_tokens: int) -> dict[str, Any]:
    return {"role": "assistant", "content": " ".join(["ok"] * max(1, max_tokens))}


def turn_facts(sessions: Sequence[SessionRecord], encode: Encoder) -> list[list[TurnFacts]]:
    """Per session, per turn: prompt tokens, the tokens reusable from the previous turn's hold, the hold this
    turn leaves (prompt + answer), the recorded gap before it and the recorded duration."""
    out: list[list[TurnFacts]] = []
    for s in sessions:
        facts: list[TurnFacts] = []
        answers: list[dict[str, Any] | None] = []
        held_prev: list[int] | None = None
        for turn, messages, tools in s.requests("live", answers):
            rec = turn.recorded
            answer = rec.answer if rec is not None and rec.answer is not None else None
            max_tokens = int(turn.params.get("max_tokens") or turn.params.get("max_completion_tokens")
                             or DEFAULT_ANSWER_TOKENS)
            if answer is None:
                answer = _stand_in(max_tokens)
            answers.append(answer)
            prompt = encode(messages, tools, True)
            held = encode([*messages, answer], tools, False)
            reused = min(common_prefix(prompt, held_prev), len(prompt) - 1) if held_prev is not None else 0
            output = (rec.completion_tokens if rec is not None and rec.completion_tokens
                      else max(1, len(held) - len(prompt)))
            facts.append(TurnFacts(
                session_id=s.session_id, index=turn.index, prompt_tokens=len(prompt), reused_tokens=max(0, reused),
                held_after=max(len(held), len(prompt) + 1), output_tokens=output, gap_s=turn.delay_ms / 1000.0,
                recorded_e2e_s=rec.e2e_ms / 1000.0 if rec is not None and rec.e2e_ms is not None else None,
                recorded_ttft_s=rec.ttft_ms / 1000.0 if rec is not None and rec.ttft_ms is not None else None,
            ))
            held_prev = held
        out.append(facts)
    return out
