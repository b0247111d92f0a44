"""The relay's streamed answer as an ASGI response.

Starlette's ``StreamingResponse`` watches for the client leaving in an anyio task group of its own, one per
answer; its set-up, and cancelling it when the answer is done (anyio formats the task's repr for the cancel
message), cost a turn more than anything else in the response path. Here the watcher is a plain asyncio task:
when the client leaves it cancels the task sending the answer, which stops reading the node (so vLLM aborts the
request) and runs the relay's clean-up; the cancellation it caused is then taken back, so the server sees an
answer that simply ended.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Mapping

from starlette.responses import Response
from starlette.types import Receive, Scope, Send


class LastChunk(bytes):
    """The stream's end (``data: [DONE]`` and what follows it in that read): sent as the answer's last body
    message, so the chunked body's terminator leaves in the same write instead of one of its own."""


class RelayResponse(Response):
    media_type = "text/event-stream"

    def __init__(self, content: AsyncGenerator[bytes, None], headers: Mapping[str, str] | None = None) -> None:
        self.body_iterator = content
        self.status_code = 200
        self.background = None
        self.init_headers(headers)
        self.on_close: list[Callable[[], None]] = []  # run once the answer is over, however it ended
        # How it ended, for on_close: complete ([DONE] went out), client_left, or broken (it ended without [DONE]).
        self.end = "broken"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        state = {"over": False, "left": False}
        last = False  # [DONE] reached the client

        async def watch() -> None:
            # uvicorn's receive() returns http.disconnect when the client leaves, and also once the answer is
            # complete: only the first is a reason to stop.
            while (await receive())["type"] != "http.disconnect":
                pass
            if not state["over"]:
                state["left"] = True
                task.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                if state["over"]:
                    continue  # past [DONE]: the relay finishes reading the node (keep-alive), the client is done
                if type(chunk) is LastChunk:
                    state["over"] = last = True
                await send({"type": "http.response.body", "body": chunk, "more_body": not state["over"]})
            if not state["over"]:
                state["over"] = True
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not state["left"]:
                raise
            task.uncancel()  # the cancellation was ours: the client left, nothing failed
        finally:
            self.end = "client_left" if state["left"] else "complete" if last else "broken"
            state["over"] = True
            watcher.cancel()
            await self.body_iterator.aclose()  # the relay's clean-up, if the answer stopped half-way
            for done in self.on_close:
                done()
