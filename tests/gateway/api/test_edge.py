"""The edge's stream conversion: however the relay's network reads cut the chat stream, the client gets the
same events."""

from __future__ import annotations

import itertools
import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from kvtether.gateway.api.edge import _convert_events


class Recorder:
    def __init__(self) -> None:
        self.seen: list[Any] = []

    def feed(self, chunk: dict[str, Any]) -> bytes:
        self.seen.append(chunk)
        return f"[{chunk['n']}]".encode()

    def done(self) -> bytes:
        self.seen.append("done")
        return b"[done]"

    def broken(self, message: str) -> bytes:
        self.seen.append(("broken", message))
        return b"[broken]"


STREAM = b"".join(f"data: {json.dumps({'n': i, 'choices': []})}\n\n".encode() for i in range(6))


@given(st.lists(st.integers(0, len(STREAM)), max_size=12), st.booleans())
@settings(max_examples=200, deadline=None)
def test_any_cut_of_the_stream_gives_the_same_events(cuts: list[int], error: bool) -> None:
    tail = b'data: {"error": {"message": "node failed"}}\n\n' if error else b"data: [DONE]\n\n"
    whole = STREAM + tail
    bounds = sorted({0, len(whole), *cuts})
    rec, out, pending = Recorder(), b"", b""
    for a, b in itertools.pairwise(bounds):
        got, pending = _convert_events(pending + whole[a:b], rec, final=b == len(whole))
        out += got
    want = b"".join(f"[{i}]".encode() for i in range(6)) + (b"[broken]" if error else b"[done]")
    assert out == want and pending == b""
    assert rec.seen[-1] == (("broken", "node failed") if error else "done")
