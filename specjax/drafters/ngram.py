"""``NGramDrafter``: prompt lookup (Max-Gram) with an optional bigram fallback table, in
static shapes."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Int

from specjax.drafters.base import Context, StatelessChain, _check_sizes, take_tokens


@dataclasses.dataclass(frozen=True)
class NGramDrafter(StatelessChain):
    """Prompt lookup (Max-Gram): the longest suffix of the context, up to ``max_ngram``
    tokens and at least ``min_ngram``, that occurred before (the latest such occurrence)
    proposes the ``depth`` tokens that followed it, repeating periodically when the match
    runs into the suffix. Without a match, ``dparams`` (a ``[V]`` next-token table, -1 for
    none, see ``bigram_table``) continues from the root; ``None`` proposes nothing.
    Deterministic, so ``Draft.probs`` is None; no state, no training.

    For an encoder-decoder target (parameters bound to an ``EncodedSource``) the lookup
    searches the source before the decoded tokens, so a summary copies from its article
    (``over_source=False`` turns this off); proposals stop at the source's end.
    """

    depth: int = 7  # verification width 8: padded widths cost the same (docs/design.md)
    max_ngram: int = 4
    min_ngram: int = 2
    per_match_token: int = 0  # > 0: propose at most this many tokens per matched token
    over_source: bool = True

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

    def chain_tokens(self, table, ctx: Context):
        """The longest-match continuation (else the bigram chain from the root, with a
        ``table``), and which of its tokens are valid."""
        hist, length = ctx.tokens, ctx.length
        src = ctx.source  # an encoder-decoder target's source ids (-1, never matched, past
        if self.over_source and src is not None:  # its end), searched before the decoded ones
            hist = jnp.concatenate([src, hist], axis=1)
            length = length + src.shape[1]
        toks, found, count = jax.vmap(self._lookup)(hist, length)
        valid = found[:, None] & (jnp.arange(self.depth)[None] < count[:, None])
        valid = valid & (jnp.cumprod(toks >= 0, axis=1) > 0)
        if table is not None:
            def nxt(t, _):
                n = table[jnp.maximum(t, 0)]
                return jnp.where(t >= 0, n, -1), jnp.where(t >= 0, n, -1)

            root = take_tokens(ctx.tokens, (ctx.length - 1)[:, None])[:, 0]
            _, chain = lax.scan(nxt, root, None, length=self.depth)
            chain = chain.T
            toks = jnp.where(found[:, None], toks, jnp.maximum(chain, 0))
            valid = jnp.where(found[:, None], valid, jnp.cumprod(chain >= 0, axis=1) > 0)
        return jnp.maximum(toks, 0), valid


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
