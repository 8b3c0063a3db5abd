"""The small helpers the decoding loops and drafters share (one copy each): the EOS cut,
output packing, draft trimming, the width branch, the chunk loop, prefill plus first
token, early-exit scoring, ``OnTarget`` and the shipped-head lookup. Tiny shapes."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import toys
from specjax.core import decoder, decoding, sampling, widths
from specjax.core.decoder import PAD, eos_cut, is_eos, pad_after, after_prompt
from specjax.core.verify import Draft, trim
from specjax.drafters import base, eagle, redrafter
from specjax.drafters.early_exit import EarlyExitDrafter, exit_logits, target_head
from specjax.models.llama import Llama


def test_is_eos_and_eos_cut():
    toks = jnp.asarray([[4, 2, 9, 2], [1, 1, 1, 1], [2, 3, 3, 3], [5, 6, 7, 9]])
    eos = jnp.asarray([2, 9])
    assert is_eos(toks, eos).tolist() == [[False, True, True, True], [False] * 4,
                                         [True, False, False, False],
                                         [False, False, False, True]]
    assert is_eos(toks, jnp.zeros((0,), jnp.int32)).sum() == 0  # no EOS ids: never
    n = jnp.asarray([4, 3, 0, 3])
    # row 0: EOS at 1 kept; row 1: none, all n; row 2: n = 0; row 3: the EOS at 3 is past n
    assert eos_cut(toks, n, eos).tolist() == [2, 3, 0, 3]
    assert eos_cut(toks, jnp.asarray([1, 4, 1, 4]), eos).tolist() == [1, 4, 1, 4]


def test_after_prompt_and_pad_after():
    toks = jnp.arange(12).reshape(2, 6)
    out = after_prompt(toks, jnp.asarray([2, 4]), 4)
    assert out.tolist() == [[2, 3, 4, 5], [10, 11, 11, 11]]  # past the buffer: its last slot
    assert pad_after(out, jnp.asarray([3, 0])).tolist() == [[2, 3, 4, PAD], [PAD] * 4]


@pytest.mark.parametrize("probs", [False, True])
def test_trim_keeps_the_first_nodes(probs):
    b, n, v = 2, 5, 3
    d = Draft(tokens=jnp.arange(b * n).reshape(b, n), parents=jnp.tile(jnp.arange(n) - 1, (b, 1)),
              valid=jnp.ones((b, n), bool),
              probs=jnp.ones((b, n, v)) / v if probs else None)
    for k in (0, 2, n):
        t = trim(d, k)
        assert t.tokens.shape == t.parents.shape == t.valid.shape == (b, k)
        np.testing.assert_array_equal(t.tokens, d.tokens[:, :k])
        assert (t.probs is None) == (not probs)
        if probs:
            assert t.probs.shape == (b, k, v)


def test_narrowest_width():
    ws = (1, 4, 9)
    got = [int(widths.narrowest(ws, jnp.asarray(need))) for need in (0, 1, 2, 4, 5, 9, 10)]
    assert got == [0, 0, 1, 1, 2, 2, 2]  # the widest when none holds it
    assert int(widths.narrowest((7,), jnp.asarray(3))) == 0


def test_over_chunks_covers_the_longest_prompt():
    def body(start, pos, c):
        assert pos.shape == (2, 4)
        return c.at[start // 4].set(pos[1, 0] + 1)  # records each chunk's start (+ 1)

    got = decoding.over_chunks(body, jnp.zeros(4, jnp.int32), jnp.asarray([3, 9]), 4)
    assert got.tolist() == [1, 5, 9, 0]  # ceil(9 / 4) = 3 chunks, starting at 0, 4, 8


def _batch(sampler, key):
    toks = jnp.asarray([[1, 5, 2, 7, 0, 0, 0, 0], [3, 3, 0, 0, 0, 0, 0, 0]])
    return decoder.Batch(tokens=toks, lengths=jnp.asarray([4, 2]), budgets=jnp.asarray([3, 3]),
                         eos=jnp.asarray([0]), key=key, sampler=sampler, capacity=8, max_out=16)


@pytest.mark.parametrize("sampler", [sampling.Greedy(), sampling.Sample(temperature=0.7)])
def test_prefill_first_is_prefill_then_one_draw(sampler):
    model, tp = toys.llama()
    batch = _batch(sampler, jax.random.key(3))
    first, cache, key, hidden = decoding.prefill_first(model, tp, batch, 4, keep_hidden=True)
    h_last, c2, h_all = decoding.prefill(model, tp, batch.tokens, batch.lengths,
                                         model.init_cache(2, 8), 4, True)
    k, sub = jax.random.split(batch.key)
    want = sampling.sample(sub, model.logits(tp, h_last), sampler)
    np.testing.assert_array_equal(first, want)
    np.testing.assert_array_equal(jax.random.key_data(key), jax.random.key_data(k))
    np.testing.assert_array_equal(cache.length, batch.lengths)
    np.testing.assert_array_equal(hidden, h_all)
    assert decoding.prefill_first(model, tp, batch, 4)[3] is None


def test_exit_logits_last_is_the_last_of_all():
    model, tp = toys.llama()
    toks = jnp.asarray([[1, 5, 2]])
    pos = jnp.arange(3)[None]
    full, c1 = exit_logits(model, tp, 1, target_head, None, toks, pos, model.init_cache(1, 8))
    last, c2 = exit_logits(model, tp, 1, target_head, None, toks, pos, model.init_cache(1, 8),
                           last=True)
    assert full.shape == (1, 3, toys.V) and last.shape == (1, toys.V)
    np.testing.assert_allclose(last, full[:, -1], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(c1.length, c2.length)


def test_on_target_drafters_refuse_another_target():
    model, _ = toys.llama()
    other = Llama(dataclasses.replace(toys.LLAMA, num_layers=2))
    for d in (EarlyExitDrafter(model, 1), eagle.EagleDrafter(model, depth=2, topk=2,
                                                             total_tokens=3),
              redrafter.RedrafterDrafter(model, width=2, length=2)):
        assert isinstance(d, base.OnTarget) and d.draft_model is None
        d.check(model)
        with pytest.raises(ValueError, match="must be built on the target it drafts for"):
            d.check(other)
    assert EarlyExitDrafter(model, 1).feature_layers == ()
    assert eagle.EagleDrafter(model).feature_layers == (model.config.num_layers,)


def test_one_shipped_head_lookup():
    from specjax.heads import shipped

    assert shipped.shipped_dir(None) is None and shipped.shipped_dir("no-such-head") is None
    assert shipped.shipped_head("eagle", "nope") is None
    assert shipped.shipped_head("exit-heads", "nope") is None
    assert shipped.shipped_head("redrafter", "smollm2-135m") is None
    assert shipped.shipped_head("no-such-kind", "smollm2-135m") is None
    for kind, table in shipped.SHIPPED.items():
        for model, name in table.items():
            assert shipped.shipped_head(kind, model) == shipped.shipped_dir(name) is not None
