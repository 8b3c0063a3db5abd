"""Calibration of the EAGLE head (EAGLE-2's Figure 6): draft confidence vs acceptance.

On held-out Spec-Bench questions, the target's greedy answer is teacher-forced through the
head. At every answer position the head's top-``k`` draft tokens and their probabilities
are compared with the target's next token: a draft token is accepted when it is that token.
Depth 1 reads the target's true feature of the previous position; depth 2 reads the head's
own predicted feature, as the second level of a draft tree does.

    python benchmarks/eagle_calibration.py --questions ../shared/data/spec_bench/question.jsonl \
        --limit 30 --out docs/results/eagle_calibration
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

import specjax
from specjax import bench, methods
from specjax.drafters import eagle
from specjax.models import load

from specjax.jax_setup import setup_jax  # noqa: E402

setup_jax()  # as the specjax commands run: XLA:CPU's in-place flag, the compilation cache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--head", help="exported head (default: the shipped one)")
    ap.add_argument("--questions")
    ap.add_argument("--limit", type=int, default=30)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default="docs/results/eagle_calibration")
    args = ap.parse_args()

    lm = load(args.model)
    drafter, dp = methods.load_drafter("eagle2", lm, args.model, args.head)
    hp, tp, m = dp["head"], lm.params, lm.model
    emb = dp.get("out_embed", eagle.output_embedding(m, tp))
    ids_map = dp.get("vocab_ids")
    fwd = jax.jit(lambda toks, prev: eagle.training_forward(m, hp, tp, toks, prev))
    conf = {1: [], 2: []}
    hit = {1: [], 2: []}
    for q in tqdm(bench.load_questions(args.questions, limit=args.limit), desc="calibration"):
        ids = lm.encode(q.text, chat=lm.has_chat_template)
        ans = specjax.generate(m, tp, [ids], max_new_tokens=args.max_new_tokens,
                               eos_ids=lm.eos_ids).to_lists()[0]
        seq = jnp.asarray([ids + ans])
        t = seq.shape[1]
        _, hid, _ = m.forward(tp, seq, jnp.arange(t)[None], m.init_cache(1, t))
        f = eagle.features(m, tp, hid[m.config.num_layers])
        toks, prev = eagle.head_inputs(seq, f)  # entry j: token j + 1 beside feature j
        out1 = fwd(toks, prev)  # entry j predicts feature j + 1, and so token j + 2
        # the previous feature predicted: entry j reads entry j - 1's output
        out2 = fwd(toks, jnp.pad(out1, ((0, 0), (1, 0), (0, 0)))[:, :-1])
        nxt = np.asarray(seq[0, 2:])
        lo = len(ids) - 2  # the entry that predicts the first answer token
        for depth, out in ((1, out1), (2, out2)):
            q_ = jax.nn.softmax(out[0, lo:t - 2] @ emb.T.astype(out.dtype), -1)
            p, k = jax.lax.top_k(q_, args.topk)
            k = np.asarray(k if ids_map is None else ids_map[k])
            conf[depth].append(np.asarray(p).ravel())
            hit[depth].append((k == nxt[lo:, None]).ravel())
    bins = np.linspace(0, 1, 11)
    report = {"model": args.model, "topk": args.topk, "questions": args.limit,
              "method": "teacher-forced on the target's greedy answers", "depths": {}}
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.6, 4.2))
    ax.plot([0, 1], [0, 1], "k:", lw=1, label="calibrated")
    for depth in (1, 2):
        c, h = np.concatenate(conf[depth]), np.concatenate(hit[depth])
        idx = np.clip(np.digitize(c, bins) - 1, 0, len(bins) - 2)
        rate = [float(h[idx == i].mean()) if np.any(idx == i) else None
                for i in range(len(bins) - 1)]
        count = [int(np.sum(idx == i)) for i in range(len(bins) - 1)]
        report["depths"][depth] = {"bin_lo": bins[:-1].tolist(), "acceptance": rate,
                                   "count": count,
                                   "top1_acceptance": float(h.reshape(-1, args.topk)[:, 0].mean())}
        mid = (bins[:-1] + bins[1:]) / 2
        ok = [i for i, r in enumerate(rate) if r is not None and count[i] >= 20]
        ax.plot(mid[ok], [rate[i] for i in ok], "o-", label=f"depth {depth}")
    ax.set_xlabel("draft confidence (head probability)")
    ax.set_ylabel("acceptance rate")
    ax.set_title(f"EAGLE head calibration, {args.model}")
    ax.legend()
    fig.tight_layout()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out.with_suffix(".png"), dpi=120)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    print(json.dumps({d: v["top1_acceptance"] for d, v in report["depths"].items()}))
    print(f"wrote {out.with_suffix('.png')} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
