"""How fast the training-data path runs, against what this machine's matrix products do.

In one run, for one target (compile time excluded: every shape runs once before it is
timed; each figure is the median of ``--repeats``):

(a) **roofline**: the target's own matrix products (every layer's q/k/v, o, gate/up and down
    projections, and the LM head where the phase needs logits) as a pure-JAX chain on the
    same row count, in float32, with the weights on the left as the port computes them;
(b) **feature pass**: teacher-forced last-layer features (``text_corpus``'s prefill, what
    ``specjax features`` and ``train eagle --data CONVERSATIONS`` run) in tokens/s, at
    ``--feature-len`` tokens a row and ``--feature-tokens`` a batch;
(c) **batched on-policy decoding**: ``specjax.generate`` at each of ``--batches``, in answer
    tokens/s, prompts of ``--prompt-len`` tokens: a step's time is that of ``--new-tokens``
    tokens less that of one, over ``--new-tokens - 1`` (the prefill cancels out);
(d) **the head's training step**: ``train.eagle``'s step on ``--feature-tokens`` tokens a
    batch, in tokens/s.

Phases (b) and (c) are reported with their ratio to the roofline at their row count (the
decoding step's includes the LM head).

    python benchmarks/data_path.py --model smollm2-135m --out docs/results/data_path/smollm2.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specjax.jax_setup import setup_jax  # noqa: E402

setup_jax()  # as the specjax commands run: XLA:CPU's in-place flag, the compilation cache


def _time(fn, repeats: int) -> float:
    jax.block_until_ready(fn())  # compile and warm
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def roofline(cfg, rows: int, head: bool, repeats: int, seed: int = 0) -> float:
    """Seconds for the target's matrix products on ``rows`` rows: every layer's
    projections (and the LM head when ``head``), chained, float32, weights on the left.
    Every layer has its own weights, as the model does, so at a small row count the chain
    pays for reading them from memory as a decoding step does."""
    d, i = cfg.hidden_size, cfg.intermediate_size
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    shapes = {"qkv": (qkv, d), "o": (d, cfg.num_heads * cfg.head_dim), "gu": (2 * i, d),
              "down": (d, i)}
    k = jax.random.split(jax.random.key(seed), cfg.num_layers + 1)
    layers = [{n: jax.random.normal(jax.random.fold_in(k[j], c), s) * 0.02
               for c, (n, s) in enumerate(shapes.items())} for j in range(cfg.num_layers)]
    emb = jax.random.normal(k[-1], (cfg.vocab_size, d)) * 0.02

    @jax.jit
    def chain(layers, emb, x):  # x [D, rows]
        for lw in layers:
            q = lw["qkv"] @ x
            x = x + lw["o"] @ q[:cfg.num_heads * cfg.head_dim]
            g = lw["gu"] @ x
            x = x + lw["down"] @ (g[:i] * g[i:])
        return jnp.argmax(emb @ x, 0) if head else x

    x = jax.random.normal(jax.random.key(1), (d, rows))
    return _time(lambda: chain(layers, emb, x), repeats)


def feature_pass(lm, length: int, batch_tokens: int, repeats: int) -> float:
    from specjax.train import text_corpus

    run = text_corpus._prefill_fn(lm.model)
    rows = max(1, batch_tokens // length)
    toks = jnp.asarray(np.random.default_rng(0).integers(
        1, lm.model.config.vocab_size, (rows, length)), jnp.int32)
    return _time(lambda: run(lm.params, toks), repeats)


def decoding(lm, batch: int, prompt_len: int, new: int, repeats: int) -> float:
    from specjax import generate

    rng = np.random.default_rng(batch)
    prompts = [list(rng.integers(1, lm.model.config.vocab_size, prompt_len)) for _ in range(batch)]

    def run(n):
        return lambda: generate(lm.model, lm.params, prompts, max_new_tokens=n).tokens
    # a step's time: the prefill and the first token cancel out of the difference
    return (_time(run(new), repeats) - _time(run(1), repeats)) / (new - 1)


def train_step(lm, batch_tokens: int, length: int, repeats: int) -> float:
    from specjax.drafters import eagle
    from specjax.train import eagle as train_eagle

    cfg = train_eagle.TrainConfig(batch_tokens=batch_tokens, max_len=length)
    opt = train_eagle.optimizer(cfg)
    params = eagle.init_head(lm.model.config, jax.random.key(0), attn_norm=False)
    state = {"params": params, "opt_state": opt.init(params), "step": jnp.asarray(0)}
    step = train_eagle.make_step(lm.model, cfg, opt)
    rows = max(1, batch_tokens // length)
    rng = np.random.default_rng(0)
    d = lm.model.config.hidden_size
    toks = jnp.asarray(rng.integers(1, 1000, (rows, length)), jnp.int32)
    h = jnp.asarray(rng.normal(size=(rows, length, d)), jnp.float32)
    mask = jnp.ones((rows, length), jnp.float32)
    vids = jnp.arange(cfg.ce_vocab, dtype=jnp.int32)
    return _time(lambda: step(state, lm.params, toks, h, h, mask, vids)[1]["loss"], repeats)


def _commit() -> str | None:
    """The checkout's commit, ``-dirty`` with uncommitted changes; None outside git."""
    import subprocess

    def git(*a):
        return subprocess.run(["git", *a], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip()
    try:
        head = git("rev-parse", "--short", "HEAD")
        return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "") or None
    except OSError:
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--feature-len", type=int, default=512)
    ap.add_argument("--feature-tokens", type=int, default=4096)
    ap.add_argument("--batches", default="32,64,128")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--phases", default="roofline,features,decode,train")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from specjax.models import load

    lm = load(args.model)
    cfg, phases, rows = lm.model.config, args.phases.split(","), []

    def report(phase, rows_per_call, seconds, tokens, head):
        roof = roofline(cfg, rows_per_call, head, args.repeats)
        r = {"phase": phase, "rows": rows_per_call, "tokens_per_s": round(tokens / seconds, 1),
             "roofline_rows_per_s": round(rows_per_call / roof, 1),
             "of_roofline": round((tokens / seconds) / (rows_per_call / roof), 3)}
        rows.append(r)
        print(json.dumps(r), flush=True)

    if "features" in phases:
        n = max(1, args.feature_tokens // args.feature_len) * args.feature_len
        report("feature_pass", n, feature_pass(lm, args.feature_len, args.feature_tokens,
                                               args.repeats), n, head=False)
    if "decode" in phases:
        for b in [int(x) for x in args.batches.split(",")]:
            s = decoding(lm, b, args.prompt_len, args.new_tokens, args.repeats)
            report(f"decode_batch{b}", b, s, b, head=True)
    if "train" in phases:
        n = max(1, args.feature_tokens // args.feature_len) * args.feature_len
        s = train_step(lm, args.feature_tokens, args.feature_len, args.repeats)
        r = {"phase": "train_step", "rows": n, "tokens_per_s": round(n / s, 1)}
        rows.append(r)
        print(json.dumps(r), flush=True)
    out = {"model": args.model, "commit": _commit(), "machine": f"{platform.machine()}, {jax.device_count()} "
           f"{jax.devices()[0].platform} device(s), {jax.local_devices()[0].device_kind}",
           "jax": jax.__version__, "settings": {k: v for k, v in vars(args).items() if k != "out"},
           "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
