"""Reproduces Table 9 of the HSD paper (speedup of the optimal hierarchy over the target
alone) as heatmaps, ours next to the printed values; writes ``docs/results/hsd_table9.png``
and ``docs/results/hsd_table9.json``.

    .venv/bin/python benchmarks/plot_table9.py [--data tests/data/hsd/paper_tables.json]

Setting: target A costs 1024, B costs 256 with alpha(B, A) = 0.5; C's cost varies by
column, alpha(C, B) by row (0..0.9) and alpha(C, A) = max(0, alpha(C, B) + alpha(B, A) - 1).
Each cell: 1024 / optimal latency over all hierarchies ending with A and T <= 15.

Columns. The printed header lists 8 C costs (1, 2, ..., 128) for 9 columns. We append 256:
with it 85 of the 90 cells match to the printed 0.01 (the others by 0.01), against 51 when
0.5 is prepended instead; a C as costly as B cannot help, which is what the all-1.2 last
column shows. Both choices are recorded in the JSON. The "paper" latency model (closed form,
exact gamma) is the one that reproduces the table; the exact model (buffer overshoot
included) is recorded too, with larger speedups where C-B-A is chosen.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from specjax.hsd import hierarchy as H  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NAMES = "CBA"


def grid(alpha_cb: list[float], cost_c: list[float], model: str, t_max: int = 15) -> dict:
    """Speedups and chosen hierarchies (e.g. ``"CBA T=(1, 2)"``) for every cell."""
    speed, label = np.zeros((len(alpha_cb), len(cost_c))), []
    for r, acb in enumerate(alpha_cb):
        label.append([])
        for k, cc in enumerate(cost_c):
            alpha = [[None, acb, max(0.0, acb + 0.5 - 1)], [None, None, 0.5], [None] * 3]
            lat, sigma, T = H.optimal_hierarchy([cc, 256.0, 1024.0], alpha, t_max,
                                                method="brute", model=model)
            speed[r, k] = 1024.0 / lat
            label[-1].append("".join(NAMES[i] for i in sigma) + f" T={T}")
    return dict(speedup=speed.tolist(), hierarchy=label)


def heatmap(ax, values: np.ndarray, text: list[list[str]], title: str, cols, rows, vmax):
    ax.imshow(values, cmap="viridis", vmin=1.0, vmax=vmax, origin="lower", aspect="auto")
    for (r, k), v in np.ndenumerate(values):
        ax.text(k, r, text[r][k], ha="center", va="center", fontsize=6.5,
                color="white" if v < 1 + 0.6 * (vmax - 1) else "black")
    ax.set_xticks(range(len(cols)), [f"{c:g}" for c in cols])
    ax.set_yticks(range(len(rows)), [f"{a:.1f}" for a in rows])
    ax.set_xlabel("cost of C (A = 1024, B = 256)")
    ax.set_ylabel("alpha(C, B)")
    ax.set_title(title, fontsize=9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(ROOT / "tests/data/hsd/paper_tables.json"))
    ap.add_argument("--out", default=str(ROOT / "docs/results/hsd_table9"))
    args = ap.parse_args()
    t9 = json.loads(Path(args.data).read_text())["table9"]
    rows, printed = t9["alpha_C_to_B"], np.array(t9["speedup_rows_as_printed"])
    choices = {"append_256": t9["cost_C_header_as_printed"] + [256.0],
               "prepend_0.5": [0.5] + t9["cost_C_header_as_printed"]}
    report = dict(setting=__doc__.split("Columns.")[0].split("Setting:")[1].strip(),
                  alpha_C_to_B=rows, paper=printed.tolist(), column_choices={})
    for name, cols in choices.items():
        ours = {m: grid(rows, cols, m) for m in ("paper", "exact")}
        for m, g in ours.items():
            d = np.round(g["speedup"], 2) - printed
            g.update(max_abs_diff=float(np.abs(d).max().round(4)),
                     cells_equal_to_print=int((np.abs(d) < 0.005).sum()))
        report["column_choices"][name] = dict(cost_C=cols, ours=ours)
    used = report["column_choices"]["append_256"]
    cols, ours, exact = used["cost_C"], used["ours"]["paper"], used["ours"]["exact"]
    vmax = float(max(np.max(exact["speedup"]), printed.max()))
    fig, axes = plt.subplots(1, 3, figsize=(19, 5.2))
    short = lambda g: [[f"{v:.2f}\n{h.split()[0]}" for v, h in zip(rv, rh)]  # noqa: E731
                       for rv, rh in zip(g["speedup"], g["hierarchy"])]
    heatmap(axes[0], np.array(ours["speedup"]), short(ours), "ours, paper latency model "
            f"({ours['cells_equal_to_print']}/90 cells = print, max |diff| "
            f"{ours['max_abs_diff']:.2f})", cols, rows, vmax)
    heatmap(axes[1], printed, [[f"{v:.2f}" for v in r] for r in printed],
            "paper, Table 9 as printed (last column's C cost taken as 256)", cols, rows, vmax)
    heatmap(axes[2], np.array(exact["speedup"]), short(exact), "ours, exact model (overshoot) "
            f"({exact['cells_equal_to_print']}/90 = print, max |diff| "
            f"{exact['max_abs_diff']:.2f})", cols, rows, vmax)
    fig.suptitle("HSD Table 9: speedup of the optimal hierarchy over A alone", fontsize=11)
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=110)
    Path(args.out + ".json").write_text(json.dumps(report, indent=1) + "\n")
    for name, c in report["column_choices"].items():
        for m, g in c["ours"].items():
            print(f"{name:12s} {m:6s} cells equal to print {g['cells_equal_to_print']}/90, "
                  f"max |diff| {g['max_abs_diff']:.2f}")
    print(f"wrote {args.out}.png and {args.out}.json")


if __name__ == "__main__":
    main()
