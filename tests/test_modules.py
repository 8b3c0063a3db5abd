"""Flax NNX modules: models and draft heads are modules whose state is the plain parameter
pytree the functional API takes, and whose call is that API's pure forward, with and
without jit and inside a user's ``lax.while_loop``."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specjax
import toys
from specjax.drafters import eagle, exit_heads
from specjax.models import Gemma, LanguageModel, Llama, gemma, llama

TINY_L = toys.LLAMA
TINY_G = toys.GEMMA  # a sliding and a full layer
FAMILIES = {"llama": (Llama(TINY_L), llama.init_params), "gemma": (Gemma(TINY_G), gemma.init_params)}
TOKENS = jnp.asarray([[1, 5, 9, 2, 7, 3], [4, 4, 8, 1, 0, 6]], jnp.int32)


def _module(family):
    arch, init = FAMILIES[family]
    params = init(arch.config, jax.random.key(1))
    return arch, params, LanguageModel(arch, params)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_module_state_is_the_parameter_pytree(family):
    arch, params, m = _module(family)
    _, state = nnx.split(m)
    pure = nnx.to_pure_dict(state)
    assert set(pure) == set(params)
    assert len(pure["layers"]) == len(params["layers"]) == arch.config.num_layers
    for i, lp in enumerate(params["layers"]):
        for name, w in lp.items():
            assert pure["layers"][i][name] is w or np.array_equal(pure["layers"][i][name], w)
    chex.assert_trees_all_equal(m.params, params)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_module_call_equals_the_functional_forward(family):
    arch, params, m = _module(family)
    b, t = TOKENS.shape
    cache = arch.init_cache(b, 16)
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    want, hid, _ = arch.forward(params, TOKENS, pos, cache, return_layers=(1,))
    got, ghid, gcache = m(TOKENS, cache=cache, return_layers=(1,))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(ghid[1], hid[1])
    assert int(gcache.length[0]) == 0  # forward writes K/V but does not advance


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_functional_api_takes_the_split_state(family):
    arch, params, m = _module(family)
    _, state = nnx.split(m)
    prompts = [[1, 5, 9, 2], [4, 4]]
    a = specjax.generate(arch, params, prompts, max_new_tokens=6)
    b = specjax.generate(arch, nnx.to_pure_dict(state), prompts, max_new_tokens=6)
    np.testing.assert_array_equal(a.tokens, b.tokens)


def test_greedy_loop_over_the_merged_module_inside_while_loop():
    """A user's own jitted decode loop over ``nnx.merge(graphdef, state)`` reproduces
    ``specjax.generate`` token for token."""
    arch, params, m = _module("gemma")
    graphdef, state = nnx.split(m)
    prompt = jnp.asarray([[1, 5, 9, 2, 7]], jnp.int32)
    steps = 8

    @jax.jit
    def decode(state, prompt):
        model = nnx.merge(graphdef, state)
        cache = model.init_cache(1, prompt.shape[1] + steps)
        logits, _, cache = model(prompt, cache=cache)
        cache = cache.advance(prompt.shape[1])
        out = jnp.zeros((steps,), jnp.int32).at[0].set(jnp.argmax(logits[0, -1]))

        def body(i, carry):
            out, cache = carry
            lg, _, cache = model(out[i - 1][None, None], cache=cache)
            return out.at[i].set(jnp.argmax(lg[0, -1])), cache.advance(1)

        return jax.lax.fori_loop(1, steps, body, (out, cache))[0]

    want = specjax.generate(arch, params, [list(map(int, prompt[0]))], max_new_tokens=steps)
    np.testing.assert_array_equal(decode(state, prompt), want.tokens[0, :steps])


class ModuleVariants(chex.TestCase):
    """The module call, the merged graph and the heads agree with and without jit."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_merged_model_equals_module(self):
        _, _, m = _module("llama")
        graphdef, state = nnx.split(m)
        fn = self.variant(lambda st, t: nnx.merge(graphdef, st)(t)[0])
        np.testing.assert_allclose(fn(state, TOKENS), m(TOKENS)[0], rtol=1e-5, atol=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    def test_eagle_head_forward_goes_through_the_module(self):
        arch, params, _ = _module("llama")
        head = eagle.EagleHead(TINY_L, jax.random.key(2))
        hp = eagle.init_head(TINY_L, jax.random.key(2))
        chex.assert_trees_all_equal(nnx.to_pure_dict(nnx.state(head)), hp)
        prev = jax.random.normal(jax.random.key(3), TOKENS.shape + (32,))
        fn = self.variant(lambda hp, t, f: eagle.training_forward(arch, hp, params, t, f))
        got = fn(hp, TOKENS, prev)
        b, t = TOKENS.shape
        zk = jnp.zeros((b, 2, 8, t))
        zv = jnp.zeros((b, 2, t, 8))
        mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
        want, _, _ = head(arch.embed(params, TOKENS), prev, jnp.broadcast_to(jnp.arange(t), (b, t)),
                          zk, zv, jnp.zeros((b,), jnp.int32), mask)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    def test_fresh_exit_adapter_is_the_plain_exit(self):
        hp = exit_heads.init_adapter(TINY_L, jax.random.key(4), rank=4)
        chex.assert_shape([hp["down"], hp["up"]], [(32, 4), (4, 32)])
        h = jax.random.normal(jax.random.key(5), (2, 3, 32))
        out = self.variant(lambda hp, h: exit_heads.adapt(hp, h, TINY_L.rms_norm_eps))(hp, h)
        np.testing.assert_array_equal(out, h)  # up starts at zero


def test_optax_trains_the_head_through_the_module():
    """Gradients reach every ``EagleHead`` parameter through ``nnx.merge``, and a few Adam
    steps lower the regression loss on a fixed batch."""
    import optax

    arch, params, _ = _module("llama")
    hp = eagle.init_head(TINY_L, jax.random.key(6))
    toks = TOKENS
    target = jax.random.normal(jax.random.key(7), toks.shape + (32,))
    toks, prev = eagle.head_inputs(toks, target)
    target = target[:, 1:]

    def loss(hp):
        return jnp.mean((eagle.training_forward(arch, hp, params, toks, prev) - target) ** 2)

    opt = optax.adam(1e-2)
    st = opt.init(hp)
    grads = jax.grad(loss)(hp)
    assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads))
    first = float(loss(hp))

    @jax.jit
    def step(hp, st):
        g = jax.grad(loss)(hp)
        up, st = opt.update(g, st, hp)
        return optax.apply_updates(hp, up), st

    for _ in range(20):
        hp, st = step(hp, st)
    assert float(loss(hp)) < 0.7 * first


def test_language_model_refuses_what_is_not_a_model():
    with pytest.raises(TypeError, match="does not implement"):
        LanguageModel(object(), {"embed": jnp.zeros((2, 2))})


def test_shapes_are_asserted_at_the_module_boundary():
    _, _, m = _module("llama")
    with pytest.raises(AssertionError):
        m(TOKENS[0])  # rank 1
    with pytest.raises(AssertionError):
        m(TOKENS, positions=jnp.zeros((2, 3), jnp.int32))
