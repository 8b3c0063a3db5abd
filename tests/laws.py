"""Statistical checks of a sampled law shared by the tests: the exact joint law of a toy
target's first two sampled tokens after ``PROMPT`` (by enumeration), a chi-square p-value
of counts against it, and two tokens sampled by speculative decoding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

from specjax.core import sampling
from specjax.core.speculative import speculative_generate
from toys import V

PROMPT = [1, 5, 2, 7, 5]


def exact_pair(model, params, sampler, prompt=PROMPT):
    """P(y0, y1) of the target after ``prompt``, by enumeration."""
    def dist(seqs):
        toks = jnp.asarray(seqs)
        cache = model.init_cache(len(seqs), 64)
        pos = jnp.broadcast_to(jnp.arange(toks.shape[1]), toks.shape)
        logits, _, _ = model.forward(params, toks, pos, cache)
        return np.asarray(sampling.probs(logits[:, -1], sampler), np.float64)

    p0 = dist([list(prompt)])[0]
    p1 = dist([list(prompt) + [y] for y in range(V)])
    return p0[:, None] * p1


def pvalue(counts, probs) -> float:
    """The chi-square p-value of ``counts`` against the law ``probs`` (same shape), cells
    expected fewer than 5 times pooled into one; 0 when a count falls where ``probs`` is 0."""
    probs = np.asarray(probs, np.float64).ravel()
    counts = np.asarray(counts, np.float64).ravel()
    n = counts.sum()
    if np.any((probs == 0) & (counts > 0)):
        return 0.0  # a token the target can never emit
    big = probs * n >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(probs[big] * n, probs[~big].sum() * n)
    exp = exp * (counts.sum() / exp.sum())  # float rounding of the probabilities
    keep = exp > 0
    return stats.chisquare(obs[keep], exp[keep]).pvalue


def sampled_pairs(model, tparams, drafter, dp, calls: int = 40, batch: int = 256):
    """Two tokens sampled at temperature 1 by ``calls`` speculative runs of ``batch`` rows:
    the chi-square p-value of their joint counts against the target's exact pair
    distribution, and the fraction of rounds whose first draft token was accepted."""
    sampler = sampling.Sample(1.0)
    counts, acc = np.zeros((V, V)), []
    for i in range(calls):
        out = speculative_generate(model, tparams, drafter, dp, [PROMPT] * batch,
                                   max_new_tokens=2, sampler=sampler, key=jax.random.key(i))
        y = np.asarray(out.tokens)[:, :2]
        np.add.at(counts, (y[:, 0], y[:, 1]), 1)
        acc.append(np.asarray(out.accepted_at)[:, 0])
    return pvalue(counts, exact_pair(model, tparams, sampler)), float(np.mean(acc))
