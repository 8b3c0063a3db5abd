"""What drafters share: the top-k tree growth of model-based drafters, ``OnTarget`` (the
base of drafters that run a head or the first layers on the target itself), and the
drafter protocol and context re-exported from
``specjax.core.drafter`` (where the decoding loops define what they need of a drafter).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Float, Int

from specjax.core import sampling, tree
from specjax.core.verify import Draft
from specjax.core.drafter import Context, Drafter  # noqa: F401  (re-exported)


def take_tokens(tokens: Int[Array, "B C"], idx: Int[Array, "B T"]) -> Int[Array, "B T"]:
    """``tokens[b, idx[b, t]]``, with ``idx`` clipped into the row (a padded index reads an
    edge entry instead of failing)."""
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


class ChainOrTree:
    """Sizes of a drafter that drafts ``depth`` tokens as a chain (``topk`` 1) or as a tree
    of ``total_tokens`` nodes from the ``topk`` best tokens per level (DFlash, Gemma 4
    assistants), every round verified at one width. Needs those three fields; its
    ``__post_init__`` calls ``_default_total``. Defines ``chain``, ``num_nodes`` and
    ``verify_widths``; the drafter declares the rest of ``Drafter``."""

    def _default_total(self) -> None:
        """``total_tokens`` None: ``depth`` for a chain, every node a tree drafts."""
        from specjax.drafters.eagle import pool_size

        if self.total_tokens is None:
            n = self.depth if self.topk == 1 else pool_size(self.depth, self.topk)
            object.__setattr__(self, "total_tokens", n)

    @property
    def chain(self) -> bool:
        return self.topk == 1

    @property
    def num_nodes(self) -> int:
        return self.depth if self.chain else self.total_tokens

    @property
    def verify_widths(self) -> tuple[int, ...]:
        return (self.num_nodes + 1,)


def _check_sizes(depth: int, width: int) -> None:
    if depth < 1 or width < 1:
        raise ValueError(f"draft depth and width must be >= 1, got depth={depth}, "
                         f"width={width}")


class StatelessChain:
    """The base of a drafter that proposes a chain of ``depth`` tokens from the context
    alone: no state, no weights of its own, no target features, no draft model. A subclass
    is a frozen dataclass with a ``depth`` field and defines ``chain_tokens(dparams, ctx)
    -> (tokens [B, depth], valid [B, depth])``; ``propose`` makes the chain's ``Draft``
    (deterministic: ``probs`` None) and ``commit`` keeps the empty state. A round without
    a valid token runs as one plain decoding step (``verify_widths``: 1 or ``depth + 1``)."""

    chain = True  # drafts are chains: Speculative commits the cache without a gather
    needs_features = False
    feature_layers = ()
    draft_model = None

    @property
    def num_nodes(self) -> int:
        return self.depth

    @property
    def verify_widths(self) -> tuple[int, ...]:
        return (1, self.depth + 1)

    def check(self, target) -> None:
        _check_sizes(self.depth, 1)

    def init(self, dparams, ctx, chunk):
        return ()

    def chain_tokens(self, dparams, ctx: Context):
        raise NotImplementedError

    def propose(self, dparams, state, ctx: Context, key, sampler):
        toks, valid = self.chain_tokens(dparams, ctx)
        parents = tree.chain(toks.shape[0], self.depth)
        return Draft(tokens=toks.astype(jnp.int32), parents=parents, valid=valid), state, ctx.cache

    def commit(self, dparams, state, ctx, result):
        return state


class OnTarget:
    """The base of a drafter that runs on the target it was built for, ``self.target`` (a
    head over its features, or its own first layers): it has no draft model of its own,
    and by default reads the target's last layer (``needs_features``, ``feature_layers``;
    a drafter reading other layers, or none, overrides them). Its ``check`` calls
    ``check_target`` first."""

    draft_model = None  # the target's head or layers, not a model of its own
    needs_features = True  # reads the target's hidden states (Context.hidden)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target's last layer: its output, final-normed, is the head's feature."""
        return (self.target.config.num_layers,)

    def check_target(self, target) -> None:
        """``ValueError`` unless ``target`` is the target this drafter was built on (its
        head, cache or layers are that model's)."""
        if target != self.target:
            name = type(self).__name__
            article = "an" if name[0].lower() in "aeiou" else "a"
            raise ValueError(f"{article} {name} must be built on the target it drafts for")
