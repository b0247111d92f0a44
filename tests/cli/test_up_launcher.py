"""`kvtether up`: pure command construction, and process management with fake children (no vLLM needed)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from kvtether.cli.up.cluster_spec import ChildCommand, ClusterOptions
from kvtether.cli.up.command import running_cluster
from kvtether.cli.up.launcher import dry_run_text, gateway_session_ttl, plan_cluster
from kvtether.cli.up.supervisor import Child, ChildDied, ChildStuck, Supervisor
from kvtether.cli.up.vllm_instance import cpu_binds_for, kv_transfer_config

from tests.support.processes import Spawn, read_line, start_with_sigint_default, start_with_sigint_ignored, wait_exit


def _opts(**kw: object) -> ClusterOptions:
    base: dict[str, object] = {"model": "/m/tiny", "vllm_python": "/v/bin/python", "cpu_count": 2}
    base.update(kw)
    return ClusterOptions(**base)  # type: ignore[arg-type]


def _arg(argv: tuple[str, ...], flag: str) -> str:
    assert argv.count(flag) == 1, f"{flag} must appear exactly once in {argv}"
    return argv[argv.index(flag) + 1]


def test_kv_transfer_config_is_one_compact_json_element() -> None:
    s = kv_transfer_config("prefill", device="cpu", decode_ttl_s=30, failure_policy="fail")
    assert " " not in s
    cfg = json.loads(s)
    assert cfg == {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_producer",
        "kv_buffer_device": "cpu",
        "kv_load_failure_policy": "fail",
        "kv_connector_extra_config": {"bidirectional_kv_xfer": True, "decoder_kv_blocks_ttl": 30},
    }
    d = json.loads(kv_transfer_config("decode", device="cuda", decode_ttl_s=12.5, failure_policy="recompute"))
    assert d["kv_role"] == "kv_consumer"
    assert d["kv_buffer_device"] == "cuda"
    assert d["kv_load_failure_policy"] == "recompute"
    assert d["kv_connector_extra_config"]["decoder_kv_blocks_ttl"] == 12.5
    both = json.loads(kv_transfer_config("decode", device="cpu", decode_ttl_s=1, kv_both=True, recompute_threshold=64))
    assert both["kv_role"] == "kv_both"
    assert both["kv_connector_extra_config"]["kv_recompute_threshold"] == 64
    # A pool instance takes both roles whatever `kv_both` says.
    node = json.loads(kv_transfer_config("node", device="cpu", decode_ttl_s=30))
    assert node["kv_role"] == "kv_both"
    assert node["kv_connector_extra_config"]["bidirectional_kv_xfer"] is True


def test_gateway_ttl_stays_well_below_engine_ttl() -> None:
    assert gateway_session_ttl(480) == 432
    assert gateway_session_ttl(60) == 50
    assert gateway_session_ttl(30) == 20
    assert gateway_session_ttl(20) == 10
    assert gateway_session_ttl(3) == 1
    for ttl in (11, 15, 25, 45, 100, 480, 3600):
        g = gateway_session_ttl(ttl)
        assert g <= 0.9 * ttl and g <= ttl - 10


def test_cpu_binds() -> None:
    assert cpu_binds_for(2, 2) == ["0", "1"]
    assert cpu_binds_for(2, 8) == ["0-3", "4-7"]
    assert cpu_binds_for(3, 8) == ["0-1", "2-3", "4-7"]
    assert cpu_binds_for(3, 2) == ["0", "1", "0"]
    assert cpu_binds_for(1, 1) == ["0"]


def test_cpu_plan_commands_and_env() -> None:
    plan = plan_cluster(_opts(prefill=1, decode=1, decode_ttl_s=30, gateway_port=9000))
    assert [i.command.name for i in plan.instances] == ["prefill-0", "decode-0"]
    p, d = plan.prefill[0], plan.decode[0]
    assert (p.port, d.port) == (9100, 9101)
    assert p.command.url == "http://127.0.0.1:9100"
    for inst, role in ((p, "kv_producer"), (d, "kv_consumer")):
        argv = inst.command.argv
        assert argv[:3] == ("/v/bin/python", "-m", "vllm.entrypoints.openai.api_server")
        assert _arg(argv, "--model") == "/m/tiny"
        assert _arg(argv, "--port") == str(inst.port)
        assert _arg(argv, "--host") == "127.0.0.1"
        for flag in ("--enforce-eager", "--enable-prefix-caching", "--enable-prompt-tokens-details"):
            assert argv.count(flag) == 1
        cfg = json.loads(_arg(argv, "--kv-transfer-config"))
        assert cfg["kv_role"] == role
        assert cfg["kv_buffer_device"] == "cpu"
        assert cfg["kv_connector_extra_config"] == {"bidirectional_kv_xfer": True, "decoder_kv_blocks_ttl": 30}
        env = inst.command.env
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
        assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(inst.side_channel_port)
        assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"
        assert env["KVTETHER_NIXL_PTHR_DELAY_US"] == "1000"
        assert env["KVTETHER_CPU_REQUEST_AMX"] == "1"
        assert env["KVTETHER_VLLM_SHM_RECHECK_MS"] == "50"
        assert env["KVTETHER_VLLM_SHM_BUSY_LOOP_MS"] == "0"
        assert env["HF_HUB_OFFLINE"] == env["TRANSFORMERS_OFFLINE"] == env["VLLM_NO_USAGE_STATS"] == "1"
        assert "CUDA_VISIBLE_DEVICES" not in env
    assert p.side_channel_port != d.side_channel_port
    assert p.command.env["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert d.command.env["VLLM_CPU_OMP_THREADS_BIND"] == "1"


def test_prefill_prefix_caching_can_be_turned_off_on_prefill_only() -> None:
    plan = plan_cluster(_opts(prefill=2, decode=1, prefill_prefix_caching=False))
    for p in plan.prefill:
        assert "--no-enable-prefix-caching" in p.command.argv
        assert "--enable-prefix-caching" not in p.command.argv
    # Decode keeps its prefix cache: decode-local turns and P->D reads of what D already holds depend on it.
    assert "--enable-prefix-caching" in plan.decode[0].command.argv
    assert "--no-enable-prefix-caching" not in plan.decode[0].command.argv


def test_gpu_plan_has_no_cpu_bits() -> None:
    plan = plan_cluster(_opts(prefill=2, decode=2, device="cuda"))
    gpus = [i.command.env["CUDA_VISIBLE_DEVICES"] for i in plan.instances]
    assert gpus == ["0", "1", "2", "3"]
    for i in plan.instances:
        assert "--enforce-eager" not in i.command.argv
        assert "KVTETHER_NIXL_PTHR_DELAY_US" not in i.command.env
        assert "KVTETHER_CPU_REQUEST_AMX" not in i.command.env
        assert "VLLM_CPU_OMP_THREADS_BIND" not in i.command.env
        assert "VLLM_CPU_KVCACHE_SPACE" not in i.command.env
        assert json.loads(_arg(i.command.argv, "--kv-transfer-config"))["kv_buffer_device"] == "cuda"
    assert len({i.port for i in plan.instances}) == 4
    assert len({i.side_channel_port for i in plan.instances}) == 4


def test_extra_args_are_appended_verbatim_and_eager_not_duplicated() -> None:
    plan = plan_cluster(_opts(extra_vllm_args=["--max-model-len", "2048", "--enforce-eager"]))
    argv = plan.prefill[0].command.argv
    assert argv[-3:] == ("--max-model-len", "2048", "--enforce-eager")
    assert argv.count("--enforce-eager") == 1


def test_gateway_command_in_front() -> None:
    plan = plan_cluster(_opts(prefill=2, decode=1, decode_ttl_s=60, gateway_port=8000, gateway_python="/p/python"))
    gw = plan.gateway
    assert gw is not None
    assert gw.session_ttl_s == 50
    assert gw.prefill_urls == ("http://127.0.0.1:8100", "http://127.0.0.1:8101")
    assert gw.decode_urls == ("http://127.0.0.1:8102",)
    argv = gw.command.argv
    assert argv == ("/p/python", "-m", "kvtether.cli.up.command", "gateway", argv[4], "--log-level", "warning")
    assert gw.child_args == argv[4:]
    settings = json.loads(argv[4])
    assert settings == {
        "prefill": list(gw.prefill_urls),
        "decode": list(gw.decode_urls),
        "host": "127.0.0.1",
        "port": 8000,
        "session_ttl_s": 50,
        "engine_kv_ttl_s": 60,
        "tokenizer": "/m/tiny",  # the guard tokenizes with the served model's own tokenizer
        "chunk_tokens": 2048,  # vLLM's step budget on CPU (step_budget.py)
    }
    # The gateway accepts exactly these settings (its TTL below the engine's).
    from kvtether.gateway.config import load_config

    cfg = load_config(**settings)
    assert cfg.session_ttl_s < cfg.engine_kv_ttl_s
    assert plan.urls() == {
        "gateway": "http://127.0.0.1:8000",
        "prefill": list(gw.prefill_urls),
        "decode": list(gw.decode_urls),
    }
    assert plan_cluster(_opts(gateway=False)).gateway is None


def test_gateway_tokenizer_follows_the_served_model_unless_set(tmp_path: Path) -> None:
    def tokenizer(**kw: object) -> object:
        gw = plan_cluster(_opts(**kw)).gateway
        assert gw is not None
        return json.loads(gw.child_args[0]).get("tokenizer")

    assert tokenizer() == "/m/tiny"
    assert tokenizer(extra_vllm_args=["--tokenizer", "/t/tok"]) == "/t/tok"
    assert tokenizer(extra_vllm_args=["--tokenizer=/t/tok2"]) == "/t/tok2"
    assert tokenizer(gateway_settings={"tokenizer": ""}) == ""  # --gateway-set tokenizer= turns it off
    with_file = tmp_path / "gw.toml"
    with_file.write_text('[gateway]\ntokenizer = "/f/tok"\n')
    assert tokenizer(gateway_config_file=str(with_file)) is None  # the file's own setting stands
    without = tmp_path / "other.toml"
    without.write_text('[gateway]\npolicy = "pull"\n')
    assert tokenizer(gateway_config_file=str(without)) == "/m/tiny"


def test_gateway_replicas_on_consecutive_ports() -> None:
    plan = plan_cluster(_opts(gateway_port=8000, gateways=3, gateway_settings={"store": "redis://r:6379/0"}))
    assert [g.port for g in plan.gateways] == [8000, 8001, 8002] and plan.gateway is plan.gateways[0]
    assert [g.command.name for g in plan.gateways] == ["gateway", "gateway-1", "gateway-2"]
    for g in plan.gateways:
        settings = json.loads(g.child_args[0])
        assert settings["port"] == g.port and settings["store"] == "redis://r:6379/0"
        assert g.command.argv[4:] == g.child_args
    assert plan.commands()[-3:] == [g.command for g in plan.gateways]
    assert plan.urls()["gateways"] == ["http://127.0.0.1:8000", "http://127.0.0.1:8001", "http://127.0.0.1:8002"]
    assert "gateways" not in plan_cluster(_opts()).urls()
    with pytest.raises(ValueError, match="collide with a vLLM port"):
        plan_cluster(_opts(gateway_port=8000, gateways=101))
    with pytest.raises(ValueError, match="at least one gateway"):
        plan_cluster(_opts(gateways=0))


def test_pool_plan_starts_instances_that_take_both_roles() -> None:
    """`--nodes 3`: three kv_both instances with prefix caching, and the gateway given them as its pool."""
    plan = plan_cluster(_opts(nodes=3, cpu_count=6, decode_ttl_s=60, gateway_port=8000,
                              prefill_prefix_caching=False))  # fmt: skip
    assert plan.prefill == () and plan.decode == ()
    assert [i.command.name for i in plan.instances] == ["node-0", "node-1", "node-2"]
    assert plan.instances == plan.nodes
    assert [i.port for i in plan.nodes] == [8100, 8101, 8102]
    assert [i.side_channel_port for i in plan.nodes] == [5600, 5601, 5602]
    assert [i.command.env["VLLM_CPU_OMP_THREADS_BIND"] for i in plan.nodes] == ["0-1", "2-3", "4-5"]
    for inst in plan.nodes:
        argv = inst.command.argv
        assert argv.count("--enable-prefix-caching") == 1  # --no-prefill-prefix-caching is for prefill only
        assert "--no-enable-prefix-caching" not in argv
        cfg = json.loads(_arg(argv, "--kv-transfer-config"))
        assert cfg["kv_role"] == "kv_both"
        assert cfg["kv_connector_extra_config"] == {"bidirectional_kv_xfer": True, "decoder_kv_blocks_ttl": 60}
        assert inst.command.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(inst.side_channel_port)
    urls = [str(i.command.url) for i in plan.nodes]
    assert urls == ["http://127.0.0.1:8100", "http://127.0.0.1:8101", "http://127.0.0.1:8102"]
    gw = plan.gateway
    assert gw is not None
    assert (gw.prefill_urls, gw.decode_urls, gw.node_urls) == ((), (), tuple(urls))
    settings = json.loads(gw.child_args[0])
    assert settings["nodes"] == urls
    assert settings["prefill"] == settings["decode"] == []
    from kvtether.gateway.config import load_config

    cfg = load_config(**settings)
    assert (cfg.nodes, cfg.prefill, cfg.decode) == (urls, [], [])
    assert plan.urls() == {"gateway": "http://127.0.0.1:8000", "prefill": [], "decode": [], "nodes": urls}
    assert "# node-2  (http://127.0.0.1:8102)" in dry_run_text(plan)


def test_pool_instances_may_stand_beside_prefill_and_decode() -> None:
    """Asked for beside --nodes, prefill and decode instances come first; the gateway takes all three kinds."""
    plan = plan_cluster(_opts(prefill=1, decode=1, nodes=2, cpu_count=4, gateway_port=8000))
    assert [i.command.name for i in plan.instances] == ["prefill-0", "decode-0", "node-0", "node-1"]
    assert [i.port for i in plan.instances] == [8100, 8101, 8102, 8103]
    assert len({i.side_channel_port for i in plan.instances}) == 4
    assert [i.command.env["VLLM_CPU_OMP_THREADS_BIND"] for i in plan.instances] == ["0", "1", "2", "3"]
    roles = [json.loads(_arg(i.command.argv, "--kv-transfer-config"))["kv_role"] for i in plan.instances]
    assert roles == ["kv_producer", "kv_consumer", "kv_both", "kv_both"]
    gw = plan.gateway
    assert gw is not None
    from kvtether.gateway.config import load_config

    cfg = load_config(**json.loads(gw.child_args[0]))
    assert cfg.prefill == ["http://127.0.0.1:8100"] and cfg.decode == ["http://127.0.0.1:8101"]
    assert cfg.nodes == ["http://127.0.0.1:8102", "http://127.0.0.1:8103"]
    # Beside pool instances, prefill and decode are each none unless asked for.
    only_p = plan_cluster(_opts(prefill=1, nodes=2))
    assert [i.command.name for i in only_p.instances] == ["prefill-0", "node-0", "node-1"]
    with pytest.raises(ValueError, match="--cpu-binds needs 3 entries"):
        plan_cluster(_opts(nodes=3, cpu_binds=["0", "1"]))


def test_without_nodes_a_prefill_decode_cluster_as_before() -> None:
    plan = plan_cluster(_opts())
    assert [i.command.name for i in plan.instances] == ["prefill-0", "decode-0"]
    assert plan.nodes == ()
    assert "nodes" not in plan.urls()
    gw = plan.gateway
    assert gw is not None and gw.node_urls == ()
    assert "nodes" not in json.loads(gw.child_args[0])
    assert _opts(prefill=2, decode=3).prefill_count == 2 and _opts().decode_count == 1
    # A prefill/decode pair that both take both roles (as the real-vLLM both-roles tests start it).
    both = plan_cluster(_opts(kv_both=True))
    assert [i.command.name for i in both.instances] == ["prefill-0", "decode-0"]
    assert {json.loads(_arg(i.command.argv, "--kv-transfer-config"))["kv_role"] for i in both.instances} == {"kv_both"}
    with pytest.raises(ValueError, match="or pool instances"):
        plan_cluster(_opts(decode=0))
    with pytest.raises(ValueError, match="not be negative"):
        plan_cluster(_opts(nodes=-1))
    with pytest.raises(ValueError, match="pool instances"):
        plan_cluster(_opts(nodes=0, prefill=0, decode=0))


def test_plan_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        plan_cluster(_opts(prefill=0))
    with pytest.raises(ValueError):
        plan_cluster(_opts(decode_ttl_s=0))
    with pytest.raises(ValueError):
        plan_cluster(_opts(gateway_port=8100, vllm_base_port=8099))
    with pytest.raises(ValueError):
        plan_cluster(_opts(cpu_binds=["0"]))
    with pytest.raises(ValueError):
        plan_cluster(_opts(vllm_base_port=5600))


def test_dry_run_text_is_copy_pasteable() -> None:
    plan = plan_cluster(_opts(decode_ttl_s=30))
    text = dry_run_text(plan)
    assert "# prefill-0  (http://127.0.0.1:8100)" in text
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT=5600" in text
    # The JSON is shell-quoted as one word.
    line = next(ln for ln in text.splitlines() if "prefill-0" not in ln and "kv_producer" in ln)
    import shlex

    words = shlex.split(line)
    cfg = json.loads(words[words.index("--kv-transfer-config") + 1])
    assert cfg["kv_role"] == "kv_producer"


def test_cli_dry_run_json() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "from kvtether.cli.up.command import main; main()",
            "--model",
            "/m/tiny",
            "--decode-ttl",
            "30",
            "--vllm-python",
            "/v/python",
            "--dry-run",
            "--json",
            "--no-prefill-prefix-caching",
            "--",
            "--max-model-len",
            "1024",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    assert "--max-model-len 1024" in out
    blocks = out.split("# ")
    assert "--no-enable-prefix-caching" in next(b for b in blocks if b.startswith("prefill-0"))
    assert "--enable-prefix-caching" in next(b for b in blocks if b.startswith("decode-0"))
    assert json.loads(out.strip().splitlines()[-1])["prefill"] == ["http://127.0.0.1:8100"]


# ---- process management with fake servers ------------------------------------------------------------

FAKE_SERVER = textwrap.dedent(
    """
    import http.server, os, subprocess, sys, time
    port = int(sys.argv[sys.argv.index("--port") + 1])
    # A grandchild in the same process group, like vLLM's engine core: it must not outlive the test.
    g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(os.environ["FAKE_PIDS"], "a") as f:
        f.write(f"{os.getpid()} {g.pid}\\n")
    die_after = float(os.environ.get("FAKE_DIE_AFTER", "0"))
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
        def log_message(self, *a):
            pass
    srv = http.server.HTTPServer(("127.0.0.1", port), H)
    srv.timeout = 0.2
    t0 = time.time()
    while not die_after or time.time() - t0 < die_after:
        srv.handle_request()
    sys.exit(3)
    """
)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _free_ports(offsets: tuple[int, ...], extra: int = 1) -> tuple[int, list[int]]:
    """A base port with base + each offset free, and `extra` more free ports outside that set. Two
    independent `_free_port()` calls can collide (the gateway's port on base + 1, a side channel taken)."""
    import socket

    for _ in range(50):
        base = _free_port()
        wanted = [base + o for o in offsets]
        try:
            with contextlib.ExitStack() as stack:
                for port in wanted:
                    s = stack.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
                others: list[int] = []
                while len(others) < extra:
                    s = stack.enter_context(socket.socket())
                    s.bind(("127.0.0.1", 0))
                    port = int(s.getsockname()[1])
                    if port not in wanted:
                        others.append(port)
            return base, others
        except OSError:
            continue
    raise RuntimeError("no free port block")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); check its state.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _wait_dead(pids: list[int], timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if _alive(p)]
        if not left:
            return []
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _fake_cmd(tmp: Path, name: str, pids: Path, die_after: float = 0) -> ChildCommand:
    script = tmp / "fake_server.py"
    script.write_text(FAKE_SERVER)
    port = _free_port()
    env = {"FAKE_PIDS": str(pids)}
    if die_after:
        env["FAKE_DIE_AFTER"] = str(die_after)
    return ChildCommand(
        name=name, argv=(sys.executable, str(script), "--port", str(port)), env=env, url=f"http://127.0.0.1:{port}"
    )


def _all_pids(pids: Path) -> list[int]:
    return [int(x) for x in pids.read_text().split()] if pids.exists() else []


def test_supervisor_stops_children_and_grandchildren(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    sup = Supervisor(log_dir=tmp_path / "logs")
    a = sup.start(_fake_cmd(tmp_path, "a", pids))
    b = sup.start(_fake_cmd(tmp_path, "b", pids))
    sup.wait_healthy(a, timeout_s=30)
    sup.wait_healthy(b, timeout_s=30)
    all_pids = _all_pids(pids)
    assert len(all_pids) == 4 and all(_alive(p) for p in all_pids)
    sup.stop_all()
    assert _wait_dead(all_pids) == []
    assert sup.children == []
    sup.stop_all()  # idempotent


def test_one_child_dying_stops_the_others(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    cmds = [_fake_cmd(tmp_path, "steady", pids), _fake_cmd(tmp_path, "flaky", pids, die_after=1.0)]

    plan = SimpleNamespace(instances=[SimpleNamespace(command=c) for c in cmds], gateway=None)
    with pytest.raises(ChildDied) as ei, running_cluster(plan, log_dir=tmp_path / "logs") as sup:  # type: ignore[arg-type]
        while True:
            sup.check()
            time.sleep(0.1)
    assert ei.value.name == "flaky"
    assert ei.value.returncode == 3
    assert _wait_dead(_all_pids(pids)) == []


def test_a_child_that_logs_a_taken_port_fails_its_start_at_once_not_at_the_health_timeout(tmp_path: Path) -> None:
    """vLLM's API server stays up, never healthy, when a worker cannot bind its NIXL side channel: the start
    fails on that log line, naming the child and the line, instead of waiting out the health timeout."""
    line = "zmq.error.ZMQError: Address already in use (addr='tcp://127.0.0.1:38535')"
    hung = f"import sys, time; print('starting', flush=True); time.sleep(0.5); print({line!r}, flush=True); "
    hung += "time.sleep(600)"
    sup = Supervisor(log_dir=tmp_path / "logs")
    port = _free_port()
    child = sup.start(ChildCommand(name="prefill-0", argv=(sys.executable, "-c", hung), env={},
                                   url=f"http://127.0.0.1:{port}"))
    try:
        with pytest.raises(ChildStuck) as ei:
            sup.wait_healthy(child, timeout_s=60, interval_s=0.1)
        assert ei.value.name == "prefill-0" and ei.value.line == line
        assert isinstance(ei.value, ChildDied)  # `up` reports it as it does a death: the message and the log's tail
        assert child.alive()  # it had not exited: only its log told
    finally:
        sup.stop_all()


def test_a_taken_port_in_a_log_is_found_however_the_lines_arrive(tmp_path: Path) -> None:
    log = tmp_path / "node.log"
    child = Child(command=ChildCommand(name="n", argv=("x",), env={}), proc=None, log_path=log)  # type: ignore[arg-type]
    assert child.stuck_line() is None  # no log yet
    log.write_bytes(b"INFO starting\nERROR bind: Address alre")
    assert child.stuck_line() is None  # half a line: not yet
    with open(log, "ab") as f:
        f.write(b"ady in use\nINFO more\n")
    assert child.stuck_line() == "ERROR bind: Address already in use"
    assert child.stuck_line() is None  # each line once


def test_a_second_stop_signal_hurries_stop_all_instead_of_breaking_it_off(spawn: Spawn, tmp_path: Path) -> None:
    """A child that ignores SIGTERM waits out the stop timeout before its SIGKILL; a stop signal meanwhile (a
    second Ctrl-C) must cut that short, not raise out of stop_all and leave the child behind. In a process of
    its own: the signal goes to the process that stops."""
    code = textwrap.dedent(
        """
        import json, os, signal, sys, threading, time
        from pathlib import Path
        from kvtether.cli.up.cluster_spec import ChildCommand
        from kvtether.cli.up.supervisor import Supervisor
        log_dir = Path(sys.argv[1])
        stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); "
        stubborn += "time.sleep(600)"
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as `up` has a handler of its own
        sup = Supervisor(log_dir=log_dir, stop_timeout_s=120)
        child = sup.start(ChildCommand(name="stubborn", argv=(sys.executable, "-c", stubborn), env={}, url=None))
        while "ready" not in (log_dir / "stubborn.log").read_text():
            time.sleep(0.05)
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        t0 = time.monotonic()
        try:
            sup.stop_all()
            error = None
        except BaseException as e:
            error = repr(e)
        print(json.dumps({"took": time.monotonic() - t0, "error": error, "pid": child.proc.pid,
                          "rc": child.proc.poll()}), flush=True)
        """
    )
    proc = spawn([sys.executable, "-c", code, str(tmp_path / "logs")], stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=180)
    got = json.loads(out)
    try:
        assert got["error"] is None
        assert got["took"] < 60, got  # cut short: not the 120 s stop timeout, however busy the machine
        assert got["rc"] == -signal.SIGKILL
        assert _wait_dead([got["pid"]]) == []
    finally:  # a broken-off stop_all leaves the child in a session of its own, where no teardown finds it
        if _alive(got["pid"]):
            os.kill(got["pid"], signal.SIGKILL)


@pytest.mark.parametrize(("sig", "with_gateway", "sigint_ignored"),
                         [(signal.SIGINT, True, False), (signal.SIGTERM, False, False), (signal.SIGINT, False, True)],
                         ids=["SIGINT-gateway", "SIGTERM", "SIGINT-background-job"])
def test_cli_up_stops_everything_on_signal(spawn: Spawn, tmp_path: Path, sig: int, with_gateway: bool,
                                           sigint_ignored: bool) -> None:
    """`kvtether up` end to end with a fake vLLM (and the real gateway in front): JSON on stdout once all are
    healthy; Ctrl-C/SIGTERM leaves no process behind, also when `up` started with SIGINT ignored (a background
    job of a non-interactive shell)."""
    pids = tmp_path / "pids"
    fake_py = tmp_path / "fake-python"
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    # Stands in for the vLLM venv's python: ignores `-m vllm...`, serves /health on --port.
    fake_py.write_text(f"#!/bin/sh\nexec {sys.executable} {script} \"$@\"\n")
    fake_py.chmod(0o755)
    # P and D on base and base + 1, their NIXL side channels on base + 50 and base + 51, the gateway apart.
    base, (gw_port,) = _free_ports((0, 1, 50, 51))
    proc = spawn(
        [
            sys.executable, "-c", "from kvtether.cli.up.command import main; main()",
            "--model", "m", "--vllm-python", str(fake_py), "--json", "--decode-ttl", "30",
            *([] if with_gateway else ["--no-gateway"]),
            "--vllm-base-port", str(base), "--port", str(gw_port),
            "--side-channel-base-port", str(base + 50), "--log-dir", str(tmp_path / "logs"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "FAKE_PIDS": str(pids)},
        text=True,
        preexec_fn=start_with_sigint_ignored if sigint_ignored else start_with_sigint_default,
    )  # fmt: skip
    try:
        line = read_line(proc, 120)
        if not line:  # `up` exited before its JSON line: say why
            proc.wait(timeout=30)
            pytest.fail(f"kvtether up exited {proc.returncode}: {proc.stderr.read() if proc.stderr else ''}")
        urls = json.loads(line)
        assert urls["gateway"] == (f"http://127.0.0.1:{gw_port}" if with_gateway else None)
        if with_gateway:
            import httpx

            assert httpx.get(urls["gateway"] + "/health", trust_env=False).status_code == 200
        assert urls["prefill"] == [f"http://127.0.0.1:{base}"]
        assert urls["decode"] == [f"http://127.0.0.1:{base + 1}"]
        all_pids = _all_pids(pids)
        assert len(all_pids) == 4
        proc.send_signal(sig)
        rc = wait_exit(proc, 30)
        assert rc is not None, f"kvtether up still runs 30 s after {signal.Signals(sig).name}"
        assert rc == 0, proc.stderr.read() if proc.stderr else ""
        assert _wait_dead(all_pids) == []
        if with_gateway:
            import httpx

            with pytest.raises(httpx.ConnectError):
                httpx.get(urls["gateway"] + "/health", trust_env=False)
    finally:
        # The spawn fixture kills `up` and the tree below it while `up` lives; if `up` is gone, the fakes' own
        # children (they have no death signal) are no longer below it.
        for p in _all_pids(pids):
            if _alive(p):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGKILL)


def test_children_get_sigterm_when_the_supervisor_is_killed(tmp_path: Path) -> None:
    """Even a SIGKILLed `kvtether up` leaves no server behind: each child leader has PR_SET_PDEATHSIG."""
    pids = tmp_path / "pids"
    cmd = _fake_cmd(tmp_path, "orphan", pids)
    code = textwrap.dedent(
        f"""
        import time
        from kvtether.cli.up.cluster_spec import ChildCommand
        from kvtether.cli.up.supervisor import Supervisor
        sup = Supervisor()
        c = sup.start(ChildCommand(name="x", argv={cmd.argv!r}, env={dict(cmd.env)!r}, url={cmd.url!r}))
        sup.wait_healthy(c, timeout_s=30)
        print("ready", flush=True)
        time.sleep(600)
        """
    )
    sup = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert sup.stdout is not None
        assert sup.stdout.readline().strip() == "ready"
        leader = _all_pids(pids)[0]
        assert _alive(leader)
        sup.kill()
        sup.wait(timeout=10)
        assert _wait_dead([leader]) == []
    finally:
        if sup.poll() is None:
            sup.kill()
        for p in _all_pids(pids):  # the fake's own grandchild has no death signal: clean it up here
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
