"""Held-out top-1 of an EAGLE head per prompt source: the on-policy store's held-out
answers by source (GSM8K, self-instruct, T0), and the target's own greedy answers to
Spec-Bench questions by category (its six: MT-bench, translation, summarization, QA,
math, RAG; the first N of each; decoded here, scored only: never trained on).

The head is unrolled on its own outputs for 3 draft steps, the target's tokens fed, on
answer positions, exactly as ``specjax train onpolicy`` scores its held-out set
(``onpolicy.validate``). It says where a head's acceptance is lost to the prompts it
was trained on.

    python benchmarks/heldout_by_source.py --head shipped --out docs/results/heldout_by_source.json
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

from specjax.jax_setup import setup_jax  # noqa: E402

setup_jax()  # as the specjax commands run: XLA:CPU's in-place flag, the compilation cache


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--head", default="shipped", help="'shipped' or an EAGLE-2 head directory")
    p.add_argument("--shards", default="data/onpolicy/smollm2-135m")
    p.add_argument("--questions", default="../shared/data/spec_bench/question.jsonl")
    p.add_argument("--per-category", type=int, default=12,
                   help="Spec-Bench questions per category (the first N of each)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--vocab", type=int, default=8192,
                   help="ids ranked (the first of the head's vocabulary order), as "
                        "`train onpolicy --draft-vocab` and the bench's `vocab=8192`")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import jax.numpy as jnp

    from specjax import bench
    from specjax.heads import shipped_head
    from specjax.models import load
    from specjax.train import glue, onpolicy, shards, ttt

    kind = ttt.EAGLE2
    lm = load(args.model)
    start = glue.onpolicy_start(args.head, shipped_head("eagle", args.model), kind)
    head = glue.onpolicy_head(start, lm.model.config, kind)
    vids = jnp.asarray(start.order[:args.vocab], jnp.int32)
    layers = kind.layers(lm.model.config)
    evaluate = onpolicy.make_eval(kind, lm.model)
    score = lambda ex: onpolicy.validate(evaluate, head, lm.params, ex, vids, 4096)

    groups: dict[str, list] = collections.defaultdict(list)
    manifest = shards.read_manifest(args.shards)
    store = shards.ShardStore.open(args.shards, manifest["target"], lm.model.config.vocab_size)
    val = onpolicy.prefill_features(lm, store.read("val"), layers)
    for pid, ex in zip(manifest["val"]["prompt_ids"], val):
        groups["store/" + pid.split("#")[0].split("/")[0]].append(ex)

    cats: dict[str, list] = collections.defaultdict(list)
    for q in bench.load_questions(args.questions):  # MT-bench's categories as mt_bench
        if len(cats[q.category]) < args.per_category:
            cats[q.category].append(q)
    for cat, rows in cats.items():
        toks = [lm.encode(q.text, chat=lm.has_chat_template) for q in rows]
        groups["spec_bench/" + cat] = onpolicy.decode_round(lm, toks, args.max_new_tokens,
                                                            layers)
        print(f"decoded {len(rows)} Spec-Bench {cat} questions", flush=True)

    out = {"model": args.model, "head": args.head, "vocab": int(len(vids)),
           "max_new_tokens": args.max_new_tokens, "groups": {}}
    for name, ex in sorted(groups.items()):
        r = score(ex)
        out["groups"][name] = {"prompts": len(ex), **r}
        print(f"{name:32s} {len(ex):3d} prompts {r['val_tokens']:6d} tokens  top-1 "
              + " / ".join(f"{x:.3f}" for x in r["val_top1"]), flush=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
