"""Replay results: summaries (pure), SLO checks (pure) and Rich rendering (to a given console)."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any, Literal

from kvtether.cli.common.stats import PERCENTILE_METHOD, p99_warning, summarize
from kvtether.cli.replay.engine import ReplayRun, TurnResult
from kvtether.cli.streaming import TIME_DEFINITIONS
from rich.console import Console
from rich.markup import escape
from rich.table import Table

SCHEMA_VERSION = 1

# The streaming client's times (kvtether.cli.streaming defines them), then how a run is summarized.
DEFINITIONS = {
    **TIME_DEFINITIONS,
    "percentiles": PERCENTILE_METHOD,
    "error_rate": "failed requests / requests sent (skipped turns of a failed session are not sent)",
    "empty": "successful responses without any visible token; excluded from TTFT/TPOT, included in E2E",
}

METRICS = ("ttfc", "ttft", "tpot", "e2e")
STATS = ("mean", "p50", "p95", "p99", "min", "max")


def _reuse(results: list[TurnResult]) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    cached_known = [r for r in ok if r.cached_tokens is not None]
    cached = sum(r.cached_tokens or 0 for r in cached_known)
    headers: dict[str, Any] = {}
    by_name: dict[str, list[str]] = defaultdict(list)
    for r in ok:
        for k, v in r.reuse.items():
            by_name[k].append(v)
    for name, values in sorted(by_name.items()):
        try:
            headers[name] = {"sum": sum(int(v) for v in values), "n": len(values)}
        except ValueError:
            headers[name] = dict(Counter(values).most_common(20))
    if by_name:
        source = "gateway response headers (x-kvtether-*)"
    elif cached_known:
        source = "usage.prompt_tokens_details.cached_tokens"
    else:
        source = "none reported"
    return {
        "source": source,
        "prompt_tokens": prompt,
        "cached_tokens": cached if cached_known else None,
        "cached_fraction": (cached / prompt) if cached_known and prompt else None,
        "headers": headers,
    }


def summarize_run(label: str, run: ReplayRun, sessions: int) -> dict[str, Any]:
    results = run.results
    sent = [r for r in results if not r.skipped]
    ok = [r for r in sent if r.ok]
    errors = [r for r in sent if not r.ok]
    out: dict[str, Any] = {
        "label": label,
        "sessions": sessions,
        "requests": len(sent),
        "ok": len(ok),
        "errors": len(errors),
        "skipped": len(results) - len(sent),
        "empty": sum(1 for r in ok if r.empty),
        "error_rate": (len(errors) / len(sent)) if sent else 0.0,
        "errors_by_kind": dict(Counter(r.error_kind or "?" for r in errors)),
        "first_errors": [f"{r.session_id} turn {r.turn}: {r.error_kind}: {r.error}" for r in errors[:5]],
        "wall_s": run.wall_s,
    }
    if run.clock_s is not None:  # virtual time: the run's length on it, the CPU it took, the modelled gateway
        out["clock"] = "virtual"
        out["virtual_s"] = round(run.clock_s, 6)
        out["cpu_s"] = None if run.cpu_s is None else round(run.cpu_s, 3)
        out["gateway_model"] = run.gateway_model
    warnings: list[str] = []
    if run.arrivals_late:
        out["arrivals_late"] = run.arrivals_late
        warnings.append(
            f"{run.arrivals_late} session(s) started up to {run.arrival_lag_max_s:.1f} s after their arrival: the "
            f"replay's cap on sessions in flight held them, so the load was below the one asked for"
        )
    if out["empty"]:
        warnings.append(
            f"{out['empty']} response(s) had no visible token (e.g. a cut-off tool call held back by the "
            "server's tool parser): no TTFT/TPOT for them"
        )
    for m in METRICS:
        s = summarize(getattr(r, f"{m}_ms") for r in ok)
        out[f"{m}_ms"] = s.to_json()
        w = p99_warning(s.n, m.upper())
        if w and m == "ttft":
            warnings.append(w)
    per_turn: dict[int, list[float]] = defaultdict(list)
    for r in ok:
        if r.ttft_ms is not None:
            per_turn[r.turn].append(r.ttft_ms)
    out["per_turn_ttft_ms"] = []
    small = []
    for t in sorted(per_turn):
        s = summarize(per_turn[t])
        out["per_turn_ttft_ms"].append({"turn": t, "n": s.n, "p50": s.p50, "p95": s.p95, "p99": s.p99})
        if s.n < 100:
            small.append(t)
    if small:
        warnings.append(f"per-turn p99 from < 100 samples for turn(s) {_ranges(small)}")
    out["reuse"] = _reuse(results)
    if out["reuse"]["source"] == "none reported":
        warnings.append("no reuse attribution: the server sent neither x-kvtether-* headers nor cached_tokens")
    out["warnings"] = warnings
    return out


def _ranges(xs: list[int]) -> str:
    if not xs:
        return ""
    parts: list[str] = []
    start = prev = xs[0]
    for x in [*xs[1:], None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        parts.append(str(start) if start == prev else f"{start}–{prev}")
        if x is not None:
            start = prev = x
    return ", ".join(parts)


# --- SLOs -----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Slo:
    metric: str  # ttft, ttfc, tpot, e2e or error_rate
    stat: str | None  # p50, p95, p99, mean, max (None for error_rate)
    limit: float

    @property
    def key(self) -> str:
        return self.metric if self.stat is None else f"{self.metric}_{self.stat}"


def _key_limit(spec: str) -> tuple[str, float | None]:
    """``KEY=VALUE`` or ``KEY<=VALUE``: the lower-cased key and the limit (None: no ``=``, or not a number >= 0)."""
    key, sep, value = spec.replace("<=", "=").partition("=")
    try:
        limit = float(value)
    except ValueError:
        return key.strip().lower(), None
    return key.strip().lower(), limit if sep and limit == limit and limit >= 0 else None


def parse_slo(spec: str) -> Slo:
    """``ttft_p95=500`` or ``ttft_p95<=500`` (milliseconds); ``error_rate=0.01`` (a fraction)."""
    key, limit = _key_limit(spec)
    if limit is None:
        raise ValueError(f"bad SLO {spec!r} (expected e.g. ttft_p95=500, in ms, or error_rate=0.01)")
    if key == "error_rate":
        return Slo("error_rate", None, limit)
    metric, _, stat = key.partition("_")
    if metric not in METRICS or stat not in STATS:
        raise ValueError(
            f"bad SLO {spec!r}: metric must be one of {', '.join(METRICS)} with _p50/_p95/_p99/_mean/_max, "
            "or error_rate"
        )
    return Slo(metric, stat, limit)


def check_slos(run_summary: dict[str, Any], slos: list[Slo]) -> list[dict[str, Any]]:
    out = []
    for slo in slos:
        if slo.stat is None:
            actual: float | None = run_summary["error_rate"]
        else:
            actual = run_summary[f"{slo.metric}_ms"][slo.stat]
        # No measurement (every request failed) cannot meet a latency objective.
        ok = actual is not None and actual <= slo.limit
        out.append({"slo": slo.key, "limit": slo.limit, "actual": actual, "ok": ok})
    return out


# --- per-turn objectives, attainment and goodput ---------------------------------------------------

TpotSource = Literal["client", "engine"]
TPOT_SOURCES: dict[TpotSource, str] = {
    "client": "client-side TPOT (token chunks as received)",
    "engine": "engine TPOT (the simulated decode node's own step times, free of this machine's load)",
}
# Goodput: the highest load at which at least this share of turns meets every objective.
GOODPUT_ATTAINMENT = 0.9


@dataclass(frozen=True, slots=True)
class Objectives:
    """Per-turn latency objectives, ms; None: no objective on that metric."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def __bool__(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None

    def describe(self) -> str:
        parts = [f"{m} <= {v:g} ms" for m, v in (("TTFT", self.ttft_ms), ("TPOT", self.tpot_ms)) if v is not None]
        return " and ".join(parts)


def parse_rates(spec: str) -> list[float]:
    """``0.5,1,2,4``: the --goodput rate multipliers, each > 0, in the order given (duplicates dropped)."""
    rates: list[float] = []
    for part in spec.split(","):
        try:
            rate = float(part)
        except ValueError:
            rate = 0.0
        if not rate > 0 or rate == float("inf"):
            raise ValueError(f"bad --goodput {spec!r} (expected rate multipliers > 0, e.g. 0.5,1,2,4)")
        if rate not in rates:
            rates.append(rate)
    return rates


def parse_objectives(specs: list[str]) -> Objectives:
    """``ttft=2000``, ``tpot=25`` (ms, ``<=`` also accepted); a metric given twice keeps the last."""
    values: dict[str, float] = {}
    for spec in specs:
        key, limit = _key_limit(spec)
        if limit is None or key not in ("ttft", "tpot"):
            raise ValueError(f"bad objective {spec!r} (expected ttft=MS or tpot=MS)")
        values[key] = limit
    return Objectives(ttft_ms=values.get("ttft"), tpot_ms=values.get("tpot"))


def _turn_tpot(r: TurnResult, source: TpotSource) -> tuple[bool, float | None]:
    """(measured, TPOT): an answer of one token has no TPOT and is measured (it meets any objective)."""
    if r.completion_tokens is not None and r.completion_tokens <= 1:
        return True, None
    tpot = r.engine_tpot_ms if source == "engine" else r.tpot_ms
    if source == "client" and r.ok and not r.empty and tpot is None:
        return True, None  # the client counted one token chunk: no inter-token time to judge
    return tpot is not None, tpot


@dataclass(frozen=True, slots=True)
class Judged:
    """One turn against the objectives: what it met, and whether its TPOT could be judged at all."""

    ttft_ok: bool
    tpot_ok: bool
    measured: bool

    @property
    def met(self) -> bool:
        return self.ttft_ok and self.tpot_ok


def judge(r: TurnResult, objectives: Objectives, source: TpotSource) -> Judged:
    """A failed turn, an empty answer (no token, so no TTFT) and a turn skipped after its session failed meet
    nothing. A turn meets TPOT when its TPOT is within the objective; an answer of one token has none and meets
    it; a multi-token answer without a TPOT from `source` is unmeasured and does not meet a TPOT objective."""
    served = r.ok and not r.skipped and not r.empty
    ttft_ok = served and (objectives.ttft_ms is None or (r.ttft_ms is not None and r.ttft_ms <= objectives.ttft_ms))
    measured, tpot = _turn_tpot(r, source) if served else (True, None)
    tpot_ok = served and measured and (objectives.tpot_ms is None or tpot is None or tpot <= objectives.tpot_ms)
    return Judged(ttft_ok, tpot_ok, measured)


def attainment(results: list[TurnResult], objectives: Objectives, source: TpotSource) -> dict[str, Any]:
    """The share of the run's turns that meet every objective (`judge`); every turn of the sessions counts.
    ``tpot_unmeasured``: multi-token answers without a TPOT from `source` (engine TPOT not joined to the
    answer)."""
    judged = [judge(r, objectives, source) for r in results]
    met = sum(j.met for j in judged)
    met_ttft = sum(j.ttft_ok for j in judged)
    met_tpot = sum(j.tpot_ok for j in judged)
    unmeasured = sum(not j.measured for j in judged)
    n = len(results)
    return {
        "objectives": {"ttft_ms": objectives.ttft_ms, "tpot_ms": objectives.tpot_ms},
        "tpot_source": source,
        "turns": n,
        "met": met,
        "met_ttft": met_ttft,
        "met_tpot": met_tpot,
        "tpot_unmeasured": unmeasured,
        "attainment": met / n if n else None,
    }


def goodput(levels: list[tuple[float, float | None]], threshold: float = GOODPUT_ATTAINMENT) -> float | None:
    """The highest rate multiplier whose attainment reaches `threshold`; None when no level does."""
    passing = [rate for rate, share in levels if share is not None and share >= threshold]
    return max(passing) if passing else None


def goodput_report(runs: list[tuple[str, float, dict[str, Any]]]) -> dict[str, Any]:
    """Per policy, the attainment at each rate and the goodput, from (policy, rate, run summary with
    ``attainment``) in run order."""
    policies: dict[str, list[dict[str, Any]]] = {}
    for policy, rate, s in runs:
        a = s["attainment"]
        policies.setdefault(policy, []).append(
            {"rate": rate, "attainment": a["attainment"], "met": a["met"], "turns": a["turns"],
             "errors": s["errors"], "label": s["label"]}
        )
    first = runs[0][2]["attainment"] if runs else None
    return {
        "threshold": GOODPUT_ATTAINMENT,
        "objectives": first["objectives"] if first else None,
        "tpot_source": first["tpot_source"] if first else None,
        "policies": [
            {"policy": p, "levels": levels, "goodput": goodput([(x["rate"], x["attainment"]) for x in levels])}
            for p, levels in policies.items()
        ],
    }


# --- rendering --------------------------------------------------------------------------------------


def _f(v: float | None, digits: int = 1) -> str:
    return "–" if v is None else f"{v:,.{digits}f}"


def _compact(v: float | None) -> str:
    # Three numbers per cell, several policies per row: no separators, so the table fits 80 columns.
    return "–" if v is None else f"{v:.0f}"


def render_run(console: Console, s: dict[str, Any], time_note: str) -> None:
    console.print(f"latency in ms, {time_note}", highlight=False)
    t = Table(title=f"{s['label']}", title_justify="left")
    t.add_column("metric")
    for col in ("n", "mean", "p50", "p95", "p99", "max"):
        t.add_column(col, justify="right")
    for m in METRICS:
        x = s[f"{m}_ms"]
        t.add_row(m.upper(), str(x["n"]), _f(x["mean"]), _f(x["p50"]), _f(x["p95"]), _f(x["p99"]), _f(x["max"]))
    console.print(t)
    pt = Table(title="TTFT by turn index (ms)", title_justify="left")
    for col in ("turn", "n", "p50", "p95", "p99"):
        pt.add_column(col, justify="right")
    for row in s["per_turn_ttft_ms"]:
        pt.add_row(str(row["turn"]), str(row["n"]), _f(row["p50"]), _f(row["p95"]), _f(row["p99"]))
    console.print(pt)
    _render_tail(console, s)


def _render_tail(console: Console, s: dict[str, Any]) -> None:
    reuse = s["reuse"]
    frac = reuse["cached_fraction"]
    console.print(
        f"[bold]{s['label']}[/]: {s['requests']} requests, {s['ok']} ok, {s['errors']} errors "
        f"({s['error_rate']:.1%}), {s['skipped']} skipped, {s['empty']} empty, {s['wall_s']:.1f} s wall",
        soft_wrap=True,
    )
    cached = "–" if reuse["cached_tokens"] is None else f"{reuse['cached_tokens']:,}"
    frac_s = "" if frac is None else f" ({frac:.1%})"
    console.print(
        f"  reuse ({escape(reuse['source'])}): prompt tokens {reuse['prompt_tokens']:,}, cached {cached}{frac_s}",
        soft_wrap=True,
    )
    for name, v in reuse["headers"].items():
        console.print(f"    {name}: {v}")
    if s["errors_by_kind"]:
        console.print(f"  errors: {s['errors_by_kind']}")
        for line in s["first_errors"]:
            console.print(f"    {line}", markup=False, soft_wrap=True)
    if "attainment" in s:
        console.print(f"  {escape(attainment_line(s['attainment']))}", soft_wrap=True, highlight=False)
    for w in s["warnings"]:
        console.print(f"  [yellow]note:[/] {escape(w)}", soft_wrap=True)


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{v:.1%}"


def attainment_line(a: dict[str, Any]) -> str:
    o = Objectives(a["objectives"]["ttft_ms"], a["objectives"]["tpot_ms"])
    n = a["turns"]
    # The TPOT's source matters only where a TPOT objective judges it.
    source = f"; {TPOT_SOURCES[a['tpot_source']]}" if o.tpot_ms is not None else ""
    line = (
        f"SLO attainment ({o.describe()}{source}): {_pct(a['attainment'])} of {n} turns "
        f"(TTFT met {_pct(a['met_ttft'] / n if n else None)}, TPOT met {_pct(a['met_tpot'] / n if n else None)})"
    )
    if a["tpot_unmeasured"]:
        line += f"; {a['tpot_unmeasured']} answer(s) without a {a['tpot_source']} TPOT counted as missed"
    return line


def render_goodput(console: Console, report: dict[str, Any], time_note: str) -> None:
    """Attainment per rate multiplier (rows) and policy (columns), and each policy's goodput."""
    rates = sorted({x["rate"] for p in report["policies"] for x in p["levels"]})
    t = Table(title=f"SLO attainment by arrival rate (open loop; {time_note})", title_justify="left")
    t.add_column("rate ×", justify="right")
    for p in report["policies"]:
        t.add_column(p["policy"], justify="right")
    for rate in rates:
        cells = []
        for p in report["policies"]:
            x = next((x for x in p["levels"] if x["rate"] == rate), None)
            cells.append("–" if x is None else f"{_pct(x['attainment'])} of {x['turns']}")
        t.add_row(f"{rate:g}", *cells)
    t.add_row(
        f"goodput (≥ {report['threshold']:.0%})",
        *["none" if p["goodput"] is None else f"× {p['goodput']:g}" for p in report["policies"]],
    )
    console.print(t)
    o = report["objectives"]
    if o is not None:
        objectives = Objectives(o["ttft_ms"], o["tpot_ms"]).describe()
        source = TPOT_SOURCES[report["tpot_source"]]
        console.print(f"  objectives per turn: {objectives}; {source}", soft_wrap=True, highlight=False)
    for p in report["policies"]:
        if p["goodput"] is None:
            share = f"{report['threshold']:.0%}"
            console.print(f"  {escape(p['policy'])}: no rate met the objectives for {share} of turns", soft_wrap=True)


def render_compare(console: Console, runs: list[dict[str, Any]], time_note: str) -> None:
    console.print(f"policies side by side; latency in ms, {time_note}", highlight=False)
    t = Table()
    t.add_column("metric")
    for s in runs:
        t.add_column(s["label"], justify="right")
    for m in METRICS:
        for stat in ("p50", "p95", "p99"):
            t.add_row(f"{m.upper()} {stat}", *[_f(s[f"{m}_ms"][stat]) for s in runs])
    t.add_row("errors", *[f"{s['errors']} ({s['error_rate']:.1%})" for s in runs])
    if all("attainment" in s for s in runs):
        t.add_row("SLO attainment", *[_pct(s["attainment"]["attainment"]) for s in runs])
    t.add_row(
        "cached fraction",
        *["–" if s["reuse"]["cached_fraction"] is None else f"{s['reuse']['cached_fraction']:.1%}" for s in runs],
    )
    console.print(t)
    turns = sorted({row["turn"] for s in runs for row in s["per_turn_ttft_ms"]})
    pt = Table(title="TTFT by turn index, p50 / p95 / p99 (ms)", title_justify="left")
    pt.add_column("turn", justify="right")
    for s in runs:
        pt.add_column(s["label"], justify="right", no_wrap=True)
    for turn in turns:
        cells = []
        for s in runs:
            row = next((r for r in s["per_turn_ttft_ms"] if r["turn"] == turn), None)
            cells.append("–" if row is None else "/".join(_compact(row[k]) for k in ("p50", "p95", "p99")))
        pt.add_row(str(turn), *cells)
    console.print(pt)
    for s in runs:
        _render_tail(console, s)


def render_slos(console: Console, label: str, checks: list[dict[str, Any]]) -> None:
    for c in checks:
        mark = "[green]ok[/]" if c["ok"] else "[red]MISSED[/]"
        console.print(f"  SLO {label} {c['slo']} <= {c['limit']:g}: actual {_f(c['actual'], 3)} {mark}")
