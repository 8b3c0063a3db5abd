"""The one layer loop of the ports (``specjax.models.decoder``): every family's forward is
``DecoderParts.forward``, and ``run_layers`` unrolled and under ``lax.scan`` run the same
blocks, write each block's new K/V at the rows' lengths and return the same streams."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.models import T5, Gemma, KVCache, Llama
from specjax.models.decoder import DecoderParts, run_layers

L, B, K, H, S, T, D = 3, 2, 1, 2, 6, 2, 4


def test_every_port_runs_the_shared_forward():
    for cls in (Llama, Gemma, T5):
        assert cls.forward is DecoderParts.forward, cls.__name__
        assert "layer_block" in vars(cls), cls.__name__


def _block(i, lp, x, k_cache, v_cache):
    """A toy layer: the stream scaled by its weight plus what the cache holds; new keys and
    values made from the stream (shapes of the cache's layouts)."""
    x = x * lp["w"] + k_cache.sum() + v_cache.sum()
    k = jnp.broadcast_to(x.sum(0)[:, None, None, :], (B, K, H, T))
    v = jnp.broadcast_to(-x.sum(0)[:, None, :, None], (B, K, T, H))
    return x, k, v


@pytest.mark.parametrize("n", [1, 2, L])
@pytest.mark.parametrize("return_layers", [(), (0,), (1, 2), (0, 1, 2, 3)])
def test_scanned_and_unrolled_loops_agree(n, return_layers):
    return_layers = tuple(l for l in return_layers if l <= n)
    ws = [{"w": jnp.float32(1.5 + i)} for i in range(L)]
    x = jax.random.normal(jax.random.key(0), (D, B, T))
    length = jnp.asarray([1, 3], jnp.int32)
    flat = KVCache.zeros(L, B, S, K, H).replace(length=length)
    stacked = KVCache.zeros(L, B, S, K, H, stacked=True).replace(length=length)
    h1, c1 = run_layers(_block, ws, flat, x, n, return_layers)
    h2, c2 = run_layers(_block, {"w": jnp.stack([w["w"] for w in ws])}, stacked, x, n,
                        return_layers, scan=True)
    assert set(h1) == set(h2) == set(return_layers) | {n}
    for l in h1:
        np.testing.assert_array_equal(h1[l], h2[l])
    np.testing.assert_array_equal(c1.length, length)
    for i in range(L):
        np.testing.assert_array_equal(c1.k[i], c2.k[i])
        np.testing.assert_array_equal(c1.v[i], c2.v[i])
        written = i < n
        for b in range(B):
            s = int(length[b])
            assert bool(jnp.any(c1.k[i][b, :, :, s:s + T] != 0)) == written
            assert not jnp.any(c1.k[i][b, :, :, :s]) and not jnp.any(c1.k[i][b, :, :, s + T:])
