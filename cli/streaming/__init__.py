"""One streaming client: one reader of a streamed answer (chat completions, completions, OpenAI Responses and
Anthropic Messages SSE) and one definition of the times taken from it, used by `replay`, `assess`, `demo` and
the benchmarks.

Every event is stamped (``time.perf_counter_ns``) as it arrives, before any other work on it; the request's time
zero is taken just before it is sent.

- **TTFC**: request sent → the first event of any kind (often a role-only chunk).
- **TTFT**: request sent → the first event that carries a token of the answer, of any kind: content (text),
  reasoning, a refusal, or a tool call (its name or its arguments). A role-only first chunk is not a token.
  Tool-call-only turns count: an agent's turn often has no text.
- **TPOT**: (end of generation − first token event) / (tokens − 1), tokens being the answer's completion tokens
  from its usage (without usage: the number of token events). The end of generation is the event that says why
  the answer ended (chat's ``finish_reason``, Messages' ``stop_reason``, Responses' ``response.completed``): it
  comes with the engine step that sampled the last token, an end-of-sequence token included, which has no text
  and so no token event but is one of the completion tokens; without it, the last token event. So a lone
  stream's TPOT is the engine's step time. An answer of one token has no TPOT.
- **E2E**: request sent → the end of the stream.

Which events carry a token and which ends the generation is ``kvtether.protocol.tokens``'s rule, the one the
SDK and the gateway read too. A 200 stream that ends without one is an answer
without a TTFT (an empty answer), never a failure; an error event inside it is one.

``stream_answer`` sends a request with httpx and reads its answer; a caller that reads a stream some other way
(through the SDK) feeds each event to ``reader_for(api, clock)`` with its arrival time.
"""

from kvtether.cli.streaming.answers import (
    APIS,
    CHAT,
    COMPLETIONS,
    MESSAGES,
    RESPONSES,
    AnswerReader,
    reader_for,
)
from kvtether.cli.streaming.client import PATHS, StreamedAnswer, StreamFailure, stream_answer
from kvtether.cli.streaming.clock import TIME_DEFINITIONS, TokenClock, loop_clock_ns, now_ns

__all__ = [
    "APIS",
    "CHAT",
    "COMPLETIONS",
    "MESSAGES",
    "PATHS",
    "RESPONSES",
    "TIME_DEFINITIONS",
    "AnswerReader",
    "StreamFailure",
    "StreamedAnswer",
    "TokenClock",
    "loop_clock_ns",
    "now_ns",
    "reader_for",
    "stream_answer",
]
