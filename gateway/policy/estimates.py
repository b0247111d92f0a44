"""Online estimates of node speed for the cost-based placement policy (pure: no I/O, no clock read).

What the gateway learns from the turns it serves, per node (or per link), each as a small linear model
whose *shape* comes from configuration and whose *scale* is learned:

- prefill seconds  ``t = a + b·tokens + c·pairs`` with ``pairs = tokens·(context + tokens/2)``, the number
  of (query, key) pairs causal attention touches when ``tokens`` new tokens follow ``context`` cached ones;
- transfer seconds ``t = latency + tokens·s_per_token`` (a NIXL read of ``tokens`` tokens' KV), times what
  transfers of that size took against it (:func:`size_class`): one fit is pinned by the many short reads of
  ordinary turns, while a long history's read meets limits they do not (the NIC's message rate over its
  thousands of descriptors, other reads on the link), so a 60k-token read is estimated from 60k-token reads;
- decode step seconds (TPOT) ``t = base + per_seq·batch``;
- queue seconds ``t = per_request·ahead`` (requests ahead of a new one on that node).

Why multipliers of a seeded shape rather than free coefficients: the gateway sees few, noisy, collinear
samples (most turns of a session have similar sizes), and a free 3-coefficient fit would swing wildly
(negative slopes, huge intercepts). Each observation is normalised by what the *seed* predicts for it, so
the unknowns are dimensionless multipliers θ (1 = the seed is right) fitted by ridge regression towards 1:

    minimise  Σ_k w_k (t_k/ŷ0_k − Σ_i θ_i g_ki)²  +  λ Σ_i (θ_i − 1)²,   g_ki = seed_i·x_ki / ŷ0_k

i.e. relative error, so a 10 ms and a 2 s sample weigh alike. Directions the data does not pin down stay
at the seed. Bounded and decaying:

- the sufficient statistics (a d×d matrix, d ≤ 3) are an exponentially weighted moving sum: every new
  sample multiplies the old weight by ``1 − alpha``, and time multiplies it by ``0.5 ** (age / half_life)``,
  so a node not observed for a while slides back to the seed (the prior term wins as the data weight → 0);
- a sample is clamped to ``[1/outlier_factor, outlier_factor]`` × the current prediction before it is
  used (a turn stuck behind a preemption does not teach the model that the node is 50× slower);
- θ is clamped to ``[theta_min, theta_max]``; below ``min_weight`` of (decayed) samples θ is blended
  towards the fallback (cluster-wide fit, then seed) in proportion, so a fit is trusted gradually;
- at most ``max_keys`` nodes/links are kept (least recently observed dropped); a cluster-wide fit ("*")
  learns from every sample and serves (or underpins) nodes with too little data of their own.

All times are seconds; ``now`` is any monotonic clock the caller reads (the shell), passed in.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

Kind = Literal["prefill", "transfer", "tpot", "queue"]
KINDS: tuple[Kind, ...] = ("prefill", "transfer", "tpot", "queue")
GLOBAL = "*"  # key of the cluster-wide fit of each kind
_NEGLIGIBLE = 1e-3  # a fit whose weight fell below this × min_weight is left out of snapshots


@dataclass(frozen=True, slots=True)
class EstimatorSeeds:
    """Starting values (from configuration) and the shape every learned model keeps.

    Defaults are the order of magnitude of an 8B model on one H100-class GPU with a 200 Gb/s link;
    set them from a short benchmark of your cluster (they only matter until a few turns are observed,
    and again when a node has been idle long enough to decay back to them).
    """

    prefill_overhead_s: float = 0.010  # a: scheduling + launch of one prefill
    prefill_s_per_token: float = 1.0e-4  # b: dense part, ≈ 10k tokens/s
    prefill_s_per_pair: float = 1.5e-9  # c: attention over the context, per (query, key) pair
    transfer_latency_s: float = 0.005  # handshake + descriptor exchange of one NIXL read
    transfer_s_per_token: float = 5.0e-6  # ≈ 200k tokens/s (≈ 130 KB of KV per token at 25 GB/s)
    tpot_base_s: float = 0.012  # one decode step, batch of 1 (weights read once)
    tpot_s_per_seq: float = 2.0e-4  # added per running sequence (its KV read)
    queue_s_per_request: float = 0.100  # delay added by each request ahead in a node's queue

    def coefficients(self, kind: Kind) -> tuple[float, ...]:
        if kind == "prefill":
            return (self.prefill_overhead_s, self.prefill_s_per_token, self.prefill_s_per_pair)
        if kind == "transfer":
            return (self.transfer_latency_s, self.transfer_s_per_token)
        if kind == "tpot":
            return (self.tpot_base_s, self.tpot_s_per_seq)
        return (self.queue_s_per_request,)

    def __post_init__(self) -> None:
        for kind in KINDS:
            if not all(math.isfinite(c) and c > 0 for c in self.coefficients(kind)):
                raise ValueError(f"seed coefficients of {kind} must be finite and > 0")


@dataclass(frozen=True, slots=True)
class LearningParams:
    alpha: float = 0.05  # weight lost by old samples at each new one: ≈ the last 1/alpha samples count
    half_life_s: float = 600.0  # data weight halves per this much time without samples → back to the seed
    # λ: how many samples' worth the seed is worth. Small against the steady-state weight (1/alpha = 20),
    # so a converged fit is biased towards the seed by only λ/(20+λ) ≈ 1.5 % of the gap; it still pins
    # the directions the samples do not determine (collinear sizes) to the seed's shape.
    prior_weight: float = 0.3
    # Below this (decayed) sample weight a fit is only partly trusted: θ is blended linearly towards its
    # fallback (the cluster-wide fit, then the seed). One sample moves an estimate by ≤ 1/min_weight of the
    # (clamped) gap, and a stale fit glides back instead of jumping.
    min_weight: float = 5.0
    outlier_factor: float = 4.0  # a sample is clamped to [1/f, f] × the current prediction
    theta_min: float = 0.1  # learned coefficients stay within [theta_min, theta_max] × seed
    theta_max: float = 10.0
    max_keys: int = 256  # nodes + links remembered per kind (the "*" fit is always kept)

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha < 1.0:
            raise ValueError("alpha must be in (0, 1)")
        if self.half_life_s <= 0 or self.prior_weight <= 0 or self.min_weight < 0:
            raise ValueError("half_life_s and prior_weight must be > 0, min_weight >= 0")
        if self.outlier_factor <= 1.0:
            raise ValueError("outlier_factor must be > 1")
        if not 0.0 < self.theta_min <= 1.0 <= self.theta_max:
            raise ValueError("need 0 < theta_min <= 1 <= theta_max")
        if self.max_keys < 1:
            raise ValueError("max_keys must be >= 1")


# ---------------------------------------------------------------------------------------------------------
# One fit: immutable state + pure update.


@dataclass(frozen=True, slots=True)
class Fit:
    """Decayed sufficient statistics of one ridge fit of multipliers θ (see the module docstring)."""

    sxx: tuple[tuple[float, ...], ...]  # Σ w·g·gᵀ
    sxy: tuple[float, ...]  # Σ w·g·t
    weight: float  # Σ w
    updated_at: float  # `now` of the last sample

    @staticmethod
    def empty(dim: int, now: float) -> Fit:
        return Fit(tuple((0.0,) * dim for _ in range(dim)), (0.0,) * dim, 0.0, now)

    def decayed(self, now: float, params: LearningParams, extra: float = 1.0) -> Fit:
        """The statistics as seen at `now` (time decay), times `extra` (per-sample decay)."""
        age = max(0.0, now - self.updated_at)
        f = extra * 0.5 ** (age / params.half_life_s)
        return Fit(
            tuple(tuple(v * f for v in row) for row in self.sxx),
            tuple(v * f for v in self.sxy),
            self.weight * f,
            max(now, self.updated_at),
        )

    def trust(self, params: LearningParams) -> float:
        """0 … 1: how far to move from the fallback towards this fit's own θ."""
        return min(1.0, self.weight / params.min_weight) if params.min_weight > 0 else 1.0

    def theta(self, params: LearningParams, fallback: Sequence[float] | None = None) -> tuple[float, ...]:
        """Multipliers of the seed coefficients, blended towards `fallback` (default: the seed) by trust."""
        dim = len(self.sxy)
        base = tuple(fallback) if fallback is not None else (1.0,) * dim
        if self.weight <= 0:
            return base
        w = self.trust(params)
        return tuple(b + w * (t - b) for b, t in zip(base, self.raw_theta(params), strict=True))

    def raw_theta(self, params: LearningParams) -> tuple[float, ...]:
        """The ridge solution, clamped to [theta_min, theta_max]."""
        dim = len(self.sxy)
        lam = params.prior_weight
        a = [[self.sxx[i][j] + (lam if i == j else 0.0) for j in range(dim)] for i in range(dim)]
        b = [self.sxy[i] + lam for i in range(dim)]
        th = _solve(a, b)
        return tuple(min(params.theta_max, max(params.theta_min, t)) for t in th)


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """`a`·x = `b` for the ridge system (symmetric positive definite, d ≤ 3): closed form for d ≤ 2 (a sample is
    learned on every turn, and these are the TPOT, transfer and queue fits), elimination for the prefill fit."""
    n = len(b)
    if n == 1:
        return [b[0] / a[0][0]] if abs(a[0][0]) >= 1e-300 else [1.0]
    if n == 2:
        det = a[0][0] * a[1][1] - a[0][1] * a[1][0]
        if abs(det) < 1e-300:
            return [1.0, 1.0]
        return [(b[0] * a[1][1] - a[0][1] * b[1]) / det, (a[0][0] * b[1] - b[0] * a[1][0]) / det]
    return _eliminate(a, b)


def _eliminate(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting."""
    n = len(b)
    m = [[*row, b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[piv] = m[piv], m[col]
        p = m[col][col]
        if abs(p) < 1e-300:  # cannot happen with λ > 0; keep the seed rather than divide by zero
            return [1.0] * n
        for r in range(col + 1, n):
            f = m[r][col] / p
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


def predict(seed: Sequence[float], theta: Sequence[float], x: Sequence[float]) -> float:
    return sum(s * t * v for s, t, v in zip(seed, theta, x, strict=True))


def observe(fit: Fit, seed: Sequence[float], x: Sequence[float], seconds: float, now: float,
            params: LearningParams) -> Fit:
    """`fit` after one sample: features `x` (e.g. ``(1, tokens, pairs)``) took `seconds`."""
    y0 = predict(seed, (1.0,) * len(seed), x)  # what the seed says: the normaliser
    if not (math.isfinite(seconds) and seconds > 0 and math.isfinite(y0) and y0 > 0):
        return fit  # nothing to learn from (zero-size sample, clock glitch)
    cur = fit.decayed(now, params)
    g = [s * v / y0 for s, v in zip(seed, x, strict=True)]
    # Clamp against the current prediction (in seed units): one stalled turn moves θ by a bounded step.
    pred = sum(t * gi for t, gi in zip(cur.theta(params), g, strict=True))
    t = min(pred * params.outlier_factor, max(pred / params.outlier_factor, seconds / y0))
    keep = 1.0 - params.alpha
    dim = len(g)
    return Fit(
        tuple(tuple(keep * cur.sxx[i][j] + g[i] * g[j] for j in range(dim)) for i in range(dim)),
        tuple(keep * cur.sxy[i] + g[i] * t for i in range(dim)),
        keep * cur.weight + 1.0,
        cur.updated_at,
    )


def pairs(tokens: int, context: int) -> float:
    """(query, key) pairs of causal attention for `tokens` new tokens after `context` cached ones."""
    return float(tokens) * (float(context) + float(tokens) / 2.0)


def features(kind: Kind, size: float, context: float = 0.0) -> tuple[float, ...]:
    if kind == "prefill":
        return (1.0, float(size), float(size) * (float(context) + float(size) / 2.0))
    if kind in ("transfer", "tpot"):
        return (1.0, float(size))
    return (float(size),)


SIZE_CLASSES = 8  # transfer sizes told apart: < 1k tokens, then one per doubling, 64k and up the last


def size_class(tokens: float) -> int:
    """The size class of a transfer of `tokens` tokens: 0 below 1,024, then one per doubling, capped."""
    if tokens < 1024:
        return 0
    return min(SIZE_CLASSES - 1, int(math.log2(tokens / 1024.0)) + 1)


@dataclass(frozen=True, slots=True)
class SizeClass:
    """What transfers of one size class took: decayed, weighted sums of log(seconds) and log(tokens) (the same
    decay as the fits: per sample and over time). Read against the linear fit as it is now (:meth:`factor`), so
    that as the fit learns from the same reads, the class does not count their excess twice."""

    log_seconds: float
    log_tokens: float
    weight: float
    updated_at: float

    def decayed(self, now: float, params: LearningParams, extra: float = 1.0) -> SizeClass:
        f = extra * 0.5 ** (max(0.0, now - self.updated_at) / params.half_life_s)
        return SizeClass(self.log_seconds * f, self.log_tokens * f, self.weight * f, max(now, self.updated_at))

    def factor(self, params: LearningParams, linear: Sequence[float]) -> float:
        """Its reads' (geometric) mean time over what the linear fit `linear` says of their (geometric) mean
        size, trusted as a fit is: in proportion to its weight up to min_weight."""
        if self.weight <= 0.0:
            return 1.0
        said = _dot(linear, features("transfer", math.exp(self.log_tokens / self.weight)))
        if not said > 0.0:
            return 1.0
        trust = min(1.0, self.weight / params.min_weight) if params.min_weight > 0 else 1.0
        return math.exp(trust * (self.log_seconds / self.weight - math.log(said)))


def link_key(a: str, b: str) -> str:
    """Transfers are learned per pair of nodes, either direction (same NICs, same path)."""
    return f"{a}|{b}" if a <= b else f"{b}|{a}"


# ---------------------------------------------------------------------------------------------------------
# Snapshot: plain immutable data the pure policy reads.


@dataclass(frozen=True, slots=True)
class EstimatorSnapshot:
    """Coefficients per kind and key (node url, link key, or "*"), frozen at one instant."""

    seeds: EstimatorSeeds = field(default_factory=EstimatorSeeds)
    coefficients: Mapping[str, Mapping[str, tuple[float, ...]]] = field(
        default_factory=lambda: MappingProxyType({})
    )
    weights: Mapping[str, Mapping[str, float]] = field(default_factory=lambda: MappingProxyType({}))
    # Per link key (or "*"), per size class: what transfers of that size took over the linear fit (1: as it says).
    transfer_sizes: Mapping[str, Mapping[int, float]] = field(default_factory=lambda: MappingProxyType({}))

    def coeffs(self, kind: Kind, key: str) -> tuple[float, ...]:
        """The node's own fit, else the cluster-wide one, else the seed."""
        by_key = self.coefficients.get(kind, {})
        if key in by_key:
            return by_key[key]
        if GLOBAL in by_key:
            return by_key[GLOBAL]
        return self.seeds.coefficients(kind)

    def prefill_s(self, node: str, tokens: int, context: int = 0, *, overhead: bool = True) -> float:
        """Compute time of `tokens` new tokens after `context` cached ones; `overhead=False`: without the
        per-request constant (what the tokens add to an engine step that runs anyway)."""
        if tokens <= 0:
            return 0.0
        c = self.coeffs("prefill", node)
        return _dot(c, features("prefill", tokens, context)) - (0.0 if overhead else c[0])

    def transfer_s(self, src: str, dst: str, tokens: int) -> float:
        if tokens <= 0 or src == dst:
            return 0.0
        return self.linear_transfer_s(src, dst, tokens) * self.size_factor(link_key(src, dst), tokens)

    def linear_transfer_s(self, src: str, dst: str, tokens: int) -> float:
        """The linear fit's transfer time alone, whatever transfers of that size took."""
        if tokens <= 0 or src == dst:
            return 0.0
        return _dot(self.coeffs("transfer", link_key(src, dst)), features("transfer", tokens))

    def size_factor(self, link: str, tokens: int) -> float:
        """What transfers of this size took over the linear fit: the link's own, else the cluster's, else 1."""
        cls = size_class(tokens)
        for key in (link, GLOBAL):
            factor = self.transfer_sizes.get(key, {}).get(cls)
            if factor is not None:
                return factor
        return 1.0

    def tpot_s(self, node: str, batch: float) -> float:
        return _dot(self.coeffs("tpot", node), features("tpot", max(1.0, batch)))

    def queue_s(self, node: str, ahead: float) -> float:
        if ahead <= 0:
            return 0.0
        return _dot(self.coeffs("queue", node), features("queue", ahead))


def _dot(c: Sequence[float], x: Sequence[float]) -> float:
    return sum(a * b for a, b in zip(c, x, strict=True))


# ---------------------------------------------------------------------------------------------------------
# The estimator: the shell owns one, feeds it timings, hands snapshots to the policy.


SNAPSHOT_REUSE_S = 0.05


class Estimator:
    """Holds the fits. Mutable container of immutable fits; no I/O, no clock (`now` is passed in)."""

    def __init__(self, seeds: EstimatorSeeds | None = None, params: LearningParams | None = None) -> None:
        self.seeds = seeds or EstimatorSeeds()
        self.params = params or LearningParams()
        self._fits: dict[Kind, OrderedDict[str, Fit]] = {k: OrderedDict() for k in KINDS}
        self._snapshot: tuple[float, EstimatorSnapshot] | None = None  # the last one, and the `now` it was for
        # Per kind, its part of the last snapshot and the `now` it was computed for: a sample changes one kind,
        # so the next snapshot recomputes that kind's fits and reuses the others' (SNAPSHOT_REUSE_S).
        self._parts: dict[Kind, tuple[float, Mapping[str, tuple[float, ...]], Mapping[str, float]]] = {}
        # Per link key (and "*"), per size class: what transfers of that size took (SizeClass).
        self._sizes: OrderedDict[str, dict[int, SizeClass]] = OrderedDict()

    def __len__(self) -> int:
        """Number of fits held (all kinds, "*" included): bounded by 4 × (max_keys + 1)."""
        return sum(len(d) for d in self._fits.values())

    def _observe(self, kind: Kind, key: str, x: tuple[float, ...], seconds: float, now: float) -> None:
        self._snapshot = None
        self._parts.pop(kind, None)
        seed = self.seeds.coefficients(kind)
        fits = self._fits[kind]
        for k in (key, GLOBAL):
            old = fits.pop(k, None) or Fit.empty(len(seed), now)
            fits[k] = observe(old, seed, x, seconds, now, self.params)  # re-inserted last: most recent
        while len(fits) > self.params.max_keys + 1:
            oldest = next(k for k in fits if k != GLOBAL)
            del fits[oldest]

    def observe_prefill(self, node: str, tokens: int, context: int, seconds: float, *, now: float) -> None:
        """`tokens` new tokens after `context` cached/pulled ones took `seconds` of compute on `node`."""
        if tokens > 0:
            self._observe("prefill", node, features("prefill", tokens, context), seconds, now)

    def observe_transfer(self, src: str, dst: str, tokens: int, seconds: float, *, now: float) -> None:
        """Moving the KV of `tokens` tokens between `src` and `dst` took `seconds`: taught to the link's linear
        fit and to its size class."""
        if tokens <= 0 or src == dst:
            return
        said = self.snapshot(now).transfer_s(src, dst, tokens)
        key = link_key(src, dst)
        self._observe("transfer", key, features("transfer", tokens), seconds, now)
        if not (math.isfinite(seconds) and seconds > 0 and said > 0):
            return
        f = self.params.outlier_factor  # one stalled read moves a class by a bounded step, as a fit's
        log_seconds = math.log(min(said * f, max(said / f, seconds)))
        cls = size_class(tokens)
        keep = 1.0 - self.params.alpha
        for k in (key, GLOBAL):
            classes = self._sizes.pop(k, None) or {}
            old = classes.get(cls, SizeClass(0.0, 0.0, 0.0, now)).decayed(now, self.params, keep)
            classes[cls] = SizeClass(old.log_seconds + log_seconds, old.log_tokens + math.log(tokens),
                                     old.weight + 1.0, old.updated_at)
            self._sizes[k] = classes  # re-inserted last: most recent
        while len(self._sizes) > self.params.max_keys + 1:
            del self._sizes[next(k for k in self._sizes if k != GLOBAL)]

    def observe_tpot(self, node: str, batch: float, seconds: float, *, now: float) -> None:
        """One decode step on `node` with `batch` running sequences took `seconds` (inter-token time)."""
        if batch >= 1:
            self._observe("tpot", node, features("tpot", batch), seconds, now)

    def observe_queue(self, node: str, ahead: float, seconds: float, *, now: float) -> None:
        """A request that found `ahead` requests before it waited `seconds` before being scheduled."""
        if ahead > 0:
            self._observe("queue", node, features("queue", ahead), seconds, now)

    def observe_prefill_leg(self, node: str, tokens: int, context: int, seconds: float, *, now: float,
                            ahead: float = 0.0, pulled_tokens: int = 0, pulled_from: str | None = None) -> None:
        """A whole P leg (what the shell can time: send → P's answer), split into its parts.

        A leg is queue + (pull from D) + prefill. Only one unknown is learned per sample, the others are
        subtracted at their current estimate: with requests ahead, the residual is queue delay; else with a
        pull, the residual is the transfer; else the leg is pure prefill. Mixing unknowns in one sample would
        let a slow link be learned as a slow GPU.
        """
        snap = self.snapshot(now)
        compute = snap.prefill_s(node, tokens, context)
        pull = snap.transfer_s(pulled_from, node, pulled_tokens) if pulled_from and pulled_tokens > 0 else 0.0
        if ahead > 0:
            self.observe_queue(node, ahead, seconds - compute - pull, now=now)
        elif pull > 0 and pulled_from is not None:
            self.observe_transfer(pulled_from, node, pulled_tokens, seconds - compute, now=now)
        else:
            self.observe_prefill(node, tokens, context, seconds, now=now)

    def snapshot(self, now: float) -> EstimatorSnapshot:
        """The estimates at `now`. A turn asks several times (plan, TPOT quota, learning) and busy gateways many
        times a second: without a sample since, the one computed less than SNAPSHOT_REUSE_S before stands in
        (the data's decay over that time, a factor 0.5 ** (0.05 / 600), changes nothing). After a sample, only
        the kind it taught is computed again, on the same terms."""
        last = self._snapshot
        if last is not None and 0.0 <= now - last[0] < SNAPSHOT_REUSE_S:
            return last[1]
        coefficients: dict[str, Mapping[str, tuple[float, ...]]] = {}
        weights: dict[str, Mapping[str, float]] = {}
        for kind in KINDS:
            part = self._parts.get(kind)
            if part is None or not 0.0 <= now - part[0] < SNAPSHOT_REUSE_S:
                part = (now, *self._compute_kind(kind, now))
                self._parts[kind] = part
            coefficients[kind], weights[kind] = part[1], part[2]
        transfer = coefficients["transfer"]
        fallback = transfer.get(GLOBAL, self.seeds.coefficients("transfer"))
        sizes = {key: MappingProxyType({cls: c.decayed(now, self.params).factor(self.params,
                                                                                transfer.get(key, fallback))
                                        for cls, c in classes.items()})
                 for key, classes in self._sizes.items()}
        snap = EstimatorSnapshot(self.seeds, MappingProxyType(coefficients), MappingProxyType(weights),
                                 MappingProxyType(sizes))
        self._snapshot = (now, snap)
        return snap

    def _compute_kind(self, kind: Kind, now: float) -> tuple[Mapping[str, tuple[float, ...]], Mapping[str, float]]:
        """One kind's coefficients and data weights per key at `now`."""
        fits = self._fits[kind]
        seed = self.seeds.coefficients(kind)
        cs: dict[str, tuple[float, ...]] = {}
        ws: dict[str, float] = {}
        g = fits.get(GLOBAL)
        g_theta = g.decayed(now, self.params).theta(self.params) if g is not None else (1.0,) * len(seed)
        for key, fit in fits.items():
            cur = fit.decayed(now, self.params)
            if cur.weight < _NEGLIGIBLE * self.params.min_weight:
                continue  # (almost) no data left: the fallback answers
            # A node's own fit stands on the cluster-wide one, which stands on the seed.
            th = cur.theta(self.params, None if key == GLOBAL else g_theta)
            cs[key] = tuple(s * t for s, t in zip(seed, th, strict=True))
            ws[key] = cur.weight
        return MappingProxyType(cs), MappingProxyType(ws)
