"""A tool-calling agent on kvtether: the only kvtether lines are the session and the client.

It needs something that speaks the OpenAI API on port 8000: as in README's Quick start, a simulated
cluster and the kvtether gateway in front of it, each in its own terminal (``kvtether demo`` runs its own
cluster and gateway on free ports, and stops them when it ends)::

    kvtether sim --prefill 1 --decode 2 --port 8100
    kvtether serve --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8101 --decode http://127.0.0.1:8102

or the test fake, ``python tests/support/fake_openai.py --port 8000``. Then::

    python examples/agent_loop.py                       # --base-url http://127.0.0.1:8000/v1
    python examples/agent_loop.py --record session.jsonl
    kvtether replay session.jsonl --gateway http://127.0.0.1:8000   # replays the recorded session

Every request carries the session id and the turn/prefix stamps, so the gateway keeps the
conversation on the node that holds its KV cache; the session reports client-side TTFT per turn.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from collections.abc import Callable
from typing import Any

from kvtether.sdk import AgentSession, StampedAsyncOpenAI

# --- a few fake tools -------------------------------------------------------------------------


def get_weather(city: str) -> str:
    return json.dumps({"city": city, "temp_c": 4 + len(city) % 7, "sky": "rain"})


def add(a: float, b: float) -> str:
    return str(a + b)


def search_docs(query: str) -> str:
    return f"kvtether pins a session to the node that holds its KV cache (matched {query!r})."


TOOLS: dict[str, Callable[..., str]] = {"get_weather": get_weather, "add": add, "search_docs": search_docs}


def _schema(name: str, description: str, **props: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {k: {"type": t} for k, t in props.items()},
                "required": list(props),
            },
        },
    }


SCHEMAS = [
    _schema("get_weather", "Current weather for a city", city="string"),
    _schema("add", "Add two numbers", a="number", b="number"),
    _schema("search_docs", "Search the kvtether docs", query="string"),
]


def run_tool(call: dict[str, Any]) -> str:
    fn = call["function"]
    try:
        return TOOLS[fn["name"]](**json.loads(fn["arguments"] or "{}"))
    except Exception as e:  # a model may call a tool badly: tell it, as a real agent would
        return f"error: {e}"


# --- the agent ---------------------------------------------------------------------------------


async def run_agent(
    base_url: str,
    question: str = "What's the weather in Oslo, and what is 2.5 + 4?",
    *,
    model: str | None = None,
    record_to: str | None = None,
    max_steps: int = 6,
) -> AgentSession:
    with AgentSession(record_to=record_to) as session:
        client = StampedAsyncOpenAI(session=session, base_url=base_url, api_key=os.getenv("OPENAI_API_KEY", "-"))
        model = model or (await client.models.list()).data[0].id
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a helpful agent. Use the tools when they help."},
            {"role": "user", "content": question},
        ]
        for _ in range(max_steps):
            stream = await client.chat.completions.create(
                model=model, messages=messages, tools=SCHEMAS, stream=True,  # type: ignore[arg-type]
                stream_options={"include_usage": True}, max_tokens=256,
            )  # fmt: skip
            text, calls = await collect(stream)
            messages.append({"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})})
            turn = session.last_turn
            assert turn is not None
            print(f"turn {turn.turn}: ttft {turn.ttft_ms or 0:.1f} ms, {len(calls)} tool call(s)")
            if not calls:
                print(f"answer: {text}")
                break
            for call in calls:
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": run_tool(call)})
        await client.close()
    return session


async def collect(stream: Any) -> tuple[str, list[dict[str, Any]]]:
    """Assemble a streamed answer: its text and its tool calls."""
    text, calls = "", {}
    async for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                empty = {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
                slot = calls.setdefault(tc.index, empty)
                slot["id"] = tc.id or slot["id"]
                if tc.function:
                    slot["function"]["name"] += tc.function.name or ""
                    slot["function"]["arguments"] += tc.function.arguments or ""
    return text, [calls[i] for i in sorted(calls)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default=os.getenv("KVTETHER_BASE_URL", "http://127.0.0.1:8000/v1"))
    p.add_argument("--model", default=None, help="default: the first model the server lists")
    p.add_argument("--record", default=None, help="append the session to this session file (JSONL)")
    p.add_argument("--question", default="What's the weather in Oslo, and what is 2.5 + 4?")
    args = p.parse_args()
    session = asyncio.run(run_agent(args.base_url, args.question, model=args.model, record_to=args.record))
    print(f"session {session.id}: {len(session.turns)} turn(s)")


if __name__ == "__main__":
    main()
