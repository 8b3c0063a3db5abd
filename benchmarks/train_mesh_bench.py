"""Training throughput on a mesh: EAGLE-head steps on one device and on 8 simulated CPU devices.

Trains an EAGLE head (``specjax.train.eagle.train``, Orbax checkpoints included) on a random
4-layer Llama (vocabulary 8192, hidden 512) for ``--steps`` steps of about
``--batch-tokens`` tokens, once per setting, each in its own process: ``1 device`` without
flags, the meshes with ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (JAX fixes
its device count when it starts). The corpus is random tokens and features of the target's
width: throughput does not depend on their values. Tokens/s counts the trained (masked)
tokens of the steps after the first (which compiles). On a CPU the simulated devices share
the same cores, so this measures the cost of partitioning and collectives, not a speedup.

    .venv/bin/python benchmarks/train_mesh_bench.py --out docs/results/train_mesh_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from specjax.jax_setup import setup_jax  # noqa: E402

setup_jax()  # as the specjax commands run: XLA:CPU's in-place flag, the compilation cache

SETTINGS = {"1 device": None, "data=8": (8, 1), "data=2,model=4": (2, 4)}
MACHINE = "2-core x86_64 CPU, 8 simulated devices share the same 2 cores"


def child(setting: str, steps: int, batch_tokens: int) -> dict:
    """One setting's run in this process: ``{"setting", "tokens_per_s", ...}``."""
    import jax
    import numpy as np

    from specjax import sharding
    from specjax.models.llama import Llama, LlamaConfig, init_params
    from specjax.train import eagle as train_eagle

    cfg = LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_layers=4,
                      num_heads=8, num_kv_heads=4, head_dim=64, max_position_embeddings=1024)
    model, tp = Llama(cfg), init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    corpus = []
    for n in rng.integers(100, 128, size=128):  # one length bucket (128): one compile
        corpus.append((rng.integers(1, cfg.vocab_size, size=n).astype(np.int32), 32,
                       rng.standard_normal((n, cfg.hidden_size)).astype(np.float32)))
    tc = train_eagle.TrainConfig(steps=steps, batch_tokens=batch_tokens, max_len=128,
                                 warmup=1, save_every=steps, ce_vocab=4096, noise=0.0)
    plan = train_eagle.batch_plan(corpus, tc)
    trained = [float(train_eagle.batch_at(corpus, plan, s, tc)[3].sum()) for s in range(steps)]
    mesh = None if SETTINGS[setting] is None else sharding.make_mesh(*SETTINGS[setting])
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as run:
        t = time.perf_counter()
        train_eagle.train(model, tp, corpus, tc, run, log=rows.append, mesh=mesh)
        total = time.perf_counter() - t
    secs = [r["seconds"] for r in rows if "seconds" in r]
    steady = secs[-1] - secs[0]  # steps 2..N: the first compiles
    return {"setting": setting, "devices": len(jax.devices()), "steps": steps,
            "rows_per_step": len(plan[0]), "trained_tokens_per_step": float(np.mean(trained)),
            "tokens_per_s": sum(trained[1:]) / steady, "seconds_per_step": steady / (steps - 1),
            "first_step_s": secs[0], "total_s": round(total, 1)}


def run_child(setting: str, args) -> dict:
    env = dict(os.environ)
    if SETTINGS[setting] is not None:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "")
                            + " --xla_force_host_platform_device_count=8").strip()
    r = subprocess.run([sys.executable, __file__, "--child", setting, "--steps", str(args.steps),
                        "--batch-tokens", str(args.batch_tokens)], env=env, capture_output=True,
                       text=True, check=False)
    if r.returncode:
        raise SystemExit(f"{setting} failed:\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--out", default="docs/results/train_mesh_cpu.json")
    ap.add_argument("--child", choices=list(SETTINGS), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.steps, args.batch_tokens)))
        return 0
    import jax

    rows = [run_child(s, args) for s in SETTINGS]
    base = rows[0]["tokens_per_s"]
    print(f"{'setting':16} {'devices':>7} {'tok/s':>8} {'s/step':>7} {'vs 1 dev':>8}")
    for r in rows:
        r["vs_one_device"] = round(r["tokens_per_s"] / base, 3)
        print(f"{r['setting']:16} {r['devices']:7d} {r['tokens_per_s']:8.1f} "
              f"{r['seconds_per_step']:7.3f} {r['vs_one_device']:8.2f}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=Path(__file__).parent).stdout.strip()
    report = {"what": "EAGLE-head training throughput (specjax.train.eagle.train), trained "
                      "tokens/s after the first (compiling) step",
              "target": "random Llama: vocab 8192, hidden 512, MLP 1536, 4 layers, 8/4 heads",
              "machine": MACHINE, "note": "the CPU was shared with other jobs while this ran",
              "jax": jax.__version__, "commit": commit,
              "command": "python benchmarks/train_mesh_bench.py " + " ".join(sys.argv[1:]),
              "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
