"""What the API translations share with the gateway's guard."""

from __future__ import annotations

from typing import Any


def effort_in_template_kwargs(out: dict[str, Any], effort: Any) -> None:
    """What vLLM's chat request does with ``reasoning_effort`` (``ChatCompletionRequest.build_chat_params``): hands
    it to the template, overriding a kwarg of that name, and sets ``enable_thinking`` where the client did not."""
    if effort is None:
        return
    kwargs = dict(out.get("chat_template_kwargs") or {})
    kwargs["reasoning_effort"] = effort
    kwargs.setdefault("enable_thinking", effort != "none")
    out["chat_template_kwargs"] = kwargs
