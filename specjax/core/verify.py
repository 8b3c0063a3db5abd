"""Verification of a draft against the target: lossless on chains and trees, batched.

``verify`` takes the target's logits at the root and at every draft node and returns, per
row, the accepted path and the next token (a correction, or a bonus when a leaf's whole
path was accepted). With ``Greedy`` the emitted tokens are exactly the target's argmax
rollout. With ``Sample`` and the default ``Rejection`` rule they are distributed exactly as
the target's ``sampling.probs`` (temperature, top-k, top-p applied), whatever the draft:

* siblings are tried in index order against a running residual: accept ``x`` with
  probability ``min(1, p(x) / q(x))``, else ``p <- norm(max(p - q, 0))`` (Leviathan et al.
  for one child, SpecInfer's multi-round rule for several);
* ``q`` of node ``j`` is the distribution it was drawn from *given its earlier siblings*:
  the parent's draft distribution for i.i.d. siblings, the same with earlier siblings
  removed for sampling without replacement, and one-hot for deterministic (top-k or
  n-gram) drafts, which is what ``Draft.probs = None`` means.

``Typical`` acceptance (Medusa) is the one lossy rule; it is opt-in and says so.
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
from flax import struct
from jax import lax
from jaxtyping import Array, Bool, Float, Int

from specjax.core import sampling, tree

PAD = -1  # the token id after a row's last emitted or generated token


@struct.dataclass
class Draft:
    """A static-shape draft: ``N`` nodes below the root (see ``specjax.core.tree``).

    ``probs[b, j]`` is the distribution node ``j`` was drawn from given its path and its
    earlier siblings; ``None`` means every node was chosen deterministically (one-hot q).
    """

    tokens: Int[Array, "B N"]
    parents: Int[Array, "B N"]
    valid: Bool[Array, "B N"]
    probs: Float[Array, "B N V"] | None = None


def trim(draft: Draft, n: int) -> Draft:
    """The draft's first ``n`` nodes (``n`` static): what a verification forward of width
    ``n + 1`` carries. Parents precede children, so every kept node's parent is kept too
    (the kept nodes are a subtree)."""
    cut = lambda x: None if x is None else x[:, :n]
    return Draft(tokens=cut(draft.tokens), parents=cut(draft.parents), valid=cut(draft.valid),
                 probs=cut(draft.probs))


@struct.dataclass
class VerifyResult:
    """Per row: ``accepted`` draft tokens along ``path``; ``tokens`` holds them then
    ``next_token`` (``PAD`` after); ``accepted + 1`` tokens are emitted."""

    accepted: Int[Array, "B"]
    path: Int[Array, "B D"]
    tokens: Int[Array, "B D+1"]
    next_token: Int[Array, "B"]


@dataclasses.dataclass(frozen=True)
class Rejection:
    """Lossless rejection sampling: accept with ``min(1, p/q)``; residual ``norm(max(p-q,0))``."""

    lossy = False

    def accept_prob(self, p: Float[Array, "V"], q: Float[Array, "V"], x: Array) -> Array:
        return jnp.where(q[x] > 0, jnp.minimum(1.0, p[x] / jnp.maximum(q[x], 1e-30)), p[x] > 0)

    def residual(self, p: Float[Array, "V"], q: Float[Array, "V"]) -> Float[Array, "V"]:
        r = jnp.maximum(p - q, 0.0)
        z = jnp.sum(r)
        return jnp.where(z > 1e-12, r / jnp.maximum(z, 1e-30), p)  # z = 0 only if p == q


@dataclasses.dataclass(frozen=True)
class Typical:
    """LOSSY typical acceptance (Medusa): accept ``x`` iff ``p(x) >= min(epsilon,
    delta * exp(-H(p)))``. Output is *not* distributed as the target; opt-in only."""

    epsilon: float = 0.3
    delta: float = 0.09
    lossy = True

    def accept_prob(self, p, q, x):
        ent = -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.maximum(p, 1e-30)), 0.0))
        return (p[x] >= jnp.minimum(self.epsilon, self.delta * jnp.exp(-ent))).astype(p.dtype)

    def residual(self, p, q):
        return p


Rule = Rejection | Typical


def sanitize(draft: Draft, vocab_size: int) -> Draft:
    """The same draft with every node that cannot be verified made inert.

    A node stays valid only if it was marked valid, its token lies in ``[0, vocab_size)``,
    its parent lies in ``[-1, j)`` and that parent is itself valid. Inert nodes get token
    ``0`` (in range, never emitted) and, where their parent was out of range, parent ``-1``.
    Works under ``jit``: a malformed draft can shorten a round but never change its output.
    """
    n = draft.tokens.shape[1]
    par_ok = (draft.parents >= -1) & (draft.parents < jnp.arange(n)[None])
    parents = jnp.where(par_ok, draft.parents, -1).astype(jnp.int32)
    ok = draft.valid & par_ok & (draft.tokens >= 0) & (draft.tokens < vocab_size)
    anc = tree.ancestors(parents)  # [B, N, N]: well formed now
    ok = jnp.all(~anc | ok[:, None, :], axis=-1)  # every node on the path is valid
    return draft.replace(tokens=jnp.where(ok, draft.tokens, 0).astype(jnp.int32),
                         parents=parents, valid=ok)


def _path_tokens(tokens, path, accepted, nxt):
    """[accepted path tokens, next token, PAD...] for one row."""
    toks = jnp.where(path >= 0, tokens[jnp.maximum(path, 0)], PAD)
    out = jnp.concatenate([toks, jnp.full((1,), PAD, jnp.int32)])
    return out.at[accepted].set(nxt)


def _greedy(logits, draft: Draft, depth: int) -> VerifyResult:
    """Deepest node whose whole path matches the target's argmax (ties: lowest index)."""
    am = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, N+1]
    b, n = draft.tokens.shape
    at_parent = jnp.take_along_axis(am, draft.parents + 1, axis=1)
    correct = draft.valid & (draft.tokens == at_parent)
    anc = tree.ancestors(draft.parents)  # [B, N, N]
    ok = jnp.all(jnp.where(anc, correct[:, None, :], True), axis=-1)
    dep = jnp.sum(anc, axis=-1)
    score = jnp.where(ok, dep, 0)
    best = jnp.argmax(score, axis=-1)
    accepted = jnp.minimum(score[jnp.arange(b), best], depth)
    on_path = anc[jnp.arange(b), best] & (accepted > 0)[:, None]  # [B, N]
    level = jnp.arange(depth)[None, :, None] + 1 == dep[:, None, :]  # [B, D, N]
    hit = on_path[:, None, :] & level
    path = jnp.where(jnp.any(hit, -1), jnp.argmax(hit, -1), -1).astype(jnp.int32)
    nxt = jnp.where(accepted > 0, am[jnp.arange(b), best + 1], am[:, 0])
    toks = jax.vmap(_path_tokens)(draft.tokens, path, accepted, nxt)
    return VerifyResult(accepted=accepted.astype(jnp.int32), path=path, tokens=toks,
                        next_token=nxt)


def _sample_row(p_nodes, tokens, parents, valid, q, key, rule: Rule, depth: int):
    """Rejection sampling down one row's tree. ``p_nodes``: [N+1, V] target distributions."""
    n = tokens.shape[0]
    v = p_nodes.shape[-1]

    def q_of(j):
        return jax.nn.one_hot(tokens[j], v, dtype=p_nodes.dtype) if q is None else q[j]

    def level(carry):
        cur, p, d, path, done, key = carry
        kids = jnp.nonzero((parents == cur) & valid, size=n, fill_value=n)[0]
        nkids = jnp.sum((parents == cur) & valid)

        def try_kid(c):
            k, p, hit, key = c
            j = kids[k]
            key, sub = jax.random.split(key)
            qj = q_of(j)
            acc = jax.random.uniform(sub) < rule.accept_prob(p, qj, tokens[j])
            return k + 1, jnp.where(acc, p, rule.residual(p, qj)), jnp.where(acc, j, -1), key

        _, p, hit, key = lax.while_loop(lambda c: (c[0] < nkids) & (c[2] < 0), try_kid,
                                        (jnp.int32(0), p, jnp.int32(-1), key))
        go = hit >= 0
        path = jnp.where(go, path.at[d].set(hit), path)
        p = jnp.where(go, p_nodes[jnp.maximum(hit, 0) + 1], p)
        return (jnp.where(go, hit, cur), p, d + go, path, ~go, key)

    init = (jnp.int32(-1), p_nodes[0], jnp.int32(0), jnp.full((depth,), -1, jnp.int32),
            jnp.bool_(False), key)
    _, p, d, path, _, key = lax.while_loop(lambda c: (~c[4]) & (c[2] < depth), level, init)
    nxt = jax.random.categorical(key, jnp.log(p)).astype(jnp.int32)
    return d, path, _path_tokens(tokens, path, d, nxt), nxt


def verify(target_logits: Float[Array, "B N+1 V"], draft: Draft, key: Array | None,
           sampler: sampling.Sampler = sampling.Greedy(), *, rule: Rule = Rejection(),
           depth: int | None = None, sanitized: bool = False) -> VerifyResult:
    """Verifies ``draft`` against the target's logits at ``[root, node 0, ..., node N-1]``.

    ``depth`` bounds the accepted path (default ``N``; the tree's depth suffices). Lossless
    for ``Greedy`` and for ``Sample`` with ``Rejection``; ``Typical`` is lossy. Shapes are
    checked eagerly. Nodes that cannot be verified (a token outside the vocabulary, a parent
    outside ``[-1, j)``, an invalid ancestor) are treated as invalid (``sanitize``): never
    accepted, never emitted. ``tree.validate`` is the eager check that reports them.
    ``sanitized=True`` says the caller already applied ``sanitize`` (the decode loop does,
    before its forward), so it is not done twice.
    """
    chex.assert_rank([target_logits, draft.tokens], [3, 2])
    chex.assert_equal_shape([draft.tokens, draft.parents, draft.valid])
    chex.assert_type([draft.tokens, draft.parents, draft.valid], [int, int, bool])
    b, n = draft.tokens.shape
    if target_logits.shape[:2] != (b, n + 1):
        raise ValueError(f"target logits {target_logits.shape[:2]} must cover the root and "
                         f"{n} draft nodes: expected ({b}, {n + 1}, V)")
    vocab = target_logits.shape[-1]
    if draft.probs is not None and draft.probs.shape != (b, n, vocab):
        raise ValueError(f"draft probabilities have shape {draft.probs.shape}, expected "
                         f"{(b, n, vocab)}: the draft and target vocabularies differ")
    depth = n if depth is None else depth
    if not sanitized:
        draft = sanitize(draft, vocab)
    if n == 0:  # nothing to verify: one ordinary decoding step
        if key is None and not isinstance(sampler, sampling.Greedy):
            raise ValueError("sampled verification needs an explicit PRNG key")
        nxt = sampling.sample(key, target_logits[:, 0], sampler)
        pad = jnp.full((b, depth), PAD, jnp.int32)
        return VerifyResult(accepted=jnp.zeros((b,), jnp.int32), path=pad,
                            tokens=jnp.concatenate([nxt[:, None], pad], 1), next_token=nxt)
    if isinstance(sampler, sampling.Greedy) and isinstance(rule, Rejection):
        return _greedy(target_logits, draft, depth)
    if key is None:
        raise ValueError("sampled verification needs an explicit PRNG key")
    p = sampling.probs(target_logits.reshape(b * (n + 1), vocab), sampler)
    p = p.reshape(b, n + 1, vocab)
    keys = jax.random.split(key, b)
    row = lambda pn, t, par, val, q, k: _sample_row(pn, t, par, val, q, k, rule, depth)
    acc, path, toks, nxt = jax.vmap(row, in_axes=(0, 0, 0, 0, None if draft.probs is None else 0,
                                                  0))(p, draft.tokens, draft.parents,
                                                      draft.valid, draft.probs, keys)
    return VerifyResult(accepted=acc, path=path, tokens=toks, next_token=nxt)


__all__ = ["Draft", "VerifyResult", "Rejection", "Typical", "Rule", "verify", "sanitize", "trim",
           "PAD"]
