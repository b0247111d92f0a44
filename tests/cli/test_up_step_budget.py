"""`kvtether up` tells the gateway the step budget of the vLLM instances it starts (`chunk_tokens` = their
`--max-num-batched-tokens`, given or vLLM's default), unless the user set it; the gateway prices prefills in
those steps."""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

import pytest
from kvtether.cli.main import app
from kvtether.cli.up import command as cmd_up
from kvtether.cli.up import step_budget as sb
from kvtether.cli.up.cluster_spec import ClusterOptions, GpuInfo
from kvtether.cli.up.gateway_child import gateway_child_config
from kvtether.cli.up.launcher import gateway_config, plan_cluster
from typer.testing import CliRunner

H100 = GpuInfo(81559, "NVIDIA H100 80GB HBM3")
H200 = GpuInfo(143771, "NVIDIA H200")
B200 = GpuInfo(183359, "NVIDIA B200")
A100_80 = GpuInfo(81920, "NVIDIA A100-SXM4-80GB")
L4 = GpuInfo(23034, "NVIDIA L4")


@pytest.mark.parametrize(("args", "device", "gpu", "budget"), [
    ((), "cuda", H100, 8192),
    ((), "cuda", H200, 8192),
    ((), "cuda", B200, 16384),
    ((), "cuda", A100_80, 2048),  # vLLM keeps A100s small: larger steps cost them throughput
    ((), "cuda", L4, 2048),
    (("--performance-mode", "throughput"), "cuda", H200, 16384),
    (("--max-num-batched-tokens", "4096"), "cuda", H200, 4096),
    (("--max_num_batched_tokens=12288", "--performance-mode", "throughput"), "cuda", H200, 12288),
    ((), "cuda", None, None),  # vLLM's pick depends on a GPU not known here
    ((), "cpu", None, 2048),
    (("--tensor-parallel-size", "2", "--pipeline-parallel-size", "2"), "cpu", None, 8192),
    (("--max-num-batched-tokens", "lots"), "cpu", None, None),
], ids=lambda x: str(x))
def test_the_budget_is_the_flag_else_vllms_default_for_the_device(args: tuple[str, ...], device: str,
                                                                   gpu: GpuInfo | None, budget: int | None) -> None:
    assert sb.vllm_step_budget(args, device, gpu) == budget  # type: ignore[arg-type]


def test_nvidia_smis_line_is_read_and_its_absence_is_no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    assert sb.parse_gpu_line("143771, NVIDIA H200\n") == H200
    assert sb.parse_gpu_line("") is None and sb.parse_gpu_line("[N/A], X") is None

    def missing(*_a: object, **_kw: object) -> None:
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(subprocess, "run", missing)
    assert sb.query_gpu() is None


def test_the_gateway_gets_the_instances_budget_unless_the_user_set_one(tmp_path: Path) -> None:
    opts = ClusterOptions(model="m", cpu_count=2, device="cuda", gpu=H200)
    assert gateway_config(opts, ["http://p"], ["http://d"], 50.0)["chunk_tokens"] == 8192
    plan = plan_cluster(ClusterOptions(model="m", cpu_count=2, extra_vllm_args=("--max-num-batched-tokens", "512")))
    assert plan.gateway is not None
    assert gateway_child_config(plan.gateway.child_args)[0].chunk_tokens == 512
    # The user's word wins: --gateway-set, or the config file.
    mine = ClusterOptions(model="m", cpu_count=2, device="cuda", gpu=H200, gateway_settings={"chunk_tokens": 1024})
    assert gateway_config(mine, ["http://p"], ["http://d"], 50.0)["chunk_tokens"] == 1024
    (tmp_path / "gw.toml").write_text("[gateway]\nchunk_tokens = 3000\n")
    filed = ClusterOptions(model="m", cpu_count=2, device="cuda", gpu=H200,
                           gateway_config_file=str(tmp_path / "gw.toml"))
    assert "chunk_tokens" not in gateway_config(filed, ["http://p"], ["http://d"], 50.0)
    # A GPU not known: the gateway keeps its own default rather than a guess.
    unknown = ClusterOptions(model="m", cpu_count=2, device="cuda")
    assert "chunk_tokens" not in gateway_config(unknown, ["http://p"], ["http://d"], 50.0)


def test_up_on_cuda_asks_nvidia_smi_and_the_dry_run_shows_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kvtether.cli.up.flags.query_gpu", lambda: B200)
    monkeypatch.setattr(cmd_up, "run_up", lambda *_a, **_kw: 0)
    r = CliRunner().invoke(app, ["up", "--model", "/m/tiny", "--vllm-python", "/v/python", "--device", "cuda",
                                 "--dry-run"])
    assert r.exit_code == 0, r.stderr
    lines = r.stdout.splitlines()
    line = lines[next(i for i, ln in enumerate(lines) if ln.startswith("# gateway")) + 1]
    assert json.loads(shlex.split(line)[4])["chunk_tokens"] == 16384
