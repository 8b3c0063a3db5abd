"""Beam search and prefix dedup (``specjax.core.beams``): a hand-computed example, invariants
of the packed tree on random beams, state gathering, and losslessness at temperature 1
against the reference's "best beam" rule, which must fail the same test."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from specjax.core import beams, sampling, tree
from specjax.core.verify import Rejection, verify

# next-token draft distribution after each token (rows: the last token); root = 0
TABLE = np.asarray([[0.1, 0.7, 0.2],   # after 0
                    [0.1, 0.1, 0.8],   # after 1
                    [0.5, 0.4, 0.1]])  # after 2
LOG = jnp.log(jnp.asarray(TABLE))


def _bigram(state, toks):
    return LOG[toks], state


def test_beams_and_packed_tree_match_hand_computed_example():
    """W=2, L=3 from root 0.
    step 1 (beam 0 only): [1] .7, [2] .2
    step 2: [1,2] .56, [1,0] .07, [1,1] .07 | [2,0] .10, [2,1] .08, [2,2] .02 -> [1,2], [2,0]
    step 3: [1,2,0] .28, [1,2,1] .224, [1,2,2] .056 | [2,0,1] .07 ... -> [1,2,0], [1,2,1]
    The two beams share the prefix [1, 2]: 4 nodes, not 6.
    """
    found, _ = beams.beam_search(_bigram, jnp.zeros((1, 2)), jnp.asarray([0]), 2, 3)
    np.testing.assert_array_equal(found.tokens[0], [[1, 2, 0], [1, 2, 1]])
    np.testing.assert_allclose(np.exp(found.scores[0]), [0.28, 0.224], rtol=1e-5)
    # the distributions each token was chosen from: after 0, after 1, after 2
    np.testing.assert_allclose(np.exp(found.logq[0, 0]), TABLE[[0, 1, 2]], rtol=1e-5)
    np.testing.assert_allclose(np.exp(found.logq[0, 1]), TABLE[[0, 1, 2]], rtol=1e-5)
    t = beams.pack(found.tokens)
    np.testing.assert_array_equal(t.tokens[0], [1, 2, 0, 1, 0, 0])
    np.testing.assert_array_equal(t.parents[0], [-1, 0, 1, 1, -1, -1])
    np.testing.assert_array_equal(t.valid[0], [1, 1, 1, 1, 0, 0])
    np.testing.assert_array_equal(t.node[0], [[0, 1, 2], [0, 1, 3]])
    assert int(t.num_nodes[0]) == 4
    sees = {0: [0], 1: [0, 1], 2: [0, 1, 2], 3: [0, 1, 3]}
    want = np.zeros((7, 7), bool)
    want[:, 0] = True
    for node, anc in sees.items():
        want[node + 1, [a + 1 for a in anc]] = True
    for pad in (4, 5):  # padding sees the root and itself only
        want[pad + 1, pad + 1] = True
    np.testing.assert_array_equal(beams.mask(t)[0], want)


@jax.jit
def _packed(toks):
    """The packed tree of beams ``toks``, its ancestor matrix and its mask (jitted: eager,
    the packing's many small operations made an example take about 1 s)."""
    t = beams.pack(toks)
    return t, tree.ancestors(t.parents), beams.mask(t)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), b=st.integers(1, 3), w=st.integers(1, 5),
       l=st.integers(1, 4), v=st.integers(2, 4))
def test_packed_tree_invariants_on_random_beams(seed, b, w, l, v):
    toks = np.random.default_rng(seed).integers(0, v, size=(b, w, l)).astype(np.int32)
    t, anc, m = _packed(jnp.asarray(toks))
    tk, par, val, node = (np.asarray(x) for x in (t.tokens, t.parents, t.valid, t.node))
    anc, m = np.asarray(anc), np.asarray(m)
    for r in range(b):
        n = int(t.num_nodes[r])
        assert n == len({tuple(toks[r, k, :i + 1]) for k in range(w) for i in range(l)})
        assert val[r].tolist() == [True] * n + [False] * (w * l - n)
        assert all(par[r, j] < j for j in range(w * l))
        for k in range(w):  # every beam's path is in the tree, ending at its last node
            path, j = [], int(node[r, k, l - 1])
            while j >= 0:
                assert val[r, j]
                path.append(int(tk[r, j]))
                j = int(par[r, j])
            assert path[::-1] == toks[r, k].tolist()
        pairs = [(int(par[r, j]), int(tk[r, j])) for j in range(n)]
        assert len(pairs) == len(set(pairs)), "two nodes share (parent, token)"
        for j in range(n):  # a valid node sees the root, itself and its ancestors only
            assert m[r, j + 1, 0]
            np.testing.assert_array_equal(m[r, j + 1, 1:], anc[r, j])


def test_state_follows_its_beam():
    """The state is the running sum of the tokens fed: after the search, beam ``w``'s state
    must be the root plus its own tokens except the last (never fed)."""
    def step(state, toks):
        return LOG[toks], state + toks

    root = jnp.asarray([0, 2])
    found, state = beams.beam_search(step, jnp.zeros((2, 3), jnp.int32), root, 3, 4)
    want = np.asarray(root)[:, None] + np.asarray(found.tokens)[:, :, :-1].sum(-1)
    np.testing.assert_array_equal(np.asarray(state), want)
    assert len({tuple(x) for x in np.asarray(found.tokens[0]).tolist()}) == 3  # distinct beams


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="width and length must be >= 1"):
        beams.check_sizes(0, 3)
    with pytest.raises(ValueError, match="width and length must be >= 1"):
        beams.check_sizes(2, 0)
    with pytest.raises(ValueError, match="exceeds the draft vocabulary"):
        beams.beam_search(_bigram, jnp.zeros((1, 4)), jnp.asarray([0]), 4, 2)


# --- temperature 1: ours against the reference's rule --------------------------------------

V, W, L, ROOT, N = 5, 3, 2, 0, 40_000
P_LOGITS = 1.5 * jax.random.normal(jax.random.key(0), (V, V))   # target: bigram
Q_LOGITS = P_LOGITS + jax.random.normal(jax.random.key(1), (V, V))  # draft: a noisy copy


def _draft_beams():
    logq = jax.nn.log_softmax(Q_LOGITS, -1)
    found, _ = beams.beam_search(lambda s, t: (logq[t], s), jnp.zeros((1, W)),
                                 jnp.asarray([ROOT]), W, L)
    return found


def _ours(key):
    """One round of specjax's verification on the packed beams, then y1 from the target
    when only one token was emitted."""
    t = beams.pack(_draft_beams().tokens)
    draft = jax.tree.map(lambda x: jnp.broadcast_to(x, (N,) + x.shape[1:]), beams.to_draft(t))
    logits = jnp.concatenate([P_LOGITS[ROOT][None], P_LOGITS[draft.tokens[0]]], 0)
    logits = jnp.broadcast_to(logits, (N,) + logits.shape)
    k1, k2 = jax.random.split(key)
    res = verify(logits, draft, k1, sampling.Sample(1.0), rule=Rejection(), depth=L)
    y0 = res.tokens[:, 0]
    y1 = jnp.where(res.accepted >= 1, res.tokens[:, 1],
                   jax.random.categorical(k2, P_LOGITS[y0]))
    return np.asarray(y0), np.asarray(y1)


def _reference(key):
    """The reference's rule: each beam accepts its tokens with min(1, p/q) against its own
    draft distribution until the first rejection; the beam with the most accepted tokens is
    kept; the next token comes from norm(max(p - q, 0)) at its rejection point (or from p
    after a whole beam)."""
    found = _draft_beams()
    toks = found.tokens[0]  # [W, L]
    q = jnp.exp(found.logq[0])  # [W, L, V]
    ctx = jnp.concatenate([jnp.full((W, 1), ROOT), toks[:, :-1]], 1)
    p = jax.nn.softmax(P_LOGITS[ctx], -1)  # [W, L, V]
    k1, k2, k3 = jax.random.split(key, 3)
    u = jax.random.uniform(k1, (N, W, L))
    ratio = jnp.take_along_axis(p / q, toks[..., None], -1)[..., 0]  # [W, L]
    ok = jnp.cumprod(u < jnp.minimum(1.0, ratio)[None], -1)  # [N, W, L]
    n_acc = ok.sum(-1)
    best = jnp.argmax(n_acc, -1)  # first beam with the most accepted
    a = n_acc[jnp.arange(N), best]
    at = jnp.minimum(a, L - 1)
    pp, qq = p[best, at], q[best, at]  # [N, V]
    res = jnp.maximum(pp - qq, 0.0)
    res = jnp.where(a[:, None] < L, res / jnp.maximum(res.sum(-1, keepdims=True), 1e-30), 0.0)
    nxt = jax.random.categorical(k2, jnp.log(jnp.maximum(res, 1e-30)))
    after = toks[best, L - 1]
    nxt = jnp.where(a < L, nxt, jax.random.categorical(k3, P_LOGITS[after]))
    y0 = jnp.where(a >= 1, toks[best, 0], nxt)
    y1 = jnp.where(a >= 2, toks[best, 1], jnp.where(a == 1, nxt, jax.random.categorical(
        jax.random.fold_in(k3, 1), P_LOGITS[y0])))
    return np.asarray(y0), np.asarray(y1)


def _pvalue(y0, y1):
    p0 = np.asarray(jax.nn.softmax(P_LOGITS[ROOT]), np.float64)
    joint = p0[:, None] * np.asarray(jax.nn.softmax(P_LOGITS, -1), np.float64)
    counts = np.zeros((V, V))
    np.add.at(counts, (y0, y1), 1)
    exp = joint.ravel() * counts.sum()
    big = exp >= 5
    obs = np.append(counts.ravel()[big], counts.ravel()[~big].sum())
    e = np.append(exp[big], exp[~big].sum())
    return stats.chisquare(obs, e * obs.sum() / e.sum()).pvalue


def test_packed_beams_keep_the_target_law_and_the_reference_rule_does_not():
    y0, y1 = _ours(jax.random.key(7))
    p_ours = _pvalue(y0, y1)
    accepted = np.mean(y0 == int(_draft_beams().tokens[0, 0, 0]))
    assert accepted > 0.1, "the draft's first token is rarely emitted: a vacuous test"
    assert p_ours > 1e-3, f"packed beams + one-hot q: (y0, y1) differs from the target ({p_ours:.2e})"
    r0, r1 = _reference(jax.random.key(7))
    p_ref = _pvalue(r0, r1)
    assert p_ref < 1e-6, f"the reference's best-beam rule passed the test (p={p_ref:.2e})"
