"""``kvtether serve``: run the gateway in front of vLLM prefill/decode (or aggregated) nodes.

Flags name the cluster; everything else comes from ``--config FILE`` (TOML, see docs/gateway.md).
Flags win over the file. Exit codes: 0 normal stop, 2 bad configuration.
"""

from __future__ import annotations

import logging

import typer

EXIT_USAGE = 2


def register(app: typer.Typer) -> None:
    @app.command("serve")
    def serve(
        prefill: list[str] = typer.Option(None, "--prefill", "-p", help="Prefill node URL (repeatable)."),
        decode: list[str] = typer.Option(None, "--decode", "-d", help="Decode node URL (repeatable)."),
        aggregated: list[str] = typer.Option(
            None, "--aggregated", "-a", help="Plain vLLM replica URL, no P/D (repeatable)."
        ),
        config: str | None = typer.Option(None, "--config", "-c", help="TOML config file."),
        host: str | None = typer.Option(None, "--host", help="Listen address (default 127.0.0.1)."),
        port: int | None = typer.Option(None, "--port", help="Listen port (default 8000)."),
        policy: str | None = typer.Option(None, "--policy", help="auto | pull | no-pull | reference."),
        otlp_endpoint: str | None = typer.Option(None, "--otlp-endpoint", help="OTLP/HTTP traces endpoint."),
        log_level: str = typer.Option("info", "--log-level", help="debug | info | warning | error."),
    ) -> None:
        """Start the OpenAI-compatible gateway (POST /v1/chat/completions, /v1/completions; GET /v1/models,
        /health, /ready, /metrics, /admin/sessions)."""
        from kvtether.gateway.config import ConfigError, load_config
        from kvtether.gateway.server import run_gateway

        try:
            cfg = load_config(config, prefill=prefill or None, decode=decode or None, aggregated=aggregated or None,
                              host=host, port=port, policy=policy, otlp_endpoint=otlp_endpoint)
        except ConfigError as exc:
            typer.echo(f"kvtether serve: {exc}", err=True)
            raise typer.Exit(EXIT_USAGE) from None
        logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        mode = "aggregated" if cfg.aggregated else f"P/D ({len(cfg.prefill)}P {len(cfg.decode)}D)"
        typer.echo(f"kvtether gateway on http://{cfg.host}:{cfg.port} — {mode}, policy {cfg.policy}", err=True)
        run_gateway(cfg, log_level=log_level)
