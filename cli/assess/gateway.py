"""`kvtether assess --gateway URL`: the answers from what a running gateway has seen.

The gateway keeps no transcript of its traffic; the recording is the SDK's (``AgentSession(record_to=…)``) or
any session file of the same traffic, given as FILE. From the gateway itself:

- ``GET /metrics``: every turn's handle outcome (``kvtether_handle_outcomes_total``: attached, truncated,
  expired, missing, …), the handles released and why (``kvtether_handle_releases_total{reason}``), the held KV
  per decode node and its budget, prompt and reused tokens, and the gateway-measured TTFT by where the KV came
  from (``kvtether_ttft_seconds``);
- ``GET /ready``: the nodes, their roles, KV capacity and block size;
- ``GET /admin/sessions``: the pinned sessions, their turns and held tokens.

Polled over ``watch_s`` seconds, the held KV becomes a time series. Parsing and summarising are pure
(:func:`summarize_gateway`); :func:`scrape` does the HTTP.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
from prometheus_client.parser import text_string_to_metric_families

# Handle outcomes (gateway/telemetry.py HANDLE_OUTCOMES) grouped by what they mean for the turn's KV.
REUSED_OUTCOMES = ("attached", "truncated", "unused_local")
GONE_OUTCOMES = {"expired": "expired", "missing": "released or never returned"}
OTHER_OUTCOMES = ("refused_by_guard", "unused_cold", "lost_race", "store_unavailable", "retried_cold")


@dataclass(slots=True)
class Scrape:
    t: float  # seconds since the first scrape
    metrics: dict[str, list[tuple[dict[str, str], float]]]  # sample name -> (labels, value)


@dataclass(slots=True)
class GatewaySeen:
    url: str
    scrapes: list[Scrape] = field(default_factory=list)
    ready: dict[str, Any] = field(default_factory=dict)
    sessions: list[dict[str, Any]] = field(default_factory=list)


def parse_metrics(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name].append((dict(s.labels), float(s.value)))
    return dict(out)


async def scrape(url: str, watch_s: float = 0.0, interval_s: float = 2.0, headers: Mapping[str, str] | None = None,
                 ) -> GatewaySeen:
    """/ready, /admin/sessions, and /metrics once (or every ``interval_s`` for ``watch_s``). Raises httpx errors."""
    base = url.rstrip("/")
    seen = GatewaySeen(url=base)
    async with httpx.AsyncClient(timeout=10.0, headers=dict(headers or {})) as client:
        r = await client.get(f"{base}/ready")
        seen.ready = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
        r = await client.get(f"{base}/admin/sessions")
        r.raise_for_status()
        seen.sessions = r.json()
        t0 = time.monotonic()
        while True:
            r = await client.get(f"{base}/metrics")
            r.raise_for_status()
            seen.scrapes.append(Scrape(time.monotonic() - t0, parse_metrics(r.text)))
            if time.monotonic() - t0 + interval_s > watch_s:
                break
            await anyio.sleep(interval_s)
    return seen


def _sum(samples: Mapping[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float:
    return sum(v for lab, v in samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items()))


def _by(samples: Mapping[str, list[tuple[dict[str, str], float]]], name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for lab, v in samples.get(name, []):
        out[lab.get(label, "")] += v
    return dict(out)


def histogram_quantile(buckets: Sequence[tuple[float, float]], q: float) -> float | None:
    """Prometheus' histogram_quantile: ``buckets`` are (upper bound, cumulative count), +Inf last; linear
    interpolation inside the bucket the rank falls in (the +Inf bucket answers its lower bound)."""
    bs = sorted(buckets)
    if not bs or bs[-1][1] <= 0:
        return None
    rank = q * bs[-1][1]
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in bs:
        if count >= rank:
            if math.isinf(bound):
                return prev_bound
            if count == prev_count:
                return bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = bound, count
    return prev_bound


def _ttft_by_source(samples: Mapping[str, list[tuple[dict[str, str], float]]]) -> dict[str, dict[str, Any]]:
    per: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for lab, v in samples.get("kvtether_ttft_seconds_bucket", []):
        le = lab.get("le", "+Inf")
        per[lab.get("reuse_source", "?")].append((math.inf if le in ("+Inf", "inf") else float(le), v))
    out = {}
    for src, raw in per.items():
        merged: dict[float, float] = defaultdict(float)
        for b, c in raw:
            merged[b] += c
        bs = sorted(merged.items())
        n = bs[-1][1] if bs else 0
        if not n:
            continue
        out[src] = {"n": int(n), **{f"p{q}": _ms(histogram_quantile(bs, q / 100)) for q in (50, 95, 99)}}
    return out


def _ms(s: float | None) -> float | None:
    return None if s is None else round(s * 1000, 1)


def summarize_gateway(seen: GatewaySeen) -> dict[str, Any]:
    """What the gateway's counters say about reuse (q1), retention (q3) and TTFT (q4)."""
    last = seen.scrapes[-1].metrics if seen.scrapes else {}
    outcomes = {k: int(v) for k, v in _by(last, "kvtether_handle_outcomes_total", "outcome").items() if v}
    releases = {k: int(v) for k, v in _by(last, "kvtether_handle_releases_total", "reason").items() if v}
    failures = {k: int(v) for k, v in _by(last, "kvtether_handle_release_failures_total", "cause").items() if v}
    prompt = _sum(last, "kvtether_prompt_tokens_total")
    reused = _sum(last, "kvtether_reused_tokens_total")
    decided = sum(outcomes.values())
    gone = {GONE_OUTCOMES[k]: outcomes.get(k, 0) for k in GONE_OUTCOMES}
    nodes = [n for n in seen.ready.get("nodes", []) if isinstance(n, dict)]
    capacity = {n["url"]: n.get("kv_capacity_tokens") for n in nodes if n.get("role") in ("decode", "both")}
    series = [{"t": round(s.t, 3),
               **{lab.get("node", "?"): v for lab, v in s.metrics.get("kvtether_held_kv_tokens", [])}}
              for s in seen.scrapes]
    budget = _sum(last, "kvtether_held_kv_budget") or None
    turns_by_source = {k: int(v) for k, v in _by(last, "kvtether_ttft_seconds_count", "reuse_source").items() if v}
    gone_n = sum(gone.values())
    if decided:
        verdict_q3 = (f"{gone_n / decided:.0%} of the gateway's turns found their KV gone "
                      f"({', '.join(f'{k} {v}' for k, v in gone.items() if v) or 'none'}); handles released: "
                      f"{', '.join(f'{k} {v}' for k, v in sorted(releases.items())) or 'none'}")
    else:
        verdict_q3 = "the gateway has placed no turn with a handle outcome yet"
    share = reused / prompt if prompt else None
    return {
        "url": seen.url,
        "mode": seen.ready.get("mode"),
        "policy": seen.ready.get("policy"),
        "nodes": [{k: n.get(k) for k in ("url", "role", "healthy", "kv_capacity_tokens", "block_size",
                                         "held_kv_tokens", "prefix_caching")} for n in nodes],
        "pinned_sessions": len(seen.sessions),
        "session_turns": sum(int(s.get("turns") or 0) for s in seen.sessions),
        "held_tokens_now": sum(int(s.get("held_tokens") or 0) for s in seen.sessions),
        "prompt_tokens": int(prompt),
        "reused_tokens": int(reused),
        "reused_share": round(share, 4) if share is not None else None,
        "handle_outcomes": outcomes,
        "gone": gone,
        "gone_share": round(gone_n / decided, 4) if decided else None,
        "releases": releases,
        "release_failures": failures,
        "decode_capacity_tokens": capacity,
        "held_kv_budget_share": budget,
        "held_series": series,
        "turns_by_source": turns_by_source,
        "ttft_ms_by_source": _ttft_by_source(last),
        "verdict_q1": (f"the gateway offered {share:.0%} of its P/D turns' prompt tokens from a decode handle"
                       if share is not None else "the gateway has counted no verified P/D prompt yet"),
        "verdict_q3": verdict_q3,
    }
