"""``kvtether sessions --gateway URL``: the gateway's pinned sessions (``GET /admin/sessions``), then what its
handles hold on each decode node (``GET /ready``).

Columns: session id, decode node, held tokens, handle age (s), turns, expiry (s left).

The admin endpoint answers a JSON list of objects (or ``{"sessions": [...]}``). Field names are
read tolerantly (the first present of each alias list) so a renamed field degrades to "–" rather
than a crash; unknown fields are kept in ``--json`` output untouched.
"""

from __future__ import annotations

import json
from typing import Any

import anyio
import httpx
import typer
from kvtether.cli.common.exits import EXIT_FAILED, EXIT_OK
from kvtether.cli.common.failures import fail
from kvtether.cli.common.options import FLAG
from rich.console import Console
from rich.table import Table

COLUMNS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("session", ("session_id", "id", "session")),
    ("decode node", ("decode_node", "node", "decode")),
    ("held tokens", ("held_tokens", "tokens", "num_tokens")),
    ("age s", ("handle_age_s", "age_s", "handle_age")),
    ("turns", ("turns", "turn_count", "n_turns")),
    ("expires s", ("expires_in_s", "ttl_s", "expiry_s", "expires_at")),
)


def _field(obj: dict[str, Any], names: tuple[str, ...]) -> Any:
    for n in names:
        if obj.get(n) is not None:
            return obj[n]
    return None


def _cell(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:,.1f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


async def fetch_sessions(url: str, timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """Raises ``RuntimeError`` with one readable line on any failure."""
    target = url.rstrip("/") + "/admin/sessions"
    try:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            resp = await client.get(target)
    except httpx.HTTPError as e:
        why = f"{type(e).__name__}: {e or 'no answer'}"
        raise RuntimeError(f"cannot reach {url} ({why}); is the gateway running?") from None
    if resp.status_code != 200:
        raise RuntimeError(f"{target} answered HTTP {resp.status_code}: {resp.text[:200]}")
    try:
        data = resp.json()
    except json.JSONDecodeError:
        raise RuntimeError(f"{target} did not answer JSON") from None
    if isinstance(data, dict) and isinstance(data.get("sessions"), list):
        data = data["sessions"]
    if not isinstance(data, list) or not all(isinstance(x, dict) for x in data):
        raise RuntimeError(f"{target} answered JSON that is not a list of session objects")
    return data


async def fetch_held(url: str, timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """The decode nodes' held KV (``GET /ready``): url, held tokens, KV capacity. Empty when not to be had."""
    try:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            data = (await client.get(url.rstrip("/") + "/ready")).json()
    except (httpx.HTTPError, json.JSONDecodeError):
        return []
    nodes = data.get("nodes") if isinstance(data, dict) else None
    return [n for n in nodes or ()
            if isinstance(n, dict) and n.get("role") in ("decode", "both") and "held_kv_tokens" in n]


def held_table(nodes: list[dict[str, Any]]) -> Table:
    table = Table(title="held KV per decode node (the gateway's handles)", title_justify="left")
    table.add_column("decode node", overflow="fold")
    for name in ("held tokens", "KV capacity", "share"):
        table.add_column(name, justify="right", no_wrap=True)
    for n in nodes:
        held, cap = n.get("held_kv_tokens"), n.get("kv_capacity_tokens")
        share = f"{held / cap:.1%}" if isinstance(held, int) and isinstance(cap, int) and cap else "–"
        table.add_row(str(n.get("url")), _cell(held), _cell(cap), share)
    return table


def register(app: typer.Typer) -> None:
    @app.command("sessions")
    def sessions(
        gateway: str = typer.Option("http://127.0.0.1:8000", "--gateway", metavar="URL", help="The gateway to ask."),
        as_json: bool = typer.Option(False, "--json/--no-json", metavar=FLAG,
                                     help="Write the gateway's answer to stdout as JSON."),
        timeout: float = typer.Option(10.0, "--timeout", min=0.001, help="How long to wait for the gateway, seconds."),
    ) -> None:
        """The gateway's pinned sessions: decode node, held tokens, handle age, turns, expiry."""
        err = Console(stderr=True)
        try:
            rows = anyio.run(fetch_sessions, gateway, timeout)
        except RuntimeError as e:
            fail(err, EXIT_FAILED, str(e))
        if as_json:
            typer.echo(json.dumps(rows, indent=2))
            raise typer.Exit(EXIT_OK)
        table = Table(title=f"{len(rows)} pinned session(s) at {gateway}", title_justify="left")
        for name, _ in COLUMNS:
            if name in ("session", "decode node"):
                table.add_column(name, overflow="fold")  # ids and URLs wrap rather than lose their tail
            else:
                table.add_column(name, justify="right", no_wrap=True)
        for r in sorted(rows, key=lambda r: str(_field(r, COLUMNS[0][1]))):
            table.add_row(*[_cell(_field(r, names)) for _, names in COLUMNS])
        Console().print(table)
        held = anyio.run(fetch_held, gateway, timeout)
        if held:
            Console().print(held_table(held))
