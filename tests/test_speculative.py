"""Speculative decoding end to end: sampled losslessness of the whole loop on toy models,
KV commit, and bad input."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
import toys as toy_models  # the module; "toys" is a fixture below
from laws import PROMPT, sampled_pairs
from specjax.core import sampling, tree
from specjax.drafters import EarlyExitDrafter, ModelDrafter, NGramDrafter, bigram_table
from specjax.models.llama import Llama
from specjax.core.speculative import speculative_generate

# Greedy exactness on the real model with every drafter (batch 4, and 1 for trained heads):
# tests/test_real_smollm2.py::test_speculative_greedy_equals_ar.


# --- toy models: the whole loop at temperature 1 --------------------------------------------

V = toy_models.V
TOY = toy_models.LLAMA


@pytest.fixture(scope="module")
def toys():
    model, tparams = toy_models.llama(seed=1)  # params times 3: sharper, context-dependent logits
    return model, tparams, toy_models.llama_params(seed=2)


# The registered drafters (n-gram, early exit, EAGLE, ReDrafter, HSD) are checked at
# temperature 1 and against ar at batch 1 and 4 by tests/test_conformance.py; the model
# drafter, which no method spec builds, here. Its chain is opt-in (the suite's time): the
# early-exit drafter's chain (tests/test_conformance.py) proposes through the same
# ``TopKTree`` code.
@pytest.mark.parametrize("kind", [pytest.param("model-chain", marks=pytest.mark.extended),
                                  "model-tree-wor"])
def test_sampled_loop_matches_target(toys, kind):
    model, tparams, dparams = toys
    drafter = {"model-chain": ModelDrafter(model, depth=3),
               "model-tree-wor": ModelDrafter(model, depth=2, width=3)}[kind]
    p, acc = sampled_pairs(model, tparams, drafter, dparams)
    assert p > 1e-4, f"{kind}: (y0, y1) differs from the target (p={p:.2e})"
    assert acc > 0.0, "no draft was ever accepted: the test would be vacuous"


def test_greedy_model_tree_batch_of_one_equals_ar(toys):
    """Batch 1 on a toy (batch 4 on the real weights: tests/test_real_smollm2.py)."""
    model, tparams, dparams = toys
    drafter = ModelDrafter(model, depth=3, width=2)
    ar = specjax.generate(model, tparams, [PROMPT], max_new_tokens=14).to_lists()
    out = speculative_generate(model, tparams, drafter, dparams, [PROMPT], max_new_tokens=14)
    assert out.to_lists() == ar and len(ar[0]) == 14


def test_kv_commit_equals_running_accepted_tokens(toys):
    model, params, _ = toys
    fwd = jax.jit(model.forward)  # as decoding runs it (eager is slow)
    prompt = jnp.asarray([[3, 1, 4, 1, 5, 9]])
    cache = model.init_cache(1, 64)
    pos = jnp.arange(6)[None]
    _, _, cache = fwd(params, prompt, pos, cache)
    cache = cache.advance(6)
    # root 2, then a tree: nodes 0,1 children of root; 2 under 0; 3 under 1; 4 under 3
    parents = jnp.asarray([[-1, -1, 0, 1, 3]])
    nodes = jnp.asarray([[7, 8, 9, 10, 11]])
    toks = jnp.concatenate([jnp.asarray([[2]]), nodes], 1)
    _, _, cache = fwd(params, toks, tree.positions(cache.length, parents), cache,
                      tree.attention_mask(parents))
    path = jnp.asarray([[1, 3, 4]])  # accept nodes 1 -> 3 -> 4 (tokens 8, 10, 11)
    committed = cache.commit(jnp.concatenate([jnp.zeros((1, 1), jnp.int32), path + 1], 1),
                             jnp.asarray([4]), window=6)
    ref = model.init_cache(1, 64)
    seq = jnp.asarray([[3, 1, 4, 1, 5, 9, 2, 8, 10, 11]])
    _, _, ref = fwd(params, seq, jnp.arange(10)[None], ref)
    assert int(committed.length[0]) == 10
    for a, b in zip(committed.k, ref.k):  # [B, K, H, S]
        np.testing.assert_allclose(np.asarray(a)[..., :10], np.asarray(b)[..., :10], atol=1e-5)
    for a, b in zip(committed.v, ref.v):  # [B, K, S, H]
        np.testing.assert_allclose(np.asarray(a)[:, :, :10], np.asarray(b)[:, :, :10], atol=1e-5)


def test_ngram_drafter_proposes_the_continuation(toys):
    model, params, _ = toys
    from specjax.drafters import Context

    hist = jnp.asarray([[1, 2, 3, 4, 5, 1, 2, 3, 0, 0]])
    ctx = Context(tokens=hist, length=jnp.asarray([8]), prompt_len=jnp.asarray([8]),
                  cache=model.init_cache(1, 16), params=params)
    draft, _, _ = NGramDrafter(depth=4).propose(None, (), ctx, None, sampling.Greedy())
    assert draft.tokens[0].tolist() == [4, 5, 1, 2] and bool(draft.valid.all())
    # the latest match wins, and a match running into the suffix repeats periodically
    ctx = ctx.replace(tokens=jnp.asarray([[7, 8, 7, 8, 7, 0, 0, 0, 0, 0]]), length=jnp.asarray([5]))
    draft, _, _ = NGramDrafter(depth=5).propose(None, (), ctx, None, sampling.Greedy())
    assert draft.tokens[0].tolist() == [8, 7, 8, 7, 8]
    # no match: nothing valid, unless a bigram table continues from the root
    ctx = ctx.replace(tokens=jnp.asarray([[1, 2, 3, 0, 0, 0, 0, 0, 0, 0]]), length=jnp.asarray([3]))
    draft, _, _ = NGramDrafter(depth=3).propose(None, (), ctx, None, sampling.Greedy())
    assert not bool(draft.valid.any())
    table = jnp.asarray(bigram_table([[3, 6, 4, 3, 6]], V))
    draft, _, _ = NGramDrafter(depth=3).propose(table, (), ctx, None, sampling.Greedy())
    assert draft.tokens[0].tolist()[:2] == [6, 4] and draft.valid[0].tolist() == [True] * 3


def test_bad_input_fails_clearly(toys):
    model, params, _ = toys
    other = Llama(dataclasses.replace(TOY, vocab_size=V + 5, num_layers=1))
    with pytest.raises(ValueError, match="vocabulary mismatch"):
        speculative_generate(model, params, ModelDrafter(other), None, [PROMPT], max_new_tokens=4)
    with pytest.raises(ValueError, match="draft slots"):
        speculative_generate(model, params, NGramDrafter(depth=8), None, [PROMPT],
                             max_new_tokens=120, cache_size=128)
    with pytest.raises(ValueError, match="depth and width must be >= 1"):
        speculative_generate(model, params, ModelDrafter(model, depth=0), params, [PROMPT],
                             max_new_tokens=4)
    with pytest.raises(ValueError, match="early-exit layer"):
        speculative_generate(model, params, EarlyExitDrafter(model, 3), None, [PROMPT],
                             max_new_tokens=4)


@dataclasses.dataclass(frozen=True)
class _PaddingDrafter(NGramDrafter):
    """An n-gram drafter whose every third node carries a padding id outside the vocabulary
    (alternately -1 and V + 5), still marked valid: a user's drafter gone wrong."""

    def propose(self, table, state, ctx, key, sampler):
        d, state, cache = super().propose(table, state, ctx, key, sampler)
        j = jnp.arange(d.tokens.shape[1])[None]
        bad = jnp.where(j % 6 == 2, -1, V + 5)
        return d.replace(tokens=jnp.where(j % 3 == 2, bad, d.tokens)), state, cache


def test_padding_ids_from_a_drafter_are_never_emitted(toys):
    """The loop runs such drafts (the bad nodes inert) and still reproduces ``generate``."""
    model, params, _ = toys
    prompts = [PROMPT * 3, [4, 4, 4, 4, 4, 4], PROMPT + [3, 3]]
    ar = specjax.generate(model, params, prompts, max_new_tokens=20).to_lists()
    out = speculative_generate(model, params, _PaddingDrafter(depth=6, min_ngram=1), None,
                               prompts, max_new_tokens=20)
    assert out.to_lists() == ar
    assert np.asarray(out.accepted_at)[:, 0].sum() > 0  # clean nodes were still accepted
    for i in range(4):  # sampled: a padding id is never accepted, so never emitted
        out = speculative_generate(model, params, _PaddingDrafter(depth=6, min_ngram=1), None,
                                   prompts * 8, max_new_tokens=20, sampler=sampling.Sample(1.0),
                                   key=jax.random.key(i))
        toks = [t for row in out.to_lists() for t in row]
        assert min(toks) >= 0 and max(toks) < V
