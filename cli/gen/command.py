"""``kvtether gen`` (synthetic agent sessions) and ``kvtether convert`` (import other tools' files)."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from kvtether.cli.common.options import FLAG
from kvtether.cli.gen.generate import DEFAULT_NEW_TOKENS, DEFAULT_OUTPUT_TOKENS, GenParams, generate_sessions
from kvtether.cli.gen.importers import FORMATS, MOONCAKE_BLOCK_SIZE, ImportFormatError, import_file
from kvtether.sdk.sessionfile import SessionRecord, write_sessions
from rich.console import Console
from rich.markup import escape

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def _error(err: Console, message: str) -> None:
    err.print(f"[red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)


def _write(out: Path | None, sessions: list[SessionRecord], err: Console) -> None:
    if out is None:
        for s in sessions:
            typer.echo(_line(s))
        return
    try:
        write_sessions(out, sessions)
    except OSError as e:
        _error(err, f"cannot write {out}: {e}")
        raise typer.Exit(EXIT_FAILED) from None
    n_turns = sum(len(s.turns) for s in sessions)
    err.print(f"wrote {len(sessions)} sessions, {n_turns} turns to {out}", highlight=False, soft_wrap=True)


def _line(s: SessionRecord) -> str:
    return json.dumps(s.to_json(), ensure_ascii=False)


def register(app: typer.Typer) -> None:
    @app.command("gen")
    def gen(
        out: Path | None = typer.Option(None, "--out", "-o", help="Output JSONL file (default: stdout)."),
        sessions: int = typer.Option(8, "--sessions", min=1, help="Number of sessions."),
        turns: int = typer.Option(6, "--turns", min=1, help="Turns (requests) per session."),
        new_tokens: str = typer.Option(
            DEFAULT_NEW_TOKENS, "--new-tokens", help="Tool-result tokens per turn: N, LO-HI or LO-HI:W,LO-HI:W mix."
        ),
        output_tokens: str = typer.Option(
            DEFAULT_OUTPUT_TOKENS, "--output-tokens", help="Answer tokens per turn (max_tokens): N, LO-HI or a mix."
        ),
        think_ms: float = typer.Option(500.0, "--think-ms", min=0, help="Mean think/tool time between turns, ms."),
        user_prob: float = typer.Option(
            0.15, "--user-prob", min=0.0, max=1.0, help="Chance that a turn also carries a new user message."
        ),
        system_tokens: int = typer.Option(
            400, "--system-tokens", min=1,
            help="System prompt length in tokens (written as that many common words, about one token each)."),
        model: str = typer.Option("kvtether-sim", "--model", help="Model name written into the sessions."),
        seed: int = typer.Option(0, "--seed", help="Same seed, same file."),
        pin_output: bool = typer.Option(
            True, "--pin-output/--no-pin-output", metavar=FLAG,
            help="Add vLLM's min_tokens + ignore_eos so answers have max_tokens."
        ),
    ) -> None:
        """Generate synthetic agent sessions: system prompt + tools, tool-call loops with growing history."""
        err = Console(stderr=True)
        params = GenParams(
            sessions=sessions,
            turns=turns,
            new_tokens=new_tokens,
            output_tokens=output_tokens,
            think_ms=think_ms,
            user_message_prob=user_prob,
            system_tokens=system_tokens,
            model=model,
            seed=seed,
            pin_output=pin_output,
        )
        try:
            generated = generate_sessions(params)
        except ValueError as e:
            _error(err, str(e))
            raise typer.Exit(EXIT_USAGE) from None
        _write(out, generated, err)

    @app.command("convert")
    def convert(
        src: Path = typer.Argument(..., metavar="FILE", help="The file to import."),
        input_format: str = typer.Option(..., "--from", help=f"Input format: {', '.join(FORMATS)}."),
        out: Path | None = typer.Option(None, "--out", "-o", help="Output session JSONL (default: stdout)."),
        model: str = typer.Option("default", "--model", help="Model name (no format records one)."),
        max_tokens: int = typer.Option(256, "--max-tokens", min=1, help="max_tokens when the file has none."),
        block_size: int = typer.Option(
            MOONCAKE_BLOCK_SIZE, "--block-size", min=1, help="mooncake: tokens per hash id (the trace's block size)."
        ),
        pin_output: bool = typer.Option(
            True, "--pin-output/--no-pin-output", metavar=FLAG,
            help="mooncake: add vLLM's min_tokens + ignore_eos so answers have the trace's output_length."
        ),
    ) -> None:
        """Import vLLM multi-turn benchmark JSON, AIPerf multi_turn JSONL or a Mooncake trace (AIPerf's
        mooncake_trace JSONL) into a kvtether session file."""
        err = Console(stderr=True)
        if input_format not in FORMATS:
            _error(err, f"unknown format {input_format!r}; known: {', '.join(FORMATS)}")
            raise typer.Exit(EXIT_USAGE)
        try:
            imported = import_file(src, input_format, model=model, default_max_tokens=max_tokens,
                                   block_size=block_size, pin_output=pin_output)
        except FileNotFoundError:
            _error(err, f"{src}: no such file")
            raise typer.Exit(EXIT_USAGE) from None
        except ImportFormatError as e:
            _error(err, f"malformed {input_format} file: {e}")
            raise typer.Exit(EXIT_USAGE) from None
        except (OSError, UnicodeDecodeError) as e:
            _error(err, f"{src}: cannot read ({e})")
            raise typer.Exit(EXIT_USAGE) from None
        _write(out, imported, err)
