"""How many tokens one engine step of the vLLM instances `up` starts takes (`--max-num-batched-tokens`), so that the
gateway's `chunk_tokens` says the same.

The gateway prices a local prefill (and a pool instance's prefill leg) in steps of `chunk_tokens`: an answer
decoding through any part of a step takes all of it. With the gateway's default (2,048) against an H200's 8,192, a
5k-token prefill was planned as three steps of a third of its stall each, when it runs as one. The gateway cannot
read the value from vLLM (its `/server_info` is served in development mode only), but `up` knows what it starts.

vLLM 0.32's own default for its OpenAI server (``EngineArgs.get_batch_defaults``), when the flag is not given:
16,384 on a GPU of at least 160 GiB (B200, B300); 8,192 on one of at least 70 GiB that is not an A100 (H100, H200);
2,048 on others; 2,048 × the world size (tensor × pipeline parallel) on CPU; doubled with ``--performance-mode
throughput``. vLLM reads device 0's total memory and name: so does :func:`query_gpu`, through ``nvidia-smi``.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence

from kvtether.cli.up.cluster_spec import Device, GpuInfo
from kvtether.cli.up.vllm_instance import vllm_arg

_GIB_MIB = 1024

def vllm_step_budget(args: Sequence[str], device: Device, gpu: GpuInfo | None) -> int | None:
    """The instances' tokens per engine step: the flag when given, else vLLM's default for `device` (and `gpu`);
    None where that default depends on a GPU not known here."""
    given = vllm_arg(args, "--max-num-batched-tokens")
    if given is not None:
        try:
            value = int(given)
        except ValueError:
            return None  # vLLM refuses it at start-up and says why; the gateway keeps its default meanwhile
        return value if value > 0 else None
    if device == "cpu":
        budget = 2048 * _world_size(args)
    elif gpu is None:
        return None
    elif gpu.memory_mib >= 160 * _GIB_MIB:
        budget = 16384
    elif gpu.memory_mib >= 70 * _GIB_MIB and "a100" not in gpu.name.lower():
        budget = 8192
    else:
        budget = 2048
    return budget * 2 if vllm_arg(args, "--performance-mode") == "throughput" else budget


def _world_size(args: Sequence[str]) -> int:
    size = 1
    for flag in ("--tensor-parallel-size", "--pipeline-parallel-size"):
        value = vllm_arg(args, flag)
        if value is not None and value.isdigit() and int(value) > 0:
            size *= int(value)
    return size


def query_gpu(timeout_s: float = 10.0) -> GpuInfo | None:
    """Device 0's memory and name from ``nvidia-smi``; None without one (or when it fails)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total,name", "--format=csv,noheader,nounits",
                              "--id=0"], capture_output=True, text=True, timeout=timeout_s, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_gpu_line(out)


def parse_gpu_line(text: str) -> GpuInfo | None:
    """``81559, NVIDIA H100 80GB HBM3`` (nvidia-smi's CSV without header or units) -> GpuInfo."""
    first = text.strip().splitlines()[0] if text.strip() else ""
    memory, _, name = first.partition(",")
    if not memory.strip().isdigit():
        return None
    return GpuInfo(int(memory.strip()), name.strip())
