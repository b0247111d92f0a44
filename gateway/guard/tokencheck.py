"""Whether the guard may trust its local tokenizer, per served model.

A local tokenizer that disagrees with the engine is worse than none: the guard would compare D's held tokens
with ids the engine never computes. So its ids are used for a model only once they equalled the engine's
``/tokenize``: at start-up, on a few probe requests (chat with multi-part content, tools, a tool call and its
result, reasoning; a completions prompt), or, when P could not be asked then, on the model's first guarded
turns. A share of later turns (``tokenizer_check_share``) is checked again. Any difference switches that
model back to ``/tokenize`` for good (a warning, and ``kvtether_tokenizer_mismatches_total``). The state is
per process: each gateway worker checks for itself.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import random
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import anyio
import anyio.to_thread
from kvtether.gateway import telemetry as T
from kvtether.gateway.guard.chat_render import Unsupported
from kvtether.gateway.guard.tokenizer import LocalTokenizer

log = logging.getLogger(__name__)

# Background encodes at a time (each in a worker thread): a warm-up is a head start, never a backlog.
WARMING = 2

# Asks an engine's /tokenize for a body's ids (None: it could not answer, or refused the body).
RemoteTokenize = Callable[[Mapping[str, Any]], Awaitable[list[int] | None]]


class Trust(enum.Enum):
    UNCHECKED = "unchecked"  # not compared yet: /tokenize decides, and the local ids are compared with it
    VERIFIED = "verified"  # equal so far: local ids, a share of turns compared again
    DISABLED = "disabled"  # differed once: /tokenize only


def probes(model: str) -> list[dict[str, Any]]:
    """/tokenize bodies that exercise what a chat template renders differently (the gateway's own shape:
    ``body.tokenize_body``)."""
    text = "Line one.\n\n  indented\tcode = f(x) + 1  # ünïcödé ✓ 中文 "
    tools = [{"type": "function", "function": {"name": "read_file", "description": "Read a file.",
                                               "parameters": {"type": "object", "properties": {
                                                   "path": {"type": "string"}}, "required": ["path"]}}}]
    call = {"id": "call_0", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}
    history = [
        {"role": "system", "content": "You are a careful agent."},
        {"role": "user", "content": [{"type": "text", "text": "First part."}, {"type": "text", "text": text}]},
        {"role": "assistant", "content": "Reading it.", "reasoning": "The user wants the file.",
         "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": "print('hello')\n"},
        {"role": "user", "content": "Thanks. " + text},
    ]
    plain = [history[0], {"role": "user", "content": text}, {"role": "assistant", "content": "Sure: " + text},
             {"role": "user", "content": "Again."}]
    return [
        {"model": model, "messages": plain, "add_generation_prompt": True},
        {"model": model, "messages": history, "add_generation_prompt": True, "tools": tools},
        {"model": model, "messages": history[:2], "add_generation_prompt": True},
        {"model": model, "prompt": text},
    ]


class GuardTokenizer:
    """The local tokenizer with its per-model trust; None-safe to ask before it is loaded."""

    def __init__(self, source: str, metrics: T.Metrics, check_share: float,
                 rng: Callable[[], float] = random.random) -> None:
        self.source = source
        self.metrics = metrics
        self.check_share = check_share
        self._rng = rng
        self.local: LocalTokenizer | None = None
        self._trust: dict[str, Trust] = {}
        self._warming: set[asyncio.Future[None]] = set()

    def loaded(self, local: LocalTokenizer) -> None:
        self.local = local

    def trust(self, model: str) -> Trust:
        return self._trust.get(model, Trust.UNCHECKED)

    def usable(self, model: str) -> bool:
        return self.local is not None and self.trust(model) is not Trust.DISABLED

    async def encode(self, payload: Mapping[str, Any]) -> list[int] | None:
        """The local ids, or None when the local tokenizer cannot render this request exactly."""
        if self.local is None:
            return None
        try:
            return await self.local.encode(payload)
        except Unsupported:
            return None
        except Exception as exc:  # a template error: the engine's /tokenize gives the real answer
            log.debug("local tokenizer failed on a request: %s", exc)
            return None

    def warm(self, payload: Mapping[str, Any]) -> None:
        """Encodes a prompt in the background, so that its pieces are cached when the session's next turn, the
        first one the guard checks, encodes the whole history (else that turn pays for all of it: ~60 ms on a
        16k-token history). At most WARMING encodes at a time; the rest are skipped."""
        local = self.local
        if local is None or len(self._warming) >= WARMING:
            return
        task = asyncio.ensure_future(self._warm(local, payload))
        self._warming.add(task)
        task.add_done_callback(self._warming.discard)

    @staticmethod
    async def _warm(local: LocalTokenizer, payload: Mapping[str, Any]) -> None:
        try:
            await anyio.to_thread.run_sync(local.encode_sync, payload)
        except Exception as exc:  # the turn that needs these ids will say why, if it still matters
            log.debug("warming the tokenizer's cache failed: %s", exc)

    async def warmed(self) -> None:
        """Until the background encodes started so far are done (tests, shutdown)."""
        while self._warming:
            await asyncio.wait(set(self._warming))

    def wants_check(self, model: str) -> bool:
        """Whether this turn's local ids must be compared with /tokenize before use."""
        return self.trust(model) is Trust.UNCHECKED or self._rng() < self.check_share

    def compare(self, model: str, local: list[int], remote: list[int], check: str) -> bool:
        """Records a comparison; a difference disables the local tokenizer for `model`."""
        if local == remote:
            if self.trust(model) is Trust.UNCHECKED:
                log.info("local tokenizer %s matches /tokenize for %s: the guard uses it", self.source, model)
                self._trust[model] = Trust.VERIFIED
            return True
        self._trust[model] = Trust.DISABLED
        self.metrics.tokenizer_mismatches.labels(check).inc()
        at = next((i for i, (a, b) in enumerate(zip(local, remote, strict=False)) if a != b), min(len(local),
                                                                                                  len(remote)))
        log.warning("local tokenizer %s differs from /tokenize for %s (%s check: %d vs %d ids, first difference at "
                    "%d): the guard uses /tokenize for this model from now on", self.source, model, check,
                    len(local), len(remote), at)
        return False

    async def startup_check(self, models: list[str], remote: Callable[[str], RemoteTokenize]) -> None:
        """Compares the probes' local ids with each model's /tokenize; a model P could not answer for stays
        unchecked (its first guarded turns check it)."""
        for model in models:
            ask = remote(model)
            compared = 0
            for payload in probes(model):
                theirs = await ask(payload)
                if theirs is None:
                    continue
                ours = await self.encode(payload)
                compared += 1
                if ours is None or not self.compare(model, ours, theirs, "startup"):
                    if ours is None:
                        self._disable(model, "startup", "cannot render a probe the engine tokenizes")
                    break
            if compared == 0:
                log.warning("local tokenizer %s: no /tokenize answer for %s at start-up; checked on its first "
                            "guarded turns", self.source, model)

    def _disable(self, model: str, check: str, why: str) -> None:
        self._trust[model] = Trust.DISABLED
        self.metrics.tokenizer_mismatches.labels(check).inc()
        log.warning("local tokenizer %s %s for %s: the guard uses /tokenize for this model", self.source, why, model)
