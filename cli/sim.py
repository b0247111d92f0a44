"""``kvtether sim``: run a simulated vLLM prefill/decode cluster on local ports until Ctrl-C.

With ``--json`` the first line on stdout is ``{"prefill": [...], "decode": [...], "aggregated": [...]}``
so scripts can start it in the background and read where the nodes listen.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys

import typer
from kvtether.cli.common.exits import EXIT_FAILED, EXIT_USAGE
from kvtether.cli.common.failures import fail
from kvtether.cli.common.options import FLAG
from kvtether.cli.common.ports import IN_USE, busy_ports, describe_bind_error, listen_fix
from kvtether.cli.common.signals import STOP_SIGNALS, stop_signals_interrupt
from kvtether.sim.cluster import ClusterSpec, SimCluster
from kvtether.sim.config import EMULATED_VERSIONS, FAILURE_POLICIES
from kvtether.sim.presets import PRESETS, UnknownPreset, get_preset
from kvtether.sim.template import TOOL_FORMATS
from rich.console import Console
from rich.table import Table


def _table(cluster: SimCluster) -> Table:
    spec = cluster.spec
    table = Table(title=f"kvtether sim — preset {spec.preset}, speed ×{spec.speed:g}, vLLM {spec.emulate}")
    for col in ("role", "url", "engine id", "bidirectional", "prefix cache", "tool calls"):
        table.add_column(col)
    for node in cluster.nodes:
        table.add_row(node.cfg.role, node.url, node.cfg.engine_id[:8], "on" if node.cfg.bidirectional else "off",
                      "on" if node.cfg.enable_prefix_caching else "off", node.tool_format)
    return table


async def _serve(spec: ClusterSpec, as_json: bool) -> None:
    """Serve until SIGINT or SIGTERM: either cancels this task, and the cluster closes its nodes on the way out.

    The loop's handlers replace whatever disposition the process inherited (an ignored SIGINT included). A second
    signal cancels again, which cuts a slow shutdown short."""
    main = asyncio.current_task()
    loop = asyncio.get_running_loop()
    if main is not None:
        for sig in STOP_SIGNALS:
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, main.cancel)
    with contextlib.suppress(asyncio.CancelledError):
        async with SimCluster(spec) as cluster:
            if as_json:
                sys.stdout.write(json.dumps(cluster.urls()) + "\n")
                sys.stdout.flush()
            else:
                err = Console(stderr=True)
                err.print(_table(cluster))
                err.print("Ctrl-C to stop.")
            await asyncio.Event().wait()


# The command's options, in the order of its help.
_PREFILL = typer.Option(1, "--prefill", min=0, help="Prefill nodes.")
_DECODE = typer.Option(1, "--decode", min=0, help="Decode nodes.")
_AGGREGATED = typer.Option(0, "--aggregated", min=0, help="Aggregated (kv_both) nodes: replicas, or a pool's instances "
                           "(kvtether serve --node).")
_PRESET = typer.Option("toy", "--preset", help=f"Model/hardware preset ({', '.join(sorted(PRESETS))}).")
_SPEED = typer.Option(1.0, "--speed", min=0.001, help="Clock speed-up (simulated s per real s).")
_HOST = typer.Option("127.0.0.1", "--host", help="Interface to listen on.")
_PORT = typer.Option(0, "--port", min=0, help="First node's port; the others follow (0: free ports).")
_EMULATE = typer.Option("0.33", "--emulate", help="vLLM version to emulate: 0.32 or 0.33.")
_DECODE_TTL = typer.Option(480.0, "--decode-ttl", help="decoder_kv_blocks_ttl, simulated seconds.")
_THRESHOLD = typer.Option(64, "--recompute-threshold", help="kv_recompute_threshold, tokens.")
_FAILURE_POLICY = typer.Option("fail", "--failure-policy", help="kv_load_failure_policy.")
_BIDIRECTIONAL = typer.Option(
    True, "--bidirectional/--no-bidirectional", metavar=FLAG,
    help="bidirectional_kv_xfer on the nodes (decode keeps KV and hands back a handle P can pull).")
_PREFILL_PREFIX_CACHING = typer.Option(
    True, "--prefill-prefix-caching/--no-prefill-prefix-caching", metavar=FLAG,
    help="Prefix caching on the prefill nodes (default on, vLLM's default); off is vLLM's --no-enable-prefix-caching, "
    "as in vLLM's P/D runs. Shown in the nodes' table.")
_SIDE_CHANNEL_HOST = typer.Option("localhost", "--side-channel-host", help="remote_host advertised.")
_TOOL_CALL_PARSER = typer.Option(
    None, "--tool-call-parser",
    help=f"How the model writes tool calls ({', '.join(TOOL_FORMATS)}; default: the preset's model's, glm47 for "
    "GLM-5, else hermes).")
_STREAM_INTERVAL = typer.Option(
    1, "--stream-interval", min=1,
    help="vLLM --stream-interval: a streamed answer sends its first token at once, then a chunk every N tokens (give "
    "the gateway the same stream_interval).")
_JSON = typer.Option(False, "--json/--no-json", metavar=FLAG, help="Print the node URLs as one JSON line on stdout.")


def sim(
    prefill: int = _PREFILL, decode: int = _DECODE, aggregated: int = _AGGREGATED, preset: str = _PRESET,
    speed: float = _SPEED, host: str = _HOST, port: int = _PORT, emulate: str = _EMULATE,
    decode_ttl: float = _DECODE_TTL, threshold: int = _THRESHOLD, failure_policy: str = _FAILURE_POLICY,
    bidirectional: bool = _BIDIRECTIONAL, prefill_prefix_caching: bool = _PREFILL_PREFIX_CACHING,
    side_channel_host: str = _SIDE_CHANNEL_HOST, tool_call_parser: str | None = _TOOL_CALL_PARSER,
    stream_interval: int = _STREAM_INTERVAL, as_json: bool = _JSON,
) -> None:
    """Run a simulated vLLM P/D cluster (bidirectional KV transfer) until Ctrl-C."""
    err = Console(stderr=True)
    _check(err, preset, emulate, failure_policy, tool_call_parser, prefill + decode + aggregated)
    ports = [port + i for i in range(prefill + decode + aggregated)] if port else []
    # Checked before any node starts: a node that cannot bind reports only "[Errno 98] Address already in use",
    # with neither the port nor which --port chose it.
    busy = busy_ports(host, ports)
    if busy:
        fail(err, EXIT_FAILED, _ports_message(host, port, ports, busy))
    spec = ClusterSpec(
        prefill=prefill, decode=decode, aggregated=aggregated, preset=preset, speed=speed, host=host, emulate=emulate,
        bidirectional=bidirectional, prefill_prefix_caching=prefill_prefix_caching, decoder_kv_blocks_ttl=decode_ttl,
        kv_recompute_threshold=threshold, kv_load_failure_policy=failure_policy, side_channel_host=side_channel_host,
        base_port=port, tool_call_parser=tool_call_parser, stream_interval=stream_interval)
    try:
        with stop_signals_interrupt():  # until _serve takes them over
            asyncio.run(_serve(spec, as_json))
    except KeyboardInterrupt:  # a stop signal before _serve took them over: a normal stop all the same
        pass
    except OSError as e:  # taken between the check and the bind, or a failure the check does not see
        busy = busy_ports(host, ports)
        fail(err, EXIT_FAILED, _ports_message(host, port, ports, busy) if busy
             else f"cannot start the cluster on {host}: {describe_bind_error(e)}")


def register(app: typer.Typer) -> None:
    app.command("sim")(sim)


def _check(err: Console, preset: str, emulate: str, failure_policy: str, tool_call_parser: str | None,
           nodes: int) -> None:
    """The choices that must name something the simulator knows, and at least one node (exit 2)."""
    try:
        get_preset(preset)
    except UnknownPreset as e:
        fail(err, EXIT_USAGE, str(e))
    if emulate not in EMULATED_VERSIONS:
        fail(err, EXIT_USAGE, f"--emulate must be one of {', '.join(sorted(EMULATED_VERSIONS))}")
    if failure_policy not in FAILURE_POLICIES:
        fail(err, EXIT_USAGE, f"--failure-policy must be one of {', '.join(FAILURE_POLICIES)}")
    if tool_call_parser is not None and tool_call_parser not in TOOL_FORMATS:
        fail(err, EXIT_USAGE, f"--tool-call-parser must be one of {', '.join(TOOL_FORMATS)}")
    if nodes == 0:
        fail(err, EXIT_USAGE, "no nodes to run (give --prefill, --decode or --aggregated)")


def _ports_message(host: str, port: int, ports: list[int], busy: list[tuple[int, str]]) -> str:
    """One line: which ports failed, how --port chose them, and what to do."""
    problem = busy[0][1]
    names = ", ".join(str(p) for p, _ in busy)
    where = (f"--port {port} puts the {len(ports)} nodes on ports {ports[0]}-{ports[-1]}" if len(ports) > 1
             else f"--port {port}")
    fix = listen_fix(problem)
    if problem == IN_USE:
        fix += ", or --port 0 for free ports"
    return f"cannot listen on {host} port{'s' if len(busy) > 1 else ''} {names}: {problem} ({where}); {fix}"
