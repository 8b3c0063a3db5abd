"""Draws ``docs/results/data_path/*.json`` (``benchmarks/data_path.py``'s results): each
phase's tokens/s as a fraction of the roofline at its row count, one bar per model.

    .venv/bin/python benchmarks/plot_data_path.py docs/results/data_path
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    folder = Path(sys.argv[1])
    runs = [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]
    phases = [r["phase"] for r in runs[0]["rows"] if "of_roofline" in r]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    w = 0.8 / len(runs)
    for k, run in enumerate(runs):
        got = {r["phase"]: r["of_roofline"] for r in run["rows"] if "of_roofline" in r}
        ax.bar([i + k * w for i in range(len(phases))], [got.get(p, 0) for p in phases], w,
               label=run["model"])
    ax.axhline(0.7, ls="--", c="gray", lw=0.8)
    ax.axhline(0.5, ls=":", c="gray", lw=0.8)
    ax.set_xticks([i + w * (len(runs) - 1) / 2 for i in range(len(phases))],
                  [p.replace("decode_batch", "decode b").replace("_", " ") for p in phases])
    ax.set_ylabel("of the matmul roofline")
    ax.set_ylim(0, 1.05)
    ax.legend(frameon=False, fontsize=8)
    ax.set_title("Data path on the 2-core CPU (float32); goals: 0.7 features, 0.5 decoding",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(folder / "data_path.png", dpi=120)


if __name__ == "__main__":
    main()
