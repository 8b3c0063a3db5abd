"""Training curve of a ``specjax train`` run: loss and top-1 agreement per step.

    .venv/bin/python benchmarks/plot_train.py runs/eagle/log.jsonl docs/results/eagle_train.png

ReDrafter runs (logs with ``acc1``..``accL``) may be compared: pass several logs, then the
output; each run's loss and held-out agreement by draft step are drawn side by side.
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def smooth(x: np.ndarray, w: int = 25) -> np.ndarray:
    w = max(1, min(w, len(x)))
    return np.convolve(x, np.ones(w) / w, mode="valid")


def read(log: str) -> tuple[dict, dict]:
    """(training rows, held-out rows) by step; a resumed run repeats steps: keep the last."""
    rows, val = {}, {}
    for line in open(log):
        r = json.loads(line)
        (val if any(k.startswith("val_") for k in r) else rows)[r["step"]] = r
    return rows, val


def main(*args: str) -> None:
    *logs, out = args
    rows, val = read(logs[0])
    if "acc1" in next(iter(rows.values())):
        return plot_redrafter(logs, out)
    steps = np.asarray(sorted(rows))
    if "ce" not in rows[steps[-1]]:  # exit heads: KL and top-1 agreement per exit layer
        return plot_exits(rows, steps, out)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, key, title in zip(axes, ("loss", "ce", "acc"),
                              ("total loss", "cross-entropy vs target", "top-1 agreement")):
        y = np.asarray([rows[s][key] for s in steps])
        ax.plot(steps, y, alpha=0.3, lw=0.8)
        ys = smooth(y)
        ax.plot(steps[len(steps) - len(ys):], ys, lw=1.8)
        vkey = {"loss": "val_loss", "acc": "val_acc"}.get(key)
        if vkey and val:
            vs = sorted(val)
            ax.plot(vs, [val[s][vkey] for s in vs], "o-", lw=1.5, ms=4, label="held out")
            ax.legend()
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}; last step {steps[-1]}: "
          + ", ".join(f"{k} {rows[steps[-1]][k]:.3f}" for k in ("loss", "ce", "acc"))
          + (f"; held out: acc {val[max(val)]['val_acc']:.3f}" if val else ""))


def plot_exits(rows: dict, steps: np.ndarray, out: str) -> None:
    layers = sorted(int(k[4:]) for k in rows[steps[-1]] if k.startswith("acc_"))
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    y = np.asarray([rows[s]["loss"] for s in steps])
    axes[0].plot(steps, y, alpha=0.3, lw=0.8)
    axes[0].plot(steps[len(steps) - len(smooth(y)):], smooth(y), lw=1.8)
    axes[0].set_title("KL(final || exit), mean over exits")
    for l in layers:
        ys = smooth(np.asarray([rows[s][f"acc_{l}"] for s in steps]))
        axes[1].plot(steps[len(steps) - len(ys):], ys, lw=1.5, label=f"exit {l}")
    axes[1].set_title("top-1 agreement with the final layer")
    axes[1].legend(fontsize=8)
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}; last step {steps[-1]}: loss {rows[steps[-1]]['loss']:.3f}, "
          + ", ".join(f"exit {l} {rows[steps[-1]][f'acc_{l}']:.3f}" for l in layers))


def plot_redrafter(logs: list[str], out: str) -> None:
    """Training loss and held-out agreement with the target's argmax at each draft step."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for log in logs:
        rows, val = read(log)
        steps = np.asarray(sorted(rows))
        name = log.split("/")[-1].removesuffix(".jsonl").removesuffix("_train_log")
        y = smooth(np.asarray([rows[s]["loss"] for s in steps]))
        axes[0].plot(steps[len(steps) - len(y):], y, lw=1.5, label=name)
        vs = sorted(val)
        depth = sorted(int(k[7:]) for k in val[vs[-1]] if k.startswith("val_acc") and k[7:])
        for d, style in zip(depth, ("o-", "s--", "^:", "d-.")):
            axes[1].plot(vs, [val[s][f"val_acc{d}"] for s in vs], style, ms=4, lw=1.3,
                         label=f"{name}, draft step {d}")
        print(f"{log}: step {steps[-1]}; held out at step {vs[-1]}: "
              + " / ".join(f"{val[vs[-1]][f'val_acc{d}']:.3f}" for d in depth))
    axes[0].set_title("training loss (smoothed; KD and CE are on different scales)")
    axes[1].set_title("held-out agreement with the target's argmax")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(*sys.argv[1:])
