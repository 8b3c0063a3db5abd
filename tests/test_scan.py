"""``Llama(scan_layers=True)``: the layers under one ``lax.scan`` over stacked weights and a
stacked KV cache compute what the unrolled layers compute: logits (prefill, cached steps,
a tree mask), early exits, chosen hidden states, the cache and its commit, and greedy
output for every decoding method."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import specjax
import toys
from specjax import sharding
from specjax.core import tree
from specjax.models.llama import Llama, stack_layers, unstack_layers

V = toys.V
TOY = toys.LLAMA
PROMPTS = [[1, 5, 2, 7, 5, 2, 7, 5], [3, 3, 1], [1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [7]]
BUDGETS = [20, 9, 26, 12]


@pytest.fixture(scope="module")
def toy():
    tp = toys.llama_params(seed=1)
    unrolled, scanned = Llama(TOY), Llama(TOY, scan_layers=True)
    ar = specjax.generate(unrolled, tp, PROMPTS, max_new_tokens=BUDGETS).to_lists()
    return unrolled, tp, scanned, stack_layers(tp), ar


def _close(a, b, tol=1e-5):
    """Equal to float32 rounding at the array's scale: the scanned and unrolled programs
    are compiled apart and may order a sum differently (a real difference is O(1))."""
    b = np.asarray(b)
    scale = max(1.0, float(np.max(np.abs(b)))) if b.size else 1.0
    np.testing.assert_allclose(np.asarray(a), b, atol=tol * scale, rtol=tol)


def test_stack_and_unstack_are_inverse(toy):
    _, tp, _, sp, _ = toy
    assert sp["layers"]["qkv"].shape[0] == TOY.num_layers
    assert stack_layers(sp) is sp and unstack_layers(tp) is tp
    back = unstack_layers(sp)
    assert jax.tree.structure(back) == jax.tree.structure(tp)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(tp)):
        np.testing.assert_array_equal(a, b)


def test_forward_equals_unrolled(toy):
    """Prefill, two cached steps (one a draft tree), an early exit and chosen layers."""
    unrolled, tp, scanned, sp, _ = toy
    jit = lambda m: jax.jit(m.forward, static_argnames=("exit_layer", "return_layers"))
    fu, fs = jit(unrolled), jit(scanned)
    b, t = 2, 7
    toks = jax.random.randint(jax.random.key(0), (b, t), 0, V)
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    cu, cs = unrolled.init_cache(b, 32), scanned.init_cache(b, 32)
    assert cs.stacked and not cu.stacked and cs.capacity == cu.capacity == 32
    lu, hu, cu = fu(tp, toks, pos, cu, return_layers=(0, 1, 2))
    ls, hs, cs = fs(sp, toks, pos, cs, return_layers=(0, 1, 2))
    _close(lu, ls)
    assert sorted(hu) == sorted(hs) == [0, 1, 2, 3]
    for l in hu:
        _close(hu[l], hs[l])
    for i in range(TOY.num_layers):
        _close(cu.k[i], cs.k[i]), _close(cu.v[i], cs.v[i])
    cu, cs = cu.advance(t), cs.advance(t)
    # a draft tree: root, two children of the root, a grandchild of the second
    parents = jnp.asarray([[-1, -1, 1]] * b)
    valid = jnp.ones((b, 3), bool)
    nodes = jnp.asarray([[4, 9, 2, 5]] * b)
    tpos = tree.positions(jnp.full((b,), t), parents)
    mask = tree.attention_mask(parents, valid)
    lu, _, cu2 = fu(tp, nodes, tpos, cu, mask)
    ls, _, cs2 = fs(sp, nodes, tpos, cs, mask)
    _close(lu, ls)
    src, count = jnp.asarray([[0, 2, 3]] * b), jnp.asarray([3, 1])
    cu2, cs2 = cu2.commit(src, count, 4), cs2.commit(src, count, 4)
    for i in range(TOY.num_layers):
        _close(cu2.k[i], cs2.k[i]), _close(cu2.v[i], cs2.v[i])
    np.testing.assert_array_equal(cu2.length, cs2.length)
    one, p1 = nodes[:, :1], cu2.length[:, None]
    lu, hu, _ = fu(tp, one, p1, cu2, exit_layer=2, return_layers=(1,))
    ls, hs, _ = fs(sp, one, p1, cs2, exit_layer=2, return_layers=(1,))
    _close(lu, ls)
    assert sorted(hu) == sorted(hs) == [1, 2]
    _close(hu[1], hs[1]), _close(hu[2], hs[2])


def test_layout_mismatches_are_refused(toy):
    unrolled, tp, scanned, sp, _ = toy
    toks, pos = jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 2), jnp.int32)
    with pytest.raises(ValueError, match="stack_layers"):
        scanned.forward(tp, toks, pos, scanned.init_cache(1, 8))
    with pytest.raises(ValueError, match="unstack_layers"):
        unrolled.forward(sp, toks, pos, unrolled.init_cache(1, 8))
    with pytest.raises(ValueError, match="init_cache"):
        scanned.forward(sp, toks, pos, unrolled.init_cache(1, 8))


# every registered method (its first tiny spec) and the early exit, on the scanned layers
@pytest.mark.parametrize("spec", toys.sweep_specs(extra=("sd-early-exit:1",)))
def test_greedy_methods_equal_unrolled_ar(toy, spec):
    _, _, scanned, sp, ar = toy
    assert toys.run_spec(spec, scanned, sp, PROMPTS, BUDGETS).to_lists() == ar


def test_stacked_weights_shard_by_heads(toy):
    """``param_specs`` and ``split_layout`` keep the stacked layer axis whole; the stacked
    cache's spec keeps it whole too; a one-device mesh decodes as without one."""
    _, tp, scanned, sp, ar = toy
    fake = types.SimpleNamespace(shape={"data": 1, "model": 2})
    split = sharding.split_layout(TOY, sp)
    per_layer = sharding.split_layout(TOY, tp)
    for name in ("q", "k", "v", "gate", "up"):
        np.testing.assert_array_equal(split["layers"][name][1], per_layer["layers"][1][name])
    specs = sharding.param_specs(TOY, split, fake)
    assert specs["layers"]["q"] == P(None, "model", None)
    assert specs["layers"]["o"] == P(None, None, "model")
    assert specs["layers"]["attn_norm"] == P()
    assert sharding.param_specs(TOY, per_layer, fake)["layers"][0]["q"] == P("model", None)
    cs = sharding.cache_spec(scanned.init_cache(2, 8), fake)
    assert cs.k == P(None, "data", "model", None, None)
    mesh = sharding.make_mesh(1, 1)
    placed = sharding.shard_params(TOY, sp, mesh)
    out = specjax.generate(scanned, placed, PROMPTS, max_new_tokens=BUDGETS, mesh=mesh)
    assert out.to_lists() == ar


def test_load_refuses_scan_for_gemma():
    from specjax.models.gemma import GEMMA3_270M, Gemma

    g = Gemma(GEMMA3_270M)
    with pytest.raises(ValueError, match="unrolled"):
        g.forward({"layers": {"qkv": jnp.zeros((1,))}, "embed": jnp.zeros((4, 640))},
                  jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32),
                  g.init_cache(1, 8))


def test_wide_batches_write_and_commit_alike(toy):
    """Above 8 rows the cache writes and commits take their batched (vmap) path."""
    unrolled, tp, scanned, sp, _ = toy
    b, t = 10, 3
    toks = jax.random.randint(jax.random.key(4), (b, t), 0, V)
    pos = jnp.broadcast_to(jnp.arange(t), (b, t)) + jnp.arange(b)[:, None] % 3
    length = jnp.arange(b, dtype=jnp.int32) % 3
    cu = unrolled.init_cache(b, 16).replace(length=length)
    cs = scanned.init_cache(b, 16).replace(length=length)
    lu, _, cu = jax.jit(unrolled.forward)(tp, toks, pos, cu)
    ls, _, cs = jax.jit(scanned.forward)(sp, toks, pos, cs)
    _close(lu, ls)
    src = jnp.broadcast_to(jnp.asarray([1, 2]), (b, 2))
    count = jnp.arange(b, dtype=jnp.int32) % 3
    cu, cs = cu.commit(src, count, t), cs.commit(src, count, t)
    for i in range(TOY.num_layers):
        _close(cu.k[i], cs.k[i]), _close(cu.v[i], cs.v[i])
