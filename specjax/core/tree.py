"""Draft trees: parent pointers, ancestry, depths and tree-attention masks.

A draft of ``N`` nodes hangs below a root, the last emitted token, which is not a draft
node. ``parents[b, j]`` is ``-1`` for a child of the root, else the index of an earlier
node (``parents[b, j] < j``). A chain is ``parents = [-1, 0, 1, ...]``. The verification
forward runs ``N + 1`` tokens, the root first; index ``0`` of every ``[N + 1]`` axis below is
the root and index ``j + 1`` is node ``j``.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int


def validate(parents, vocab_size: int | None = None, tokens=None) -> None:
    """Raises ``ValueError`` unless every ``parents[..., j]`` lies in ``[-1, j)``.

    Checks concrete arrays only (host side): call it before ``jit`` on user-built drafts.
    With ``tokens`` and ``vocab_size``, also requires every token id in ``[0, vocab_size)``.
    """
    par = np.asarray(parents)
    n = par.shape[-1]
    idx = np.arange(n)
    bad = (par < -1) | (par >= idx)
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"inconsistent draft tree: parents{list(where)} = {par[where]} "
                         f"but a node's parent must be -1 (the root) or an earlier node "
                         f"(< {where[-1]})")
    if tokens is not None and vocab_size is not None:
        tok = np.asarray(tokens)
        if tok.min() < 0 or tok.max() >= vocab_size:
            raise ValueError(f"draft token ids must lie in [0, {vocab_size}) (the target's "
                             f"vocabulary); got ids in [{tok.min()}, {tok.max()}]")


def chain(batch: int, n: int) -> Int[Array, "B N"]:
    """Parents of a chain of ``n`` nodes."""
    return jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32) - 1, (batch, n))


def ancestors(parents: Int[Array, "B N"]) -> Bool[Array, "B N N"]:
    """``out[b, i, j]``: node ``j`` is node ``i`` or one of its ancestors (the root excluded)."""
    b, n = parents.shape
    # Pointer doubling, without a loop: after step k, anc[i] holds the ancestors of i less
    # than 2^k levels up and up[i] the one exactly 2^k up (-1 past the root). A path has at
    # most n nodes, so ceil(log2 n) unrolled steps of a row gather each suffice; a
    # sequential loop over nodes would be n iterations, each a host-read predicate on GPU.
    anc = jnp.broadcast_to(jnp.eye(n, dtype=bool), (b, n, n))
    up = parents.astype(jnp.int32)
    for _ in range(max(n - 1, 0).bit_length()):
        has = (up >= 0)[:, :, None]
        far = jnp.take_along_axis(anc, jnp.maximum(up, 0)[:, :, None], axis=1)  # rows of up
        anc = anc | (far & has)
        up = jnp.where(up >= 0, jnp.take_along_axis(up, jnp.maximum(up, 0), axis=1), -1)
    return anc


def depths(parents: Int[Array, "B N"]) -> Int[Array, "B N"]:
    """Depth of each node: 1 for a child of the root."""
    return jnp.sum(ancestors(parents), axis=-1, dtype=jnp.int32)


def attention_mask(parents: Int[Array, "B N"],
                   valid: Bool[Array, "B N"] | None = None) -> Bool[Array, "B N+1 N+1"]:
    """Tree attention over ``[root, nodes]``: each token sees the root and its ancestors.

    An invalid node sees only the root and itself (its outputs are never used), so padding
    never reaches a valid node's attention.
    """
    b, n = parents.shape
    anc = ancestors(parents)
    if valid is not None:
        anc = anc & (valid[:, :, None] | jnp.eye(n, dtype=bool)[None])
    top = jnp.zeros((b, 1, n), bool)
    nodes = jnp.concatenate([top, anc], axis=1)  # [B, N+1, N]
    return jnp.concatenate([jnp.ones((b, n + 1, 1), bool), nodes], axis=2)


def positions(base: Int[Array, "B"], parents: Int[Array, "B N"]) -> Int[Array, "B N+1"]:
    """Position of the root (``base``) and of every node (``base + depth``)."""
    d = jnp.concatenate([jnp.zeros((parents.shape[0], 1), jnp.int32), depths(parents)], axis=1)
    return base[:, None] + d


__all__ = ["validate", "chain", "ancestors", "depths", "attention_mask", "positions"]
