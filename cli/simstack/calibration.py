"""The gateway estimator's seeds from a simulated cluster's cost model: what `kvtether assess` and the placement
benchmarks give the `auto` policy so that it decides as on a cluster whose speed it has measured."""

from __future__ import annotations

from kvtether.sim.presets import Preset


def calibrated_seeds(preset: Preset, speed: float) -> dict[str, float]:
    """The gateway estimator's seeds from a preset's cost model, in the gateway's (real) seconds: what an
    operator sets from a short benchmark of the cluster. prefill ≈ a + b·n + c·n·(ctx + n/2) by relative least
    squares; transfer = latency + per token; decode step = base + per sequence; queue = a typical prefill."""
    c, p = preset.cost, preset
    pts = [(n, ctx) for n in (64, 512, 2048, 8192, 16384) for ctx in (0, 8192)]
    rows = [(1.0, float(n), n * (ctx + n / 2)) for n, ctx in pts]
    ys = [c.lone_prefill_seconds(n, ctx, p.max_num_batched_tokens) for n, ctx in pts]
    coef = _lstsq(rows, ys)
    t1, t2 = c.transfer_seconds(1000), c.transfer_seconds(20000)
    per_tok = (t2 - t1) / 19000
    step = c.hardware.step_overhead
    d1, d16 = c.decode_seconds([12000]) + step, c.decode_seconds([12000] * 16) + step
    per_seq = (d16 - d1) / 15
    seeds = {
        "seed_prefill_overhead_s": max(coef[0], 1e-4), "seed_prefill_s_per_token": max(coef[1], 1e-8),
        "seed_prefill_s_per_pair": max(coef[2], 1e-13), "seed_transfer_latency_s": max(t1 - 1000 * per_tok, 1e-4),
        "seed_transfer_s_per_token": max(per_tok, 1e-9), "seed_tpot_base_s": max(d1 - per_seq, 1e-4),
        "seed_tpot_s_per_seq": max(per_seq, 1e-6),
        "seed_queue_s_per_request": c.lone_prefill_seconds(4000, 0, p.max_num_batched_tokens),
    }
    return {k: v / speed for k, v in seeds.items()}


def _lstsq(rows: list[tuple[float, float, float]], ys: list[float]) -> list[float]:
    """Relative least squares (each point weighted by 1/y) for 3 unknowns, by normal equations."""
    a = [[0.0] * 3 for _ in range(3)]
    b = [0.0] * 3
    for row, y in zip(rows, ys, strict=True):
        w = 1.0 / (y * y) if y > 0 else 0.0
        for i in range(3):
            b[i] += w * row[i] * y
            for j in range(3):
                a[i][j] += w * row[i] * row[j]
    # Gaussian elimination with partial pivoting.
    m = [[*a[i], b[i]] for i in range(3)]
    for col in range(3):
        piv = max(range(col, 3), key=lambda r: abs(m[r][col]))
        m[col], m[piv] = m[piv], m[col]
        if abs(m[col][col]) < 1e-300:
            return [0.0, 0.0, 0.0]
        for r in range(3):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col], strict=True)]
    return [m[i][3] / m[i][i] for i in range(3)]
