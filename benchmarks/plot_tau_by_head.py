"""Every head in the on-policy training log that was benched with one method, as bars of
its tau on the 12 Spec-Bench questions, in log order, with a target line: how far each
training variant moved tau at a fixed tree.

    python benchmarks/plot_tau_by_head.py docs/results/onpolicy_train_log.jsonl \\
        --method eagle2:3,4,6:vocab=8192 --target 2.0 --rename shipped="shipped (11-26)" \\
        --rename ttt-e2="ttt-e2 (shipped)" --out docs/results/tau_by_head.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def heads(log: Path, method: str) -> list[tuple[str, float]]:
    """``(label, tau)`` of every log row benched with ``method``, in log order."""
    rows = [json.loads(l) for l in log.read_text().splitlines() if l.strip()]
    return [(r["label"], r["tau_12q"]) for r in rows
            if r.get("method") == method and r.get("tau_12q") is not None]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log")
    ap.add_argument("--method", required=True)
    ap.add_argument("--target", type=float)
    ap.add_argument("--rename", action="append", default=[], help="LABEL=SHOWN on the axis")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    shown = dict(r.split("=", 1) for r in args.rename)
    got = [(shown.get(k, k), t) for k, t in heads(Path(args.log), args.method)]
    if not got:
        raise SystemExit(f"no row of {args.log} was benched with {args.method}")
    labels, taus = zip(*got)
    fig, ax = plt.subplots(figsize=(8, 3.6))
    ax.bar(range(len(taus)), taus, color="tab:blue")
    for i, t in enumerate(taus):
        ax.text(i, t + 0.01, f"{t:.2f}", ha="center", va="bottom", fontsize=7)
    if args.target is not None:
        ax.axhline(args.target, color="tab:red", ls="--", lw=1, label=f"target τ {args.target:g}")
        ax.legend(loc="upper left", fontsize=8)
    ax.set_xticks(range(len(labels)), labels, rotation=40, ha="right", fontsize=8)
    ax.set_ylim(1.0, max(max(taus), args.target or 0) + 0.2)
    ax.set_ylabel("τ, 12 Spec-Bench questions")
    ax.set_title(f"SmolLM2-135M heads, {args.method}, in training-log order", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}: {len(taus)} heads, best {max(taus):.3f}")


if __name__ == "__main__":
    main()
