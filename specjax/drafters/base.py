"""The drafter protocol, the context a drafter reads, and the top-k tree growth that
model-based drafters share.

A drafter is a hashable frozen dataclass (its sizes are static) that implements the
``Drafter`` protocol below, with three pure methods:

* ``init(dparams, ctx, chunk) -> state`` after the prompt is in the target's cache;
* ``propose(dparams, state, ctx, key, sampler) -> (Draft, state, target_cache)``;
* ``commit(dparams, state, ctx, result) -> state`` once ``ctx`` holds the emitted tokens.

A drafter whose drafts are always chains says so with ``chain = True``: its parents are then
taken to be ``[-1, 0, 1, ...]``, and since a chain's accepted path is its first nodes, which
the verification forward already wrote in place, the target cache is committed by moving
its length alone (no gather of K/V for every layer).

``ctx`` is a ``Context``: the tokens so far (prompt, then emitted; the root is the last),
and the target's parameters and committed cache. A drafter may write scratch entries past
the target cache's length (an early exit does), but must return its length unchanged.
With a ``Greedy`` target, drafts are deterministic (``Draft.probs is None``); with
``Sample``, model drafters sample and report the distributions they drew from.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax
from jaxtyping import Array, Float, Int

from specjax.core import sampling
from specjax.core.verify import Draft
from specjax.models.kv_cache import KVCache


@struct.dataclass
class Context:
    """What a drafter may read: ``tokens[b, :length[b]]`` is prompt then emitted tokens; the
    last is the root, not yet in ``cache`` (whose length is ``length - 1``).

    ``hidden`` holds the target's hidden states for a drafter with ``needs_features``
    (after its ``feature_layers``, concatenated; for EAGLE-2, the last layer's, before the
    final norm): at ``init``, of every prompt slot ``[B, C, D]``; at
    ``commit``, of the round's verification forward over ``[root, nodes]`` ``[B, N+1, D]``.
    """

    tokens: Int[Array, "B C"]
    length: Int[Array, "B"]
    prompt_len: Int[Array, "B"]
    cache: KVCache
    params: Any
    hidden: Any = None
    source: Any = None  # [B, S] source ids of an encoder-decoder target (Model.source_tokens)


@runtime_checkable
class Drafter(Protocol):
    """What the decoding loops read of a drafter. Every drafter declares each member
    itself (no attribute is probed with a default):

    * ``depth``: the most tokens one root-to-leaf path drafts; ``num_nodes``: the nodes of
      a draft (``Draft.tokens.shape[1]``); ``verify_widths``: the forward widths its rounds
      are verified at (ascending; the last covers ``num_nodes + 1``);
    * ``chain``: every draft is a chain (parents ``[-1, 0, 1, ...]``), so the target cache
      commits by moving its length alone;
    * ``needs_features``: ``Context.hidden`` must hold the target's hidden states at
      ``init`` and ``commit``; ``feature_layers``: which ones, the residual streams after
      those layers concatenated in that order (``(num_layers,)``: the last layer's output,
      EAGLE-2's and ReDrafter's; EAGLE-3 fuses three; ``()`` without features);
    * ``draft_model``: the model a ``ModelDrafter`` drafts with (its parameters are
      ``dparams``; an encoder-decoder one encodes the source with them), None otherwise;
    * ``check(target)``: ``ValueError`` unless it can draft for ``target``;
    * ``init``, ``propose``, ``commit``: the pure methods of the module docstring.
    """

    chain: bool
    needs_features: bool
    feature_layers: tuple[int, ...]
    draft_model: Any

    @property
    def depth(self) -> int: ...

    @property
    def num_nodes(self) -> int: ...

    @property
    def verify_widths(self) -> tuple[int, ...]: ...

    def check(self, target) -> None: ...

    def init(self, dparams, ctx: Context, chunk: int) -> Any: ...

    def propose(self, dparams, state, ctx: Context, key, sampler) -> tuple[Draft, Any, KVCache]:
        ...

    def commit(self, dparams, state, ctx: Context, result) -> Any: ...


def _take(tokens: Int[Array, "B C"], idx: Int[Array, "B T"]) -> Int[Array, "B T"]:
    return jnp.take_along_axis(tokens, jnp.clip(idx, 0, tokens.shape[1] - 1), axis=1)


def tree_parents(depth: int, width: int) -> np.ndarray:
    """Parents of the top-``width`` tree: ``width`` siblings per level, the first of which
    carries the next level. Node ``d * width + s`` is sibling ``s`` at depth ``d + 1``."""
    par = [-1 if d == 0 else (d - 1) * width for d in range(depth) for _ in range(width)]
    return np.asarray(par, np.int32)


def _pick(key, logits: Float[Array, "B V"], sampler, width: int):
    """``width`` distinct tokens and, when sampling, each one's conditional q.

    Greedy: the top-``width`` tokens (q one-hot, returned as None). Sample: a draw without
    replacement (Gumbel top-k); sibling ``s`` has q with siblings ``< s`` removed.
    """
    if isinstance(sampler, sampling.Greedy):
        return lax.top_k(logits, width)[1].astype(jnp.int32), None
    q = sampling.probs(logits, sampler)
    g = jnp.log(q) + jax.random.gumbel(key, q.shape)
    toks = lax.top_k(g, width)[1].astype(jnp.int32)  # [B, W]
    taken = jax.nn.one_hot(toks, q.shape[-1], dtype=bool)  # [B, W, V]
    before = jnp.cumsum(taken, axis=1) - taken  # siblings drawn earlier
    qs = jnp.where(before > 0, 0.0, q[:, None, :])
    return toks, qs / jnp.sum(qs, axis=-1, keepdims=True)


def _grow(step: Callable, state, first_logits, start_pos, depth: int, width: int, key,
          sampler) -> tuple[Draft, Any]:
    """Top-``width`` tree of ``depth`` levels. ``step(state, tok[B,1], pos[B,1]) -> (logits
    [B,V], state)`` runs the drafter on the chosen token of a level at ``pos``."""
    b = first_logits.shape[0]

    def level(carry, d):
        logits, st, key = carry
        key, sub = jax.random.split(key)
        toks, q = _pick(sub, logits, sampler, width)
        logits, st = step(st, toks[:, :1], (start_pos + d)[:, None])
        return (logits, st, key), (toks, q)

    (logits, state, key), (toks, qs) = lax.scan(level, (first_logits, state, key),
                                                jnp.arange(depth - 1))
    last_t, last_q = _pick(key, logits, sampler, width)
    toks = jnp.concatenate([jnp.moveaxis(toks, 0, 1), last_t[:, None]], 1).reshape(b, -1)
    probs = None
    if last_q is not None:
        probs = jnp.concatenate([jnp.moveaxis(qs, 0, 1), last_q[:, None]], 1)
        probs = probs.reshape(b, depth * width, -1)
    parents = jnp.broadcast_to(jnp.asarray(tree_parents(depth, width)), toks.shape)
    return Draft(tokens=toks, parents=parents, valid=jnp.ones(toks.shape, bool),
                 probs=probs), state


class TopKTree:
    """Sizes of a drafter that grows a top-``width`` tree of ``depth`` levels (needs
    ``depth`` and ``width``): every round is verified at one width. Defines ``chain``;
    the drafter declares the rest of ``Drafter``."""

    @property
    def chain(self) -> bool:
        """With one token per level the draft is a chain (see the module docstring)."""
        return self.width == 1

    @property
    def num_nodes(self) -> int:
        return self.depth * self.width

    @property
    def verify_widths(self) -> tuple[int, ...]:
        return (self.num_nodes + 1,)


def _check_sizes(depth: int, width: int) -> None:
    if depth < 1 or width < 1:
        raise ValueError(f"draft depth and width must be >= 1, got depth={depth}, "
                         f"width={width}")
