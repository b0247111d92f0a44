"""The OpenAI Agents SDK with its default model (``OpenAIResponsesModel``, the Responses API) through kvtether on
the simulator: one conversation of several turns, each a ``Runner.run`` whose input is the previous result's
``to_input_list()`` plus the next question (as the SDK's docs show for conversations without a server-side
state).

The agent has one tool, ``read_file``, that reads a file of a scratch directory and nothing else (the simulated
model calls it with random words as the file name about half the time; a missing file is an answer too). The
session's identity comes from kvtether's SDK: the ``AsyncOpenAI`` the SDK's model calls through is a
``StampedAsyncOpenAI`` for one ``AgentSession`` (``--identity header`` sends the session header through
``ModelSettings.extra_headers`` on a plain ``AsyncOpenAI`` instead). Prints each run's answer, then the gateway's
turns: how many, where each one's KV came from, and the prompt tokens the answers said were cached.

    .venv/bin/python examples/agents/agents_sdk.py [--identity sdk|header] [--speed 20] [--json]

Needs the ``openai-agents`` package (in the dev extra). No network: the SDK's trace export is off.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import anyio
import openai
from agents import Agent, ModelSettings, RunConfig, Runner, function_tool
from agents.models.openai_provider import OpenAIProvider
from common import gateway_summary, print_turns, simulated_gateway, traced_turns
from kvtether.gateway import telemetry as T
from kvtether.protocol.contract import SESSION_HEADER
from kvtether.sdk import AgentSession, StampedAsyncOpenAI

MODEL = "kvtether-sim"
PROMPTS = (
    "What is this project? Read README.txt if you need to.",
    "What do the notes say about the project?",
    "Sum up what you know in one sentence.",
)
# The simulated model calls a tool on about 60 % of its answers, so a run's length is geometric: 20 model calls
# (the SDK's default is 10) makes a run that never answers a one-in-30,000 event.
MAX_TURNS = 20


def read_file_tool(root: Path) -> Any:
    """A tool that reads a file directly in ``root`` and cannot reach anything else."""

    @function_tool
    def read_file(name: str) -> str:
        """Read a text file of the project.

        Args:
            name: The file's name, e.g. README.txt.
        """
        path = (root / name).resolve()
        if path.parent != root or not path.is_file():
            return f"no file named {name!r}; the files are: {', '.join(sorted(p.name for p in root.iterdir()))}"
        return path.read_text(errors="replace")[:4000]

    return read_file


async def run(speed: float = 20.0, *, identity: str = "sdk", learn_estimates: bool = True) -> dict[str, Any]:
    """One conversation of len(PROMPTS) ``Runner.run`` calls through a gateway on a simulated 1P 1D cluster; what
    the SDK and the gateway saw. ``identity``: "sdk" (``StampedAsyncOpenAI``) or "header" (``extra_headers``).
    ``learn_estimates=False``: the cost policy decides from its seeds alone (a test's choice, so that a busy
    machine's timings do not change which turns reuse)."""
    if identity not in ("sdk", "header"):
        raise ValueError(f"identity must be 'sdk' or 'header', got {identity!r}")
    runs: list[dict[str, Any]] = []
    tracer, spans = T.in_memory_provider()  # the gateway's spans: each turn's session and KV reuse
    async with simulated_gateway(speed, learn_estimates=learn_estimates, tracer_provider=tracer) as (url, client):
        with tempfile.TemporaryDirectory(prefix="kvtether-agents-") as scratch:
            root = Path(await anyio.Path(scratch).resolve())
            await anyio.Path(root / "README.txt").write_text("A scratch project: two files, nothing to change.\n")
            await anyio.Path(root / "notes.txt").write_text("Notes: the project has no code yet.\n")
            settings = ModelSettings()
            if identity == "sdk":
                session = AgentSession()
                oai: openai.AsyncOpenAI = StampedAsyncOpenAI(base_url=f"{url}/v1", api_key="sk-kvtether-local",
                                                             session=session)
                sid = session.id
            else:
                session = None
                oai = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="sk-kvtether-local")
                sid = f"agents-sdk-{uuid.uuid4().hex}"
                settings = ModelSettings(extra_headers={SESSION_HEADER: sid})
            provider = OpenAIProvider(openai_client=oai)  # the SDK's default: the Responses API
            agent = Agent(name="project reader", model=MODEL, tools=[read_file_tool(root)], model_settings=settings,
                          instructions="You answer questions about a small project. Be brief.")
            config = RunConfig(model_provider=provider, tracing_disabled=True)
            history: list[Any] = []
            try:
                for prompt in PROMPTS:
                    result = await Runner.run(agent, [*history, {"role": "user", "content": prompt}],
                                              run_config=config, max_turns=MAX_TURNS)
                    history = result.to_input_list()
                    usage = result.context_wrapper.usage
                    runs.append({"final_output": result.final_output, "model_calls": len(result.raw_responses),
                                 "cached_tokens": usage.input_tokens_details.cached_tokens,
                                 "input_tokens": usage.input_tokens})
                seen = await gateway_summary(client, url, "responses")
                # StampedAsyncOpenAI's own per-call record (TTFT, cached tokens), None with a plain client.
                recorded = len(session.turns) if session is not None else None
            finally:
                if session is not None:
                    await session.aclose()  # the decode node releases what it holds for the session
                await oai.close()
    return {"session": sid, "identity": identity, "model_class": type(provider.get_model(MODEL)).__name__,
            "runs": runs, "sdk_recorded_calls": recorded, "turns": traced_turns(spans, "/v1/responses"), **seen}


def completed(run: dict[str, Any]) -> bool:
    """The run ended with an answer (the SDK raises when it cannot: MaxTurnsExceeded, a model error)."""
    return isinstance(run["final_output"], str) and bool(run["final_output"].strip())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--identity", choices=("sdk", "header"), default="sdk",
                    help="session id from StampedAsyncOpenAI (sdk) or ModelSettings.extra_headers (header)")
    ap.add_argument("--speed", type=float, default=20.0, help="simulated seconds per real second")
    ap.add_argument("--json", action="store_true", help="print everything as JSON")
    args = ap.parse_args()
    out = anyio.run(lambda: run(args.speed, identity=args.identity))
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"model: {out['model_class']}, session id by {out['identity']}: {out['session']}")
        for i, r in enumerate(out["runs"]):
            print(f"run {i + 1}: {r['model_calls']} model calls, {r['cached_tokens']} of {r['input_tokens']} prompt "
                  f"tokens cached: {r['final_output'][:50]!r}")
        print_turns(out["turns"])
        print("gateway turns by reuse source:", {k: int(v) for k, v in out["turns_by_source"].items() if v})
        print(f"tokens pulled back from decode handles (decode_pull turns): {int(out['reused_tokens'])}")
    sys.exit(0 if len(out["runs"]) == len(PROMPTS) and all(completed(r) for r in out["runs"]) else 1)


if __name__ == "__main__":
    main()
