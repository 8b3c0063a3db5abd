"""HSD on a real model: predicted vs measured latency per token, one point per hierarchy
that ``specjax bench`` ran (``ar`` is the target alone); writes ``OUT.png`` and ``OUT.json``.

    .venv/bin/python benchmarks/plot_hsd.py --calibration docs/results/hsd_calibration_cpu.json \\
        --bench docs/results/hsd_cpu.json --out docs/results/hsd_predicted_vs_measured

Predictions come from ``specjax.hsd.calibrate.predicted_latency`` under the calibration JSON, with
both latency models: ``exact`` (buffer overshoot included; what ``tune`` uses) and ``paper``
(the closed form).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from specjax.hsd import calibrate  # noqa: E402


def points(calib: dict, report: dict) -> list[dict]:
    """One row per hierarchy in ``report``: its spec, measured and predicted ms/token."""
    layers = calib["layers"]
    specs = dict(report.get("hsd", {}).get("hierarchies", {}))
    rows = []
    for method, summary in report["methods"].items():
        if method == "ar":
            sigma, T, spec = (len(layers) + 1,), (), "target"
        elif method in specs:
            spec = specs[method]
            sigma, T = calibrate.parse_hierarchy(spec, layers)
        else:
            continue
        rows.append({"method": method, "hierarchy": spec,
                     "measured_ms": 1e3 / summary["tokens_per_s"],
                     "predicted_ms": calibrate.predicted_latency(calib, sigma, T, "exact"),
                     "predicted_paper_ms": calibrate.predicted_latency(calib, sigma, T, "paper"),
                     "tau": summary.get("tau")})
    for r in rows:
        r["error"] = r["predicted_ms"] / r["measured_ms"] - 1
    return rows


def plot(rows: list[dict], path: Path, title: str) -> None:
    fig, ax = plt.subplots(figsize=(6, 5))
    hi = 1.15 * max(max(r["measured_ms"], r["predicted_ms"]) for r in rows)
    ax.plot([0, hi], [0, hi], "k:", lw=1, label="predicted = measured")
    ax.fill_between([0, hi], [0, 0.9 * hi], [0, 1.1 * hi], color="0.9", label="±10%")
    for r in rows:
        ax.scatter(r["measured_ms"], r["predicted_ms"], zorder=3)
        ax.annotate(r["hierarchy"], (r["measured_ms"], r["predicted_ms"]), fontsize=7,
                    xytext=(4, 4), textcoords="offset points")
    ax.set(xlim=(0, hi), ylim=(0, hi), xlabel="measured ms / token",
           ylabel="predicted ms / token (exact model)", title=title)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calibration", required=True)
    ap.add_argument("--bench", required=True)
    ap.add_argument("--out", required=True, help="path without extension")
    args = ap.parse_args()
    calib = json.loads(Path(args.calibration).read_text())
    report = json.loads(Path(args.bench).read_text())
    rows = points(calib, report)
    for r in rows:
        print(f"{r['hierarchy']:>28}: measured {r['measured_ms']:6.1f} ms/token, predicted "
              f"{r['predicted_ms']:6.1f} (exact) {r['predicted_paper_ms']:6.1f} (paper), "
              f"{100 * r['error']:+.0f}%")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    plot(rows, out.with_suffix(".png"),
         f"HSD, {report['model']}, {report['n_questions']} questions")
    out.with_suffix(".json").write_text(json.dumps({"calibration": args.calibration,
                                                    "bench": args.bench, "points": rows},
                                                   indent=1))
    print(f"wrote {out.with_suffix('.png')} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
