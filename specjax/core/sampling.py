"""Sampling strategies: small pytree dataclasses, so new values never recompile.

``probs(logits, sampler)`` is the distribution a strategy draws from (temperature, top-k
and top-p applied). Verification compares drafts against this same distribution.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax
from jaxtyping import Array, Float, Int


@struct.dataclass
class Greedy:
    """Always the most likely token (ties: the lowest id)."""


@struct.dataclass
class Sample:
    """Ancestral sampling from softmax(logits / temperature), restricted to the top-k tokens
    (``top_k <= 0``: no limit) and to the smallest set whose mass reaches ``top_p``.

    All three fields are traced values, so changing them does not recompile. Concrete values
    are checked on construction: a finite ``temperature > 0`` (use ``Greedy`` for 0), ``top_k >= 0``
    and ``0 < top_p <= 1``. Under ``jit`` the most likely token is always kept, so no value
    of ``top_k`` or ``top_p`` can leave an empty distribution.
    """

    temperature: float | Array = 1.0
    top_k: int | Array = 0
    top_p: float | Array = 1.0

    def __post_init__(self):
        checks = (("temperature", lambda t: 0 < t < float("inf"),
                   "finite and > 0 (Greedy() decodes greedily)"),
                  ("top_k", lambda k: k >= 0, ">= 0 (0: no limit)"),
                  ("top_p", lambda p: 0 < p <= 1, "in (0, 1] (1: no limit)"))
        for name, ok, want in checks:
            v = _concrete(getattr(self, name))
            if v is not None and not ok(v):
                raise ValueError(f"Sample({name}={getattr(self, name)!r}): {name} must be {want}")


Sampler = Greedy | Sample


def _concrete(x) -> float | None:
    """``x`` as a Python number when it is known outside tracing (a scalar), else ``None``."""
    if isinstance(x, (int, float, np.integer, np.floating)):
        return float(x)
    if isinstance(x, (np.ndarray, jax.Array)) and not isinstance(x, jax.core.Tracer) \
            and np.ndim(x) == 0:
        return float(x)
    return None


def _truncate(logits: Float[Array, "B V"], top_k, top_p) -> Float[Array, "B V"]:
    """Masks to -inf every token outside the top-k set and the top-p nucleus."""
    v = logits.shape[-1]
    srt = jnp.sort(logits, axis=-1)[..., ::-1]  # descending
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
    kth = jnp.take_along_axis(srt, jnp.broadcast_to(k - 1, srt.shape[:-1])[..., None], -1)
    p = jax.nn.softmax(jnp.where(srt >= kth, srt, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(p, axis=-1) - p
    keep_sorted = ((mass_before < top_p) & (srt >= kth)).at[..., 0].set(True)  # never empty
    # smallest kept logit: everything at or above it stays (ties stay together)
    cut = jnp.min(jnp.where(keep_sorted, srt, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits >= cut, logits, -jnp.inf)


def probs(logits: Float[Array, "B V"], sampler: Sampler) -> Float[Array, "B V"]:
    """The distribution ``sample`` draws from; one-hot at the argmax for ``Greedy``."""
    logits = logits.astype(jnp.float32)
    if isinstance(sampler, Greedy):
        return jax.nn.one_hot(jnp.argmax(logits, -1), logits.shape[-1], dtype=jnp.float32)
    scaled = logits / sampler.temperature
    needs_cut = (sampler.top_k > 0) | (sampler.top_p < 1.0)
    scaled = lax.cond(needs_cut, lambda x: _truncate(x, sampler.top_k, sampler.top_p),
                      lambda x: x, scaled)
    return jax.nn.softmax(scaled, axis=-1)


def sample(key: Array, logits: Float[Array, "B V"], sampler: Sampler) -> Int[Array, "B"]:
    """One token per row, drawn from ``probs(logits, sampler)``."""
    if isinstance(sampler, Greedy):
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    p = probs(logits, sampler)
    return jax.random.categorical(key, jnp.log(p), axis=-1).astype(jnp.int32)
