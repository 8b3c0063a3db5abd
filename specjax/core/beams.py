"""Beam search over a draft model, and the packing of beams into one draft tree.

``beam_search`` is a pure, jittable function with static width ``W`` and length ``L``:
every step keeps the ``W`` best of the ``W × V`` one-token extensions by summed draft
log-probability. ``pack`` merges the beams' shared prefixes (ReDrafter's prefix match)
into a draft tree in ``specjax.core.tree``'s format, padded to the static size ``W·L``.
Beam search selects deterministically, so the tree is verified with one-hot ``q``
(``Draft.probs = None``), which keeps decoding lossless at any temperature.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax
from jaxtyping import Array, Bool, Float, Int

from specjax.core import tree
from specjax.core.verify import Draft


@struct.dataclass
class Beams:
    """``W`` beams of ``L`` drafted tokens (the root excluded), best first."""

    tokens: Int[Array, "B W L"]
    scores: Float[Array, "B W"]  # summed draft log-probability
    logq: Float[Array, "B W L V"]  # the distribution each token was chosen from


def check_sizes(width: int, length: int, vocab: int | None = None) -> None:
    """``ValueError`` unless ``1 <= width <= vocab`` and ``length >= 1``."""
    if width < 1 or length < 1:
        raise ValueError(f"beam width and length must be >= 1, got width={width}, "
                         f"length={length}")
    if vocab is not None and width > vocab:
        raise ValueError(f"beam width {width} exceeds the draft vocabulary ({vocab} tokens)")


def _gather(tree_: Any, idx: Int[Array, "B W"]) -> Any:
    """Every leaf ``[B, W, ...]`` reordered along axis 1 by ``idx``."""
    def take(x):
        i = idx.reshape(idx.shape + (1,) * (x.ndim - 2))
        return jnp.take_along_axis(x, i, axis=1)

    return jax.tree.map(take, tree_)


def beam_search(step: Callable, state: Any, root: Int[Array, "B"], width: int,
                length: int) -> tuple[Beams, Any]:
    """``W = width`` beams of ``length`` tokens below ``root``.

    ``step(state, tokens[B, W]) -> (logq[B, W, V], state)`` feeds one token per beam
    (log-softmax out); ``state`` leaves have leading axes ``[B, W]``. The first call feeds
    ``root`` to every beam; only beam 0 extends at the first step, so no two beams are equal.
    Ties go to the lower flat index ``(beam, token)``. Returns the beams and the state after
    the last token fed (the last drafted token is not fed).
    """
    check_sizes(width, length)
    b = root.shape[0]
    logq, state = step(state, jnp.broadcast_to(root[:, None], (b, width)))
    v = logq.shape[-1]
    check_sizes(width, length, v)
    score = jnp.broadcast_to(jnp.where(jnp.arange(width) == 0, 0.0, -jnp.inf), (b, width))
    toks, dists = [], []
    for i in range(length):  # static and short: unrolled, so the last token is never fed
        cand = (score[:, :, None] + logq).reshape(b, width * v)  # [B, W·V]
        score, flat = lax.top_k(cand, width)
        parent, tok = flat // v, (flat % v).astype(jnp.int32)
        toks = [_gather(t, parent) for t in toks] + [tok]
        dists = [_gather(d, parent) for d in dists] + [_gather(logq, parent)]
        state = _gather(state, parent)
        if i + 1 < length:
            logq, state = step(state, tok)
    toks, dists = jnp.stack(toks, axis=2), jnp.stack(dists, axis=2)
    return Beams(tokens=toks, scores=score, logq=dists), state


@struct.dataclass
class PackedTree:
    """The beams as one tree: unique prefixes first (level by level, then by beam), then
    padding (``valid`` False, token 0, parent -1). ``node[b, w, i]`` is the packed index
    of beam ``w``'s ``i``-th token."""

    tokens: Int[Array, "B N"]
    parents: Int[Array, "B N"]
    valid: Bool[Array, "B N"]
    node: Int[Array, "B W L"]
    num_nodes: Int[Array, "B"]


def pack(tokens: Int[Array, "B W L"]) -> PackedTree:
    """Merges shared prefixes: beam ``w``'s ``i``-th token is the node of the first beam
    ``w' <= w`` whose first ``i + 1`` tokens equal beam ``w``'s."""
    b, w, l = tokens.shape
    same = tokens[:, :, None, :] == tokens[:, None, :, :]  # [B, W, W', L]
    prefix = jnp.cumprod(same, axis=-1).astype(bool)  # equal up to and including i
    first = jnp.argmax(prefix, axis=2).astype(jnp.int32)  # [B, W, L]: the canonical beam
    keep = first == jnp.arange(w)[None, :, None]
    # level order: slot i * W + w
    keep_lo = jnp.swapaxes(keep, 1, 2).reshape(b, l * w)
    packed = jnp.cumsum(keep_lo, axis=1) - 1  # packed index of each kept slot
    slot_of = lambda wi, li: li * w + wi
    canon_slot = slot_of(first, jnp.arange(l)[None, None, :])  # [B, W, L]
    node = jnp.take_along_axis(packed, canon_slot.reshape(b, -1), axis=1).reshape(b, w, l)
    par_node = jnp.concatenate([jnp.full((b, w, 1), -1, jnp.int32), node[:, :, :-1]], axis=2)
    n = w * l
    dest = jnp.where(keep, node, n).reshape(b, -1)  # out of range: dropped
    rows = jnp.arange(b)[:, None]
    toks = jnp.zeros((b, n), jnp.int32).at[rows, dest].set(tokens.reshape(b, -1), mode="drop")
    pars = jnp.full((b, n), -1, jnp.int32).at[rows, dest].set(par_node.reshape(b, -1),
                                                               mode="drop")
    count = jnp.sum(keep, axis=(1, 2)).astype(jnp.int32)
    valid = jnp.arange(n)[None] < count[:, None]
    return PackedTree(tokens=toks, parents=pars, valid=valid, node=node.astype(jnp.int32),
                      num_nodes=count)


def to_draft(t: PackedTree) -> Draft:
    """The packed tree as a deterministic draft (one-hot ``q``)."""
    return Draft(tokens=t.tokens, parents=t.parents, valid=t.valid)


def mask(t: PackedTree) -> Bool[Array, "B N+1 N+1"]:
    """Tree attention over ``[root, nodes]``: each node sees the root and its ancestors."""
    return tree.attention_mask(t.parents, t.valid)


__all__ = ["Beams", "beam_search", "PackedTree", "pack", "to_draft", "mask", "check_sizes"]
