"""Checks the commands make before they start anything: can they listen where they were told to, and can the
vLLM environment `kvtether up` was pointed at run vLLM (and, on CPU, kvtether's vLLM plugin).

Each describes a problem in a few words for the command's one-line message, which adds the fix in terms of its
own flags. A failure found here costs the user a second; the same failure after start-up costs a banner that
lies, a half-started cluster, or an engine that dies at its first request.
"""

from __future__ import annotations

import errno
import json
import socket
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

IN_USE = "already in use"
NOT_LOCAL = "not an address of this machine"
PRIVILEGED = "needs privileges (ports below 1024)"


def listen_problem(host: str, port: int) -> str | None:
    """Why a server could not listen on `host:port` (None when it can), found by binding a socket there as the
    servers do (SO_REUSEADDR: a port left in TIME_WAIT by a server that just stopped is free to them)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except OSError as e:
        return describe_bind_error(e)
    except OverflowError:
        return "not a port (0-65535)"
    return None


def describe_bind_error(e: OSError) -> str:
    """The common bind failures in words (the errno text alone names neither the address nor the cause)."""
    if isinstance(e, socket.gaierror):
        return f"unknown host ({e.strerror or e})"
    if e.errno == errno.EADDRINUSE:
        return IN_USE
    if e.errno == errno.EADDRNOTAVAIL:
        return NOT_LOCAL
    if e.errno == errno.EACCES:
        return PRIVILEGED
    return e.strerror or str(e)


def listen_fix(problem: str, *, port_flag: str = "--port", host_flag: str = "--host") -> str:
    """What to do about a `listen_problem`, in terms of the command's own flags."""
    if problem == IN_USE:
        return f"stop what listens there or pass another {port_flag}"
    if problem == PRIVILEGED:
        return f"pass a {port_flag} of 1024 or more"
    if problem == NOT_LOCAL or problem.startswith("unknown host"):
        return f"check {host_flag}"
    return f"check {host_flag} and {port_flag}"


def busy_ports(host: str, ports: Sequence[int]) -> list[tuple[int, str]]:
    """(port, problem) for each of `ports` a server could not listen on; port 0 (any free port) never fails."""
    out = []
    for port in ports:
        if port:
            problem = listen_problem(host, port)
            if problem is not None:
                out.append((port, problem))
    return out


# Run by the vLLM environment's python: prints one JSON line. It only locates vllm (importing it loads torch and
# takes seconds); the plugin is imported for real, since it is light and its import is what vLLM will do.
# Written for any python 3 a vLLM environment may have.
_PROBE = r"""
import importlib, importlib.util, json
out = {"vllm": importlib.util.find_spec("vllm") is not None, "plugin_error": None, "entry_point": None}
try:
    importlib.import_module("kvtether.cli.vllm_plugin")
except Exception as e:
    out["plugin_error"] = "%s: %s" % (type(e).__name__, e)
try:
    from importlib.metadata import entry_points
    out["entry_point"] = any(ep.value.replace(" ", "") == "kvtether.cli.vllm_plugin:register"
                             for ep in entry_points(group="vllm.general_plugins"))
except Exception:
    pass
print(json.dumps(out))
"""


@dataclass(frozen=True)
class VllmEnv:
    """What the vLLM environment's python can do. `missing`: it cannot be run at all. `unknown`: it ran but did
    not answer as a python does (a wrapper or a stand-in), so nothing can be said about it."""

    has_vllm: bool = False
    plugin_error: str | None = None
    # Whether vLLM will find the plugin: the `vllm.general_plugins` entry point that installing kvtether adds
    # (None: this python could not say). Importable without it (e.g. through PYTHONPATH) is not enough.
    entry_point: bool | None = None
    missing: str | None = None
    unknown: str | None = None


def probe_vllm_env(python: str, timeout_s: float = 60.0) -> VllmEnv:
    try:
        proc = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=timeout_s,
                              stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        return VllmEnv(missing="no such file")
    except PermissionError:
        return VllmEnv(missing="not executable")
    except OSError as e:
        return VllmEnv(missing=e.strerror or str(e))
    except subprocess.TimeoutExpired:
        return VllmEnv(unknown=f"no answer within {timeout_s:.0f} s")
    try:
        got = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return VllmEnv(unknown=f"exit code {proc.returncode}: {last}")
    return VllmEnv(has_vllm=bool(got.get("vllm")), plugin_error=got.get("plugin_error"),
                   entry_point=got.get("entry_point"))


def source_tree() -> Path | None:
    """The kvtether checkout this code runs from (an editable install), for `pip install -e`; None otherwise."""
    root = Path(__file__).resolve().parents[1]
    return root if (root / "pyproject.toml").is_file() and (root / "cli" / "vllm_plugin.py").is_file() else None


@dataclass(frozen=True)
class VllmEnvCheck:
    problem: str | None = None  # one line with the fix: start nothing
    note: str | None = None  # the python could not be asked: say so, and start


def check_vllm_env(python: str, *, plugin: bool, defaulted: bool) -> VllmEnvCheck:
    """Whether `kvtether up` can run vLLM with `python` (its vLLM instances' interpreter).

    `plugin`: the instances need kvtether's vLLM plugin (cli/vllm_plugin.py; on CPU, `up` turns its fixes on
    through the environment, and without it the engine dies at its first request). `defaulted`: `python` was
    not given with --vllm-python but chosen (.venv-vllm when there is one, else this interpreter)."""
    if not defaulted:
        given = "(--vllm-python)"
    elif Path(python).parent.parent.name == ".venv-vllm":
        given = "(.venv-vllm, used when no --vllm-python is given)"
    else:
        given = "(no --vllm-python given and no .venv-vllm found, so this interpreter)"
    setup = ("run `bash scripts/setup-vllm-cpu.sh` (CPU: builds .venv-vllm, which `kvtether up` then uses) or pass "
             "--vllm-python with the python of an environment that has vLLM")
    env = probe_vllm_env(python)
    if env.missing is not None:
        return VllmEnvCheck(problem=f"{python} {given}: {env.missing}; {setup}")
    if env.unknown is not None:
        return VllmEnvCheck(note=f"could not check that {python} {given} has vLLM ({env.unknown}); starting anyway")
    if not env.has_vllm:
        return VllmEnvCheck(problem=f"{python} {given} cannot import vllm; {setup}")
    if plugin and (env.plugin_error is not None or env.entry_point is False):
        tree = source_tree()
        install = f"`{python} -m pip install --no-deps -e {tree or '<kvtether checkout>'}`"
        why = (f"cannot import kvtether.cli.vllm_plugin ({env.plugin_error})" if env.plugin_error is not None
               else "has kvtether importable but not installed (no vllm.general_plugins entry point)")
        return VllmEnvCheck(problem=f"--device cpu needs kvtether's vLLM plugin in the vLLM environment, but {python} "
                            f"{given} {why}: install kvtether there with {install} (scripts/setup-vllm-cpu.sh does "
                            "this for .venv-vllm)")
    return VllmEnvCheck()
