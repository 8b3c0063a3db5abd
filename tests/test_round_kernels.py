"""The decoding round's size in the compiled program (``specjax.hlo.hlo_stats``), so that it
does not silently grow back: on an accelerator a small model is launch-bound, and each
kernel, nested loop iteration and conditional of a round costs about the same whatever it
computes. Tiny shapes, abstract weights (compile only), ``widths="padded"`` (what
accelerators run)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from specjax import hlo
from specjax.core import decoder, decoding, sampling, speculative
from specjax.drafters import eagle, ngram
from specjax.models import llama, loading

C, MAX = 256, 32


def _cfg(layers: int):
    return llama.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                             num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=16,
                             max_position_embeddings=1024)


@functools.lru_cache(maxsize=None)
def _round(method: str, layers: int = 2) -> dict:
    """``hlo_stats(...)["round"]`` of ``method``'s decode program (batch 1)."""
    cfg = _cfg(layers)
    model = loading.model_for(cfg, jnp.float32)
    params = jax.eval_shape(lambda: llama.init_params(cfg, jax.random.key(0), jnp.float32))
    row = jax.ShapeDtypeStruct((1,), jnp.int32)
    batch = decoder.Batch(tokens=jax.ShapeDtypeStruct((1, C), jnp.int32), lengths=row,
                          budgets=row, eos=row, key=jax.eval_shape(lambda: jax.random.key(0)),
                          sampler=sampling.Greedy(), capacity=C, max_out=MAX)
    if method == "ar":
        dec = decoding.AR(model)
    else:
        if method == "ngram":
            drafter, dparams = ngram.NGramDrafter(depth=7), None
        else:
            drafter = eagle.EagleDrafter(model, depth=3, topk=4, total_tokens=7)
            dparams = {"head": jax.eval_shape(lambda: eagle.init_head(cfg, jax.random.key(1)))}
        dec, params = speculative.Speculative(model, drafter, "padded"), (params, dparams)
    lowered = jax.jit(decoder._run, static_argnames=("dec",)).lower(params, batch, dec=dec)
    return hlo.hlo_stats(lowered.compile().as_text())["round"]


def test_rounds_have_no_nested_loops_or_conditionals():
    """Tree ancestry is loop-free, EAGLE-2's levels are unrolled, one padded width means
    no switch: a round is straight-line code on an accelerator."""
    for m in ("ar", "ngram", "eagle"):
        r = _round(m)
        assert (r["whiles"], r["conditionals"], r["host_transfers"]) == (0, 0, 0), (m, r)


def test_chain_round_has_no_per_layer_commit():
    """An n-gram round's kernels beyond an ``ar`` step grow with the layers only as a width-8
    forward's do over a width-1 one (3 per layer here): a chain's accepted path is already in
    place, so the cache commit is a length update. It was a slice and an in-place update of
    every layer's K and V, 4 kernels per layer more."""
    extra = {n: _round("ngram", n)["kernels"] - _round("ar", n)["kernels"] for n in (2, 4)}
    assert extra[4] - extra[2] < 2 * 4, extra  # 6 when written; 14 with the commit
    assert extra[2] <= 60, extra  # 46 when written (draft, verify, bookkeeping, width 8)


def test_eagle_round_size():
    """EAGLE-2 3,4,7 on the tiny shape: 297 kernels per round when written (549 before the
    loop-free ancestry and unrolled levels; 78 for an ``ar`` step)."""
    assert _round("eagle")["kernels"] <= 320, _round("eagle")
