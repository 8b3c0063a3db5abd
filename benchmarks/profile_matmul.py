"""Why a wide forward costs so much on XLA:CPU: the target's two kinds of matrix product,
timed alone at the widths a speculative round uses (median of repeats). Writes JSON.

    .venv/bin/python benchmarks/profile_matmul.py --out docs/results/profile_matmul_cpu.json

- ``lm_head``: ``[T,576] x [49152,576]^T``, the tied LM head (113 MB of float32 weights);
- ``mlp``: 30 layers of ``[T,576] x [576,1536]`` up and back (the decoder's MLP shapes),
  as one jitted function, like the model's unrolled layers.
At ``T = 1`` XLA runs a matrix-vector product that streams the weights once; from ``T = 2``
it runs a general matrix product, and the step from 1 to 2 rows is where the cost jumps.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

import specjax  # noqa: F401
from specjax._timing import median_ms

from specjax.jax_setup import setup_jax  # noqa: E402

setup_jax()  # as the specjax commands run: XLA:CPU's in-place flag, the compilation cache


def _timed(fn, *args):
    return median_ms(fn, *args, repeats=40)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--widths", default="1,2,3,5,9,17,25")
    p.add_argument("--out")
    args = p.parse_args()
    rng = np.random.default_rng(0)
    emb = jnp.asarray(rng.standard_normal((49152, 576), np.float32))
    mlp_w = [jnp.asarray(rng.standard_normal((576, 1536), np.float32) * 0.02) for _ in range(30)]

    head = jax.jit(lambda x, e: jnp.einsum("td,vd->tv", x, e))  # t: width, d: 576, v: vocab

    @jax.jit
    def mlp(x, ws):
        for w in ws:
            x = x + jnp.tanh(x @ w) @ w.T
        return x

    res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "ms": {}}
    for t in [int(w) for w in args.widths.split(",")]:
        x = jnp.asarray(rng.standard_normal((t, 576), np.float32))
        row = {"lm_head": _timed(head, x, emb), "mlp": _timed(mlp, x, mlp_w)}
        res["ms"][t] = row
        print(f"T={t:>2}: lm_head {row['lm_head']:6.2f} ms   30-layer mlp {row['mlp']:6.2f} ms",
              flush=True)
    one = res["ms"][min(res["ms"])]
    res["relative_to_1"] = {t: {k: v / one[k] for k, v in r.items()} for t, r in res["ms"].items()}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
