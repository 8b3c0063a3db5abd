"""Plot a ReDrafter W x L ablation from a `specjax bench` JSON: speedup vs ar, tau and tokens
per verification forward for every `redrafter:W,L` method in it.

    python benchmarks/plot_redrafter_grid.py docs/results/redrafter_grid_cpu.json \
        docs/results/redrafter_grid_cpu.png
"""

from __future__ import annotations

import json
import re
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def grid(report: dict):
    cells = {}
    for name, m in report["methods"].items():
        hit = re.fullmatch(r"redrafter:(\d+),(\d+)", name)
        if hit:
            cells[int(hit[1]), int(hit[2])] = m
    ws = sorted({w for w, _ in cells})
    ls = sorted({l for _, l in cells})
    return ws, ls, cells


def main(src: str, out: str) -> None:
    report = json.load(open(src))
    ws, ls, cells = grid(report)
    keys = [("speedup_vs_ar", "speedup vs ar"), ("tau", "tau (tokens / target forward)"),
            ("tokens_per_forward", "tokens per verification forward")]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, (k, title) in zip(axes, keys):
        z = np.full((len(ws), len(ls)), np.nan)
        for (w, l), m in cells.items():
            z[ws.index(w), ls.index(l)] = m.get(k) or np.nan
        im = ax.imshow(z, cmap="viridis", origin="lower")
        for i in range(len(ws)):
            for j in range(len(ls)):
                if np.isfinite(z[i, j]):
                    ax.text(j, i, f"{z[i, j]:.2f}", ha="center", va="center", color="w")
        ax.set_xticks(range(len(ls)), ls)
        ax.set_yticks(range(len(ws)), ws)
        ax.set_xlabel("beam length L")
        ax.set_ylabel("beam width W")
        ax.set_title(title)
        fig.colorbar(im, ax=ax, shrink=0.8)
    fig.suptitle(f"ReDrafter W x L on {report['model']}, {report.get('n_questions', '?')} "
                 f"questions, {report['max_new_tokens']} new tokens ({report['machine']['cpu_count']}"
                 f"-core CPU)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
