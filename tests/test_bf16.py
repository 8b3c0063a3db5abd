"""The bfloat16 path: weights stored in bfloat16, products and the KV cache in the model's
``compute_dtype`` (float32 by default, bfloat16 opt-in), logits in float32; a verification
forward equal to one-token steps on a toy model in both compute dtypes, and every method's
greedy output equal to AR there with bfloat16 products, token for token. (On SmolLM2-135M the bfloat16
products leave AR on some prompts; float32 products on bfloat16 weights do not on the
measured ones: docs/guide.md, "bfloat16", and benchmarks/dtype_bench.py.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import toys
import specjax
from specjax.models import Llama
from specjax.models.llama import init_params

V = toys.V
TOY = toys.LLAMA
PROMPTS = [[1, 5, 2, 7, 5, 9], [3, 3, 1, 4], [7, 2, 7, 2, 7, 9, 11, 2], [5, 6]]
NEW = 24


@pytest.fixture(scope="module")
def weights():
    return jax.tree.map(lambda x: (x * 3.0).astype(jnp.bfloat16),
                        init_params(TOY, jax.random.key(1)))


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def toy(request, weights):
    """The toy model with bfloat16 weights, multiplying in each compute dtype."""
    return Llama(TOY, compute_dtype=jnp.dtype(request.param)), weights


def test_float32_compute_is_float32_arithmetic_on_the_stored_weights(weights):
    """Float32 products on bfloat16 weights give exactly a float32 model on the same
    weights widened; bfloat16 products give something else (the knob does something)."""
    toks, pos = jnp.asarray([[1, 5, 2, 7, 5, 9]]), jnp.arange(6)[None]
    cache = Llama(TOY).init_cache(1, 16, jnp.float32)
    wide = jax.tree.map(lambda x: x.astype(jnp.float32), weights)
    ref = Llama(TOY).forward(wide, toks, pos, cache)[0]
    f32 = Llama(TOY).forward(weights, toks, pos, cache)[0]
    b16 = Llama(TOY, compute_dtype=jnp.bfloat16).forward(weights, toks, pos, cache)[0]
    assert Llama(TOY).compute_dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(f32), np.asarray(ref))
    assert float(jnp.max(jnp.abs(b16 - ref))) > 1e-3


def test_compute_dtype_must_be_floating():
    with pytest.raises(ValueError, match="compute_dtype must be a floating dtype"):
        Llama(TOY, compute_dtype=jnp.int32)


def test_bf16_parameters_cache_in_compute_dtype_and_float32_logits(toy):
    model, tp = toy
    assert model.param_dtype(tp) == jnp.bfloat16
    cache = model.init_cache(1, 32)
    assert cache.k[0].dtype == model.compute_dtype
    logits, _, cache = model.forward(tp, jnp.asarray([[1, 2, 3]]), jnp.arange(3)[None], cache)
    assert logits.dtype == jnp.float32 and cache.v[0].dtype == model.compute_dtype


def test_bf16_verification_forward_equals_one_token_steps(toy):
    """Eight tokens verified in one forward get the logits of eight one-token steps, to
    float32 rounding: a new token reads the other new tokens' keys and values rounded to
    the cache's dtype, as a later step reads them from the cache. (With full-precision new
    keys the gap was 0.087 on logits of magnitude 10.)"""
    model, tp = toy
    toks = jnp.asarray([[1, 5, 2, 7, 5, 9, 3, 3, 1, 4, 7, 2]])
    fwd = jax.jit(model.forward)  # mask None: causal over the new tokens
    start, t = 4, 8
    _, _, cache = fwd(tp, toks[:, :start], jnp.arange(start)[None],
                      model.init_cache(1, 64))
    cache = cache.advance(start)
    wide, _, _ = fwd(tp, toks[:, start:], (start + jnp.arange(t))[None], cache)
    steps = []
    for i in range(t):
        logits, _, cache = fwd(tp, toks[:, start + i:start + i + 1],
                               jnp.asarray([[start + i]]), cache)
        cache = cache.advance(1)
        steps.append(logits[0, 0])
    steps = jnp.stack(steps)
    assert float(jnp.max(jnp.abs(steps))) > 1.0  # logits of a sharp model, not near zero
    np.testing.assert_allclose(np.asarray(wide[0]), np.asarray(steps), rtol=0, atol=1e-4)


def test_every_method_bf16_greedy_equals_bf16_ar(weights):
    """bfloat16 products: every method's greedy output equals bfloat16 AR. (Float32 products
    on these weights are float32 arithmetic on the widened weights, bit for bit:
    test_float32_compute_is_float32_arithmetic_on_the_stored_weights; every method in float32
    is tests/test_conformance.py.)"""
    model, tp = Llama(TOY, compute_dtype=jnp.bfloat16), weights
    ar = specjax.generate(model, tp, PROMPTS, max_new_tokens=NEW).to_lists()
    # every registered method (its first tiny spec, random heads in bfloat16) and the early exit
    outs = {spec: toys.run_spec(spec, model, tp, PROMPTS, NEW) for spec in toys.sweep_specs(
        skip={"ar": "the reference itself, above"}, extra=("sd-early-exit:1",))}
    for name, out in outs.items():
        assert out.to_lists() == ar, name
    assert sum(int(o.target_forwards.sum()) for o in outs.values()) < \
        len(outs) * len(PROMPTS) * NEW, "no method accepted anything: the comparison proves little"


def test_gemma4_methods_bf16_greedy_equal_bf16_ar():
    """The Gemma 4 toy in bfloat16 (weights and products): its own methods (``mtp``, the
    assistant in bfloat16 too) equal bfloat16 AR; every other method on bfloat16 is the
    Llama sweep above."""
    import jax.numpy as jnp

    from specjax.models.gemma4 import Gemma4

    base, tp = toys.gemma4_toy()
    model = Gemma4(base.config, compute_dtype=jnp.bfloat16)
    tp = jax.tree.map(lambda x: x.astype(jnp.bfloat16), tp)
    prompts = [p[:6] for p in toys.PROMPTS]
    ar = specjax.generate(model, tp, prompts, max_new_tokens=NEW).to_lists()
    specs = toys.sweep_specs(skip={"ar": "the reference itself"}, family="Gemma4", own=True)
    assert specs
    for spec in specs:
        out = toys.run_spec(spec, model, tp, prompts, NEW)
        assert out.to_lists() == ar, spec
        assert int(np.asarray(out.accepted)[1]) > 0, f"{spec}: nothing accepted"
