"""The weights-left, padded-width products (``llama.project``) against the plain formulation,
at the widths where XLA:CPU changes kernels (1, 2, 3, 8, 17)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import toys
from specjax.core import tree
from specjax.models import llama
from specjax.models.llama import Llama, init_params

WIDTHS = (1, 2, 3, 8, 17)
TOY = toys.LLAMA


def test_fast_width_pads_only_where_it_pays():
    if jax.default_backend() != "cpu":
        pytest.skip("padding applies to XLA:CPU only")
    assert [llama.fast_width(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [1, 4, 4, 4, 8, 8, 16,
                                                                           16, 24]


@pytest.mark.parametrize("n", WIDTHS)
def test_project_equals_the_plain_product(n):
    rng = np.random.default_rng(n)
    w = rng.standard_normal((40, 24)).astype(np.float32)
    x = rng.standard_normal((24, n)).astype(np.float32)
    got = jax.jit(llama.project)(jnp.asarray(w), jnp.asarray(x))
    assert got.shape == (40, n) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), w.astype(np.float64) @ x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", WIDTHS)
def test_head_logits_equal_the_plain_product(n):
    rng = np.random.default_rng(10 + n)
    head = rng.standard_normal((96, 24)).astype(np.float32)
    h = rng.standard_normal((2, n, 24)).astype(np.float32)
    got = jax.jit(llama.head_logits)(jnp.asarray(head), jnp.asarray(h))
    assert got.shape == (2, n, 96)
    np.testing.assert_allclose(np.asarray(got), h.astype(np.float64) @ head.T, rtol=1e-5,
                               atol=1e-5)


@pytest.fixture(scope="module")
def toy():
    return Llama(TOY), init_params(TOY, jax.random.key(3))


def _forward(model, params, toks, cache):
    parents = tree.chain(toks.shape[0], toks.shape[1] - 1)
    logits, _, cache = model.forward(params, toks, tree.positions(cache.length, parents), cache,
                                     tree.attention_mask(parents))
    return logits, cache


@pytest.mark.parametrize("n", WIDTHS)
def test_wide_forward_equals_unpadded_and_stepwise(toy, n, monkeypatch):
    """A padded forward over ``n`` new tokens gives the logits of the unpadded one and of
    ``n`` one-token steps, with 5 tokens already cached, at batch 2."""
    model, params = toy
    rng = np.random.default_rng(n)
    prefix = jnp.asarray(rng.integers(0, TOY.vocab_size, (2, 5)), jnp.int32)
    toks = jnp.asarray(rng.integers(0, TOY.vocab_size, (2, n)), jnp.int32)
    _, cache = jax.jit(lambda p, t, c: _forward(model, p, t, c))(params, prefix,
                                                                  model.init_cache(2, 32))
    cache = cache.advance(5)
    padded, _ = jax.jit(lambda p, t, c: _forward(model, p, t, c))(params, toks, cache)
    monkeypatch.setattr(llama, "fast_width", lambda k: k)
    unpadded = jax.jit(lambda p, t, c: _forward(model, p, t, c))  # traced after the patch
    plain, _ = unpadded(params, toks, cache)
    np.testing.assert_allclose(np.asarray(padded), np.asarray(plain), rtol=1e-5, atol=1e-5)
    step, c = [], cache
    for i in range(n):
        lg, c = unpadded(params, toks[:, i:i + 1], c)
        c = c.advance(1)
        step.append(lg)
    np.testing.assert_allclose(np.asarray(padded), np.asarray(jnp.concatenate(step, 1)),
                               rtol=1e-4, atol=1e-4)
