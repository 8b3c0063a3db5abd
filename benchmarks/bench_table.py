"""Markdown tables from a ``specjax bench`` JSON: overall, and per category.

    .venv/bin/python benchmarks/bench_table.py docs/results/sd_cpu.json

An interrupted bench (``"complete": false``) is summarized over the questions every method
finished, and says so.
"""

from __future__ import annotations

import dataclasses
import json
import sys


def main(path: str) -> None:
    rep = json.load(open(path))
    ms = rep["methods"] if rep.get("complete") else partial(rep)
    cats = sorted({c for s in ms.values() for c in s["per_category"]})
    print("| method | tok/s | vs ar | τ | questions |\n|---|---:|---:|---:|---:|")
    for name, s in ms.items():
        print(f"| {name} | {s['tokens_per_s']:.1f} | {s.get('speedup_vs_ar', 0):.2f}× | "
              f"{s['tau']:.2f} | {s['n']} |")
    print()
    print("| method | " + " | ".join(cats) + " |")
    print("|---|" + "---:|" * len(cats))
    for name, s in ms.items():
        cells = []
        for c in cats:
            cs = s["per_category"].get(c)
            cells.append("-" if cs is None else f"{cs['tokens_per_s']:.1f} tok/s, "
                         f"{cs.get('speedup_vs_ar', 0):.2f}×, τ {cs['tau']:.2f}")
        print(f"| {name} | " + " | ".join(cells) + " |")
    eagles = [m for m in ms if m.startswith("eagle2")]
    peers = [(a, b) for a, b in [("sd-ngram", "hf-pld")] + [(e, "hf") for e in eagles]
             + [("ar", "hf")] if a in ms and b in ms]
    for a, b in peers:
        print(f"\n{a} / {b}: {ms[a]['tokens_per_s'] / ms[b]['tokens_per_s']:.2f}× tokens/s")
    if rep.get("greedy_mismatch_vs_ar"):
        print(f"\ngreedy mismatches vs ar: {rep['greedy_mismatch_vs_ar']}")


def partial(rep: dict) -> dict:
    """Summaries over the questions that every method of an interrupted bench finished."""
    from specjax import bench

    done = set.intersection(*({r["question"] for r in rs} for rs in rep["runs"].values()))
    fields = {f.name for f in dataclasses.fields(bench.Run)}
    results = {m: [(bench.Question(r["question"], r["category"], ""),
                    bench.Run(**{k: v for k, v in r.items() if k in fields}))
                   for r in rs if r["question"] in done] for m, rs in rep["runs"].items()}
    print(f"interrupted bench: {len(done)} of {rep['n_questions']} questions done by every "
          f"method\n")
    return bench.summarize(results)


if __name__ == "__main__":
    main(sys.argv[1])
