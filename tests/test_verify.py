"""Verification: greedy exactness, sampled losslessness (chi-square against the exact target
distribution on a toy model), negative controls that must fail, and bad input.

The toy target draws the token at depth d after token t from softmax(A[t] + S[d - 1]), so
its distribution depends on the context; the toy draft uses other tables. Each sample runs
one verification round and then continues from the exact target up to ``M`` tokens; the
tokens at every position and the pair (y0, y1) must follow the target exactly.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from laws import pvalue
from specjax.core import sampling, tree
from specjax.core.verify import Draft, Rejection, Typical, verify

V, M, ROWS, ROOT = 8, 4, 120_000, 3
CHAIN = (-1, 0, 1, 2)
TREE = (-1, -1, -1, 0, 0, 1, 3)  # three siblings at the root, two below the first, ...


def _tables(seed, scale=1.5):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return scale * jax.random.normal(k1, (V, V)), scale * jax.random.normal(k2, (M + 2, V))


TARGET = _tables(0)


def _logits(tables, prev, depth):
    a, s = tables
    return a[prev] + s[depth]


def _draft(key, parents, q_tables, sampler, mode, valid_len=None):
    """Samples a draft for ROWS rows. mode: 'iid' | 'wor' (without replacement) | 'topk'
    (deterministic, q one-hot) | 'copy' (q = the target's own distribution)."""
    n = len(parents)
    toks, qs, dep = [], [], []
    for j, par in enumerate(parents):
        prev = jnp.full((ROWS,), ROOT) if par < 0 else toks[par]
        d = 0 if par < 0 else dep[par]
        tab = TARGET if mode == "copy" else q_tables
        q = sampling.probs(_logits(tab, prev, d), sampler if mode == "copy" else
                           sampling.Sample(1.0))
        earlier = [i for i in range(j) if parents[i] == par]
        if mode == "topk":
            t = jnp.argsort(-q, axis=-1)[:, len(earlier)]
            qj = jax.nn.one_hot(t, V)
        else:
            if mode == "wor":
                for i in earlier:
                    q = q * (1 - jax.nn.one_hot(toks[i], V))
                q = q / q.sum(-1, keepdims=True)
            t = jax.random.categorical(jax.random.fold_in(key, j), jnp.log(q))
            qj = q
        toks.append(t.astype(jnp.int32))
        qs.append(qj)
        dep.append(d + 1)
    valid = jnp.ones((ROWS, n), bool)
    if valid_len is not None:
        valid = jnp.arange(n)[None] < valid_len[:, None]
    return Draft(tokens=jnp.stack(toks, 1), parents=jnp.broadcast_to(jnp.asarray(parents), (ROWS, n)),
                 valid=valid, probs=None if mode == "topk" else jnp.stack(qs, 1)), dep


def _run(key, parents, sampler, mode, rule=Rejection(), q_seed=1, valid_len=None, pad=0.0):
    """One verification round per row, then target sampling up to M tokens. -> [ROWS, M].
    ``pad``: the share of draft tokens replaced by ids outside the vocabulary."""
    kd, kv, kc = jax.random.split(key, 3)
    draft, dep = _draft(kd, parents, _tables(q_seed), sampler, mode, valid_len)
    if pad:
        kh, kb = jax.random.split(jax.random.fold_in(kd, 99))
        hit = jax.random.uniform(kh, draft.tokens.shape) < pad
        bad = jax.random.choice(kb, jnp.asarray([-1, V, V + 7]), draft.tokens.shape)
        draft = draft.replace(tokens=jnp.where(hit, bad, draft.tokens))
    node_logits = [_logits(TARGET, draft.tokens[:, j], dep[j]) for j in range(len(parents))]
    logits = jnp.stack([_logits(TARGET, jnp.full((ROWS,), ROOT), 0)] + node_logits, 1)
    res = jax.jit(verify, static_argnames=("rule", "depth"))(logits, draft, kv, sampler,
                                                             rule=rule, depth=max(dep))
    emitted = np.asarray(res.tokens)
    take = np.minimum(np.asarray(res.accepted) + 1, M)
    out = np.full((ROWS, M), -1)
    for i in range(M):  # the round's tokens, then the exact target where it emitted fewer
        prev = np.full(ROWS, ROOT) if i == 0 else out[:, i - 1]
        y = jax.random.categorical(jax.random.fold_in(kc, i), jnp.log(
            sampling.probs(_logits(TARGET, jnp.asarray(prev), i), sampler)))
        mine = emitted[:, i] if i < emitted.shape[1] else y
        out[:, i] = np.where(i < take, mine, np.asarray(y))
    return out, np.asarray(res.accepted)


def _exact(sampler):
    """P(y_i) per position and P(y0, y1) under the target."""
    marg, joint = [], None
    p = np.asarray(sampling.probs(_logits(TARGET, jnp.asarray([ROOT]), 0), sampler))[0]
    cond = [np.asarray(sampling.probs(_logits(TARGET, jnp.arange(V), d), sampler))
            for d in range(M)]
    marg.append(p)
    joint = p[:, None] * cond[1]
    for d in range(1, M):
        marg.append(marg[-1] @ cond[d])
    return marg, joint


def _min_pvalue(out, sampler):
    marg, joint = _exact(sampler)
    ps = [pvalue(np.bincount(out[:, i], minlength=V), marg[i]) for i in range(M)]
    ps.append(pvalue(np.bincount(out[:, 0] * V + out[:, 1], minlength=V * V), joint))
    return min(ps)


T1 = sampling.Sample(1.0)
CASES = {
    "chain-partial": (CHAIN, T1, "iid"),
    "chain-all-accepted": (CHAIN, T1, "copy"),
    "chain-onehot-topk": (CHAIN, T1, "topk"),
    "chain-top-k-target": (CHAIN, sampling.Sample(0.8, top_k=5), "iid"),
    "chain-top-p-target": (CHAIN, sampling.Sample(1.2, top_p=0.7), "iid"),
    "tree-siblings-wor": (TREE, T1, "wor"),
    "tree-siblings-iid": (TREE, T1, "iid"),
    "tree-onehot-topk": (TREE, sampling.Sample(1.0, top_p=0.9), "topk"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sampled_verification_matches_target(case):
    parents, sampler, mode = CASES[case]
    out, acc = _run(jax.random.key(7), parents, sampler, mode)
    p = _min_pvalue(out, sampler)
    assert p > 1e-4, f"{case}: emitted tokens differ from the target distribution (p={p:.2e})"
    if mode == "copy":
        assert np.all(acc == len(parents)), "a draft equal to the target must always pass"
    else:
        assert 0 < acc.mean() < len(parents) or mode == "topk"


def test_all_rejected_still_exact():
    """The target keeps only its top 3 tokens; a draft outside them is always rejected."""
    sampler = sampling.Sample(1.0, top_k=3)
    p0 = np.asarray(sampling.probs(_logits(TARGET, jnp.asarray([ROOT]), 0), sampler))[0]
    outside = int(np.argmin(p0))  # q puts all its mass on a token the target cannot emit
    draft = Draft(tokens=jnp.full((ROWS, 4), outside, jnp.int32),
                  parents=jnp.broadcast_to(jnp.asarray(CHAIN), (ROWS, 4)),
                  valid=jnp.ones((ROWS, 4), bool))
    logits = jnp.broadcast_to(_logits(TARGET, jnp.asarray([ROOT]), 0), (ROWS, 5, V))
    res = verify(logits, draft, jax.random.key(3), sampler)
    assert np.all(np.asarray(res.accepted) == 0)
    counts = np.bincount(np.asarray(res.next_token), minlength=V)
    assert pvalue(counts, p0) > 1e-4


def test_padding_rows_and_nodes():
    """Rows with 0..4 valid chain nodes (some rows fully padding) stay exact."""
    lens = jax.random.randint(jax.random.key(5), (ROWS,), 0, 5)
    out, acc = _run(jax.random.key(11), CHAIN, T1, "iid", valid_len=lens)
    assert np.all(acc <= np.asarray(lens))
    assert _min_pvalue(out, T1) > 1e-4


@pytest.mark.parametrize("mode", ["topk", "iid"])
def test_padding_tokens_in_the_draft_keep_the_target_law(mode):
    """Ids outside the vocabulary (-1, V, V+7) marked valid, with one-hot q (``probs=None``)
    or with q given: never emitted, and the output is still the target's law."""
    parents = TREE if mode == "topk" else CHAIN
    out, acc = _run(jax.random.key(13), parents, T1, mode, pad=0.3)
    assert out.min() >= 0 and out.max() < V
    assert acc.mean() > 0  # the clean nodes are still accepted
    assert _min_pvalue(out, T1) > 1e-4


def _inert_reference(tokens, parents, valid, vocab):
    """Per row, the nodes that can be verified (numpy): valid, token in range, parent in
    [-1, j), parent verifiable."""
    ok = np.zeros(tokens.shape, bool)
    for b in range(tokens.shape[0]):
        for j in range(tokens.shape[1]):
            p = parents[b, j]
            ok[b, j] = (valid[b, j] and 0 <= tokens[b, j] < vocab and -1 <= p < j
                        and (p < 0 or ok[b, p]))
    return ok


@pytest.mark.parametrize("sampler", [sampling.Greedy(), sampling.Sample(1.0)],
                         ids=["greedy", "sampled"])
def test_invalid_nodes_are_inert_under_jit(sampler):
    """Random trees with out-of-vocabulary tokens, bad parents and invalid flags, verified
    under jit: every emitted token is in the vocabulary, and each row emits exactly what the
    same draft with the unverifiable nodes removed emits."""
    rng = np.random.default_rng(0)
    b, n, v = 48, 8, 6
    parents = np.stack([[rng.integers(-1, j) if j else -1 for j in range(n)] for _ in range(b)])
    tokens = rng.integers(0, v, (b, n))
    valid = rng.random((b, n)) < 0.9
    oov = rng.random((b, n)) < 0.15
    tokens = np.where(oov, rng.choice([-1, v, 99], (b, n)), tokens)
    badp = rng.random((b, n)) < 0.1
    parents = np.where(badp, rng.choice([-2, n, 0], (b, n)) + np.where(
        rng.random((b, n)) < 0.5, np.arange(n), 0), parents)  # some >= own index
    # a target that often agrees with the draft, so paths are long
    logits = rng.normal(size=(b, n + 1, v)).astype(np.float32)
    for j in range(n):
        src = np.where(parents[:, j] >= -1, np.clip(parents[:, j], -1, n - 1) + 1, 0)
        agree = rng.random(b) < 0.7
        rows = np.nonzero(agree & (tokens[:, j] >= 0) & (tokens[:, j] < v))[0]
        logits[rows, src[rows], tokens[rows, j]] += 6.0
    key = jax.random.key(5)
    run = jax.jit(lambda lg, d, k: verify(lg, d, k, sampler))
    res = run(jnp.asarray(logits), Draft(jnp.asarray(tokens, jnp.int32),
                                         jnp.asarray(parents, jnp.int32), jnp.asarray(valid)),
              key)
    acc, emitted = np.asarray(res.accepted), np.asarray(res.tokens)
    assert acc.max() >= 2, "the test should exercise accepted paths"
    ok = _inert_reference(tokens, parents, valid, v)
    clean_verify = jax.jit(lambda lg, d: verify(lg, d, None, sampler))  # eager is slow
    for i in range(b):
        got = emitted[i, :acc[i] + 1]
        assert got.min() >= 0 and got.max() < v, f"row {i} emitted {got}"
        path = np.asarray(res.path)[i, :acc[i]]
        assert all(ok[i, j] for j in path), f"row {i} accepted an unverifiable node"
        if not isinstance(sampler, sampling.Greedy):
            continue
        keep = np.nonzero(ok[i])[0]  # the same draft with unverifiable nodes removed
        remap = {-1: -1, **{int(j): k for k, j in enumerate(keep)}}
        clean = Draft(jnp.asarray(tokens[i, keep][None], jnp.int32),
                      jnp.asarray([[remap[int(parents[i, j])] for j in keep]], jnp.int32),
                      jnp.ones((1, len(keep)), bool))
        want = clean_verify(jnp.asarray(logits[i, np.concatenate([[0], keep + 1])][None]),
                            clean)
        exp = np.asarray(want.tokens)[0, :int(want.accepted[0]) + 1]
        np.testing.assert_array_equal(got, exp, err_msg=f"row {i}")


# --- negative controls: each wrong verifier must fail the same tests ------------------------


@dataclasses.dataclass(frozen=True)
class AcceptWithP(Rejection):
    """Wrong: accepts with p(x) instead of min(1, p(x)/q(x))."""

    def accept_prob(self, p, q, x):
        return p[x]


@dataclasses.dataclass(frozen=True)
class ResidualIsP(Rejection):
    """Wrong: on rejection, resamples from p instead of norm(max(p - q, 0))."""

    def residual(self, p, q):
        return p


@dataclasses.dataclass(frozen=True)
class UnnormalizedResidual(Rejection):
    """Wrong: the residual max(p - q, 0) is not renormalized before the next sibling."""

    def residual(self, p, q):
        return jnp.maximum(p - q, 0.0)


@pytest.mark.parametrize("rule,case", [
    (AcceptWithP(), "chain-partial"),
    (ResidualIsP(), "chain-partial"),
    (UnnormalizedResidual(), "tree-siblings-wor"),
    (Typical(), "chain-partial"),
])
def test_wrong_verifiers_fail_the_distribution_test(rule, case):
    parents, sampler, mode = CASES[case]
    out, _ = _run(jax.random.key(7), parents, sampler, mode, rule=rule)
    assert _min_pvalue(out, sampler) < 1e-6, f"{type(rule).__name__} was not caught"


# --- greedy, shapes, bad input ----------------------------------------------------------------


def test_greedy_picks_deepest_matching_path():
    # root argmax 5; node0=5 (ok), node1=2 (wrong sibling), node2 under node0 = argmax at node0 (7)
    logits = jnp.full((1, 4, V), -1.0)
    logits = logits.at[0, 0, 5].set(3).at[0, 1, 7].set(3).at[0, 2, 1].set(3).at[0, 3, 4].set(3)
    draft = Draft(tokens=jnp.asarray([[5, 2, 7]]), parents=jnp.asarray([[-1, -1, 0]]),
                  valid=jnp.ones((1, 3), bool))
    res = verify(logits, draft, None)
    assert int(res.accepted[0]) == 2
    assert res.path[0, :2].tolist() == [0, 2]
    assert res.tokens[0].tolist() == [5, 7, 4, -1]  # bonus = argmax at node 2
    # an invalid node is never accepted, even when it matches
    res = verify(logits, draft.replace(valid=jnp.asarray([[False, True, True]])), None)
    assert int(res.accepted[0]) == 0 and int(res.next_token[0]) == 5


def test_tree_mask_and_positions():
    parents = jnp.asarray([[-1, -1, 0, 2]])
    mask = np.asarray(tree.attention_mask(parents))[0]
    expect = np.array([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0],
                       [1, 1, 0, 1, 1]], bool)
    np.testing.assert_array_equal(mask, expect)
    assert tree.positions(jnp.asarray([10]), parents)[0].tolist() == [10, 11, 11, 12, 13]


def test_bad_input_is_rejected_clearly():
    with pytest.raises(ValueError, match="inconsistent draft tree"):
        tree.validate(np.array([[-1, 1, 0]]))  # node 1 is its own parent
    with pytest.raises(ValueError, match="inconsistent draft tree"):
        tree.validate(np.array([[-1, 0, 3, 1]]))  # a parent after its child
    with pytest.raises(ValueError, match="target's vocabulary"):
        tree.validate(np.array([[-1, 0]]), vocab_size=8, tokens=np.array([[1, 9]]))
    draft = Draft(tokens=jnp.zeros((1, 2), jnp.int32), parents=jnp.asarray([[-1, 0]]),
                  valid=jnp.ones((1, 2), bool), probs=jnp.full((1, 2, V + 4), 1.0 / (V + 4)))
    with pytest.raises(ValueError, match="vocabularies differ"):
        verify(jnp.zeros((1, 3, V)), draft, jax.random.key(0), T1)
    with pytest.raises(ValueError, match="root and 2 draft nodes"):
        verify(jnp.zeros((1, 2, V)), draft.replace(probs=None), None)
