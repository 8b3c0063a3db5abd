"""Where a speculative round's time goes on this machine: the target forward at each
verification width, and the drafting, verification and KV-commit steps, each jitted and
timed alone (median of repeats) at one cache capacity. With ``--eagle SPEC``, also one
EAGLE-2 tree draft with the shipped head (its first head pass over the pending features,
then ``depth`` levels). Writes JSON.

    .venv/bin/python benchmarks/profile_round.py --capacity 1024 --out docs/results/profile_round_cpu.json
    .venv/bin/python benchmarks/profile_round.py --widths 1,7 --eagle eagle2:3,4,6:vocab=8192
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

import specjax  # noqa: F401
from specjax.core import sampling, tree
from specjax.drafters import Context, NGramDrafter
from specjax.models import load
from specjax.core.verify import Draft, verify
from specjax._timing import median_ms

from specjax.jax_setup import setup_jax  # noqa: E402

setup_jax()  # as the specjax commands run: XLA:CPU's in-place flag, the compilation cache


def _timed(fn, *args):
    return median_ms(fn, *args, repeats=15)


def _eagle_propose_ms(lm, spec: str, ctx: Context) -> float:
    """One EAGLE-2 ``propose`` (head pass over the pending root, then the tree's levels)."""
    from specjax import methods

    drafter, dparams = methods.load_drafter(spec, lm, "smollm2-135m")
    b, c = ctx.tokens.shape
    n = int(ctx.length[0])
    ctx = ctx.replace(length=ctx.length + 1, prompt_len=ctx.length,
                      hidden=jnp.ones((b, c, lm.model.config.hidden_size), jnp.float32))
    state = jax.jit(lambda dp, ctx: drafter.init(dp, ctx, 64))(dparams, ctx)
    assert int(state.cache.length[0]) == n
    fn = jax.jit(lambda dp, st, ctx: drafter.propose(dp, st, ctx, None, sampling.Greedy())[0].tokens)
    return _timed(fn, dparams, state, ctx)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--capacity", type=int, default=1024)
    p.add_argument("--filled", type=int, default=800)
    p.add_argument("--widths", default="1,2,3,5,9,17")
    p.add_argument("--eagle", help="also time one EAGLE-2 draft with this spec")
    p.add_argument("--out")
    args = p.parse_args()
    lm = load(args.model, tokenizer=False)
    m, params = lm.model, lm.params
    cache = m.init_cache(1, args.capacity).replace(length=jnp.asarray([args.filled]))
    res = {"capacity": args.capacity, "filled": args.filled, "forward_ms": {}}

    @jax.jit
    def fwd(params, toks, cache):
        n = toks.shape[1]
        parents = tree.chain(1, n - 1)
        logits, _, c = m.forward(params, toks, tree.positions(cache.length, parents), cache,
                                 tree.attention_mask(parents))
        return logits, c.length

    for w in [int(x) for x in args.widths.split(",")]:
        toks = jnp.ones((1, w), jnp.int32)
        res["forward_ms"][w] = _timed(fwd, params, toks, cache)
        print(f"target forward, {w} tokens: {res['forward_ms'][w]:.1f} ms", flush=True)

    hist = jnp.asarray(np.random.default_rng(0).integers(0, 1000, (1, args.capacity)), jnp.int32)
    ctx = Context(tokens=hist, length=jnp.asarray([args.filled]), prompt_len=jnp.asarray([10]),
                  cache=cache, params=params)
    ng = NGramDrafter()
    draft_fn = jax.jit(lambda ctx: ng.propose(None, (), ctx, None, sampling.Greedy())[0].tokens)
    res["ngram_propose_ms"] = _timed(draft_fn, ctx)
    n = ng.depth
    logits = jax.random.normal(jax.random.key(0), (1, n + 1, m.config.vocab_size))
    d = Draft(tokens=jnp.zeros((1, n), jnp.int32), parents=tree.chain(1, n),
              valid=jnp.ones((1, n), bool))
    res["verify_greedy_ms"] = _timed(jax.jit(lambda lg, d: verify(lg, d, None).tokens), logits, d)
    src = jnp.arange(n + 1, dtype=jnp.int32)[None]
    commit = jax.jit(lambda c: c.commit(src, jnp.asarray([n + 1]), window=n + 1).length)
    res["kv_commit_ms"] = _timed(commit, cache)
    if args.eagle:
        res["eagle_propose_ms"] = _eagle_propose_ms(lm, args.eagle, ctx)
    for k in ("ngram_propose_ms", "verify_greedy_ms", "kv_commit_ms", "eagle_propose_ms"):
        if k in res:
            print(f"{k}: {res[k]:.2f}")
    f1 = res["forward_ms"][1]
    res["forward_cost_vs_one_token"] = {w: t / f1 for w, t in res["forward_ms"].items()}
    print("forward cost relative to 1 token:",
          {w: round(r, 2) for w, r in res["forward_cost_vs_one_token"].items()})
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
