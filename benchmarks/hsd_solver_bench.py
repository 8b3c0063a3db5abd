"""Times the HSD hierarchy optimisers on early-exit candidate pools of K = 42 and K = 80
and writes ``docs/results/hsd_solver.json``.

    .venv/bin/python benchmarks/hsd_solver_bench.py [--lp-time-limit 120] [--out PATH]

Instance generator (:func:`early_exit_pool`), for an ``L``-layer target (``K = L``):
model 0 is prompt lookup (cost 1e-3, acceptance half that of layer 1), model ``l`` for
``l = 1..L-1`` is an exit after layer ``l`` and model ``L`` the target. Cost of model ``l``:
``(l + h) / (L + h)`` with a head costing ``h = 1`` layer (target = 1). Acceptance of model
``l`` by the target: ``p(l) = 1 - (1 - l/L)^4`` (about 0.7 at ``l = L/4``); between two
levels ``alpha(i, j) = p(i) / p(j)``, smooth, decreasing with the layer gap, equal to 1
for ``i = j``, and consistent: ``alpha(i, k) = alpha(i, j) alpha(j, k) >= alpha(i, j) +
alpha(j, k) - 1`` (the triangle bound the paper uses for Table 9).

Timings: best of ``--repeats`` runs after one warm-up, ``t_max = 15``, ``model="paper"``
(the model ``dp`` and ``lp`` optimise); the LP gets ``--lp-time-limit`` seconds per solve.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import scipy

from specjax.hsd import hierarchy as H

ROOT = Path(__file__).resolve().parents[1]


def early_exit_pool(n_layers: int, *, kappa: float = 4.0, head: float = 1.0,
                    lookup_cost: float = 1e-3, lookup_rel: float = 0.5
                    ) -> tuple[np.ndarray, np.ndarray]:
    """``(costs, alpha)`` for prompt lookup, exits ``1..L-1`` and the target (see above)."""
    layer = np.arange(n_layers + 1, dtype=float)
    costs = (layer + head) / (n_layers + head)
    costs[0] = lookup_cost
    p = 1 - (1 - np.maximum(layer, 1) / n_layers) ** kappa
    p[0] *= lookup_rel
    return costs, np.triu(np.minimum(1.0, p[:, None] / p[None, :]), 1)


def best_time(fn, repeats: int) -> tuple[float, object]:
    """One warm-up call, then the best wall time of ``repeats`` calls, and the last result."""
    out = fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return min(times), out


def bench(K: int, t_max: int, repeats: int, lp_limit: float) -> dict:
    costs, alpha = early_exit_pool(K)
    t_dp, (lat, sigma, T) = best_time(lambda: H.optimal_hierarchy(costs, alpha, t_max), repeats)
    row = dict(K=K, t_max=t_max, dp_s=t_dp, latency=lat, sigma=list(sigma), T=list(T),
               speedup=float(costs[-1] / lat),
               exact_latency_of_dp_choice=H.latency(costs, alpha, sigma, T, model="exact"),
               best_two_level=best_single_draft(costs, alpha, t_max),
               lp_arcs=int(K * t_max * 2 + 1 + K * (K - 1) // 2 * t_max ** 2),
               lp_rows=int(1 + K * t_max))
    try:
        t_lp, (lat_lp, sig_lp, T_lp) = best_time(
            lambda: H.optimal_hierarchy(costs, alpha, t_max, method="lp", time_limit=lp_limit),
            max(1, repeats // 2))
        row.update(lp_s=t_lp, lp_latency=lat_lp, lp_agrees=bool(abs(lat_lp / lat - 1) < 1e-9),
                   lp_status="optimal")
    except RuntimeError as e:  # time limit reached
        row.update(lp_s=None, lp_status=f"not solved within {lp_limit} s: {e}")
    return row


def best_single_draft(costs: np.ndarray, alpha: np.ndarray, t_max: int) -> float:
    """Plain speculative decoding: ``min (c_K + T c_i) / E(alpha_iK, T)`` over drafts, T."""
    T = np.arange(1, t_max + 1)[None, :]
    lat = (costs[-1] + T * costs[:-1, None]) / H.expected_tokens(alpha[:-1, -1:], T)
    return float(min(lat.min(), costs[-1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--t-max", type=int, default=15)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--lp-time-limit", type=float, default=120.0)
    ap.add_argument("--out", default=str(ROOT / "docs/results/hsd_solver.json"))
    args = ap.parse_args()
    rows = [bench(K, args.t_max, args.repeats, args.lp_time_limit) for K in (42, 80)]
    print(f"{'K':>3} {'dp s':>8} {'lp s':>8} {'lp=dp':>6} {'latency':>8} {'exact':>8} "
          f"{'SD only':>8} {'speedup':>7}  hierarchy (T)")
    for r in rows:
        lp = "n/a" if r["lp_s"] is None else f"{r['lp_s']:.3f}"
        print(f"{r['K']:>3} {r['dp_s']:>8.4f} {lp:>8} {str(r.get('lp_agrees', '-')):>6} "
              f"{r['latency']:>8.4f} {r['exact_latency_of_dp_choice']:>8.4f} "
              f"{r['best_two_level']:>8.4f} {r['speedup']:>6.2f}x  {r['sigma']} {r['T']}")
    report = dict(
        generator=(__doc__ or "").split("Timings:")[0].strip(),
        model="paper", timing="best of repeats after one warm-up, wall clock",
        repeats=args.repeats, lp_time_limit_s=args.lp_time_limit, results=rows,
        machine=dict(processor=platform.processor(), cpu_count=os.cpu_count(),
                     platform=platform.platform(), python=sys.version.split()[0],
                     numpy=np.__version__, scipy=scipy.__version__,
                     load_avg=list(os.getloadavg())))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
