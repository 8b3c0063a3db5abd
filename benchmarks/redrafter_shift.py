"""How well a ReDrafter head predicts the target on the target's own answers.

For each Spec-Bench question, the target's greedy answer (chat template, ``--max-new-tokens``)
is teacher-forced through the head with the training loss (``specjax.train.redrafter``):
``acc{i}`` is the head's top-1 agreement with the target's argmax at draft step ``i`` over
the answer positions. Compare with the held-out agreement in the head's training log: a
large gap means the training text differs from what the target writes.

    python benchmarks/redrafter_shift.py --limit 12 --out docs/results/redrafter_shift_cpu.json
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

import specjax
from specjax import bench, methods
from specjax.models import load
from specjax.train import redrafter as train_rd
from specjax.train.text_corpus import _prefill_fn

from specjax.jax_setup import setup_jax  # noqa: E402

setup_jax()  # as the specjax commands run: XLA:CPU's in-place flag, the compilation cache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--head", required=True,
                    help="exported head (`specjax train redrafter ... --export DIR`)")
    ap.add_argument("--questions")
    ap.add_argument("--limit", type=int, default=12)
    ap.add_argument("--unroll", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    lm = load(args.model)
    _, dp = methods.load_drafter("redrafter", lm, args.model, args.head)
    v = lm.model.config.vocab_size
    vid = dp.get("vocab_ids")
    index_of = np.full(v, -1, np.int32)
    index_of[np.arange(v) if vid is None else np.asarray(vid)] = np.arange(
        v if vid is None else len(vid))
    cfg = train_rd.TrainConfig(steps=1, unroll=args.unroll, loss="kd")
    metrics = jax.jit(lambda t, h, m: train_rd.loss_fn(
        dp["head"], lm.params, t, h, m, vid, jnp.asarray(index_of), target=lm.model,
        cfg=cfg)[1])
    hidden_of = _prefill_fn(lm.model)
    sums, weight, per_q = {}, 0.0, []
    for q in tqdm(bench.load_questions(args.questions, None, args.limit), desc="questions"):
        ids = lm.encode(q.text, chat=lm.has_chat_template)
        ans = specjax.generate(lm.model, lm.params, [ids], max_new_tokens=args.max_new_tokens,
                               eos_ids=lm.eos_ids).to_lists()[0]
        seq = jnp.asarray([ids + ans], jnp.int32)
        mask = np.zeros(seq.shape, np.float32)
        mask[0, len(ids):] = 1.0
        m = {k: float(x) for k, x in metrics(seq, hidden_of(lm.params, seq).astype(jnp.float32),
                                             jnp.asarray(mask)).items()}
        per_q.append({"question": q.qid, "category": q.category, "answer_tokens": len(ans), **m})
        for k, x in m.items():
            sums[k] = sums.get(k, 0.0) + x * len(ans)
        weight += len(ans)
    mean = {k: x / weight for k, x in sums.items()}
    print("teacher-forced on the target's answers: "
          + ", ".join(f"{k} {x:.3f}" for k, x in mean.items()))
    with open(args.out, "w") as f:
        json.dump({"model": args.model, "head": args.head, "unroll": args.unroll,
                   "max_new_tokens": args.max_new_tokens, "mean_weighted_by_tokens": mean,
                   "per_question": per_q}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
