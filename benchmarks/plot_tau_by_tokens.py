"""Tau against the training tokens a head has seen, one line per data source: how far more
data moved tau at a fixed tree. Each point is a ``specjax bench`` report (its eagle
method's tau over the questions it ran); the first point of every line is the head the
runs started from.

    python benchmarks/plot_tau_by_tokens.py docs/results/sharegpt/tau_by_tokens.json \\
        --target 2.0 --out docs/results/sharegpt/tau_by_tokens.png

The input lists ``{"source": ..., "tokens": ..., "bench": "report.json"}`` rows (paths
relative to the input file); the method is the report's one method other than ``ar``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def tau_of(report: Path) -> tuple[str, float]:
    """``(method, tau)`` of the one non-``ar`` method in a ``specjax bench`` report."""
    methods = json.loads(report.read_text())["methods"]
    (name, rec), = [(k, v) for k, v in methods.items() if k != "ar"]
    return name, rec["tau"]


def lines(rows: list[dict], base: Path) -> dict[str, list[tuple[int, float]]]:
    """Per source, its ``(tokens, tau)`` points in token order."""
    out: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        out.setdefault(r["source"], []).append((r["tokens"], tau_of(base / r["bench"])[1]))
    return {k: sorted(v) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("points", help="JSON list of {source, tokens, bench}")
    ap.add_argument("--target", type=float, help="a horizontal line at this tau")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    path = Path(args.points)
    rows = json.loads(path.read_text())
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for source, pts in lines(rows, path.parent).items():
        ax.plot([t / 1e3 for t, _ in pts], [v for _, v in pts], "o-", label=source)
    if args.target:
        ax.axhline(args.target, ls="--", c="grey", lw=1, label=f"target {args.target}")
    method = tau_of(path.parent / rows[0]["bench"])[0]
    ax.set_xlabel("training tokens seen (thousands)")
    ax.set_ylabel(f"tau, {method}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
