"""DFlash training curves: slot-1 and all-slot top-1 accuracy against tokens seen, one line
per run log (``log.jsonl`` of ``specjax train dflash``), smoothed over 20 steps.

    .venv/bin/python benchmarks/plot_dflash_train.py OUT.png LABEL=LOG [LABEL=LOG ...]
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def _smooth(x: np.ndarray, n: int = 20) -> np.ndarray:
    c = np.cumsum(np.insert(x, 0, 0.0))
    k = np.minimum(np.arange(1, len(x) + 1), n)
    return (c[1:] - c[np.arange(len(x)) + 1 - k]) / k


def main(out: str, *runs: str) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    for run in runs:
        label, path = run.split("=", 1)
        rows = [json.loads(line) for line in open(path)]
        seen = np.cumsum([r["tokens"] for r in rows])
        for key, style in (("acc1", "-"), ("acc", ":")):
            ax.plot(seen, _smooth(np.array([r[key] for r in rows])), style,
                    label=f"{label}: {'slot 1' if key == 'acc1' else 'all slots'}")
    ax.set_xlabel("target tokens seen (training)")
    ax.set_ylabel("top-1 agreement with the answer")
    ax.set_title("DFlash drafter for SmolLM2-135M (2 layers, blocks of 8), CPU")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    main(*sys.argv[1:])
