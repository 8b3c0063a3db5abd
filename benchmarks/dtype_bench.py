"""bfloat16 against float32 on SmolLM2-135M: tok/s of `ar` and `eagle2`, and greedy agreement.

Three configurations are loaded in one process: float32; bfloat16 weights and cache with
float32 products (``compute_dtype`` float32, the default); and bfloat16 weights, cache and
products (``compute_dtype=jnp.bfloat16``). Every question is decoded by each
(configuration, method) in turn, so machine noise hits all alike (compile time excluded).
Reports tok/s and the ratio to float32 per method, which questions' `eagle2` output leaves
`ar`'s within a configuration (greedy speculative output must equal `ar`'s), and how far
each bfloat16 `ar` agrees with float32 `ar` (identical outputs, and the mean share of tokens
before the first difference). Exits 1 when a default configuration leaves `ar`.

    .venv/bin/python benchmarks/dtype_bench.py --limit 12 --out docs/results/bf16_cpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from specjax import bench
from specjax import methods as registry
from specjax.models import load

from specjax.jax_setup import setup_jax  # noqa: E402

setup_jax()  # as the specjax commands run: XLA:CPU's in-place flag, the compilation cache

# name -> (weights and cache, product inputs)
CONFIGS = {"float32": (jnp.float32, jnp.float32),
           "bfloat16": (jnp.bfloat16, jnp.float32),
           "bfloat16-products": (jnp.bfloat16, jnp.bfloat16)}
OPT_IN = ("bfloat16-products",)  # labelled: greedy output may leave ar on near-ties


def _prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _agreement(ref: list, other: list) -> dict:
    return {"identical": int(sum(a.tokens == b.tokens for a, b in zip(ref, other))),
            "questions": len(ref),
            "mean_prefix_share": float(np.mean([_prefix(a.tokens, b.tokens) / max(len(a.tokens), 1)
                                                for a, b in zip(ref, other)]))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--questions", default="../shared/data/spec_bench/question.jsonl")
    ap.add_argument("--limit", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    qs = bench.load_questions(args.questions, limit=args.limit)
    methods = {}
    for name, (dtype, compute) in CONFIGS.items():
        lm = load("smollm2-135m", dtype=dtype, compute_dtype=compute)
        methods[name, "ar"] = (lm, bench.ar_method(lm))
        eagle2 = registry.build("eagle2", lm, registry.Options(model_name="smollm2-135m"))
        methods[name, "eagle2"] = (lm, bench.decoder_method(lm, eagle2))
    runs = {k: [] for k in methods}
    with tqdm(total=len(qs) * len(methods), desc="dtype bench", unit="run") as bar:
        for q in qs:
            for k, (lm, run) in methods.items():
                bar.set_postfix_str(f"{q.category} {k[0]} {k[1]}")
                runs[k].append(run(lm.encode(q.text, chat=True), args.max_new_tokens))
                bar.update(1)
    rows = {}
    for k, rs in runs.items():
        toks, secs = sum(len(r.tokens) for r in rs), sum(r.seconds for r in rs)
        rows[f"{k[0]} {k[1]}"] = {"tokens_per_s": toks / secs, "tokens": toks,
                                  "compile_s": max(r.compile_s for r in rs),
                                  "tau": toks / sum(r.target_forwards for r in rs)}
    for (name, m), r in zip(runs, rows.values()):
        if name != "float32":
            r["vs_float32"] = r["tokens_per_s"] / rows[f"float32 {m}"]["tokens_per_s"]
    agree = {name: _agreement(runs["float32", "ar"], runs[name, "ar"])
             for name in CONFIGS if name != "float32"}
    mismatch = {f"{d} eagle2": [q.qid for q, a, e in zip(qs, runs[d, "ar"], runs[d, "eagle2"])
                                if a.tokens != e.tokens] for d in CONFIGS}
    for k, r in rows.items():
        print(f"{k:26} {r['tokens_per_s']:7.1f} tok/s  tau {r['tau']:.2f}"
              + (f"  ({r['vs_float32']:.2f}x float32)" if "vs_float32" in r else ""))
    for name, a in agree.items():
        print(f"{name} ar == float32 ar on {a['identical']}/{a['questions']} questions; mean "
              f"share before the first difference {a['mean_prefix_share']:.2f}")
    print(f"eagle2 != ar (same configuration): {mismatch}")
    report = {"model": "smollm2-135m", "max_new_tokens": args.max_new_tokens,
              "questions": [q.qid for q in qs], "machine": bench.machine_info(), "rows": rows,
              "configurations": {k: [jnp.dtype(d).name for d in v] for k, v in CONFIGS.items()},
              "ar_agreement_with_float32": agree, "greedy_mismatch_vs_ar": mismatch}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    return 1 if any(v for k, v in mismatch.items() if k.split()[0] not in OPT_IN) else 0


if __name__ == "__main__":
    sys.exit(main())
