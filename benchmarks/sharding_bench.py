"""Sharding overhead: `ar` and `eagle2` on SmolLM2-135M over simulated CPU devices.

Runs batches of 8 Spec-Bench prompts on one device and on meshes of 8 simulated CPU devices
(``--xla_force_host_platform_device_count=8``, set here before JAX starts), all in one
process and interleaved, checks that every mesh's tokens equal the one-device run, and
writes tok/s and the ratio to one device. On a 2-core machine the simulated devices share
the same cores, so this measures the cost of partitioning and collectives, not a speedup.

    .venv/bin/python benchmarks/sharding_bench.py --out docs/results/sharding_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402, F401  (the backend starts after XLA_FLAGS is set)
import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

import specjax  # noqa: E402
from specjax import bench, sharding  # noqa: E402
from specjax import methods as registry  # noqa: E402
from specjax.models import load  # noqa: E402

from specjax.jax_setup import setup_jax  # noqa: E402

setup_jax()  # as the specjax commands run: XLA:CPU's in-place flag, the compilation cache

MESHES = {"1 device": None, "data=8": (8, 1), "model=3": (1, 3), "data=2,model=3": (2, 3)}
# (each mesh compiles its own executables: about 1-2 minutes per method and mesh here)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--questions", default="../shared/data/spec_bench/question.jsonl")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--meshes", default="data=8;model=3;data=2,model=3",
                    help="meshes to compare with one device, separated by ';'")
    ap.add_argument("--methods", default="ar,eagle2", help="of ar, eagle2")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    wanted = ["1 device"] + [m for m in args.meshes.split(";") if m]
    unknown = [m for m in wanted if m not in MESHES]
    if unknown:
        ap.error(f"unknown meshes {unknown}; choose from {list(MESHES)[1:]}")

    lm = load("smollm2-135m")
    qs = bench.load_questions(args.questions, limit=args.batch)
    prompts = [lm.encode(q.text, chat=True) for q in qs]
    drafter, dp = registry.load_drafter("eagle2", lm, "smollm2-135m") if "eagle2" in \
        args.methods else (None, None)
    placed = {name: (None if MESHES[name] is None else sharding.make_mesh(*MESHES[name]))
              for name in wanted}
    params = {name: lm.params if m is None else sharding.shard_params(lm.model.config,
                                                                       lm.params, m)
              for name, m in placed.items()}
    kw = dict(max_new_tokens=args.max_new_tokens, eos_ids=lm.eos_ids)
    methods = {
        "ar": lambda n: specjax.generate(lm.model, params[n], prompts, mesh=placed[n], **kw),
        "eagle2": lambda n: specjax.speculative_generate(lm.model, params[n], drafter, dp,
                                                         prompts, mesh=placed[n], **kw),
    }
    methods = {m: methods[m] for m in args.methods.split(",")}
    times = {(m, n): [] for m in methods for n in wanted}
    tokens, compile_s = {}, {}
    with tqdm(total=len(times) * (args.repeats + 1), desc="sharding bench", unit="run") as bar:
        for rep in range(args.repeats + 1):  # the first pass compiles
            for m, run in methods.items():
                for n in wanted:
                    bar.set_postfix_str(f"{m} {n}")
                    t = time.perf_counter()
                    out = run(n)
                    out.tokens.block_until_ready()
                    dt = time.perf_counter() - t
                    if rep == 0:
                        tokens[m, n], compile_s[m, n] = out.to_lists(), out.compile_s
                    else:
                        times[m, n].append(dt)
                    bar.update(1)
    ref = tokens[next(iter(methods)), "1 device"]  # every method is lossless: one reference
    rows = []
    for (m, n), ts in times.items():
        new = sum(len(t) for t in tokens[m, n])
        rows.append({"method": m, "mesh": n, "seconds_median": float(np.median(ts)),
                     "tokens_per_s": new / float(np.median(ts)), "compile_s": compile_s[m, n],
                     "equal_to_one_device_ar": tokens[m, n] == ref})
    for r in rows:
        base = next(x for x in rows if x["method"] == r["method"] and x["mesh"] == "1 device")
        r["vs_one_device"] = r["tokens_per_s"] / base["tokens_per_s"]
    print(f"{'method':8} {'mesh':16} {'tok/s':>8} {'vs 1 dev':>9} {'compile s':>10}  equal")
    for r in rows:
        print(f"{r['method']:8} {r['mesh']:16} {r['tokens_per_s']:8.1f} {r['vs_one_device']:9.2f}"
              f" {r['compile_s']:10.1f}  {r['equal_to_one_device_ar']}")
    report = {"model": "smollm2-135m", "dtype": "float32", "batch": args.batch,
              "questions": [q.qid for q in qs],
              "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
              "devices": "8 simulated CPU devices (--xla_force_host_platform_device_count=8)",
              "machine": bench.machine_info(), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    return 0 if all(r["equal_to_one_device_ar"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
