"""The data-scaling curve of on-policy training: held-out top-1 per draft step on the
target's own answers against training tokens, one panel per run, with each run's tau on
the 12-question Spec-Bench subset from the training log.

    python scripts/plot_onpolicy.py --runs plain=RUN1 ttt=RUN2 ttt+fused=RUN3 \\
        --log docs/results/onpolicy_train_log.jsonl --out docs/results/onpolicy_scaling.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", nargs="+", required=True, help="label=run_dir (or label=log.jsonl)")
    ap.add_argument("--log", help="the training log (tau per label)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    taus = {}
    if args.log and Path(args.log).exists():
        for l in Path(args.log).read_text().splitlines():
            r = json.loads(l)
            taus[r["label"]] = r["tau_12q"]
    fig, axes = plt.subplots(1, len(args.runs), figsize=(4.2 * len(args.runs), 3.6),
                             sharey=True, squeeze=False)
    for ax, spec in zip(axes[0], args.runs):
        label, path = spec.split("=", 1)
        p = Path(path)
        p = p / "log.jsonl" if p.is_dir() else p
        rows = [json.loads(l) for l in p.read_text().splitlines() if l.strip()]
        rows = [r for r in rows if "val_top1" in r]
        x = [r["tokens_seen"] / 1e3 for r in rows]
        for s in range(len(rows[0]["val_top1"])):
            ax.plot(x, [r["val_top1"][s] for r in rows], "o-", label=f"draft step {s + 1}")
        tau = f", tau {taus[label]:.2f}" if label in taus else ""
        ax.set_title(f"{label}{tau}")
        ax.set_xlabel("training tokens (thousands)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("held-out top-1 (target's answers)")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
