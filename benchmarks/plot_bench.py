"""Plots a ``specjax bench`` JSON: speedup vs ar by category, and acceptance by draft
position for the speculative methods.

    .venv/bin/python benchmarks/plot_bench.py docs/results/sd_cpu.json docs/results/sd_cpu
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def main(path: str, stem: str) -> None:
    rep = json.load(open(path))
    if not rep.get("complete", True):  # interrupted: the questions every method finished
        from bench_table import partial

        rep["methods"] = partial(rep)
        rep["n_questions"] = next(iter(rep["methods"].values()))["n"]
    methods = {k: v for k, v in rep["methods"].items() if k != "ar"}
    cats = sorted({c for s in rep["methods"].values() for c in s["per_category"]})
    fig, ax = plt.subplots(figsize=(9, 4))
    w = 0.8 / max(len(methods), 1)
    for i, (name, s) in enumerate(methods.items()):
        ys = [s["per_category"].get(c, {}).get("speedup_vs_ar", 0) for c in cats]
        ax.bar(np.arange(len(cats)) + i * w, ys, w, label=f"{name} ({s['speedup_vs_ar']:.2f}x)")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(np.arange(len(cats)) + w * (len(methods) - 1) / 2, cats)
    ax.set_ylabel("tokens/s relative to specjax ar")
    ax.set_title(f"{rep['model']}, batch 1, greedy, {rep['max_new_tokens']} new tokens, "
                 f"{rep['n_questions']} questions")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(f"{stem}_speedup.png", dpi=120)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, s in rep["methods"].items():
        acc = s.get("acceptance_by_position")
        if acc:
            ax.plot(np.arange(1, len(acc) + 1), acc, marker="o", label=f"{name} (tau {s['tau']:.2f})")
    ax.set_xlabel("draft position")
    ax.set_ylabel("fraction of rounds reaching it")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(f"{stem}_acceptance.png", dpi=120)
    print(f"wrote {stem}_speedup.png and {stem}_acceptance.png")


if __name__ == "__main__":
    main(*sys.argv[1:3])
