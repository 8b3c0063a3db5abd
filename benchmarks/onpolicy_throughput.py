"""Tokens per second of on-policy data: the target's batched greedy decoding with the
head's features kept (``specjax.train.onpolicy.decode_round``), at batch 1 and at larger
batches, on the training rounds' first ``--n`` prompts (those a run keeps: at most 384
tokens); compile time excluded (each shape runs
once before it is timed). Plain ``ar`` (``specjax.generate``, no features) at batch 1 is
the reference.

    python benchmarks/onpolicy_throughput.py --batches 1,8,32 --out docs/results/onpolicy_throughput_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import specjax
from specjax.models import load
from specjax.train import onpolicy, ttt

from specjax.jax_setup import setup_jax  # noqa: E402

setup_jax()  # as the specjax commands run: XLA:CPU's in-place flag, the compilation cache

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", default="../shared/data/train_prompts")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--n", type=int, default=32, help="prompts timed at every batch size")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    lm = load(args.model)
    cfg = onpolicy.OnPolicyConfig()  # prompts past max_prompt_tokens are skipped, as in a run
    enc = (lm.encode(t, chat=lm.has_chat_template) for _, t in onpolicy.prompt_pool(args.prompts)[48:])
    toks = sorted([t for t in enc if len(t) <= cfg.max_prompt_tokens][:args.n], key=len)
    layers = ttt.EAGLE2.layers(lm.model.config)
    rows = []
    for b in [int(x) for x in args.batches.split(",")]:
        parts = [toks[i:i + b] for i in range(0, len(toks), b)]
        for p in parts:  # compile every shape first
            onpolicy.decode_round(lm, p, args.max_new_tokens, layers)
        t0 = time.perf_counter()
        new = sum(len(t) - pl for p in parts
                  for t, pl, _ in onpolicy.decode_round(lm, p, args.max_new_tokens, layers))
        s = time.perf_counter() - t0
        rows.append({"batch": b, "answer_tokens": new, "seconds": round(s, 2),
                     "tokens_per_s": round(new / s, 1)})
        print(rows[-1], flush=True)
    few = toks[:8]
    specjax.generate(lm.model, lm.params, few[:1], max_new_tokens=args.max_new_tokens,
                     eos_ids=lm.eos_ids)
    t0, new = time.perf_counter(), 0
    for t in few:
        new += len(specjax.generate(lm.model, lm.params, [t], max_new_tokens=args.max_new_tokens,
                                    eos_ids=lm.eos_ids).to_lists()[0])
    ar = {"answer_tokens": new, "seconds": round(time.perf_counter() - t0, 2)}
    ar["tokens_per_s"] = round(new / ar["seconds"], 1)
    print("ar batch 1 (8 prompts):", ar)
    one = next((r for r in rows if r["batch"] == 1), None)
    rep = {"model": args.model, "machine": f"{platform.machine()} CPU, {__import__('os').cpu_count()} cores",
           "max_new_tokens": args.max_new_tokens, "prompts": len(toks), "decode_round": rows,
           "ar_batch1_no_features": ar,
           "speedup_per_token_vs_batch1": {r["batch"]: round(r["tokens_per_s"] / one["tokens_per_s"], 2)
                                           for r in rows} if one else None}
    Path(args.out).write_text(json.dumps(rep, indent=1))
    print(json.dumps(rep, indent=1))


if __name__ == "__main__":
    main()
