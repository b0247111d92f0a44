"""``kvtether gen`` (synthetic agent sessions) and ``kvtether convert`` (import other tools' files)."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from kvtether.cli.common.exits import EXIT_FAILED, EXIT_USAGE
from kvtether.cli.common.failures import fail
from kvtether.cli.common.options import FLAG
from kvtether.cli.gen.generate import DEFAULT_NEW_TOKENS, DEFAULT_OUTPUT_TOKENS, GenParams, generate_sessions
from kvtether.cli.gen.importers import FORMATS, MOONCAKE_BLOCK_SIZE, ImportFormatError, import_file
from kvtether.sdk.sessionfile import SessionRecord, write_sessions
from rich.console import Console


def _write(out: Path | None, sessions: list[SessionRecord], err: Console) -> None:
    if out is None:
        for s in sessions:
            typer.echo(_line(s))
        return
    try:
        write_sessions(out, sessions)
    except OSError as e:
        fail(err, EXIT_FAILED, f"cannot write {out}: {e}")
    n_turns = sum(len(s.turns) for s in sessions)
    err.print(f"wrote {len(sessions)} sessions, {n_turns} turns to {out}", highlight=False, soft_wrap=True)


def _line(s: SessionRecord) -> str:
    return json.dumps(s.to_json(), ensure_ascii=False)


# The options of `gen`, in the order of its help.
_OUT = typer.Option(None, "--out", "-o", help="Output JSONL file (default: stdout).")
_SESSIONS = typer.Option(8, "--sessions", min=1, help="Number of sessions.")
_TURNS = typer.Option(6, "--turns", min=1, help="Turns (requests) per session.")
_NEW_TOKENS = typer.Option(
    DEFAULT_NEW_TOKENS, "--new-tokens", help="Tool-result tokens per turn: N, LO-HI or LO-HI:W,LO-HI:W mix.")
_OUTPUT_TOKENS = typer.Option(
    DEFAULT_OUTPUT_TOKENS, "--output-tokens", help="Answer tokens per turn (max_tokens): N, LO-HI or a mix.")
_THINK_MS = typer.Option(500.0, "--think-ms", min=0, help="Mean think/tool time between turns, ms.")
_USER_PROB = typer.Option(
    0.15, "--user-prob", min=0.0, max=1.0, help="Chance that a turn also carries a new user message.")
_SYSTEM_TOKENS = typer.Option(
    400, "--system-tokens", min=1,
    help="System prompt length in tokens (written as that many common words, about one token each).")
_GEN_MODEL = typer.Option("kvtether-sim", "--model", help="Model name written into the sessions.")
_SEED = typer.Option(0, "--seed", help="Same seed, same file.")
_ARRIVAL_RATE = typer.Option(
    None, "--arrival-rate", min=0.0001, metavar="PER_S",
    help="Sessions arrive as a Poisson process at this rate (per second): each gets a start offset that `replay "
    "--arrivals trace` follows (and --rate scales). Default: none (closed-loop replays).")
_PIN_OUTPUT = typer.Option(
    True, "--pin-output/--no-pin-output", metavar=FLAG, help="Add vLLM's min_tokens + ignore_eos so answers have "
    "max_tokens.")

# The arguments and options of `convert`, in the order of its help.
_SRC = typer.Argument(..., metavar="FILE", help="The file to import.")
_FROM = typer.Option(..., "--from", help=f"Input format: {', '.join(FORMATS)}.")
_CONVERT_OUT = typer.Option(None, "--out", "-o", help="Output session JSONL (default: stdout).")
_CONVERT_MODEL = typer.Option("default", "--model", help="Model name (no format records one).")
_MAX_TOKENS = typer.Option(256, "--max-tokens", min=1, help="max_tokens when the file has none.")
_BLOCK_SIZE = typer.Option(
    MOONCAKE_BLOCK_SIZE, "--block-size", min=1, help="mooncake: tokens per hash id (the trace's block size).")
_CONVERT_PIN_OUTPUT = typer.Option(
    True, "--pin-output/--no-pin-output", metavar=FLAG,
    help="mooncake: add vLLM's min_tokens + ignore_eos so answers have the trace's output_length.")


def gen(
    out: Path | None = _OUT, sessions: int = _SESSIONS, turns: int = _TURNS, new_tokens: str = _NEW_TOKENS,
    output_tokens: str = _OUTPUT_TOKENS, think_ms: float = _THINK_MS, user_prob: float = _USER_PROB,
    system_tokens: int = _SYSTEM_TOKENS, model: str = _GEN_MODEL, seed: int = _SEED, pin_output: bool = _PIN_OUTPUT,
    arrival_rate: float | None = _ARRIVAL_RATE,
) -> None:
    """Generate synthetic agent sessions: system prompt + tools, tool-call loops with growing history."""
    err = Console(stderr=True)
    params = GenParams(sessions=sessions, turns=turns, new_tokens=new_tokens, output_tokens=output_tokens,
                       think_ms=think_ms, user_message_prob=user_prob, system_tokens=system_tokens, model=model,
                       seed=seed, pin_output=pin_output, arrival_rate=arrival_rate)
    try:
        generated = generate_sessions(params)
    except ValueError as e:
        fail(err, EXIT_USAGE, str(e))
    _write(out, generated, err)


def convert(
    src: Path = _SRC, input_format: str = _FROM, out: Path | None = _CONVERT_OUT, model: str = _CONVERT_MODEL,
    max_tokens: int = _MAX_TOKENS, block_size: int = _BLOCK_SIZE, pin_output: bool = _CONVERT_PIN_OUTPUT,
) -> None:
    """Import vLLM multi-turn benchmark JSON, AIPerf multi_turn JSONL or a Mooncake trace (AIPerf's
    mooncake_trace JSONL) into a kvtether session file."""
    err = Console(stderr=True)
    if input_format not in FORMATS:
        fail(err, EXIT_USAGE, f"unknown format {input_format!r}; known: {', '.join(FORMATS)}")
    try:
        imported = import_file(src, input_format, model=model, default_max_tokens=max_tokens, block_size=block_size,
                               pin_output=pin_output)
    except FileNotFoundError:
        fail(err, EXIT_USAGE, f"{src}: no such file")
    except ImportFormatError as e:
        fail(err, EXIT_USAGE, f"malformed {input_format} file: {e}")
    except (OSError, UnicodeDecodeError) as e:
        fail(err, EXIT_USAGE, f"{src}: cannot read ({e})")
    _write(out, imported, err)


def register(app: typer.Typer) -> None:
    app.command("gen")(gen)
    app.command("convert")(convert)
