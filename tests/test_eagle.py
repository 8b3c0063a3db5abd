"""EAGLE-2: the dynamic tree against a hand-computed example and as a property, and the
drafter's losslessness (greedy and sampled) on toy models."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import specjax
import toys
from specjax.drafters import eagle
from specjax.core import sampling
from specjax.models.llama import Llama

# A bigram "draft model" over 5 tokens: the next-token distribution depends on the node's
# own token only. Values below are path products, computed by hand in the docstring.
ROOT_Q = [0.02, 0.6, 0.3, 0.06, 0.02]
NEXT_Q = {
    1: [0.02, 0.02, 0.06, 0.5, 0.4],   # after 1: 3 (.5), 4 (.4)
    2: [0.02, 0.7, 0.06, 0.2, 0.02],   # after 2: 1 (.7), 3 (.2)
    3: [0.5, 0.1, 0.3, 0.05, 0.05],    # after 3: 0 (.5), 2 (.3)
    4: [0.25, 0.6, 0.05, 0.05, 0.05],  # after 4: 1 (.6), 0 (.25)
    0: [0.2] * 5,
}
TABLE = jnp.log(jnp.asarray([NEXT_Q[t] for t in range(5)]))


def _bigram_step(carry, d, tokens, parent):
    return TABLE[tokens], carry


def _tree(by_value=True, enabled=True):
    pool, _ = eagle.expand(jnp.log(jnp.asarray([ROOT_Q])), _bigram_step, (), depth=3, topk=2,
                           by_value=by_value)
    return pool, eagle.rerank(pool, 8, jnp.asarray([10]), enabled)


def test_tree_matches_hand_computed_example():
    """Expand the top 2 for 3 levels, rerank to 8 nodes (EAGLE-2's Figure 7, our numbers).

    pool (index: token, value, parent): level 1  0: 1 .6 root, 1: 2 .3 root;
    level 2 (children of 0 and 1)  2: 3 .30 @0, 3: 4 .24 @0, 4: 1 .21 @1, 5: 3 .06 @1;
    level 3 (children of the best two, 2 and 3)  6: 0 .15 @2, 7: 2 .09 @2, 8: 1 .144 @3,
    9: 0 .06 @3. The 8 best values drop 5 and 9.
    """
    pool, t = _tree()
    np.testing.assert_array_equal(pool.tokens[0], [1, 2, 3, 4, 1, 3, 0, 2, 1, 0])
    np.testing.assert_array_equal(pool.parent[0], [-1, -1, 0, 0, 1, 1, 2, 2, 3, 3])
    np.testing.assert_allclose(np.exp(pool.value[0]),
                               [.6, .3, .3, .24, .21, .06, .15, .09, .144, .06], rtol=1e-5)
    np.testing.assert_array_equal(t.index[0], [0, 1, 2, 3, 4, 6, 7, 8])
    np.testing.assert_array_equal(t.tokens[0], [1, 2, 3, 4, 1, 0, 2, 1])
    np.testing.assert_array_equal(t.parents[0], [-1, -1, 0, 0, 1, 2, 2, 3])
    np.testing.assert_array_equal(t.positions[0], [10, 11, 11, 12, 12, 12, 13, 13, 13])
    sees = {0: [0], 1: [1], 2: [0, 2], 3: [0, 3], 4: [1, 4], 5: [0, 2, 5], 6: [0, 2, 6],
            7: [0, 3, 7]}
    want = np.zeros((9, 9), bool)
    want[:, 0] = True
    for node, anc in sees.items():
        want[node + 1, [a + 1 for a in anc]] = True
    np.testing.assert_array_equal(t.mask[0], want)


def test_tree_ablations_by_hand():
    # without reranking: breadth first, best first within a level -> nodes 0..6 and 8
    _, t = _tree(enabled=False)
    np.testing.assert_array_equal(t.index[0], [0, 1, 2, 3, 4, 5, 6, 8])
    # expansion by confidence: level 2's own probabilities .5 .4 .7 .2 expand nodes 4 and 2
    pool, _ = _tree(by_value=False)
    np.testing.assert_array_equal(pool.parent[0, 6:], [4, 4, 2, 2])
    np.testing.assert_array_equal(pool.tokens[0, 6:], [3, 4, 0, 2])
    np.testing.assert_allclose(np.exp(pool.value[0, 6:]), [.105, .084, .15, .09], rtol=1e-5)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5))
def _random_tree(key, v, depth, topk, n, enabled_by_value):
    """A pool expanded from random log-probabilities (a table: token -> next token's), and
    its reranked tree of ``n`` nodes (jitted: eager, an example took about 1 s)."""
    enabled, by_value = enabled_by_value
    k1, k2 = jax.random.split(key)
    table = jax.nn.log_softmax(jax.random.normal(k1, (v, v)) * 3)
    step = lambda c, d, tok, par: (table[tok], c)
    root = jax.nn.log_softmax(jax.random.normal(k2, (2, v)) * 3)
    pool, _ = eagle.expand(root, step, (), depth, topk, by_value)
    return pool, eagle.rerank(pool, n, jnp.asarray([0, 5]), enabled)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), depth=st.integers(1, 5), topk=st.integers(1, 4),
       frac=st.floats(0.05, 1.0), enabled=st.booleans(), by_value=st.booleans())
def test_tree_is_connected_for_random_drafts(seed, depth, topk, frac, enabled, by_value):
    n = max(1, int(frac * eagle.pool_size(depth, topk)))
    pool, t = _random_tree(jax.random.key(seed), 7, depth, topk, n, (enabled, by_value))
    par, idx = np.asarray(t.parents), np.asarray(t.index)
    for b in range(2):
        assert len(set(idx[b])) == n
        for j in range(n):
            p = par[b, j]
            assert -1 <= p < j, "a parent must be an earlier kept node"
            want_parent = np.asarray(pool.parent)[b, idx[b, j]]
            assert (p == -1 and want_parent == -1) or idx[b, p] == want_parent
            parent_pos = t.positions[b, p + 1]
            assert t.positions[b, j + 1] == parent_pos + 1
            if enabled and p >= 0:
                assert t.value[b, j] <= t.value[b, p] + 1e-6


def test_invalid_tree_size_is_rejected():
    pool, _ = _tree()
    with pytest.raises(ValueError, match="total_tokens=11 must lie in"):
        eagle.rerank(pool, 11, jnp.asarray([0]))
    with pytest.raises(ValueError, match="total_tokens"):
        eagle.EagleDrafter(Llama(TOY), depth=2, topk=2, total_tokens=7).check(Llama(TOY))
    with pytest.raises(ValueError, match=r"total_tokens=3 must lie in \[depth=4"):
        eagle.EagleDrafter(Llama(TOY), depth=4, topk=2, total_tokens=3).check(Llama(TOY))


# --- the drafter on toy models ----------------------------------------------------------

V = toys.V
TOY = toys.LLAMA
PROMPT = [1, 5, 2, 7, 5]


def _toy(layers: int):
    """The toy target and a random head of ``layers`` decoder layers (the extra layers'
    output projections made nonzero, so they change what the head drafts)."""
    model, tparams = toys.llama(seed=1)
    head = eagle.init_head(TOY, jax.random.key(3), layers=layers)
    for i, lp in enumerate(head.get("extra_layers", ())):
        k1, k2 = jax.random.split(jax.random.key(10 + i))
        lp["o"] = jax.random.normal(k1, lp["o"].shape) * 0.05
        lp["down"] = jax.random.normal(k2, lp["down"].shape) * 0.05
    return model, tparams, eagle.draft_params(head, model, tparams)


@pytest.fixture(scope="module", params=[1, 2], ids=["1-layer", "2-layer"])
def toy(request):
    return _toy(request.param)


@pytest.fixture(scope="module")
def toy2():
    """A two-layer head: the one-layer head's decoding is tests/test_conformance.py's."""
    return _toy(2)


# Greedy equals ar (full and reduced draft vocabulary, batch 1 and 4) and the sampled law:
# tests/test_conformance.py, over the registry's eagle2 and eagle3 specs.


def test_drafter_matches_the_teacher_forced_head(toy):
    """The drafter's cached, tree-masked head steps equal the head run over whole sequences:
    level 1 from the true features, level 2 from the predicted feature of its parent."""
    model, tparams, dp = toy
    drafter = eagle.EagleDrafter(model, depth=2, topk=3, total_tokens=eagle.pool_size(2, 3))
    prompt, p, cap = PROMPT * 3, len(PROMPT) * 3, 128

    @jax.jit  # both sides jitted, as they run in decoding and training (eager is slow)
    def drafted(dp, ctx):
        state = drafter.init(dp, ctx, 64)
        return drafter.propose(dp, state, ctx, jax.random.key(0), sampling.Greedy())[0]

    @jax.jit
    def teacher_forced(tparams, head, seq):
        """The head's top 3 at the last position, and then at one position more (its
        parent the first of those 3, its input feature the head's own output)."""
        _, hid, _ = model.forward(tparams, seq, jnp.arange(p + 1)[None],
                                  model.init_cache(1, cap))
        toks, prev = eagle.head_inputs(seq, eagle.features(model, tparams,
                                                           hid[TOY.num_layers]))
        out = eagle.training_forward(model, head, tparams, toks, prev)
        emb = eagle.output_embedding(model, tparams)
        level1 = jax.lax.top_k(out[0, -1] @ emb.T, 3)[1]
        toks2 = jnp.concatenate([toks, level1[None, :1]], axis=1)
        prev2 = jnp.concatenate([prev, out[:, -1:]], axis=1)
        out2 = eagle.training_forward(model, head, tparams, toks2, prev2)
        return level1, jax.lax.top_k(out2[0, -1] @ emb.T, 3)[1]

    ctx = toys.start_context(model, tparams, prompt, cap, chunk=64)
    draft = drafted(dp, ctx)
    first = int(ctx.tokens[0, p])
    level1, level2 = teacher_forced(tparams, dp["head"], jnp.asarray([prompt + [first]]))
    np.testing.assert_array_equal(draft.tokens[0, :3], level1)
    np.testing.assert_array_equal(draft.tokens[0, 3:6], level2)


def test_a_prompt_ending_near_the_buffer_end_drafts_as_in_a_larger_buffer(toy2):
    """The head's prefill reads its entries in whole chunks: a 53-token prompt in a 64-slot
    buffer (its last chunk ends at the buffer's end) writes the same head cache and drafts
    the same tree as in an 80-slot buffer (a feature sequence one entry shorter than the
    tokens' read the last chunk's features one position off)."""
    model, tparams, dp = toy2
    drafter = eagle.EagleDrafter(model, depth=2, topk=3, total_tokens=eagle.pool_size(2, 3))
    prompt = (PROMPT * 11)[:53]

    @jax.jit
    def drafted(dp, ctx):
        state = drafter.init(dp, ctx, 16)
        draft = drafter.propose(dp, state, ctx, jax.random.key(0), sampling.Greedy())[0]
        return state.cache.k[0][..., :52], state.cache.v[0][:, :, :52], draft

    (k1, v1, d1), (k2, v2, d2) = (
        drafted(dp, toys.start_context(model, tparams, prompt, cap, chunk=16)) for cap in (64, 80))
    np.testing.assert_allclose(k1, k2, atol=1e-6)  # the prompt's 52 entries
    np.testing.assert_allclose(v1, v2, atol=1e-6)
    np.testing.assert_array_equal(d1.tokens, d2.tokens)
    np.testing.assert_array_equal(d1.parents, d2.parents)


# Greedy eagle equals ar on the real model (batch 4):
# tests/test_real_smollm2.py::test_speculative_greedy_equals_ar[eagle2].


def test_drafter_state_after_commit_equals_a_fresh_start(toy2):
    """After a real round (propose, verify, commit), the head drafts exactly what a head
    started afresh on the whole accepted context drafts: the committed features and cache
    are those of the true context."""
    from specjax.drafters import Context

    model, tparams, dp = toy2
    drafter = eagle.EagleDrafter(model, depth=3, topk=3, total_tokens=8)
    cap, chunk, greedy = 128, 16, sampling.Greedy()
    eos = jnp.asarray([-1])
    # each step jitted, as decoding runs it (eager, its many small operations are slow)
    spec = specjax.Speculative(model, drafter, drafter.verify_widths, chunk=chunk)
    init, step = jax.jit(spec.init), jax.jit(spec.step)
    propose = jax.jit(lambda dp, st, ctx: drafter.propose(dp, st, ctx, jax.random.key(0),
                                                          greedy)[0])
    drafter_init = jax.jit(lambda dp, ctx: drafter.init(dp, ctx, chunk))

    def start(prompt):
        ctx = toys.start_context(model, tparams, prompt, cap, chunk)
        return ctx, drafter_init(dp, ctx)

    accepted = []
    for prompt in (PROMPT, PROMPT * 3, [3, 3, 1, 4], [7, 2]):
        p = len(prompt)
        buf = jnp.zeros((1, cap), jnp.int32).at[0, :p].set(jnp.asarray(prompt))
        x = specjax.Batch(tokens=buf, lengths=jnp.asarray([p]), budgets=jnp.asarray([64]),
                          eos=eos, key=jax.random.key(0), sampler=greedy, capacity=cap,
                          max_out=64)
        s = init((tparams, dp), x)
        for _ in range(2):  # two rounds: the second drafts from a committed state
            s = step((tparams, dp), s)
        accepted.append(int(s.stats.accepted_at[0, 0]))
        n = int(s.length[0])
        ctx = Context(tokens=s.tokens, length=s.length, prompt_len=jnp.asarray([len(prompt)]),
                      cache=s.cache, params=tparams)
        committed = propose(dp, s.dstate, ctx)
        fresh_ctx, fresh_state = start(np.asarray(s.tokens[0, : n - 1]).tolist())
        fresh = propose(dp, fresh_state, fresh_ctx)
        assert int(fresh_ctx.tokens[0, n - 1]) == int(s.tokens[0, n - 1])
        np.testing.assert_array_equal(committed.tokens, fresh.tokens)
        np.testing.assert_array_equal(committed.parents, fresh.parents)
    assert sum(accepted) > 0, "no round accepted a draft token: the commit path went untested"


# Greedy decoding with a two-layer head equals ar:
# tests/test_convert_head.py::test_a_converted_head_decodes_as_ar (its published layout).


def test_extra_layers_start_as_the_identity_and_then_count():
    """A fresh two-layer head computes exactly its first layer's function (the extra
    layer's output projections start at zero, so a warm start keeps a one-layer head's
    drafts); once they are nonzero the second layer changes the output."""
    model, tparams = toys.llama(seed=1)
    one = eagle.init_head(TOY, jax.random.key(3))
    two = eagle.init_head(TOY, jax.random.key(3), layers=2)
    assert eagle.num_layers(one) == 1 and eagle.num_layers(two) == 2
    seq = jnp.asarray([PROMPT * 2])
    prev = jax.random.normal(jax.random.key(4), (1, seq.shape[1], TOY.hidden_size))
    f1 = eagle.training_forward(model, one, tparams, seq, prev)
    np.testing.assert_array_equal(eagle.training_forward(model, two, tparams, seq, prev), f1)
    two["extra_layers"][0]["o"] = jnp.full_like(two["extra_layers"][0]["o"], 0.05)
    f2 = eagle.training_forward(model, two, tparams, seq, prev)
    assert float(jnp.abs(f2 - f1).max()) > 1e-3
    with pytest.raises(ValueError, match="at least one layer"):
        eagle.init_head(TOY, jax.random.key(3), layers=0)
