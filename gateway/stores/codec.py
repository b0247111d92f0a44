"""Session state as bytes for a shared store (pure).

Two records per session, because they live and die differently: the *session record* (pin, what D's prefix
cache holds, running means, copies) lives as long as the session, and the *handle record* (D's handle, the
held sequence it covers, when it was returned) is taken out whole, once, by the next turn. Both are compact
JSON: a held sequence is its block-hash chain (one base64 string) plus the tail tokens, never the full token
list. Times travel as wall-clock seconds (the gateway's own clock is monotonic and means nothing to another
host); ``offset`` is ``wall clock - gateway clock`` at the moment of the call.
"""

from __future__ import annotations

import base64
import functools
import re
from typing import Any

import orjson
from kvtether.gateway.guard.verify import HeldSequence
from kvtether.gateway.policy.copies import DecodeCopy, PrefillCopy
from kvtether.gateway.stores.sessions import SessionState, TakenHandle


def encode_held(held: HeldSequence) -> dict[str, Any]:
    return {"b": held.block_size, "n": len(held.hashes), "h": base64.b64encode(b"".join(held.hashes)).decode(),
            "t": list(held.tail)}


@functools.lru_cache(maxsize=8)
def _chunks(size: int) -> re.Pattern[bytes]:
    # Cuts the chain into its hashes in C: twice as fast as slicing in Python (a long session has ~10³ blocks,
    # and every get decodes one or two chains).
    return re.compile(b".{%d}" % size, re.DOTALL)


def decode_held(data: dict[str, Any]) -> HeldSequence:
    return _held(int(data["b"]), int(data["n"]), str(data["h"]), tuple(int(t) for t in data["t"]))


# A turn reads the same chains more than once (the session when the turn starts and ends, the handle when it
# takes it): decoded once per process while recent. HeldSequence is immutable, so sharing one is safe.
@functools.lru_cache(maxsize=256)
def _held(block_size: int, n: int, chain: str, tail: tuple[int, ...]) -> HeldSequence:
    raw = base64.b64decode(chain)
    size = len(raw) // n if n else 0
    if size * n != len(raw) or (n and size == 0):
        raise ValueError("held sequence: hash chain length is not a multiple of its block count")
    hashes = tuple(_chunks(size).findall(raw)) if n else ()
    return HeldSequence(block_size, hashes, tail)


def encode_session(state: SessionState, offset: float) -> bytes:
    """The session record: everything but the session id, the prefix key (kept beside it, for the store's
    own index) and the handle (its own record)."""
    rec: dict[str, Any] = {"e": state.expires_at + offset, "n": state.turns, "c": state.created_at + offset}
    optional: dict[str, Any] = {
        "d": state.decode,
        "ca": encode_held(state.cached) if state.cached is not None else None,
        "lt": state.last_tokens,
        "lp": state.last_prefill,
        "ao": state.avg_output_tokens,
        "as": state.avg_suffix_tokens,
        "el": [list(c) for c in state.elsewhere] or None,
        "pc": [list(c) for c in state.prefill_copies] or None,
        "la": state.last_turn_at + offset if state.last_turn_at is not None else None,
        "mg": state.mean_gap_s,
        "sc": state.cache_scope,
    }
    rec.update({k: v for k, v in optional.items() if v is not None})
    return orjson.dumps(rec)


def encode_handle(state: SessionState, offset: float, now: float) -> bytes | None:
    """The handle record, or None when the session holds no handle."""
    if state.handle is None:
        return None
    at = state.handle_at if state.handle_at is not None else now
    rec: dict[str, Any] = {"h": state.handle, "a": at + offset}
    if state.held is not None:
        rec["s"] = encode_held(state.held)
    return orjson.dumps(rec)


def decode_handle(data: bytes, offset: float) -> TakenHandle:
    rec = orjson.loads(data)
    handle = rec["h"]
    if not isinstance(handle, dict):
        raise ValueError("handle record: the handle is not an object")
    held = decode_held(rec["s"]) if "s" in rec else None
    return TakenHandle(handle, held, float(rec["a"]) - offset)


def decode_session(session_id: str, data: bytes, prefix_key: str | None, handle: bytes | None,
                   offset: float) -> SessionState:
    rec = orjson.loads(data)
    taken = decode_handle(handle, offset) if handle is not None else None
    return SessionState(
        session_id=session_id,
        decode=rec.get("d"),
        handle=taken.handle if taken is not None else None,
        held=taken.held if taken is not None else None,
        handle_at=taken.handle_at if taken is not None else None,
        expires_at=float(rec["e"]) - offset,
        turns=int(rec["n"]),
        created_at=float(rec["c"]) - offset,
        prefix_key=prefix_key,
        cached=decode_held(rec["ca"]) if "ca" in rec else None,
        last_tokens=rec.get("lt"),
        last_prefill=rec.get("lp"),
        avg_output_tokens=rec.get("ao"),
        avg_suffix_tokens=rec.get("as"),
        elsewhere=tuple(DecodeCopy(str(u), int(t)) for u, t in rec.get("el") or ()),
        prefill_copies=tuple(PrefillCopy(str(u), int(t), int(w)) for u, t, w in rec.get("pc") or ()),
        last_turn_at=float(rec["la"]) - offset if "la" in rec else None,
        mean_gap_s=float(rec["mg"]) if "mg" in rec else None,
        cache_scope=str(rec["sc"]) if "sc" in rec else None,
    )

