"""The assessment as a person reads it: a console summary (Rich) and one self-contained HTML page whose plots are
inline SVG drawn by matplotlib (no JavaScript, no network: the page opens offline, and prints).

Rendering only: every number comes from the assessment document (``output.py`` builds it from the answers).
"""

from __future__ import annotations

import html
import io
import math
from collections.abc import Sequence
from typing import Any

from kvtether.cli.assess.verdict import RULE_TITLES, topology_of
from kvtether.cli.replay.report import Objectives, render_goodput
from rich.console import Console
from rich.markup import escape
from rich.table import Table

QUESTIONS = (
    ("q1", "1. How much of each turn's prompt repeats the previous turn?"),
    ("q2", "2. Is the P↔D link fast enough for a pull to beat recomputing?"),
    ("q3", "3. How long does D keep the KV, and how often is it gone before the next turn?"),
    ("q4", "4. How do TTFT p95/p99 change, per topology and policy, at the same GPU count?"),
)
COLORS = {"no-pull": "#7f7f7f", "reference": "#1f77b4", "auto": "#d62728", "pull": "#9467bd",
          "colocated": "#2ca02c", "observed": "#000000"}


def _fmt(v: Any, digits: int = 1, pct: bool = False) -> str:
    if v is None:
        return "–"
    if isinstance(v, float) and math.isinf(v):
        return "∞"
    if pct:
        return f"{v:.0%}"
    if isinstance(v, float):
        return f"{v:,.{digits}f}"
    return str(v)


# --- console -------------------------------------------------------------------------------------------------


def render_console(console: Console, doc: dict[str, Any]) -> None:
    c = doc["cluster"]
    console.print(
        f"[bold]kvtether assess[/] {escape(doc['source'])}: {doc['sessions']} sessions, {doc['turns']} turns; "
        f"cluster {escape(c['preset'])}: {c['prefill_nodes']}P {c['decode_nodes']}D × {c['gpus_per_node']} GPU "
        f"= {c['gpus']} GPUs, link {c['link_gbps']:,.0f} Gb/s, decoder TTL {c['decoder_kv_blocks_ttl_s']:g} s, "
        f"P prefix caching {'on' if c['prefill_prefix_caching'] else 'off'}; "
        f"tokens: {escape(doc['tokenizer'])}", soft_wrap=True)
    a = doc.get("answers", {})
    if "q1" in a:
        _console_q1(console, a["q1"])
    if "q2" in a:
        _console_q2(console, a["q2"])
    if "q3" in a:
        _console_q3(console, a["q3"])
    if "gateway" in doc:
        _console_gateway(console, doc["gateway"])
    if "q4" in a:
        _console_q4(console, a["q4"], doc.get("time_note", ""))
    for note in doc.get("notes", []):
        console.print(f"  [yellow]note:[/] {escape(note)}", soft_wrap=True)


def _console_q1(console: Console, q: dict[str, Any]) -> None:
    t = Table(title=QUESTIONS[0][1], title_justify="left")
    for col in ("turn", "n", "prompt tok", "share p10", "p50", "p90"):
        t.add_column(col, justify="right")
    for row in q["per_turn"]:
        t.add_row(str(row["turn"]), str(row["n"]), _fmt(row["prompt_tokens_mean"], 0),
                  _fmt(row["share_p10"], pct=True), _fmt(row["share_p50"], pct=True),
                  _fmt(row["share_p90"], pct=True))
    console.print(t)
    ps = q["per_session_share"]
    console.print(f"  over sessions: mean share p10 {_fmt(ps['p10'], pct=True)}, p50 {_fmt(ps['p50'], pct=True)}, "
                  f"p90 {_fmt(ps['p90'], pct=True)}; token-weighted {_fmt(q['token_weighted_share'], pct=True)}")
    _verdict(console, q["verdict"])


def _console_q2(console: Console, q: dict[str, Any]) -> None:
    t = Table(title=QUESTIONS[1][1], title_justify="left")
    for col in ("turn", "n", "KV MB", "pull ms", "recompute ms", "break-even Gb/s", "pays"):
        t.add_column(col, justify="right")
    for row in q["per_turn"]:
        t.add_row(str(row["turn"]), str(row["n"]), _fmt(row["kv_mb_mean"], 1), _fmt(row["transfer_ms_mean"], 1),
                  _fmt(row["recompute_ms_mean"], 1), _fmt(row["breakeven_gbps_p50"], 0),
                  _fmt(row["pays_share"], pct=True))
    console.print(t)
    console.print(f"  configured link {q['link_gbps']:,.0f} Gb/s; break-even p50 "
                  f"{_fmt(q['breakeven_gbps']['p50'], 0)} Gb/s, max {_fmt(q['breakeven_gbps']['max'], 0)}; "
                  f"{q['below_min_reuse']} turns reuse too little to pull, {q['never_pays']} never pay")
    _verdict(console, q["verdict"])


def _console_q3(console: Console, q: dict[str, Any]) -> None:
    console.print(f"[bold]{QUESTIONS[2][1]}[/]")
    g = q["gaps_s"]
    console.print(f"  gaps between turns: p50 {_fmt(g['p50'], 2)} s, p90 {_fmt(g['p90'], 2)} s, max "
                  f"{_fmt(g['max'], 2)} s; over the gateway's handle TTL ({q['session_ttl_s']:g} s): "
                  f"{q['gaps_over_session_ttl']}, over D's TTL ({q['decoder_ttl_s']:g} s): "
                  f"{q['gaps_over_decoder_ttl']}")
    sh = q["outcome_share"]
    console.print("  replayed at concurrency " + str(q["concurrency"]) + ": " + ", ".join(
        f"{k.replace('_', ' ')} {_fmt(sh[k], pct=True)} ({q['outcomes'][k]})" for k in sh))
    console.print(f"  held KV peak {_fmt(q['peak_held_share'], pct=True)} of a decode node's "
                  f"{q['capacity_tokens']:,} tokens (budget {_fmt(q['budget_tokens'], 0)})")
    _verdict(console, q["verdict"])


def _console_gateway(console: Console, gw: dict[str, Any]) -> None:
    console.print(f"[bold]What the gateway at {escape(gw['url'])} has seen[/] ({gw['mode']}, policy "
                  f"{gw['policy']}): {gw['pinned_sessions']} pinned sessions")
    console.print(f"  handle outcomes {gw['handle_outcomes']}; releases {gw['releases']}; "
                  f"TTFT by source (ms) {gw['ttft_ms_by_source']}", soft_wrap=True)
    _verdict(console, gw["verdict_q1"])
    _verdict(console, gw["verdict_q3"])


def _console_q4(console: Console, q: dict[str, Any], time_note: str) -> None:
    opts = q["options"]
    t = Table(title=QUESTIONS[3][1] + f" (ms, late = turn ≥ {q['late_from_turn']})", title_justify="left")
    t.add_column("metric")
    for label in opts:
        t.add_column(label, justify="right")
    for key, name in (("ttft_ms", "TTFT"), ("late_ttft_ms", "late TTFT")):
        for stat in ("p50", "p95", "p99"):
            t.add_row(f"{name} {stat}", *[_fmt(o[key][stat], 0) for o in opts.values()])
    t.add_row(_tpot_label(opts), *[_fmt(o["tpot_ms"]["p95"], 1) for o in opts.values()])
    if any("attainment" in o for o in opts.values()):
        t.add_row(_attainment_label(opts), *[_attained(o) for o in opts.values()])
    t.add_row("errors", *[str(o["errors"]) for o in opts.values()])
    console.print(t)
    pt = Table(title="TTFT by turn index, p50 / p95 / p99 (ms)", title_justify="left")
    pt.add_column("turn", justify="right", min_width=4, no_wrap=True)
    for label in opts:
        pt.add_column(label, justify="right", no_wrap=True)
    turns = sorted({r["turn"] for o in opts.values() for r in o["per_turn_ttft_ms"]})
    for turn in turns:
        cells = []
        for o in opts.values():
            row = next((r for r in o["per_turn_ttft_ms"] if r["turn"] == turn), None)
            cells.append("–" if row is None else "/".join(_fmt(row[k], 0) for k in ("p50", "p95", "p99")))
        pt.add_row(str(turn), *cells)
    console.print(pt)
    console.print(f"  {escape(time_note)}", highlight=False)
    if "goodput" in q:
        render_goodput(console, q["goodput"], time_note)
    if q.get("ranking"):
        console.print(f"  {escape(ranking_line(q['ranking']))}", soft_wrap=True, highlight=False)
    _verdict(console, q["verdict"])


def ranking_line(r: dict[str, Any]) -> str:
    """``ranking: colocated = hybrid > auto (by …, then …)``: the options best first, ``=`` within a tie."""
    order = " > ".join(" = ".join(g) for g in r["groups"])
    return f"ranking: {order} (by {', then '.join(RULE_TITLES[x] for x in r['rules'])})"


def _ranks(r: dict[str, Any]) -> dict[str, int]:
    """Each option's rank: one more than the options ranked above its group (tied options share it)."""
    ranks, above = {}, 0
    for g in r["groups"]:
        ranks.update(dict.fromkeys(g, above + 1))
        above += len(g)
    return ranks


def _attained(o: dict[str, Any]) -> str:
    a = o.get("attainment")
    if a is None or a["attainment"] is None:
        return "–"
    return f"{100 * a['attainment']:.1f} %"


def _attainment_label(opts: dict[str, Any]) -> str:
    """Says what a turn had to meet to count: its TTFT (client) and TPOT (engine) objectives."""
    a = next(o["attainment"] for o in opts.values() if "attainment" in o)
    return f"turns meeting {Objectives(a['objectives']['ttft_ms'], a['objectives']['tpot_ms']).describe()}"


def _tpot_label(opts: dict[str, Any]) -> str:
    """Says where the TPOT comes from: the simulated engine's steps, or the client's clock."""
    engine = all(o.get("tpot_source") == "engine" for o in opts.values())
    return "TPOT p95 (engine)" if engine else "TPOT p95"


def _verdict(console: Console, text: str) -> None:
    console.print(f"  [bold green]verdict:[/] {escape(text)}", soft_wrap=True)


# --- plots ---------------------------------------------------------------------------------------------------


def _svg(fig: Any) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg"):]  # drop the XML prolog and doctype: the SVG sits inside the HTML


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # no display, no GUI toolkit
    # Text stays text in the SVG (smaller, selectable) instead of one path per glyph.
    matplotlib.rcParams.update({"svg.fonttype": "none", "font.size": 9, "axes.grid": True, "grid.alpha": 0.3})
    import matplotlib.pyplot as plt

    return plt


def plot_prefix_share(q1: dict[str, Any]) -> str:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3.2))
    rows = [r for r in q1["per_turn"] if r["share_p50"] is not None]
    xs = [r["turn"] for r in rows]
    ax.fill_between(xs, [100 * r["share_p10"] for r in rows], [100 * r["share_p90"] for r in rows],
                    color="#1f77b4", alpha=0.2, label="p10–p90 over sessions")
    ax.plot(xs, [100 * r["share_p50"] for r in rows], "o-", color="#1f77b4", label="p50")
    ax.set_xlabel("turn index")
    ax.set_ylabel("prompt repeated from previous turn (%)")
    ax.set_ylim(0, 100)
    ax2 = ax.twinx()
    ax2.plot([r["turn"] for r in q1["per_turn"]], [r["prompt_tokens_mean"] for r in q1["per_turn"]], "s--",
             color="#ff7f0e", label="prompt tokens (mean)")
    ax2.set_ylabel("prompt tokens")
    ax2.grid(False)
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="lower right", fontsize=8)
    ax.set_title("Prefix share by turn index")
    return _svg(fig)


def plot_breakeven(q2: dict[str, Any]) -> str:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3.2))
    pts = q2["points"]
    finite = [p for p in pts if p["breakeven_gbps"] is not None]
    never = [p for p in pts if p["breakeven_gbps"] is None]
    link = q2["link_gbps"]
    top = max([link * 4, *(p["breakeven_gbps"] for p in finite)]) if finite else link * 4
    pays = [p for p in finite if p["breakeven_gbps"] < link]
    loses = [p for p in finite if p["breakeven_gbps"] >= link]
    if pays:
        ax.scatter([p["turn"] for p in pays], [p["breakeven_gbps"] for p in pays], s=14, color="#2ca02c",
                   label="pull pays (break-even below the link)")
    if loses:
        ax.scatter([p["turn"] for p in loses], [p["breakeven_gbps"] for p in loses], s=14, color="#d62728",
                   label="recompute is cheaper")
    if never:
        ax.scatter([p["turn"] for p in never], [top * 1.5] * len(never), s=18, marker="^", color="#d62728",
                   label="never pays (latency/descriptors)")
    ax.axhline(link, color="black", linestyle="--", label=f"configured link {link:,.0f} Gb/s")
    ax.set_yscale("log")
    ax.set_xlabel("turn index")
    ax.set_ylabel("break-even link (Gb/s, line rate)")
    ax.legend(loc="best", fontsize=8)
    ax.set_title("Link bandwidth at which a pull beats recomputing the prefix on P")
    return _svg(fig)


def plot_gaps(q3: dict[str, Any]) -> str:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3.0))
    gaps = [max(g, 1e-3) for g in q3["gaps"]]
    hi = max([*gaps, q3["decoder_ttl_s"]]) * 2
    lo = min([*gaps, 0.1])
    edges = [lo * (hi / lo) ** (i / 40) for i in range(41)]
    if gaps:
        ax.hist(gaps, bins=edges, color="#1f77b4", alpha=0.8, label=f"gaps between turns ({len(gaps)})")
    ax.axvline(q3["session_ttl_s"], color="#ff7f0e", linestyle="--",
               label=f"gateway handle TTL {q3['session_ttl_s']:g} s")
    ax.axvline(q3["decoder_ttl_s"], color="#d62728", linestyle="-",
               label=f"D's decoder_kv_blocks_ttl {q3['decoder_ttl_s']:g} s")
    ax.set_xscale("log")
    ax.set_xlabel("seconds between an answer and the next turn")
    ax.set_ylabel("turns")
    ax.legend(fontsize=8)
    ax.set_title("Inter-turn gaps against the TTLs")
    return _svg(fig)


def plot_held(series: Sequence[dict[str, Any]], capacity: float | None, budget: float | None, title: str) -> str:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3.0))
    nodes = sorted({k for row in series for k in row if k != "t"})
    for n in nodes:
        ax.step([row["t"] for row in series], [row.get(n, 0) for row in series], where="post", label=f"held on {n}")
    if capacity:
        ax.axhline(capacity, color="#d62728", label=f"KV capacity {capacity:,.0f} tok")
    if budget:
        ax.axhline(budget, color="#ff7f0e", linestyle="--", label=f"held-KV budget {budget:,.0f} tok")
    ax.set_xlabel("seconds")
    ax.set_ylabel("tokens held for sessions")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax.set_title(title)
    return _svg(fig)


def plot_ttft(q4: dict[str, Any]) -> str:
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(10, 3.2), sharex=True)
    for ax, stat in zip(axes, ("p50", "p95", "p99"), strict=True):
        for label, o in q4["options"].items():
            rows = [r for r in o["per_turn_ttft_ms"] if r[stat] is not None]
            ax.plot([r["turn"] for r in rows], [r[stat] for r in rows], "o-", ms=3, label=label,
                    color=COLORS.get(label))
        ax.set_title(f"TTFT {stat}")
        ax.set_xlabel("turn index")
        ax.axvline(q4["late_from_turn"] - 0.5, color="grey", linestyle=":", linewidth=1)
    axes[0].set_ylabel("ms")
    axes[0].legend(fontsize=8)
    return _svg(fig)


# --- HTML ----------------------------------------------------------------------------------------------------

_CSS = """
body { font-family: system-ui, -apple-system, Segoe UI, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 2em; border-bottom: 1px solid #ddd; }
.verdict { background: #eef7ee; border-left: 4px solid #2ca02c; padding: 0.5em 0.8em; margin: 0.6em 0; }
.best { font-weight: bold; }
table { border-collapse: collapse; font-size: 0.85em; margin: 0.6em 0; }
td, th { border: 1px solid #ddd; padding: 2px 8px; text-align: right; } th { background: #f4f4f4; }
td:first-child, th:first-child { text-align: left; }
.meta { color: #555; font-size: 0.9em; } .note { color: #8a6d3b; font-size: 0.9em; }
figure { margin: 0.5em 0; } svg { max-width: 100%; height: auto; }
"""


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _verdict_html(text: str) -> str:
    return f'<div class="verdict">{html.escape(text)}</div>'


def render_html(doc: dict[str, Any]) -> str:
    c = doc["cluster"]
    a = doc.get("answers", {})
    parts = [
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>kvtether assess: {html.escape(doc['source'])}</title><style>{_CSS}</style></head><body>",
        f"<h1>kvtether assess: {html.escape(doc['source'])}</h1>",
        f"<p class='meta'>{doc['sessions']} sessions, {doc['turns']} turns · cluster {html.escape(c['preset'])} "
        f"({html.escape(c['model'])}): {c['prefill_nodes']} prefill + {c['decode_nodes']} decode nodes × "
        f"{c['gpus_per_node']} GPU = {c['gpus']} GPUs, link {c['link_gbps']:,.0f} Gb/s, KV "
        f"{c['kv_bytes_per_token']:,.0f} B/token, decoder_kv_blocks_ttl {c['decoder_kv_blocks_ttl_s']:g} s, "
        f"P prefix caching {'on' if c['prefill_prefix_caching'] else 'off'} · tokens: "
        f"{html.escape(doc['tokenizer'])} · kvtether {html.escape(doc['kvtether_version'])}, "
        f"{html.escape(doc['started_at'])}</p>",
    ]
    summary = [(title, a[key]["verdict"]) for key, title in QUESTIONS if key in a]
    if summary:
        parts.append("<h2>Answers</h2>" + _table(["question", "verdict"], summary))
    if "q1" in a:
        parts += _html_q1(a["q1"])
    if "q2" in a:
        parts += _html_q2(a["q2"])
    if "q3" in a:
        parts += _html_q3(a["q3"])
    if "gateway" in doc:
        parts += _html_gateway(doc["gateway"])
    if "q4" in a:
        parts += _html_q4(a["q4"], doc.get("time_note", ""))
    for note in doc.get("notes", []):
        parts.append(f"<p class='note'>Note: {html.escape(note)}</p>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _html_q1(q: dict[str, Any]) -> list[str]:
    return [f"<h2>{html.escape(QUESTIONS[0][1])}</h2>", _verdict_html(q["verdict"]),
            f"<figure id='plot-prefix-share'>{plot_prefix_share(q)}</figure>",
            _table(["turn", "n", "prompt tokens", "share p10", "p50", "p90"],
                   [(r["turn"], r["n"], _fmt(r["prompt_tokens_mean"], 0), _fmt(r["share_p10"], pct=True),
                     _fmt(r["share_p50"], pct=True), _fmt(r["share_p90"], pct=True)) for r in q["per_turn"]]),
            f"<p class='meta'>Over sessions (mean share per session): p10 "
            f"{_fmt(q['per_session_share']['p10'], pct=True)}, "
            f"p50 {_fmt(q['per_session_share']['p50'], pct=True)}"
            f", p90 {_fmt(q['per_session_share']['p90'], pct=True)}. Token-weighted share "
            f"{_fmt(q['token_weighted_share'], pct=True)}; prompts grow by "
            f"{_fmt(q['prompt_growth_tokens_per_turn'], 0)} tokens a turn.</p>"]


def _html_q2(q: dict[str, Any]) -> list[str]:
    return [f"<h2>{html.escape(QUESTIONS[1][1])}</h2>", _verdict_html(q["verdict"]),
            f"<figure id='plot-breakeven'>{plot_breakeven(q)}</figure>",
            _table(["turn", "n", "KV MB", "pull ms", "recompute ms", "break-even Gb/s p50", "pull pays"],
                   [(r["turn"], r["n"], _fmt(r["kv_mb_mean"], 1), _fmt(r["transfer_ms_mean"], 1),
                     _fmt(r["recompute_ms_mean"], 1), _fmt(r["breakeven_gbps_p50"], 0),
                     _fmt(r["pays_share"], pct=True)) for r in q["per_turn"]])]


def _html_q3(q: dict[str, Any]) -> list[str]:
    return [f"<h2>{html.escape(QUESTIONS[2][1])}</h2>", _verdict_html(q["verdict"]),
            f"<figure id='plot-gaps'>{plot_gaps(q)}</figure>",
            "<figure id='plot-held'>" + plot_held(q["held_series"], q["capacity_tokens"], q["budget_tokens"],
                                                  "Held KV on the decode nodes over the replayed timeline")
            + "</figure>",
            _table(["outcome of the previous turn's KV", "turns", "share"],
                   [(k.replace("_", " "), q["outcomes"][k], _fmt(q["outcome_share"][k], pct=True))
                    for k in q["outcomes"]])]


def _html_gateway(gw: dict[str, Any]) -> list[str]:
    parts = [f"<h2>What the gateway at {html.escape(gw['url'])} has seen</h2>",
             _verdict_html(gw["verdict_q1"]), _verdict_html(gw["verdict_q3"]),
             _table(["handle outcome", "turns"], sorted(gw["handle_outcomes"].items())),
             _table(["release reason", "handles"], sorted(gw["releases"].items())),
             _table(["reuse source", "n", "TTFT p50 ms", "p95", "p99"],
                    [(k, v["n"], v["p50"], v["p95"], v["p99"]) for k, v in gw["ttft_ms_by_source"].items()])]
    if gw["held_series"]:
        cap = max((v for v in gw["decode_capacity_tokens"].values() if v), default=None)
        budget = cap * gw["held_kv_budget_share"] if cap and gw["held_kv_budget_share"] else None
        parts.append(f"<figure id='plot-gateway-held'>"
                     f"{plot_held(gw['held_series'], cap, budget, 'Held KV per decode node (gateway /metrics)')}"
                     "</figure>")
    return parts


def _html_q4(q: dict[str, Any], time_note: str) -> list[str]:
    opts = q["options"]
    rows = []
    for key, name in (("ttft_ms", "TTFT"), ("late_ttft_ms", f"late TTFT (turn ≥ {q['late_from_turn']})")):
        for stat in ("p50", "p95", "p99"):
            rows.append((f"{name} {stat}", *[_fmt(o[key][stat], 0) for o in opts.values()]))
    rows.append((_tpot_label(opts), *[_fmt(o["tpot_ms"]["p95"], 1) for o in opts.values()]))
    if any("attainment" in o for o in opts.values()):
        rows.append((_attainment_label(opts), *[_attained(o) for o in opts.values()]))
    if "goodput" in q:
        g = {p["policy"]: p["goodput"] for p in q["goodput"]["policies"]}
        rows.append(("goodput (open loop, ≥ 90 % of turns)",
                     *["none" if g.get(k) is None else f"×{g[k]:g}" if k in g else "–" for k in opts]))
    rows.append(("errors", *[o["errors"] for o in opts.values()]))
    return [f"<h2>{html.escape(QUESTIONS[3][1])}</h2>", _verdict_html(q["verdict"]), *_html_ranking(q),
            f"<figure id='plot-ttft'>{plot_ttft(q)}</figure>",
            _table(["ms", *opts], rows),
            "<ul class='meta'>" + "".join(f"<li><b>{html.escape(k)}</b>: {html.escape(o['description'])}</li>"
                                           for k, o in opts.items()) + "</ul>",
            f"<p class='meta'>{html.escape(time_note)}</p>"]


def _html_ranking(q: dict[str, Any]) -> list[str]:
    """The options in the verdict's order with the figures it ranked them by, and how it ranks."""
    r = q.get("ranking")
    if not r:
        return []
    opts, ranks = q["options"], _ranks(r)
    swept = {p["policy"]: p["goodput"] for p in q.get("goodput", {}).get("policies", [])}
    header = ["rank", "option", "topology"]
    header += ["goodput"] if "goodput" in r["rules"] else []
    header += [_attainment_label(opts)] if "attainment" in r["rules"] else []
    engine = all(o.get("tpot_source") == "engine" for o in opts.values())
    header += ["late TTFT p95 (ms)", "TPOT p95 (engine, ms)" if engine else "TPOT p95 (ms)", "errors"]
    rows = []
    for name in r["order"]:
        o = opts[name]
        row: list[Any] = [ranks[name], name, topology_of(name)]
        row += ["none" if swept.get(name) is None else f"×{swept[name]:g}"] if "goodput" in r["rules"] else []
        row += [_attained(o)] if "attainment" in r["rules"] else []
        row += [_fmt(o["late_ttft_ms"]["p95"], 0), _fmt(o["tpot_ms"]["p95"], 1), o["errors"]]
        rows.append(row)
    how = "; then ".join(f"{RULE_TITLES[x]} (within noise: {r['noise'][x]})" for x in r["rules"])
    return ["<h3>Ranking</h3>", _table(header, rows),
            f"<p class='meta' id='ranking-rules'>Ranked by {html.escape(how)}: each rule keeps the options within "
            "noise of its leader, the next ranks those left; equal ranks are a tie.</p>"]
