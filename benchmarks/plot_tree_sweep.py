"""Plots a ``specjax bench`` JSON whose methods are one EAGLE head at several tree sizes:
tau and acceptance at each draft position against the tree's draft tokens, with the speed
relative to ``ar`` of the same run.

    .venv/bin/python benchmarks/plot_tree_sweep.py docs/results/onpolicy_bench/tree_sweep.json \\
        docs/results/tree_sweep.png
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import NullFormatter  # noqa: E402


def tree_tokens(method: str) -> int:
    """The draft tokens of ``eagle2:depth,topk,total[:...]``: ``total``."""
    return int(method.split(":")[1].split(",")[2])


def main(path: str, out: str) -> None:
    rep = json.load(open(path))
    rows = sorted(((tree_tokens(k), k, v) for k, v in rep["methods"].items() if k != "ar"))
    xs = [n for n, _, _ in rows]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    ax.plot(xs, [v["tau"] for _, _, v in rows], "o-", color="k", label="τ")
    depth = min(4, max(len(v["acceptance_by_position"]) for _, _, v in rows))
    for d in range(depth):
        ax.plot(xs, [(v["acceptance_by_position"] + [0] * depth)[d] for _, _, v in rows],
                "s--", ms=4, label=f"accepted at position {d + 1}")
    for a in (ax, bx):
        a.set_xscale("log")
        a.set_xticks(xs, [str(x) for x in xs])
        a.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("draft tokens in the tree")
    ax.set_title("tokens per target forward (τ) and acceptance")
    ax.legend(fontsize=7)
    bx.plot(xs, [v["speedup_vs_ar"] for _, _, v in rows], "o-")
    bx.axhline(1.0, color="k", lw=0.8)
    bx.set_xlabel("draft tokens in the tree")
    bx.set_title(f"tokens/s vs ar (same run, {rep['machine']['device']['platform']})")
    fig.suptitle(f"{rep['model']}: {rep['n_questions']} Spec-Bench questions, greedy, "
                 f"{rep['max_new_tokens']} new tokens", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    main(*sys.argv[1:3])
