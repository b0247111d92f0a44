"""What `kvtether assess` works from: the command line as given (``AssessFlags``), and, once loaded, what it read
(``Inputs``): the running gateway's counters, the cluster shape, the sessions and how their tokens are counted."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx
from kvtether.cli.assess.cluster import ClusterShape, build_shape
from kvtether.cli.assess.gateway import scrape, summarize_gateway
from kvtether.cli.assess.tokens import Encoder, hf_encoder, sim_encoder
from kvtether.cli.common.exits import EXIT_FAILED, EXIT_USAGE
from kvtether.cli.common.failures import fail
from kvtether.cli.common.sessions import load_sessions_or_fail
from kvtether.sdk.sessionfile import SessionRecord
from rich.console import Console


@dataclass(frozen=True, slots=True)
class AssessFlags:
    """The command line as given: one field per parameter of the command, of the same name."""

    file: Path | None
    gateway: str | None
    watch: float
    preset: str
    prefill: int | None
    decode: int | None
    layers: int | None
    kv_heads: int | None
    head_dim: int | None
    kv_dtype: str | None
    gpus_per_node: int | None
    link_gbps: float | None
    ttl: float
    session_ttl: float
    held_kv_budget: float
    prefill_prefix_caching: bool
    input_format: str
    model: str | None
    tokenizer: str | None
    concurrency: int | None
    options: str
    simulate: bool
    speed: float
    virtual: bool
    think_scale: float
    max_think_ms: float | None
    tpot_slo: float
    ttft_slo: float
    goodput: str | None
    limit: int | None
    report: Path | None
    as_json: bool
    quiet: bool
    engine_log: str | None


@dataclass(slots=True)
class Inputs:
    shape: ClusterShape
    sessions: list[SessionRecord]
    encode: Encoder
    token_note: str  # how tokens are counted, for the document
    seen: dict[str, Any] | None  # the running gateway's counters, summarized (--gateway)
    notes: list[str] = field(default_factory=list)  # what the user should know about the answers


def shape_from_ready(ready: dict[str, Any]) -> tuple[int | None, int | None, str | None]:
    """The P/D node counts `assess` compares at the gateway's GPU count, read off its ``/ready``, and a note when
    they are not the gateway's own. Pool instances (role ``both``) count as nodes of either role: a cluster of N
    nodes in all is assessed as ⌈N/3⌉ prefill and the rest decode (3 as 1P 2D, 4 as 2P 2D), the split its
    colocated and pool options are measured against at the same GPU count."""
    nodes = [n for n in ready.get("nodes", []) if isinstance(n, dict)]
    p = sum(1 for n in nodes if n.get("role") == "prefill")
    d = sum(1 for n in nodes if n.get("role") == "decode")
    both = sum(1 for n in nodes if n.get("role") == "both")
    if not both:
        return p or None, d or None, None
    total = p + d + both
    prefill = max(1, -(-total // 3))
    decode = max(1, total - prefill)
    return prefill, decode, (f"the gateway runs {both} pool instance(s)" + (f" and {p}P {d}D" if p or d else "")
                             + f": its {total} nodes are assessed as {prefill}P {decode}D, as {prefill + decode} "
                             "colocated nodes and as a pool (option hybrid)")


def _gateway_seen(err: Console, f: AssessFlags) -> tuple[dict[str, Any] | None, int | None, int | None, str | None]:
    """The gateway's counters, summarized, its node counts where the flags give none, and a note on them."""
    gateway = f.gateway
    if gateway is None:
        return None, f.prefill, f.decode, None
    try:
        seen = anyio.run(lambda: scrape(gateway, watch_s=f.watch))
    except (httpx.HTTPError, ValueError) as e:
        fail(err, EXIT_FAILED, f"cannot read the gateway at {gateway} ({type(e).__name__}: {e})")
    gp, gd, note = shape_from_ready(seen.ready)
    if f.prefill is not None or f.decode is not None:
        note = None  # the flags say what to assess
    return summarize_gateway(seen), f.prefill or gp, f.decode or gd, note


def _shape(err: Console, f: AssessFlags, prefill: int | None, decode: int | None) -> ClusterShape:
    try:
        return build_shape(f.preset, prefill=prefill or 1, decode=decode or 1, layers=f.layers, kv_heads=f.kv_heads,
                           head_dim=f.head_dim, kv_dtype=f.kv_dtype, gpus_per_node=f.gpus_per_node,
                           link_gbps=f.link_gbps, decoder_kv_blocks_ttl_s=f.ttl, session_ttl_s=f.session_ttl,
                           held_kv_budget=f.held_kv_budget if f.held_kv_budget < 1.0 else None,
                           prefill_prefix_caching=f.prefill_prefix_caching)
    except (KeyError, ValueError) as e:
        fail(err, EXIT_USAGE, str(e))


def _encoder(err: Console, f: AssessFlags, shape: ClusterShape) -> tuple[Encoder, str]:
    if f.tokenizer is None:
        return (sim_encoder(shape.preset.tool_call_parser),
                "the simulator's tokenizer and ChatML template (≈ 1 token per English word)")
    try:
        encode = hf_encoder(f.tokenizer)
    except Exception as e:  # transformers raises many kinds (OSError, ValueError, HF hub errors)
        fail(err, EXIT_USAGE, f"cannot load tokenizer {f.tokenizer!r}: {type(e).__name__}: {e}")
    return encode, f"{f.tokenizer} (its tokenizer and chat template)"


def load(err: Console, f: AssessFlags) -> Inputs:
    """The gateway's counters (exit 1 when it cannot be read), the cluster, the sessions and the tokenizer (exit 2
    on a bad one of them), in that order."""
    seen, prefill, decode, pool_note = _gateway_seen(err, f)
    shape = _shape(err, f, prefill, decode)
    notes: list[str] = [pool_note] if pool_note else []
    if shape.session_ttl_s != f.session_ttl:
        notes.append(f"session TTL {f.session_ttl:g} s is not below D's TTL {f.ttl:g} s: "
                     f"used {shape.session_ttl_s:g} s")
    sessions = (load_sessions_or_fail(err, f.file, f.input_format, f.model, f.limit) if f.file is not None else [])
    encode, token_note = _encoder(err, f, shape)
    return Inputs(shape=shape, sessions=sessions, encode=encode, token_note=token_note, seen=seen, notes=notes)
