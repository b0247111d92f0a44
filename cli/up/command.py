"""`kvtether up`: start a vLLM prefill/decode cluster (bidirectional NIXL), or a pool of instances that take both
roles (`--nodes N`), and the kvtether gateway in front.

The flags are checked into cluster options in `flags.py`; command construction is pure (`launcher.py`); the
processes are `supervisor.py`'s (every child in its own process group); the model's files are made local before
any child starts, which all run offline (`model_files.py`: a hub name not yet in the Hugging Face cache is fetched
once, with the vLLM environment's huggingface_hub); this module is the command: it starts the cluster, reports it,
and stops every child on Ctrl-C, on SIGTERM, or as soon as any child dies.

The gateway takes the same settings as `kvtether serve`: `--config FILE` (TOML), `--policy`, `--otlp-endpoint`,
`--store`, `--gateway-log-level`, and `--gateway-set KEY=VALUE` for any other GatewayConfig field. `--gateways N`
starts N gateway replicas on consecutive ports, which must share a Redis/Valkey store (`--store`). `up` itself
supplies the cluster (prefill/decode and pool URLs), host, port and session/engine TTLs, which win over the file.
The gateway's configuration is built here, with `load_config` from exactly the arguments its child will get,
before any vLLM instance starts: a bad setting is a usage error (exit 2), never a half-started cluster.
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Annotated

import typer
from kvtether.cli.common.exits import EXIT_FAILED
from kvtether.cli.common.options import FLAG, LOG_LEVELS
from kvtether.cli.common.ports import listen_fix, listen_problem
from kvtether.cli.common.signals import STOP_SIGNALS
from kvtether.cli.up.cluster_spec import (
    DEFAULT_DECODE_TTL_S,
    DEFAULT_GATEWAY_LOG_LEVEL,
    DEFAULT_GATEWAY_PORT,
    DEFAULT_SIDE_CHANNEL_BASE_PORT,
    ClusterPlan,
)
from kvtether.cli.up.flags import UpFlags, cluster_options, usage_error
from kvtether.cli.up.gateway_child import check_gateway_config, run_gateway_child
from kvtether.cli.up.launcher import dry_run_text, plan_cluster
from kvtether.cli.up.model_files import ModelFilesError, Wanted, dry_run_files, ensure_local, wanted_files
from kvtether.cli.up.preflight import check_vllm_env
from kvtether.cli.up.supervisor import ChildDied, Supervisor, tail
from rich.console import Console

if TYPE_CHECKING:
    from kvtether.gateway.config import GatewayConfig


@contextlib.contextmanager
def running_cluster(
    plan: ClusterPlan,
    *,
    log_dir: Path | None,
    log: Callable[[str], None] = lambda _msg: None,
    health_timeout_s: float = 300.0,
    start_gateway: bool = True,
    files: Sequence[Wanted] = (),
    fetch_python: str | None = None,
) -> Iterator[Supervisor]:
    """Start every instance (in parallel), wait for /health, then the gateway; stop everything on exit.

    The gateway's configuration is checked first (ConfigError), so that a bad one starts nothing; then `files`
    (the model and tokenizers the children load by name) are made local, fetched with `fetch_python` where
    missing (ModelFilesError), so that the children, which run offline, find them.
    """
    if start_gateway:
        check_gateway_config(plan)
    ensure_local(files, python=fetch_python, log=log)
    sup = Supervisor(log_dir=log_dir, log=log)
    try:
        instances = [sup.start(i.command) for i in plan.instances]
        for child in instances:
            took = sup.wait_healthy(child, timeout_s=health_timeout_s)
            log(f"{child.name} healthy at {child.command.url} ({took:.0f} s after its health wait began)")
        if start_gateway and plan.gateway is not None:
            gateways = [sup.start(spec.command) for spec in plan.gateways]
            for gw in gateways:
                sup.wait_healthy(gw, timeout_s=60.0)
                log(f"{gw.name} healthy at {gw.command.url}")
        yield sup
    finally:
        sup.stop_all()


class _Interrupted(Exception):
    pass


class _StopOnce:
    """The stop-signal handler of `run_up`: the first signal raises _Interrupted, which stops the cluster; later
    ones do nothing, so that they cannot break off the stop (the supervisor takes them over while it stops its
    children: they then cut its wait short) or the report after it."""

    def __init__(self) -> None:
        self.armed = True

    def __call__(self, signum: int, _frame: FrameType | None) -> None:
        if self.armed:
            self.armed = False
            raise _Interrupted(signal.Signals(signum).name)


def run_up(plan: ClusterPlan, *, files: Sequence[Wanted], fetch_python: str | None, log_dir: Path, as_json: bool,
           console: Console) -> int:
    def log(msg: str) -> None:
        console.print(f"[bold cyan]kvtether up[/] {msg}", highlight=False)

    # Installed over whatever the process inherited: a background job starts with SIGINT ignored.
    stop = _StopOnce()
    old = {s: signal.signal(s, stop) for s in (*STOP_SIGNALS, signal.SIGHUP)}
    t0 = time.monotonic()
    try:
        with (_disarmed_after(stop),
              running_cluster(plan, log_dir=log_dir, log=log, files=files, fetch_python=fetch_python) as sup):
            log(f"cluster up in {time.monotonic() - t0:.0f} s; logs in {log_dir}")
            urls = plan.urls()
            if as_json:
                sys.stdout.write(json.dumps(urls) + "\n")
                sys.stdout.flush()
            else:
                console.print(f"gateway: {', '.join(str(g.command.url) for g in plan.gateways) or None}")
                for label, instances in (("prefill", plan.prefill), ("decode", plan.decode), ("nodes", plan.nodes)):
                    if instances:
                        console.print(f"{label + ':':<8} {', '.join(str(i.command.url) for i in instances)}")
            log("running; Ctrl-C stops every instance")
            while True:
                sup.check()
                time.sleep(0.5)
    except ModelFilesError as e:  # before anything started
        console.print(f"kvtether up: {e}", markup=False, highlight=False)
        return e.exit_code
    except ChildDied as e:
        console.print(f"[bold red]kvtether up[/] {e}; stopping the others")
        t = tail(e.log_path)
        if t:
            console.print(t, markup=False, highlight=False)
        return 1
    except TimeoutError as e:
        console.print(f"[bold red]kvtether up[/] {e}; stopping")
        return 1
    except (_Interrupted, KeyboardInterrupt) as e:
        log(f"{e or 'interrupt'}: stopping")
        return 0
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return 0  # pragma: no cover - the loop above only exits by exception


@contextlib.contextmanager
def _disarmed_after(stop: _StopOnce) -> Iterator[None]:
    """Disarms `stop` once the cluster is stopped, however that came about (a child's death, a timeout)."""
    try:
        yield
    finally:
        stop.armed = False


# The command's options, in the order of its help.
_MODEL = typer.Option(
    "--model",
    help="Model path or Hugging Face name served by every instance; a name not yet in the Hugging Face cache is "
    "fetched once (with the vLLM environment's huggingface_hub) before anything starts.")
_PREFILL = typer.Option("--prefill", min=0, help="Number of prefill instances (default 1; none with --nodes).")
_DECODE = typer.Option("--decode", min=0, help="Number of decode instances (default 1; none with --nodes).")
_NODES = typer.Option(
    "--nodes", min=0,
    help="Pool instances that take both roles (kv_both, prefix caching on), instead of --prefill/--decode or "
    "beside them: the gateway runs each turn on its session's instance or prefills it on another that pulls the "
    "history. Use 2 or more: a single instance serves every turn itself.")
_DEVICE = typer.Option("--device", help="cpu or cuda.")
_VLLM_PYTHON = typer.Option("--vllm-python", help="Python of the vLLM environment (default .venv-vllm).")
_DECODE_TTL = typer.Option("--decode-ttl", help="decoder_kv_blocks_ttl in seconds (engine side).")
_PORT = typer.Option("--port", help="Gateway port; vLLM ports start at port+100.")
_HOST = typer.Option("--host", help="Bind address for every server.")
_VLLM_BASE_PORT = typer.Option(
    "--vllm-base-port",
    help="First vLLM HTTP port; the instances take consecutive ports, prefill first, then decode, then pool "
    "instances (default: --port + 100).")
_SIDE_CHANNEL_BASE_PORT = typer.Option("--side-channel-base-port", help="First NIXL side-channel port.")
_FAILURE_POLICY = typer.Option("--kv-load-failure-policy", help="fail (recommended) or recompute.")
_KV_CACHE_GIB = typer.Option("--kv-cache-gib", help="VLLM_CPU_KVCACHE_SPACE (CPU).")
_CPU_BINDS = typer.Option(
    "--cpu-binds", help="VLLM_CPU_OMP_THREADS_BIND per instance, ';'-separated (P, then D, then pool instances).")
_PREFILL_CACHE = typer.Option(
    "--prefill-prefix-caching/--no-prefill-prefix-caching", metavar=FLAG,
    help="Prefix caching on the prefill instances; off as in vLLM's published reverse-pull runs. Decode and pool "
    "instances keep it either way.")
_WITH_GATEWAY = typer.Option(
    "--gateway/--no-gateway", metavar=FLAG,
    help="Start the kvtether gateway in front; --no-gateway starts only the vLLM instances.")
_GATEWAYS = typer.Option(
    "--gateways", min=1, help="Gateway replicas on consecutive ports from --port (more than one needs --store).")
_STORE = typer.Option(
    "--store", help="Gateway session store: memory (default) or a redis://, rediss:// or unix:// URL of "
    "Redis/Valkey, shared by the gateway replicas.")
_POLICY = typer.Option("--policy", help="Gateway policy: auto | pull | no-pull | reference (default auto).")
_CONFIG = typer.Option(
    "--config",
    help="Gateway TOML config, as for `kvtether serve --config`. kvtether up supplies the cluster (prefill/decode "
    "and pool URLs), --host, --port and the session/engine TTLs (from --decode-ttl) itself; those win over the "
    "file, and so do --policy, --otlp-endpoint and --gateway-set.")
_OTLP_ENDPOINT = typer.Option("--otlp-endpoint", help="Gateway OTLP/HTTP traces endpoint.")
_GATEWAY_LOG_LEVEL = typer.Option(
    "--gateway-log-level",
    help=f"Gateway log level: {' | '.join(LOG_LEVELS)} (default {DEFAULT_GATEWAY_LOG_LEVEL}).")
_GATEWAY_SET = typer.Option(
    "--gateway-set", metavar="KEY=VALUE",
    help="Any other gateway setting (repeatable), over --config: VALUE is read as TOML when it parses "
    "(max_sessions=5000, partial_reuse=false, unidirectional_prefill='[\"http://h:8100\"]'), else as a string.")
_LOG_DIR = typer.Option("--log-dir", help="Per-child log files.")
_JSON = typer.Option("--json/--no-json", metavar=FLAG, help="Print one JSON line with the URLs on stdout.")
_DRY_RUN = typer.Option(
    "--dry-run/--no-dry-run", metavar=FLAG,
    help="Print where the model's files come from (local, cached or to fetch), the commands and env; start nothing.")


def up(
    ctx: typer.Context, model: Annotated[str, _MODEL], prefill: Annotated[int | None, _PREFILL] = None,
    decode: Annotated[int | None, _DECODE] = None, nodes: Annotated[int, _NODES] = 0,
    device: Annotated[str, _DEVICE] = "cpu",
    vllm_python: Annotated[str | None, _VLLM_PYTHON] = None,
    decode_ttl: Annotated[float, _DECODE_TTL] = DEFAULT_DECODE_TTL_S,
    port: Annotated[int, _PORT] = DEFAULT_GATEWAY_PORT, host: Annotated[str, _HOST] = "127.0.0.1",
    vllm_base_port: Annotated[int | None, _VLLM_BASE_PORT] = None,
    side_channel_base_port: Annotated[int, _SIDE_CHANNEL_BASE_PORT] = DEFAULT_SIDE_CHANNEL_BASE_PORT,
    failure_policy: Annotated[str, _FAILURE_POLICY] = "fail", kv_cache_gib: Annotated[int, _KV_CACHE_GIB] = 1,
    cpu_binds: Annotated[str | None, _CPU_BINDS] = None, prefill_cache: Annotated[bool, _PREFILL_CACHE] = True,
    with_gateway: Annotated[bool, _WITH_GATEWAY] = True, gateways: Annotated[int, _GATEWAYS] = 1,
    store: Annotated[str | None, _STORE] = None, policy: Annotated[str | None, _POLICY] = None,
    config: Annotated[Path | None, _CONFIG] = None, otlp_endpoint: Annotated[str | None, _OTLP_ENDPOINT] = None,
    gateway_log_level: Annotated[str | None, _GATEWAY_LOG_LEVEL] = None,
    gateway_set: Annotated[list[str] | None, _GATEWAY_SET] = None, log_dir: Annotated[Path | None, _LOG_DIR] = None,
    as_json: Annotated[bool, _JSON] = False, dry_run: Annotated[bool, _DRY_RUN] = False,
) -> None:
    """Start vLLM prefill/decode instances (bidirectional KV pull), or a pool of instances that take both roles
    (--nodes N), and the kvtether gateway in front.

    Extra vLLM arguments go after `--`, e.g. `kvtether up --model M -- --max-model-len 4096`.
    Gateway settings: --config FILE (as for `kvtether serve`), --policy, --otlp-endpoint, --gateway-log-level
    and --gateway-set KEY=VALUE; all are checked before anything starts.
    """
    flags = UpFlags(**locals())  # first: the parameters are all the locals there are yet
    try:
        opts = cluster_options(flags)
        plan = plan_cluster(opts)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    gateway_cfg = _check_gateway_or_exit(plan)
    files = wanted_files(opts, gateway_cfg.tokenizer if gateway_cfg is not None else None)
    if dry_run:
        sys.stdout.write(dry_run_files(files, python=opts.vllm_python) + dry_run_text(plan))
        if as_json:
            sys.stdout.write(json.dumps(plan.urls()) + "\n")
        return
    asked = _preflight_or_exit(plan, host=host, vllm_python_given=vllm_python is not None)
    console = Console(stderr=True, soft_wrap=True)
    logs = log_dir or Path(tempfile.mkdtemp(prefix="kvtether-up-"))
    raise typer.Exit(run_up(plan, files=files, fetch_python=opts.vllm_python if asked else None, log_dir=logs,
                            as_json=as_json, console=console))


def register(app: typer.Typer) -> None:
    app.command("up", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(up)


def _preflight_or_exit(plan: ClusterPlan, *, host: str, vllm_python_given: bool) -> bool:
    """What would otherwise fail only once the cluster is starting: a vLLM environment without vLLM (or, on CPU,
    without kvtether's plugin, when the engine dies at its first request), and ports something else holds.
    Whether the vLLM environment's python could be asked (else it is a stand-in, which `up` starts anyway, and
    which is not asked to fetch a model either)."""
    python = plan.instances[0].command.argv[0]
    checked = check_vllm_env(python, plugin=plan.device == "cpu", defaulted=not vllm_python_given)
    if checked.problem is not None:
        usage_error(checked.problem)
    if checked.note is not None:
        typer.echo(f"kvtether up: {checked.note}", err=True)
    # (host, port, who listens there, the flag that chose the port)
    listeners = [(host, g.port, g.command.name, "--port") for g in plan.gateways]
    for i in plan.instances:
        listeners.append((host, i.port, f"{i.command.name}'s HTTP server", "--vllm-base-port"))
        side_host = i.command.env.get("VLLM_NIXL_SIDE_CHANNEL_HOST", host)
        listeners.append((side_host, i.side_channel_port, f"{i.command.name}'s NIXL side channel",
                          "--side-channel-base-port"))
    for where, port, who, flag in listeners:
        problem = listen_problem(where, port)
        if problem is not None:
            typer.echo(f"kvtether up: cannot listen on {where}:{port} ({who}, from {flag}): {problem}; "
                       f"{listen_fix(problem, port_flag=flag)}", err=True)
            raise typer.Exit(EXIT_FAILED)
    return checked.note is None


def _check_gateway_or_exit(plan: ClusterPlan) -> GatewayConfig | None:
    from kvtether.gateway.config import ConfigError

    try:
        return check_gateway_config(plan)
    except ConfigError as e:
        msg = f"gateway settings: {e}"
        if plan.gateway is not None and plan.gateway.config_file is not None and "aggregated" in str(e):
            # The file's aggregated nodes meet the instance URLs up supplies: say which side to change.
            msg += (f" (kvtether up starts prefill/decode or pool instances: remove aggregated from "
                    f"{plan.gateway.config_file})")
        usage_error(msg)


def main(argv: Sequence[str] | None = None) -> None:  # pragma: no cover - convenience entry
    app = typer.Typer()
    register(app)
    app(args=list(argv) if argv is not None else None)


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "gateway":
        run_gateway_child(sys.argv[2:])
    else:
        main()
