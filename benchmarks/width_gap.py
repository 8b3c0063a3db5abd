"""How far a verification forward's logits are from one-token decoding's, per dtype.

Prefills a chat prompt on SmolLM2-135M, then computes the logits of its last 8 tokens twice:
in one 8-token forward (what verification does) and in 8 one-token steps (what `ar` does),
and prints the largest absolute difference. Exact arithmetic gives 0; a large gap means
near-ties can make speculative greedy output leave `ar`'s. ``--dtype`` stores weights and
cache, ``--compute-dtype`` is what the products take.

    .venv/bin/python benchmarks/width_gap.py --dtype bfloat16
    .venv/bin/python benchmarks/width_gap.py --dtype bfloat16 --compute-dtype bfloat16
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from specjax.models import load

from specjax.jax_setup import setup_jax  # noqa: E402

setup_jax()  # as the specjax commands run: XLA:CPU's in-place flag, the compilation cache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--compute-dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--prompt", default="Explain why the sky is blue, in three sentences.")
    ap.add_argument("--width", type=int, default=8)
    args = ap.parse_args()
    lm = load("smollm2-135m", dtype=jnp.dtype(args.dtype),
              compute_dtype=jnp.dtype(args.compute_dtype))
    model, params = lm.model, lm.params
    toks = jnp.asarray([lm.encode(args.prompt, chat=True)])
    fwd = jax.jit(model.forward)  # mask None: causal over the new tokens
    t = args.width
    start = toks.shape[1] - t
    cache = model.init_cache(1, -(-toks.shape[1] // 64) * 64)
    _, _, cache = fwd(params, toks[:, :start], jnp.arange(start)[None], cache)
    cache = cache.advance(start)
    wide, _, _ = fwd(params, toks[:, start:], (start + jnp.arange(t))[None], cache)
    steps = []
    for i in range(t):
        logits, _, cache = fwd(params, toks[:, start + i:start + i + 1],
                               jnp.asarray([[start + i]]), cache)
        cache = cache.advance(1)
        steps.append(logits[0, 0])
    steps = jnp.stack(steps)
    print(f"{args.dtype} weights, {args.compute_dtype} products: "
          f"max |{t}-token forward - {t} one-token steps| = "
          f"{float(jnp.max(jnp.abs(wide[0] - steps))):.3g} (largest |logit| "
          f"{float(jnp.max(jnp.abs(steps))):.1f}); argmax equal: "
          f"{bool(jnp.all(wide[0].argmax(-1) == steps.argmax(-1)))}")


if __name__ == "__main__":
    main()
