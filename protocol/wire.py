"""What the gateway sends a vLLM node, and the simulator answers as one, beyond the chat-completions API
(``docs/protocol.md``): the body field that carries a P/D transfer, the parameters of the legs the gateway asks
for, and OpenAI's error body, which vLLM, the simulator and the gateway all answer with."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

# The body field of a P/D leg's request and of its answer (a whole one, or a stream's last chunk): what the
# gateway sets per leg, and so never takes from a client.
KV_FIELD: Final = "kv_transfer_params"

# P's leg (docs/protocol.md §1.1): a remote decode asked for, the remote_* fields null.
COLD_PREFILL_PARAMS: Final[Mapping[str, Any]] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

# A decode-local turn whose blocks the gateway wants kept behind a handle (docs/protocol.md §2): no transfer
# either way, but non-empty params that are not a prefill leg's make vLLM's connector hold them.
LOCAL_RETAIN_PARAMS: Final[Mapping[str, Any]] = {"do_remote_prefill": False, "do_remote_decode": False}


def openai_error_body(message: str, type_: str, param: str | None = None,
                      code: str | int | None = None) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}``: the shape every OpenAI-compatible server answers an
    error with (vLLM's ``type`` names the exception, OpenAI's the error class; ``code`` is vLLM's status)."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
