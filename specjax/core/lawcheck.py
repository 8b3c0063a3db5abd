"""A self-check that sampled verification keeps the target's law on the device at hand.

``law_check()`` runs one verification round per row on a toy target whose next-token
distribution depends on the previous token and the depth (``softmax(A[prev] + S[depth])``,
vocabulary 8), with a draft chain drawn from other tables, then continues every row from the
exact target up to 4 tokens. Under a lossless rule the tokens at every position, and the
pair of the first two, follow the target's exact law: a chi-square test against it must not
reject (``p > 1e-4``). The same run with ``Typical`` acceptance (lossy by design) is the
negative control, and must be rejected (``p < 1e-6``), or the test would prove nothing.

Everything runs jitted on JAX's default device (the PRNG, the draft, ``verify`` and the
continuation), so this checks sampling where the user decodes; only the counts and the
chi-square statistic are computed on the host. No scipy: the chi-square tail is
``jax.scipy.special.gammaincc``. The tests run it on the CPU, ``scripts/device_check.py``
on an accelerator.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax.core import sampling
from specjax.core.verify import Draft, Rejection, Typical, verify

VOCAB, POSITIONS, ROOT = 8, 4, 3


@dataclasses.dataclass(frozen=True)
class LawResult:
    """``p_value``: the smallest over the per-position and joint tests; ``passed``: the
    lossless rule was not rejected and the negative control was."""

    rows: int
    p_value: float
    control_p_value: float
    mean_accepted: float
    seconds: float
    platform: str

    @property
    def passed(self) -> bool:
        return self.p_value > 1e-4 and self.control_p_value < 1e-6


def _tables(seed: int, scale: float = 1.5):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return (scale * jax.random.normal(k1, (VOCAB, VOCAB)),
            scale * jax.random.normal(k2, (POSITIONS + 2, VOCAB)))


def _rollout(key, rows: int, rule, n_draft: int = 3):
    """``[rows, POSITIONS]`` tokens: one verification round over an i.i.d. draft chain of
    ``n_draft`` tokens, then exact target samples; and the accepted counts."""
    target, draft_tab = _tables(0), _tables(1)
    sampler = sampling.Sample(1.0)
    kd, kv, kc = jax.random.split(key, 3)
    prev, toks, qs = jnp.full((rows,), ROOT), [], []
    for d in range(n_draft):
        q = sampling.probs(draft_tab[0][prev] + draft_tab[1][d], sampler)
        prev = jax.random.categorical(jax.random.fold_in(kd, d), jnp.log(q)).astype(jnp.int32)
        toks.append(prev)
        qs.append(q)
    toks = jnp.stack(toks, 1)
    ctx = jnp.concatenate([jnp.full((rows, 1), ROOT), toks], 1)  # node j's parent token
    logits = target[0][ctx] + target[1][jnp.arange(n_draft + 1)][None]
    draft = Draft(tokens=toks, parents=jnp.broadcast_to(jnp.arange(n_draft) - 1, toks.shape),
                  valid=jnp.ones(toks.shape, bool), probs=jnp.stack(qs, 1))
    res = verify(logits, draft, kv, sampler, rule=rule, depth=n_draft)
    take = jnp.minimum(res.accepted + 1, POSITIONS)
    out, prev = [], jnp.full((rows,), ROOT)
    for i in range(POSITIONS):  # the round's tokens, then the exact target past them
        p = sampling.probs(target[0][prev] + target[1][i], sampler)
        y = jax.random.categorical(jax.random.fold_in(kc, i), jnp.log(p)).astype(jnp.int32)
        mine = res.tokens[:, i] if i < res.tokens.shape[1] else y
        prev = jnp.where(i < take, mine, y)
        out.append(prev)
    return jnp.stack(out, 1), res.accepted


def _exact_law():
    """Per-position marginals and the joint law of the first two tokens, under the target."""
    target = [np.asarray(t, np.float64) for t in _tables(0)]

    def cond(d):  # [prev, next]
        z = target[0] + target[1][d][None]
        z = np.exp(z - z.max(1, keepdims=True))
        return z / z.sum(1, keepdims=True)

    marg = [cond(0)[ROOT]]
    for d in range(1, POSITIONS):
        marg.append(marg[-1] @ cond(d))
    return marg, marg[0][:, None] * cond(1)


def _chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's chi-square p-value of ``counts`` against ``probs`` (cells expecting
    fewer than 5 pooled); 0 when a zero-probability cell was hit."""
    counts, probs = counts.astype(np.float64).ravel(), probs.astype(np.float64).ravel()
    n = counts.sum()
    if np.any((probs == 0) & (counts > 0)):
        return 0.0
    big = probs * n >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(probs[big], probs[~big].sum()) * n
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    dof = max(int(keep.sum()) - 1, 1)
    return float(jax.scipy.special.gammaincc(dof / 2.0, stat / 2.0))


def _min_pvalue(out: np.ndarray) -> float:
    marg, joint = _exact_law()
    ps = [_chi2_pvalue(np.bincount(out[:, i], minlength=VOCAB), marg[i])
          for i in range(POSITIONS)]
    ps.append(_chi2_pvalue(np.bincount(out[:, 0] * VOCAB + out[:, 1],
                                       minlength=VOCAB * VOCAB), joint))
    return min(ps)


def law_check(rows: int = 200_000, seed: int = 7) -> LawResult:
    """Sampled (T=1) verification against the exact target law, with ``Typical`` as the
    negative control, ``rows`` rounds each, on JAX's default device."""
    t = time.perf_counter()
    run = jax.jit(_rollout, static_argnames=("rows", "rule"))
    key = jax.random.key(seed)
    out, acc = run(key, rows=rows, rule=Rejection())
    bad, _ = run(key, rows=rows, rule=Typical())
    out, acc, bad = np.asarray(out), np.asarray(acc), np.asarray(bad)
    return LawResult(rows=rows, p_value=_min_pvalue(out), control_p_value=_min_pvalue(bad),
                     mean_accepted=float(acc.mean()), seconds=time.perf_counter() - t,
                     platform=jax.devices()[0].platform)
