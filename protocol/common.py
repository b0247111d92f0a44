"""What the Responses and Messages translations share with each other and with the gateway: the choice of what
becomes of hosted tools (and a hosted tool's family, a metric label), a translation's result, how a lenient
translation leaves out what a strict one refuses, and vLLM's folding of a reasoning effort into the chat
template's kwargs."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal, ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

# What a translation does with a hosted tool (one the API's provider runs, or a built-in the model only knows
# natively: no chat template can render it): "refuse" answers 400 naming it, as vLLM's Messages endpoint does
# from 0.34 (its Responses endpoint leaves such tools out of the prompt without a word); "drop" leaves it out of
# the turn and reports it (the gateway's default, so a client that always sends one,
# as Codex sends web_search, still gets its turns).
HostedTools = Literal["drop", "refuse"]
HOSTED_TOOLS: Final[tuple[HostedTools, ...]] = ("drop", "refuse")

# A tool type's version or preview suffix: Anthropic's `_20250305`, OpenAI's `_2025_03_11` and `_preview`.
_VERSION = re.compile(r"(_preview)?(_[0-9]{8}|_[0-9]{4}_[0-9]{2}_[0-9]{2})?$")


def int_or_none(value: Any) -> int | None:
    """A count as a JSON body carries it: an integer, else None (a bool is not a count)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass(frozen=True, slots=True)
class Translation:
    """A request lowered to a chat request, the hosted tool types it left out, and the types of the client
    bookkeeping items it left out (each in request order, each once)."""

    chat: dict[str, Any]
    dropped: tuple[str, ...] = ()
    left_out: tuple[str, ...] = ()


class Refused(Exception):
    """A request, or a piece of one, that an API's translation refuses (each API's error says how to answer it)."""


def refuse(error: Refused, lenient: bool) -> None:
    """Raise ``error``. A lenient translation does not: the caller leaves out the piece the error names."""
    if not lenient:
        raise error


def leave_out_refused(lenient: bool, translate: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T | None:
    """``translate(*args, **kwargs)``, or None when it refuses its piece and the translation is lenient."""
    try:
        return translate(*args, **kwargs)
    except Refused as e:
        refuse(e, lenient)
        return None


def passes(lenient: bool, check: Callable[P, object], *args: P.args, **kwargs: P.kwargs) -> bool:
    """Whether a piece passes ``check(*args, **kwargs)``: one it refuses raises, or, in a lenient translation, is
    to be left out (False)."""
    try:
        check(*args, **kwargs)
    except Refused as e:
        refuse(e, lenient)
        return False
    return True


def tool_family(kind: str) -> str:
    """A hosted tool type without its version: ``web_search_20250305`` and ``web_search_preview_2025_03_11``
    are ``web_search``, ``computer_use_preview`` is ``computer_use`` (a metric label from a closed set)."""
    return _VERSION.sub("", kind, count=1)


def once(kinds: list[str]) -> tuple[str, ...]:
    """Each type once, in first-seen order."""
    return tuple(dict.fromkeys(kinds))


def effort_in_template_kwargs(out: dict[str, Any], effort: Any) -> None:
    """What vLLM's chat request does with ``reasoning_effort`` (``ChatCompletionRequest.build_chat_params``): hands
    it to the template, overriding a kwarg of that name, and sets ``enable_thinking`` where the client did not."""
    if effort is None:
        return
    kwargs = dict(out.get("chat_template_kwargs") or {})
    kwargs["reasoning_effort"] = effort
    kwargs.setdefault("enable_thinking", effort != "none")
    out["chat_template_kwargs"] = kwargs


def reasoning_of(message: Mapping[str, Any]) -> str:
    """A chat message's or stream delta's reasoning text ('' for none): ``reasoning``, vLLM's name, else
    ``reasoning_content``, the name older vLLM versions and other servers use."""
    reasoning = message.get("reasoning")
    if reasoning is None:
        reasoning = message.get("reasoning_content")
    return reasoning if isinstance(reasoning, str) else ""
