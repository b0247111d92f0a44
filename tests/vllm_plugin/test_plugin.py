"""kvtether's vLLM general plugin (vllm_plugin/), without vLLM: the NIXL pthrDelay patch on a stand-in
NIXL package, and the AMX permission request."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest
from kvtether import vllm_plugin as P


class _Config:
    pthrDelay = 0


class _FakeBindings:
    def __init__(self) -> None:
        self.seen: list[int] = []

    def nixlAgent(self, name: str, config: Any) -> str:
        self.seen.append(config.pthrDelay)
        return f"agent:{name}"

    other = "forwarded"


def test_parse_delay() -> None:
    assert P.parse_delay(None) is None
    assert P.parse_delay(" ") is None
    assert P.parse_delay("1000") == 1000
    assert P.parse_delay("abc") is None
    assert P.parse_delay("-5") is None


def test_patch_api_module_sets_delay_and_forwards_the_rest() -> None:
    real = _FakeBindings()
    mod = types.ModuleType("fake_api")
    mod.nixlBind = real  # type: ignore[attr-defined]
    assert P.patch_api_module(mod, 1000)
    assert mod.nixlBind.nixlAgent("a", _Config()) == "agent:a"  # type: ignore[attr-defined]
    assert real.seen == [1000]
    assert mod.nixlBind.other == "forwarded"  # type: ignore[attr-defined]
    # Idempotent: a second patch updates the delay instead of wrapping twice.
    assert P.patch_api_module(mod, 250)
    mod.nixlBind.nixlAgent("b", _Config())  # type: ignore[attr-defined]
    assert real.seen == [1000, 250]
    assert not P.patch_api_module(types.ModuleType("not_nixl"), 1000)


def test_import_hook_patches_nixl_api_when_imported_later(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "nixl_cu12"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "_api.py").write_text(
        "class _B:\n"
        "    def nixlAgent(self, name, config):\n"
        "        return config.pthrDelay\n"
        "nixlBind = _B()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("nixl_cu12", "nixl_cu12._api"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    before = list(sys.meta_path)
    monkeypatch.setattr(sys, "meta_path", before)  # restored after the test
    monkeypatch.delenv(P._UCX_RCACHE_ENV, raising=False)
    monkeypatch.setenv(P.ENV_VAR, "1000")
    P.register()
    import nixl_cu12._api as api  # type: ignore[import-not-found]

    assert api.nixlBind.nixlAgent("x", _Config()) == 1000
    assert getattr(api, P._PATCHED_ATTR) == 1000
    import os

    assert os.environ[P._UCX_RCACHE_ENV] == "1024"


def test_register_is_a_no_op_without_its_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(P.ENV_VAR, raising=False)
    monkeypatch.delenv(P.AMX_ENV_VAR, raising=False)
    called: list[bool] = []
    monkeypatch.setattr(P, "request_amx_permission", lambda: called.append(True) or True)
    monkeypatch.setattr(P, "install", lambda delay: called.append(False))
    P.register()
    assert called == []
    monkeypatch.setenv(P.AMX_ENV_VAR, "1")
    P.register()
    assert called == [True]


def test_register_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(delay: int) -> None:
        raise RuntimeError("boom")

    monkeypatch.setenv(P.ENV_VAR, "1000")
    monkeypatch.setattr(P, "install", boom)
    P.register()  # logged, not raised


def test_cpu_has_amx() -> None:
    assert P.cpu_has_amx("processor : 0\nflags : fpu avx512f amx_bf16 amx_tile amx_int8\n")
    assert not P.cpu_has_amx("flags : fpu avx2 avx512f\n")
    assert not P.cpu_has_amx("bugs : amx_tile\n")


def test_request_amx_permission_on_this_machine() -> None:
    """Granted exactly on Linux x86_64 CPUs with AMX (the syscall is real and harmless to repeat)."""
    import platform

    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    want = sys.platform == "linux" and platform.machine() == "x86_64" and P.cpu_has_amx(cpuinfo)
    assert P.request_amx_permission() is want
    assert P.request_amx_permission() is want  # idempotent


def test_shm_recheck_interval_is_shortened_in_vllms_module(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType(P._SHM_MODULE)
    fake.SHM_READER_RECHECK_INTERVAL_MS = 5000  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, P._SHM_MODULE, fake)
    monkeypatch.delenv(P.ENV_VAR, raising=False)
    monkeypatch.delenv(P.AMX_ENV_VAR, raising=False)
    monkeypatch.setenv(P.SHM_RECHECK_ENV_VAR, "50")
    P.register()
    assert fake.SHM_READER_RECHECK_INTERVAL_MS == 50  # type: ignore[attr-defined]
    # A vLLM without the constant is left alone (and nothing raises).
    other = types.ModuleType(P._SHM_MODULE)
    monkeypatch.setitem(sys.modules, P._SHM_MODULE, other)
    assert not P.set_shm_recheck_interval(50)
    assert not hasattr(other, "SHM_READER_RECHECK_INTERVAL_MS")


def test_shm_busy_loop_is_set_on_every_new_spin_condition(monkeypatch: pytest.MonkeyPatch) -> None:
    class SpinCondition:
        def __init__(self, is_reader: bool, context: Any, notify_address: str, busy_loop_s: float = 1) -> None:
            self.busy_loop_s = busy_loop_s

    fake = types.ModuleType(P._SHM_MODULE)
    fake.SpinCondition = SpinCondition  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, P._SHM_MODULE, fake)
    for var in (P.ENV_VAR, P.AMX_ENV_VAR, P.SHM_RECHECK_ENV_VAR):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(P.SHM_BUSY_LOOP_ENV_VAR, "0")
    P.register()
    assert SpinCondition(True, None, "ipc://x").busy_loop_s == 0.0
    assert SpinCondition(True, None, "ipc://x", busy_loop_s=1).busy_loop_s == 0.0  # vLLM's own value overridden
    assert P.set_shm_busy_loop(5)  # a second call retunes the same wrapper instead of wrapping twice
    assert SpinCondition(False, None, "ipc://x").busy_loop_s == 0.005
