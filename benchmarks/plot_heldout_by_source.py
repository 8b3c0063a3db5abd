"""Bar chart of held-out top-1 at draft step 1 (solid) and 3 (hatched) per prompt group,
one bar per head, from ``benchmarks/heldout_by_source.py`` reports.

    python benchmarks/plot_heldout_by_source.py shipped=A.json long=B.json --out P.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("reports", nargs="+", help="LABEL=report.json")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reps = [(r.split("=", 1)[0], json.loads(Path(r.split("=", 1)[1]).read_text()))
            for r in args.reports]
    groups = list(reps[0][1]["groups"])
    width = 0.8 / len(reps)
    fig, ax = plt.subplots(figsize=(10, 4))
    for i, (label, rep) in enumerate(reps):
        xs = [g + (i - (len(reps) - 1) / 2) * width for g in range(len(groups))]
        top = [rep["groups"][g]["val_top1"] for g in groups]
        bars = ax.bar(xs, [t[0] for t in top], width, label=f"{label}: step 1")
        ax.bar(xs, [t[2] for t in top], width, color=bars[0].get_facecolor(), alpha=0.45,
               hatch="//", label=f"{label}: step 3")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([g.replace("spec_bench/", "SB ").replace("store/", "store ")
                        for g in groups], rotation=30, ha="right")
    ax.set_ylabel("held-out top-1")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8, ncol=len(reps))
    ax.set_title("EAGLE head top-1 by prompt group (SmolLM2-135M target, its own answers)")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
