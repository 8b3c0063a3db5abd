"""Drafters: one protocol for every source of draft tokens.

A drafter is a hashable frozen dataclass (its sizes are static) with three pure methods:

* ``init(dparams, ctx, chunk) -> state`` after the prompt is in the target's cache;
* ``propose(dparams, state, ctx, key, sampler) -> (Draft, state, target_cache)``;
* ``commit(dparams, state, ctx, result) -> state`` once ``ctx`` holds the emitted tokens.

``ctx`` is a ``Context``: the tokens so far (prompt, then emitted; the root is the last),
and the target's parameters and committed cache. A drafter may write scratch entries past
the target cache's length (an early exit does), but must return its length unchanged.
With a ``Greedy`` target, drafts are deterministic (``Draft.probs is None``); with
``Sample``, model drafters sample and report the distributions they drew from.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax
from jaxtyping import Array, Float, Int

from specjax import sampling
from specjax.decoding import prefill
from specjax.models.kv_cache import KVCache
from specjax.verify import Draft, VerifyResult


@struct.dataclass
class Context:
    """What a drafter may read: ``tokens[b, :length[b]]`` is prompt then emitted tokens; the
    last is the root, not yet in ``cache`` (whose length is ``length - 1``).

    ``hidden`` holds the target's last-layer hidden states (before the final norm) for a
    drafter with ``needs_features``: at ``init``, of every prompt slot ``[B, C, D]``; at
    ``commit``, of the round's verification forward over ``[root, nodes]`` ``[B, N+1, D]``.
    """

    tokens: Int[Array, "B C"]
    length: Int[Array, "B"]
    prompt_len: Int[Array, "B"]
    cache: KVCache
    params: Any
    hidden: Any = None


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


@dataclasses.dataclass(frozen=True)
class ModelDrafter:
    """Any specjax model as the draft, with its own KV cache: a chain of ``depth`` tokens
    (``width == 1``) or a top-``width`` tree. Its vocabulary must equal the target's."""

    model: Any
    depth: int = 4
    width: int = 1

    @property
    def num_nodes(self) -> int:
        return self.depth * self.width

    @property
    def verify_widths(self) -> tuple[int, ...]:
        return (self.num_nodes + 1,)

    def check(self, target) -> None:
        _check_sizes(self.depth, self.width)
        if self.model.config.vocab_size != target.config.vocab_size:
            raise ValueError(f"vocabulary mismatch: the draft model has "
                             f"{self.model.config.vocab_size} tokens and the target "
                             f"{target.config.vocab_size}; drafts must use the target's ids")

    def init(self, dparams, ctx: Context, chunk: int):
        cache = self.model.init_cache(ctx.tokens.shape[0], ctx.cache.capacity,
                                      self.model.param_dtype(dparams))
        return prefill(self.model, dparams, ctx.tokens, ctx.prompt_len, cache, chunk)[1]

    def propose(self, dparams, cache: KVCache, ctx: Context, key, sampler):
        # slots < length - 2 are always valid after a round: re-run the last two tokens
        start = ctx.length - 2
        pos = start[:, None] + jnp.arange(2)[None]
        logits, _, cache = self.model.forward(dparams, _take(ctx.tokens, pos), pos,
                                              cache.replace(length=start))
        cache = cache.advance(2)

        def step(c, tok, p):
            lg, _, c = self.model.forward(dparams, tok, p, c)
            return lg[:, 0], c.advance(1)

        draft, cache = _grow(step, cache, logits[:, 1], ctx.length, self.depth, self.width,
                             key, sampler)
        return draft, cache, ctx.cache

    def commit(self, dparams, cache, ctx, result: VerifyResult):
        return cache


def target_head(target, tparams, dparams, hidden):
    """The target's own final norm and LM head (the default early-exit head)."""
    return target.logits(tparams, hidden)


@dataclasses.dataclass(frozen=True)
class EarlyExitDrafter:
    """The target's first ``layer`` layers and a head (default: the target's final norm and
    LM head; ``head(target, tparams, dparams, hidden) -> logits`` plugs in another).

    It reads the target's committed cache for those layers, which holds exactly what the
    truncated model would compute, and writes only scratch slots past it.
    """

    target: Any
    layer: int
    depth: int = 4
    width: int = 1
    head: Callable = target_head

    @property
    def num_nodes(self) -> int:
        return self.depth * self.width

    @property
    def verify_widths(self) -> tuple[int, ...]:
        return (self.num_nodes + 1,)

    def check(self, target) -> None:
        _check_sizes(self.depth, self.width)
        if target != self.target:
            raise ValueError("an EarlyExitDrafter must be built on the target it drafts for")
        if not 1 <= self.layer < target.config.num_layers:
            raise ValueError(f"early-exit layer {self.layer} outside [1, "
                             f"{target.config.num_layers - 1}]")

    def init(self, dparams, ctx: Context, chunk: int):
        return ()

    def _run(self, dparams, tparams, cache, tok, pos):
        _, hid, cache = self.target.forward(tparams, tok, pos, cache, exit_layer=self.layer,
                                            compute_logits=False)
        return self.head(self.target, tparams, dparams, hid[self.layer][:, -1]), cache.advance(1)

    def propose(self, dparams, state, ctx: Context, key, sampler):
        root = ctx.length - 1
        logits, cache = self._run(dparams, ctx.params, ctx.cache,
                                  _take(ctx.tokens, root[:, None]), root[:, None])
        step = lambda c, tok, p: self._run(dparams, ctx.params, c, tok, p)
        draft, cache = _grow(step, cache, logits, ctx.length, self.depth, self.width, key,
                             sampler)
        return draft, state, cache.replace(length=ctx.cache.length)

    def commit(self, dparams, state, ctx, result):
        return state


@dataclasses.dataclass(frozen=True)
class NGramDrafter:
    """Prompt lookup (Max-Gram): the longest suffix of the context, up to ``max_ngram``
    tokens and at least ``min_ngram``, that occurred before (the latest such occurrence)
    proposes the ``depth`` tokens that followed it, repeating periodically when the match
    runs into the suffix. Without a match, ``dparams`` (a ``[V]`` next-token table, -1 for
    none, see ``bigram_table``) continues from the root; ``None`` proposes nothing.
    Deterministic, so ``Draft.probs`` is None; no state, no training.
    """

    depth: int = 7  # verification width 8: padded widths cost the same (docs/design.md)
    max_ngram: int = 4
    min_ngram: int = 2
    per_match_token: int = 0  # > 0: propose at most this many tokens per matched token

    @property
    def num_nodes(self) -> int:
        return self.depth

    @property
    def verify_widths(self) -> tuple[int, ...]:
        """A round without a match runs as one plain decoding step (width 1); shorter
        matches propose fewer tokens when ``per_match_token`` is set."""
        if self.per_match_token:
            return tuple(sorted({1, *(min(self.depth, self.per_match_token * m) + 1
                                      for m in range(self.min_ngram, self.max_ngram + 1))}))
        return (1, self.depth + 1)

    def check(self, target) -> None:
        _check_sizes(self.depth, 1)
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, "
                             f"{self.max_ngram}")

    def init(self, dparams, ctx, chunk):
        return ()

    def _lookup(self, hist: Int[Array, "C"], length: Array):
        c = hist.shape[0]
        j = jnp.arange(c)
        run = jnp.ones((c,), bool)
        match = jnp.zeros((c,), jnp.int32)
        for i in range(self.max_ngram):  # match[j]: how far hist[..j] equals the suffix
            tail = hist[jnp.maximum(length - 1 - i, 0)]
            run = run & (j - i >= 0) & (hist[jnp.maximum(j - i, 0)] == tail) & (i < length - 1)
            match = match + run
        ok = (j < length - 1) & (match >= self.min_ngram)
        best = jnp.argmax(jnp.where(ok, match * c + j, -1))
        period = jnp.maximum(length - 1 - best, 1)
        idx = best + 1 + jnp.arange(self.depth) % period
        count = self.depth
        if self.per_match_token:
            count = jnp.minimum(self.depth, self.per_match_token * match[best])
        return hist[idx], jnp.any(ok), count

    def propose(self, table, state, ctx: Context, key, sampler):
        toks, found, count = jax.vmap(self._lookup)(ctx.tokens, ctx.length)
        valid = found[:, None] & (jnp.arange(self.depth)[None] < count[:, None])
        if table is not None:
            def nxt(t, _):
                n = table[jnp.maximum(t, 0)]
                return jnp.where(t >= 0, n, -1), jnp.where(t >= 0, n, -1)

            root = _take(ctx.tokens, (ctx.length - 1)[:, None])[:, 0]
            _, chain = lax.scan(nxt, root, None, length=self.depth)
            chain = chain.T
            toks = jnp.where(found[:, None], toks, jnp.maximum(chain, 0))
            valid = jnp.where(found[:, None], valid, jnp.cumprod(chain >= 0, axis=1) > 0)
        b = toks.shape[0]
        parents = jnp.broadcast_to(jnp.arange(self.depth, dtype=jnp.int32) - 1, (b, self.depth))
        return Draft(tokens=toks.astype(jnp.int32), parents=parents, valid=valid), state, ctx.cache

    def commit(self, table, state, ctx, result):
        return state


def bigram_table(sequences, vocab_size: int) -> np.ndarray:
    """The most frequent successor of each token over ``sequences`` (-1 where unseen)."""
    counts: dict[tuple[int, int], int] = {}
    for seq in sequences:
        for a, b in zip(seq[:-1], seq[1:]):
            counts[(a, b)] = counts.get((a, b), 0) + 1
    best = np.full(vocab_size, -1, np.int32)
    top = np.zeros(vocab_size, np.int64)
    for (a, b), n in counts.items():
        if n > top[a]:
            best[a], top[a] = b, n
    return best


def from_spec(spec: str, target, depth: int | None = None):
    """A drafter from a command-line spec: ``ngram[:depth]`` or ``early-exit:L``."""
    name, _, arg = spec.partition(":")
    if name == "ngram" and (not arg or arg.isdigit()):
        depth = int(arg) if arg else depth
        return NGramDrafter(**({} if depth is None else {"depth": depth}))
    if name == "early-exit" and arg.isdigit():
        return EarlyExitDrafter(target, int(arg), **({} if depth is None else {"depth": depth}))
    raise ValueError(f"unknown drafter {spec!r}; use 'ngram[:depth]' or 'early-exit:L' "
                     f"(L in [1, {target.config.num_layers - 1}])")


def _check_sizes(depth: int, width: int) -> None:
    if depth < 1 or width < 1:
        raise ValueError(f"draft depth and width must be >= 1, got depth={depth}, "
                         f"width={width}")


Drafter = ModelDrafter | EarlyExitDrafter | NGramDrafter

__all__ = ["Context", "ModelDrafter", "EarlyExitDrafter", "NGramDrafter", "Drafter",
           "bigram_table", "tree_parents", "target_head", "from_spec"]
