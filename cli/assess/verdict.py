"""Question 4's verdict: which serving option keeps the user's objectives best, as pure functions over plain data
(no I/O, no clock).

The options are ranked by rules, in this order; each rule keeps the options within noise of its leader, and the
next rule ranks those that are left (docs/assess.md, "How the verdict is reached"):

1. ``goodput`` (only with ``--goodput``): the highest load at which at least 90 % of turns meet every objective.
   A lower goodput is within noise when, at the leader's goodput load, the two options' shares are (rule 2's
   test): the 90 % line alone would otherwise decide by a turn.
2. ``attainment``: the share of the turns meeting every objective given, at the recorded load. Two shares are
   within noise when they differ by at most one turn, or by at most one standard error of their difference
   (binomial, pooled: ``sqrt(p (1 - p) (1/n1 + 1/n2))``): the error bar of a share measured on n turns.
3. ``late_ttft_p95``: the late-turn TTFT p95, lower is better; within noise below 1.1× or 50 ms apart (the
   client measures it, and the Python work of every turn, multiplied by ``--speed``, is in it).
4. ``tpot_p95``: the engine's TPOT p95, lower is better; within noise below 1.1×.

The best is what the last rule leaves; when that is more than one option, the verdict calls it a tie and names
them all. Every verdict says which rule separated the best from the runner-up, the rules on which they tied, and
what the runner-up is better at. A topology is recommended when the best meets the objectives on at least 90 %
of its turns (the goodput threshold).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtether.cli.replay.report import GOODPUT_ATTAINMENT, Objectives

# Which of the three ways to build the cluster an option is: what the verdict recommends.
TOPOLOGIES = {"colocated": "colocated serving", "hybrid": "one pool of instances that take both roles"}
PD_TOPOLOGY = "prefill/decode disaggregation"

# TTFT tails closer than this ratio, or than TTFT_NOISE_MS, are a tie: the TTFTs are the client's, and the Python
# work of each turn (client, gateway, simulated nodes, all in one process) shows up in them multiplied by
# --speed, by tens of ms on a loaded machine.
TIE_MARGIN = 1.1
TTFT_NOISE_MS = 50.0
# TPOTs are the engine's (cost-model time), but depend on which requests happened to share a step.
TPOT_TIE_MARGIN = 1.1

RULES = ("goodput", "attainment", "late_ttft_p95", "tpot_p95")
NOISE = {
    "goodput": "a lower goodput ties when the shares at the leader's goodput load are within the attainment noise",
    "attainment": "at most one turn, or at most one standard error of the difference (pooled binomial)",
    "late_ttft_p95": f"below {TIE_MARGIN:g}× or {TTFT_NOISE_MS:g} ms apart",
    "tpot_p95": f"below {TPOT_TIE_MARGIN:g}×",
}
RULE_TITLES = {"goodput": "goodput", "attainment": "turns meeting the objectives",
               "late_ttft_p95": "late-turn TTFT p95", "tpot_p95": "TPOT p95"}
_RULE_WORDS = {"goodput": "higher goodput", "attainment": "larger share of turns meeting the objectives",
               "late_ttft_p95": "lower late-turn TTFT p95", "tpot_p95": "lower TPOT p95"}


def topology_of(option: str) -> str:
    return TOPOLOGIES.get(option, PD_TOPOLOGY)


@dataclass(frozen=True, slots=True)
class Share:
    """Turns meeting every objective, of the turns run."""

    met: int
    turns: int

    @property
    def value(self) -> float | None:
        return self.met / self.turns if self.turns else None


@dataclass(frozen=True, slots=True)
class Standing:
    """One option's figures, as the ranking reads them (None: not measured)."""

    option: str
    attained: Share | None = None  # at the recorded load
    late_ttft_p95_ms: float | None = None
    tpot_p95_ms: float | None = None
    errors: int = 0
    goodput: float | None = None  # the highest swept load with >= 90 % of turns meeting the objectives
    swept: Mapping[float, Share] = field(default_factory=dict)  # the sweep's share at each load


def share_noise(a: Share, b: Share) -> float:
    """The difference two shares must exceed to count: one turn, or one standard error of the difference of two
    binomial shares under the hypothesis that they are equal (pooled), whichever is larger."""
    if not a.turns or not b.turns:
        return math.inf
    return max(1 / min(a.turns, b.turns), standard_error(a, b))


def standard_error(a: Share, b: Share) -> float:
    """The standard error of the difference of two shares of turns, under the hypothesis that they are equal."""
    p = (a.met + b.met) / (a.turns + b.turns)
    return math.sqrt(p * (1 - p) * (1 / a.turns + 1 / b.turns))


def shares_apart(a: Share | None, b: Share | None) -> bool:
    """Whether two shares differ beyond noise (a missing one is apart from a measured one)."""
    if a is None or b is None or not a.turns or not b.turns:
        return (a is None or not a.turns) != (b is None or not b.turns)
    return abs(a.met / a.turns - b.met / b.turns) > share_noise(a, b) + 1e-12


def _tails_apart(a: float | None, b: float | None, ratio: float, floor: float) -> bool:
    if a is None or b is None:
        return (a is None) != (b is None)
    lo, hi = sorted((a, b))
    return hi - lo > floor and (lo <= 0 or hi / lo >= ratio)


def _apart(rule: str, lead: Standing, other: Standing) -> bool:
    """Whether `other` is beyond noise of `lead` (the leader on `rule`) on that rule."""
    if rule == "goodput":
        if lead.goodput is None or lead.goodput == other.goodput:
            return False
        return shares_apart(lead.swept.get(lead.goodput), other.swept.get(lead.goodput))
    if rule == "attainment":
        return shares_apart(lead.attained, other.attained)
    if rule == "late_ttft_p95":
        return _tails_apart(lead.late_ttft_p95_ms, other.late_ttft_p95_ms, TIE_MARGIN, TTFT_NOISE_MS)
    return _tails_apart(lead.tpot_p95_ms, other.tpot_p95_ms, TPOT_TIE_MARGIN, 0.0)


def _key(rule: str, s: Standing) -> tuple[float, ...]:
    """Lower is better."""
    if rule == "goodput":
        at = s.swept.get(s.goodput) if s.goodput is not None else None
        share = at.value if at is not None else None
        return (-s.goodput if s.goodput is not None else math.inf, -(share or 0.0))
    if rule == "attainment":
        v = s.attained.value if s.attained is not None else None
        return (-v if v is not None else math.inf,)
    v = s.late_ttft_p95_ms if rule == "late_ttft_p95" else s.tpot_p95_ms
    return (v if v is not None else math.inf,)


def active_rules(standings: Sequence[Standing]) -> tuple[str, ...]:
    """The rules there are figures for: goodput only after a sweep, attainment only where turns were judged."""
    skip = set()
    if not any(s.swept for s in standings):
        skip.add("goodput")
    if not any(s.attained is not None and s.attained.turns for s in standings):
        skip.add("attainment")
    return tuple(r for r in RULES if r not in skip)


@dataclass(frozen=True, slots=True)
class Ranking:
    rules: tuple[str, ...]
    order: tuple[str, ...]  # best first
    groups: tuple[tuple[str, ...], ...]  # the order cut where the rules separate: options within a group tie
    tied: tuple[str, ...]  # the options within noise of the best on every rule, the best first
    decided_by: str | None  # the rule that put the runner-up behind the best; None: a tie, or a single option
    tied_on: tuple[str, ...]  # the rules on which the runner-up is within noise of the best

    @property
    def best(self) -> str | None:
        return self.order[0] if self.order else None

    @property
    def runner_up(self) -> str | None:
        return self.order[1] if len(self.order) > 1 else None


def _select(cands: list[Standing], rules: Sequence[str]) -> tuple[list[Standing], dict[str, str]]:
    """The options the rules leave, in turn (each keeps those within noise of its leader), in their nominal
    order; and per option left behind, the rule that left it."""
    def full(s: Standing) -> tuple[tuple[float, ...], ...]:
        return tuple(_key(r, s) for r in rules)

    dropped: dict[str, str] = {}
    for rule in rules:
        if len(cands) < 2:
            break
        lead = min(cands, key=lambda s: (_key(rule, s), full(s)))
        keep = [s for s in cands if s is lead or not _apart(rule, lead, s)]
        dropped.update({s.option: rule for s in cands if s not in keep})
        cands = keep
    return sorted(cands, key=full), dropped


def rank(standings: Sequence[Standing]) -> Ranking:
    """The options best first: the best group the rules leave (a tie when more than one), then the best group of
    the rest, and so on (the input order breaks exact ties)."""
    rules = active_rules(standings)
    rest = list(standings)
    groups: list[tuple[str, ...]] = []
    dropped: dict[str, str] = {}
    while rest:
        group, left = _select(rest, rules)
        if not groups:
            dropped = left
        groups.append(tuple(s.option for s in group))
        rest = [s for s in rest if s not in group]
    order = tuple(o for g in groups for o in g)
    tied = groups[0] if groups else ()
    runner = order[1] if len(order) > 1 else None
    decided = dropped.get(runner) if runner is not None and runner not in tied else None
    tied_on = rules[:rules.index(decided)] if decided is not None else rules if runner is not None else ()
    return Ranking(rules, order, tuple(groups), tied, decided, tuple(tied_on))


# --- the verdict's words ---------------------------------------------------------------------------------------


def _pct(s: Share) -> str:
    return f"{100 * s.met / s.turns:.1f} % ({s.met} of {s.turns})" if s.turns else "no turns"


def _turns(n: int) -> str:
    return f"{n} turn" if n == 1 else f"{n} turns"


def _ms(v: float | None, digits: int = 0) -> str:
    return "–" if v is None else f"{v:,.{digits}f} ms"


def _load(g: float | None) -> str:
    return "no load swept" if g is None else f"×{g:g}"


def _meeting(objectives: Objectives) -> str:
    return f"meeting {objectives.describe()}" if objectives else "served without error (no objective given)"


def _lead(b: Standing, r: Standing, rule: str, objectives: Objectives) -> str:
    """The sentence that says how the best leads the runner-up on the rule that decided."""
    if rule == "goodput":
        g = b.goodput
        at_b, at_r = b.swept.get(g) if g is not None else None, r.swept.get(g) if g is not None else None
        shares = (f" (at ×{g:g}: {_pct(at_b)} against {_pct(at_r)})" if at_b and at_r and g is not None else "")
        return (f"goodput, the highest load at which at least {GOODPUT_ATTAINMENT:.0%} of turns are "
                f"{_meeting(objectives)}: {_load(b.goodput)} against {_load(r.goodput)} for {r.option}{shares}")
    if rule == "attainment" and b.attained and r.attained:
        more = (_turns(b.attained.met - r.attained.met) + " more" if b.attained.turns == r.attained.turns else
                f"{100 * ((b.attained.value or 0) - (r.attained.value or 0)):.1f} points more")
        se = standard_error(b.attained, r.attained)
        lead = abs((b.attained.value or 0) - (r.attained.value or 0))
        errs = f" (a lead of {lead / se:.1f} standard errors)" if se else ""
        return (f"the share of turns {_meeting(objectives)}: {_pct(b.attained)} against {_pct(r.attained)} for "
                f"{r.option}, {more}{errs}")
    if rule == "late_ttft_p95":
        x, y = b.late_ttft_p95_ms, r.late_ttft_p95_ms
        ratio = f" ({y / x:.2f}× lower)" if x and y else ""
        return f"late-turn TTFT p95: {_ms(x)} against {_ms(y)} for {r.option}{ratio}"
    x, y = b.tpot_p95_ms, r.tpot_p95_ms
    ratio = f" ({y / x:.2f}× lower)" if x and y else ""
    return f"TPOT p95: {_ms(x, 1)} against {_ms(y, 1)} for {r.option}{ratio}"


def _and(words: Sequence[str]) -> str:
    return words[0] if len(words) < 2 else ", ".join(words[:-1]) + " and " + words[-1]


def _figure(rule: str, s: Standing) -> str:
    if rule == "goodput":
        return _load(s.goodput)
    if rule == "attainment":
        return _pct(s.attained) if s.attained else "–"
    return _ms(s.late_ttft_p95_ms) if rule == "late_ttft_p95" else _ms(s.tpot_p95_ms, 1)


def _figures(rule: str, group: Sequence[Standing], objectives: Objectives) -> str:
    """One rule's figures, each option's named when there are several."""
    name = {"goodput": "goodput", "attainment": f"turns {_meeting(objectives)}", "late_ttft_p95": "late-turn TTFT p95",
            "tpot_p95": "TPOT p95"}[rule]
    if len(group) == 1:
        return f"{name}: {_figure(rule, group[0])}"
    return f"{name}: " + _and([f"{s.option} {_figure(rule, s)}" for s in group])


def better_at(b: Standing, r: Standing, rules: Sequence[str]) -> list[dict[str, Any]]:
    """What the runner-up `r` is better at than the best `b`: every ranked figure on which it leads, beyond noise,
    or within it on goodput and attainment (what the user asked for: a lead there is worth telling)."""
    out: list[dict[str, Any]] = []
    if "goodput" in rules and r.goodput is not None and (b.goodput is None or r.goodput > b.goodput):
        out.append({"metric": "goodput", "runner_up": r.goodput, "best": b.goodput, "within_noise": True})
    if "attainment" in rules and b.attained and r.attained and (r.attained.value or 0) > (b.attained.value or 0):
        out.append({"metric": "attainment", "runner_up": r.attained.value, "best": b.attained.value,
                    "within_noise": not shares_apart(b.attained, r.attained),
                    "turns_more": r.attained.met - b.attained.met})
    for rule, x, y in (("late_ttft_p95", b.late_ttft_p95_ms, r.late_ttft_p95_ms),
                       ("tpot_p95", b.tpot_p95_ms, r.tpot_p95_ms)):
        if x is not None and y is not None and y < x and _apart(rule, r, b):
            out.append({"metric": rule, "runner_up": y, "best": x, "within_noise": False})
    if r.errors < b.errors:
        out.append({"metric": "errors", "runner_up": r.errors, "best": b.errors, "within_noise": False})
    return out


def _better_text(runner: str, items: Sequence[Mapping[str, Any]]) -> str:
    if not items:
        return f"{runner}, the runner-up, leads on no figure beyond noise"
    words = []
    for it in items:
        m = it["metric"]
        if m == "goodput":
            words.append(f"goodput ({_load(it['runner_up'])} against {_load(it['best'])}, within noise)")
        elif m == "attainment":
            noise = ", within noise" if it["within_noise"] else ""
            words.append(f"meeting the objectives ({_turns(it['turns_more'])} more{noise})")
        elif m == "late_ttft_p95":
            words.append(f"late-turn TTFT p95 ({_ms(it['runner_up'])} against {_ms(it['best'])})")
        elif m == "tpot_p95":
            words.append(f"TPOT p95 ({_ms(it['runner_up'], 1)} against {_ms(it['best'], 1)})")
        else:
            words.append(f"errors ({it['runner_up']} against {it['best']})")
    return f"{runner}, the runner-up, is better at " + ", ".join(words)


def _recommended(tied: Sequence[Standing]) -> list[str]:
    """The topologies of the tied best options that meet the objectives on at least 90 % of their turns."""
    keep = [s for s in tied if s.attained is None or (s.attained.value or 0) >= GOODPUT_ATTAINMENT]
    return list(dict.fromkeys(topology_of(s.option) for s in keep))


def _recommendation(tied: Sequence[Standing], objectives: Objectives) -> str:
    topologies = _recommended(tied)
    if topologies:
        return "recommended topology: " + " or ".join(topologies)
    return (f"no option has {GOODPUT_ATTAINMENT:.0%} of its turns {_meeting(objectives)}: no topology "
            f"recommended (the closest: {topology_of(tied[0].option)})")


def _decision(ranking: Ranking, by: Mapping[str, Standing], objectives: Objectives) -> str:
    """The verdict before the recommendation: the best, the rule that decided and the rules that tied."""
    best = by[ranking.order[0]]
    if len(ranking.order) == 1:
        figures = "; ".join(_figures(r, [best], objectives) for r in ranking.rules)
        return f"best: {best.option} (the only option run) — {figures}"
    if len(ranking.tied) > 1:
        group = [by[o] for o in ranking.tied]
        figures = "; ".join(_figures(r, group, objectives) for r in ranking.rules)
        first = next((r for r in ranking.rules if _key(r, best) != _key(r, group[1])), None)
        listed = (f"{best.option} is listed first for its {_RULE_WORDS[first]}, a difference within noise"
                  if first is not None else f"{best.option} is listed first as given")
        return (f"a tie between {_and(ranking.tied)}, within noise on every rule ({figures}): the "
                f"simulation cannot tell them apart; {listed}")
    runner = by[ranking.order[1]]
    ties = "".join(f"{_figures(r, [best, runner], objectives)}"
                   f"{'' if _key(r, best) == _key(r, runner) else ' within noise'}, a tie; " for r in ranking.tied_on)
    rule = ranking.decided_by or ranking.rules[-1]
    return f"best: {best.option} — {ties}decided by {_lead(best, runner, rule, objectives)}"


def verdict(standings: Sequence[Standing], objectives: Objectives) -> dict[str, Any]:
    """The ranking of `standings` and its words: the best, the runner-up, the rule that decided, what the runner-up
    is better at, the topology recommended; ``verdict`` is the one line the console and the report print."""
    if not standings:
        return {"best": None, "runner_up": None, "topology": None, "recommended": [], "margin": None,
                "ranking": None, "verdict": "no option ran: no comparison"}
    ranking = rank(standings)
    by = {s.option: s for s in standings}
    best = by[ranking.order[0]]
    runner = by[ranking.order[1]] if len(ranking.order) > 1 else None
    decision = _decision(ranking, by, objectives)
    better = better_at(best, runner, ranking.rules) if runner is not None else []
    parts = [decision]
    if runner is not None and len(ranking.tied) == 1:
        parts.append(_better_text(runner.option, better))
    if best.errors:
        parts.append(f"{best.option} had {_turns(best.errors)} failed, counted as missed")
    parts.append(_recommendation([by[o] for o in ranking.tied], objectives))
    margin = None
    if runner is not None and best.late_ttft_p95_ms and runner.late_ttft_p95_ms is not None:
        margin = round(runner.late_ttft_p95_ms / best.late_ttft_p95_ms, 3)
    return {
        "best": best.option, "runner_up": runner.option if runner is not None else None,
        "topology": topology_of(best.option), "recommended": _recommended([by[o] for o in ranking.tied]),
        "margin": margin,
        "ranking": {"rules": list(ranking.rules), "order": list(ranking.order),
                    "groups": [list(g) for g in ranking.groups], "tied": list(ranking.tied),
                    "decided_by": ranking.decided_by, "tied_on": list(ranking.tied_on),
                    "reason": decision, "runner_up_better_at": better,
                    "objectives": {"ttft_ms": objectives.ttft_ms, "tpot_ms": objectives.tpot_ms},
                    "noise": {r: NOISE[r] for r in ranking.rules}},
        "verdict": "; ".join(parts),
    }


# --- from the assessment document ------------------------------------------------------------------------------


def standings_of(q4: Mapping[str, Any]) -> tuple[list[Standing], Objectives]:
    """Question 4's document (its ``options`` and, after a sweep, its ``goodput``) as the ranking's standings, and
    the objectives the turns were judged by."""
    sweep = {p["policy"]: p for p in (q4.get("goodput") or {}).get("policies", [])}
    objectives = Objectives(q4.get("ttft_slo_ms"), q4.get("tpot_slo_ms"))
    out = []
    for name, o in q4["options"].items():
        a = o.get("attainment")
        if a is not None:
            objectives = Objectives(a["objectives"]["ttft_ms"], a["objectives"]["tpot_ms"])
        p = sweep.get(name)
        out.append(Standing(
            option=name, attained=Share(a["met"], a["turns"]) if a is not None else None,
            late_ttft_p95_ms=o["late_ttft_ms"]["p95"], tpot_p95_ms=o["tpot_ms"]["p95"], errors=o["errors"],
            goodput=p["goodput"] if p else None,
            swept={x["rate"]: Share(x["met"], x["turns"]) for x in p["levels"]} if p else {}))
    return out, objectives


def decide(q4: Mapping[str, Any]) -> dict[str, Any]:
    """The verdict fields of question 4's document, from the figures it holds."""
    standings, objectives = standings_of(q4)
    return verdict(standings, objectives)
