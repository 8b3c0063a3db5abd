"""The data-scaling curve of on-policy training: held-out top-1 on the target's own
answers against training tokens (error bars: one binomial standard error over the
held-out positions), one panel per draft step, one line per run, with each
run's tau on the 12-question Spec-Bench subset (from the training log) in the legend.

    python benchmarks/plot_onpolicy.py --runs plain=RUN1 ttt=RUN2 ttt+fused=RUN3 \\
        --start-of plain=RUN2 --log docs/results/onpolicy_train_log.jsonl \\
        --out docs/results/onpolicy_scaling.png

``--start-of LABEL=RUN`` takes the round-0 row (the head before training) of a run that
started from the same head, for a run whose log has none.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def rows_of(path: str) -> list[dict]:
    p = Path(path)
    p = p / "log.jsonl" if p.is_dir() else p
    return [r for r in (json.loads(l) for l in p.read_text().splitlines() if l.strip())
            if "val_top1" in r]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", nargs="+", required=True, help="label=run_dir (or label=log.jsonl)")
    ap.add_argument("--start-of", nargs="*", default=[], help="label=run_dir")
    ap.add_argument("--log", help="the training log (tau per label)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    taus = {}
    if args.log and Path(args.log).exists():
        for l in Path(args.log).read_text().splitlines():
            r = json.loads(l)
            taus[r["label"]] = r["tau_12q"]
    starts = dict(s.split("=", 1) for s in args.start_of)
    runs = []
    for spec in args.runs:
        label, path = spec.split("=", 1)
        rows = rows_of(path)
        if rows[0]["round"] != 0 and label in starts:
            rows = [r for r in rows_of(starts[label]) if r["round"] == 0] + rows
        runs.append((label, rows))
    steps = len(runs[0][1][0]["val_top1"])
    fig, axes = plt.subplots(1, steps, figsize=(4.3 * steps, 3.7), squeeze=False)
    for s, ax in enumerate(axes[0]):
        for label, rows in runs:
            tau = f" (tau {taus[label]:.2f})" if label in taus else ""
            y = [r["val_top1"][s] for r in rows]
            se = [(p * (1 - p) / r["val_tokens"]) ** 0.5 for p, r in zip(y, rows)]
            ax.errorbar([r["tokens_seen"] / 1e3 for r in rows], y, yerr=se, fmt="o-", ms=4,
                        capsize=2, label=label + tau)
        ax.set_title(f"draft step {s + 1}")
        ax.set_xlabel("training tokens seen (thousands)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("held-out top-1 on the target's answers")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
