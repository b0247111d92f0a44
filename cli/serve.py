"""``kvtether serve``: run the gateway in front of vLLM prefill/decode nodes, pool instances that take both roles,
or aggregated nodes.

Flags name the cluster; everything else comes from ``--config FILE`` (TOML, see docs/gateway.md).
Flags win over the file; ``KVTETHER_STORE`` stands for ``--store``. ``--workers N`` runs N processes on one
port, which share sessions through the store (so they need a Redis/Valkey URL). Exit codes: 0 normal stop
(SIGINT or SIGTERM, whatever disposition the process inherited), 1 cannot listen on its address (a busy port),
2 bad configuration.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import typer
from kvtether.cli.common.exits import EXIT_FAILED, EXIT_USAGE
from kvtether.cli.common.failures import fail_as
from kvtether.cli.common.options import LOG_LEVELS, checked_log_level
from kvtether.cli.common.ports import listen_fix, listen_problem

if TYPE_CHECKING:
    from kvtether.gateway.config import GatewayConfig

def register(app: typer.Typer) -> None:
    @app.command("serve")
    def serve(
        prefill: list[str] = typer.Option(None, "--prefill", "-p", help="Prefill node URL (repeatable)."),
        decode: list[str] = typer.Option(None, "--decode", "-d", help="Decode node URL (repeatable)."),
        node: list[str] = typer.Option(
            None, "--node", "-n",
            help="Pool instance URL (repeatable): a vLLM server with kv_role kv_both and bidirectional_kv_xfer that "
            "prefills and decodes; may be mixed with --prefill/--decode."),
        aggregated: list[str] = typer.Option(
            None, "--aggregated", "-a", help="Plain vLLM replica URL, no P/D (repeatable)."
        ),
        discovery: str | None = typer.Option(
            None, "--discovery",
            help="Where further nodes come from: static (the lists above, the default), dns (--dns-*) or kubernetes "
            "(pods by label selector; pip install 'kvtether[kubernetes]')."),
        dns_prefill: list[str] = typer.Option(
            None, "--dns-prefill",
            help="Headless Service of the prefill nodes: HOST:PORT or an SRV name _http._tcp.HOST (repeatable; "
            "--discovery dns)."),
        dns_decode: list[str] = typer.Option(None, "--dns-decode", help="The same for the decode nodes."),
        dns_pool: list[str] = typer.Option(None, "--dns-pool", help="The same for pool instances (kv_both)."),
        k8s_namespace: str | None = typer.Option(
            None, "--k8s-namespace", help="Namespace of the vLLM pods (default: the gateway pod's own)."),
        k8s_selector: str | None = typer.Option(
            None, "--k8s-selector",
            help="Label selector of the vLLM pods (default app.kubernetes.io/part-of=kvtether)."),
        kubeconfig: str | None = typer.Option(
            None, "--kubeconfig", help="Kubeconfig file (default: in a pod its service account, else $KUBECONFIG or "
            "~/.kube/config)."),
        config: str | None = typer.Option(None, "--config", "-c", help="TOML config file."),
        host: str | None = typer.Option(None, "--host", help="Listen address (default 127.0.0.1)."),
        port: int | None = typer.Option(None, "--port", help="Listen port (default 8000)."),
        policy: str | None = typer.Option(None, "--policy", help="auto | pull | no-pull | reference."),
        otlp_endpoint: str | None = typer.Option(None, "--otlp-endpoint", help="OTLP/HTTP traces endpoint."),
        store: str | None = typer.Option(
            None, "--store", envvar="KVTETHER_STORE",
            help="Session store: memory (default) or a redis://, rediss:// or unix:// URL of Redis/Valkey, shared "
            "by workers and replicas."),
        workers: int = typer.Option(1, "--workers", min=1, help="Worker processes on this port (needs --store URL)."),
        tokenizer: str | None = typer.Option(
            None, "--tokenizer",
            help="The served model's tokenizer (directory or name): the guard tokenizes locally, checked against "
            "/tokenize."),
        log_level: str = typer.Option("info", "--log-level", help=f"{' | '.join(LOG_LEVELS)}."),
    ) -> None:
        """Start the OpenAI-compatible gateway (POST /v1/chat/completions, /v1/completions; GET /v1/models,
        /health, /ready, /metrics, /admin/sessions)."""
        from kvtether.gateway.config import ConfigError, load_config

        log_level = checked_log_level("serve", "--log-level", log_level)
        found = {k: v for k, v in {"source": discovery, "dns_prefill": dns_prefill, "dns_decode": dns_decode,
                                   "dns_pool": dns_pool, "namespace": k8s_namespace, "selector": k8s_selector,
                                   "kubeconfig": kubeconfig}.items() if v}
        try:
            cfg = load_config(config, prefill=prefill or None, decode=decode or None, nodes=node or None,
                              aggregated=aggregated or None, discovery=found or None,
                              host=host, port=port, policy=policy, otlp_endpoint=otlp_endpoint, store=store,
                              tokenizer=tokenizer)
        except ConfigError as exc:
            fail_as("serve", EXIT_USAGE, str(exc))
        if workers > 1 and cfg.store == "memory":
            # Each worker would keep its own sessions: alternate turns of a session would lose their handle.
            fail_as("serve", EXIT_USAGE, "--workers > 1 needs a shared session store (--store redis://HOST:PORT, or "
                    "KVTETHER_STORE)")
        # Checked before the banner, which would otherwise announce an address that uvicorn then fails to bind.
        problem = listen_problem(cfg.host, cfg.port) if cfg.port else None
        if problem is not None:
            fail_as("serve", EXIT_FAILED, f"cannot listen on {cfg.host}:{cfg.port}: {problem}; {listen_fix(problem)}")
        logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        mode = "aggregated" if cfg.aggregated else "P/D (" + " ".join(
            [f"{len(urls)}{tag}" for urls, tag in ((cfg.prefill, "P"), (cfg.decode, "D"), (cfg.nodes, " pool")) if urls]
            + ([f"nodes by {cfg.discovery.source}"] if cfg.discovery.dynamic else [])) + ")"
        shared = f", {workers} workers" if workers > 1 else ""
        typer.echo(f"kvtether gateway on http://{cfg.host}:{cfg.port} — {mode}, policy {cfg.policy}, store "
                   f"{_redacted(cfg.store)}{shared}", err=True)
        run_gateway_until_stopped(cfg, log_level=log_level, workers=workers)


def run_gateway_until_stopped(cfg: GatewayConfig, *, log_level: str, workers: int = 1) -> None:
    """`run_gateway` until SIGINT or SIGTERM, which both end it normally (the caller then exits 0).

    uvicorn serves with its own handlers for both signals, installed over whatever the process inherited (an
    ignored SIGINT included), and shuts down gracefully on either. Then it puts back the handlers it found and
    raises the signal again, to end the process as that signal would have: SIGTERM's default action kills it
    (status -15, where a normal stop is 0). Handlers that raise KeyboardInterrupt for both signals, which
    `uvicorn.run` takes as the normal end, make either one a normal stop whatever the process inherited; they
    also cover start-up (before uvicorn's handlers are in, and with several workers, before its supervisor's).
    With several workers only the supervisor takes SIGINT; it stops the workers with SIGTERM
    (gateway/shell/workers.py)."""
    from kvtether.cli.common.signals import stop_signals_interrupt

    try:
        with stop_signals_interrupt():
            from kvtether.gateway.shell.server import run_gateway  # the app's imports take a while: stoppable too

            run_gateway(cfg, log_level=log_level, workers=workers)
    except KeyboardInterrupt:
        pass


def _redacted(url: str) -> str:
    """A store URL without its password, for the start-up line."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
    return parts._replace(netloc=netloc).geturl()
