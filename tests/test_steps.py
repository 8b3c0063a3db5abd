"""The public jittable pieces (``init``, ``step``, ``loop``, ``output``) of every method:
a user-written ``lax.scan`` over ``step`` inside the user's own ``jit`` gives the host
wrapper's tokens, and stepping a finished state changes nothing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import specjax
from specjax.drafters import eagle
from specjax.hsd import HSD, Exit, Hierarchy, NGram
from specjax.models import Llama, LlamaConfig
from specjax.models.llama import init_params

V = 48
TOY = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=256)
PROMPTS = [[1, 5, 2, 7, 5, 9], [3, 3, 1, 4], [7, 2, 7, 2, 7, 9, 11, 2]]
NEW = 20


@pytest.fixture(scope="module")
def toy():
    model = Llama(TOY)
    return model, jax.tree.map(lambda x: x * 3.0, init_params(TOY, jax.random.key(1)))


def _scan(dec, params: tuple, x, n_steps: int):
    """What a researcher writes: init, a fixed number of steps under lax.scan (recording
    each step's emitted counts), output; all inside one jit."""

    @jax.jit
    def run(params, tokens, lengths, budgets, key, eos):
        s = dec.init(*params, tokens, lengths, budgets, key, eos)
        s, nums = lax.scan(lambda s, _: (dec.step(*params, s), _num(s)), s, None,
                           length=n_steps)
        return dec.output(s), nums, s

    return run(params, x.tokens, x.lengths, x.budgets, x.key, x.eos)


def _num(s):
    return s.num if hasattr(s, "num") else s.n[-1] - s.prompt_len


def test_ar_steps_under_a_user_scan(toy):
    model, tp = toy
    x = specjax.prepare(model, PROMPTS, NEW)
    ar = specjax.AR(model, x.capacity, x.max_out)
    out, nums, s = _scan(ar, (tp,), x, NEW - 1)
    ref = specjax.generate(model, tp, PROMPTS, max_new_tokens=NEW)
    assert out.to_lists() == ref.to_lists()
    assert np.all(np.diff(np.asarray(nums), axis=0) >= 0)  # counts only grow, step by step
    again = jax.jit(ar.step)(tp, s)  # every row is done: a step is a no-op
    np.testing.assert_array_equal(again.tokens, s.tokens)
    np.testing.assert_array_equal(again.num, s.num)


@pytest.mark.parametrize("kind", ["ngram", "eagle2"])
def test_speculative_steps_under_a_user_scan(toy, kind):
    model, tp = toy
    if kind == "ngram":
        drafter, dp = specjax.NGramDrafter(depth=4, min_ngram=1), None
    else:
        drafter = eagle.EagleDrafter(model, depth=3, topk=2, total_tokens=6)
        dp = eagle.draft_params(eagle.init_head(TOY, jax.random.key(2)), model, tp)
    x = specjax.prepare(model, PROMPTS, NEW, extra=drafter.num_nodes + 1)
    spec = specjax.Speculative(model, drafter, x.capacity, x.max_out,
                               tuple(sorted(set(drafter.verify_widths))))
    out, nums, s = _scan(spec, (tp, dp), x, NEW - 1)  # each round emits >= 1 token
    ref = specjax.speculative_generate(model, tp, drafter, dp, PROMPTS, max_new_tokens=NEW)
    assert out.to_lists() == ref.to_lists() == specjax.generate(
        model, tp, PROMPTS, max_new_tokens=NEW).to_lists()
    np.testing.assert_array_equal(out.target_forwards, ref.target_forwards)
    assert bool(jnp.all(s.done))
    again = jax.jit(spec.step)(tp, dp, s)
    np.testing.assert_array_equal(again.tokens, s.tokens)
    np.testing.assert_array_equal(again.rounds, s.rounds)


def test_hsd_steps_under_a_user_scan(toy):
    model, tp = toy
    h = Hierarchy((NGram(specjax.NGramDrafter(depth=4, min_ngram=1)), Exit(1), Exit()),
                  T=(2, 2))
    extra = sum(m + 1 for m in h.buffer) + 2 * 2 + 2
    x = specjax.prepare(model, PROMPTS, NEW, extra=extra)
    dec = HSD(model, h, x.capacity, x.max_out)
    hp = (None, None, None)
    out, nums, s = _scan(dec, (tp, hp), x, NEW - 1)
    ref = specjax.hsd_generate(model, tp, h, PROMPTS, max_new_tokens=NEW)
    assert out.to_lists() == ref.to_lists()
    np.testing.assert_array_equal(out.forwards, ref.forwards)
    loop = jax.jit(lambda tp, s: dec.output(dec.loop(tp, hp, s)))
    s0 = jax.jit(lambda tp: dec.init(tp, hp, x.tokens, x.lengths, x.budgets, x.key, x.eos))(tp)
    assert loop(tp, s0).to_lists() == ref.to_lists()  # loop is the host wrapper's path
