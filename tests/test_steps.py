"""The one decoder protocol (``init``, ``step``, ``done``, ``output``) of every method: a
user-written ``lax.scan`` over ``step`` inside the user's own ``jit``, with the ``Batch``
passed in as a pytree, gives the host wrapper's tokens, and stepping a finished state
changes nothing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import toys
import specjax
from specjax.drafters import eagle
from specjax.hsd import HSD, Exit, Hierarchy, NGram
from specjax.models import Llama
from specjax.models.llama import init_params

V = toys.V
TOY = toys.LLAMA
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
    def run(params, x):
        s = dec.init(params, x)
        s, nums = lax.scan(lambda s, _: (dec.step(params, s), _num(s)), s, None,
                           length=n_steps)
        return dec.output(s), nums, s

    return run(params, x)


def _num(s):
    return s.num if hasattr(s, "num") else s.n[-1] - s.req.prompt_len


def test_ar_steps_under_a_user_scan(toy):
    model, tp = toy
    x = specjax.prepare(model, PROMPTS, NEW)
    ar = specjax.AR(model)
    assert isinstance(ar, specjax.Decoder)
    out, nums, s = _scan(ar, tp, x, NEW - 1)
    ref = specjax.generate(model, tp, PROMPTS, max_new_tokens=NEW)
    assert out.to_lists() == ref.to_lists()
    assert np.all(np.diff(np.asarray(nums), axis=0) >= 0)  # counts only grow, step by step
    again = jax.jit(ar.step)(tp, s)  # every row is done: a step is a no-op
    np.testing.assert_array_equal(again.tokens, s.tokens)
    np.testing.assert_array_equal(again.num, s.num)


def test_speculative_steps_under_a_user_scan(toy):
    """A tree drafter's rounds under a user's ``lax.scan``: the tokens and forwards of
    ``speculative_generate``, and a step after the end is a no-op. (A chain drafter's
    scan on real weights: docs/guide.md's research-code block, run by tests/test_readme.py
    against ``speculative_generate``.)"""
    model, tp = toy
    drafter = eagle.EagleDrafter(model, depth=3, topk=2, total_tokens=6)
    dp = eagle.draft_params(eagle.init_head(TOY, jax.random.key(2)), model, tp)
    spec = specjax.Speculative(model, drafter, tuple(sorted(set(drafter.verify_widths))))
    x = specjax.prepare(model, PROMPTS, NEW, extra=spec.scratch)
    assert spec.scratch == drafter.num_nodes + 1
    out, nums, s = _scan(spec, (tp, dp), x, NEW - 1)  # each round emits >= 1 token
    ref = specjax.speculative_generate(model, tp, drafter, dp, PROMPTS, max_new_tokens=NEW)
    assert out.to_lists() == ref.to_lists() == specjax.generate(
        model, tp, PROMPTS, max_new_tokens=NEW).to_lists()
    np.testing.assert_array_equal(out.target_forwards, ref.target_forwards)
    assert bool(jnp.all(s.done))
    again = jax.jit(spec.step)((tp, dp), s)
    np.testing.assert_array_equal(again.tokens, s.tokens)
    np.testing.assert_array_equal(again.stats.forwards, s.stats.forwards)


def test_hsd_steps_under_a_user_scan(toy):
    model, tp = toy
    h = Hierarchy((NGram(specjax.NGramDrafter(depth=4, min_ngram=1)), Exit(1), Exit()),
                  T=(2, 2))
    dec = HSD(model, h)
    x = specjax.prepare(model, PROMPTS, NEW, extra=dec.scratch)
    hp = (None, None, None)
    out, nums, s = _scan(dec, (tp, hp), x, NEW - 1)
    ref = specjax.hsd_generate(model, tp, h, PROMPTS, max_new_tokens=NEW)
    assert out.to_lists() == ref.to_lists()
    np.testing.assert_array_equal(out.forwards, ref.forwards)
    loop = jax.jit(lambda tp, s: dec.output(dec.loop((tp, hp), s)))
    s0 = jax.jit(lambda tp, x: dec.init((tp, hp), x))(tp, x)
    assert loop(tp, s0).to_lists() == ref.to_lists()  # loop is the host wrapper's path
