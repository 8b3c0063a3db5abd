"""Trained early-exit heads: a low-rank adapter per exit layer on the target's own LM head.

An exit after layer ``l`` turns the residual stream ``h`` into logits with the target's
final norm and (tied) LM head, after a rank-``r`` correction::

    logits = lm_head(final_norm(h + (rms_norm(h) · g) A B))        A: [D, r], B: [r, D]

``B`` starts at zero, so an untrained adapter is exactly the plain early exit. The LM head
is shared and frozen; each layer adds ``2·D·r + D`` parameters. ``exit_head`` has the head
protocol of ``EarlyExitDrafter`` and ``hsd.Exit`` (``head(target, tparams, hp, hidden)``).
"""

from __future__ import annotations

import functools
import types
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from specjax.drafters import blocks
from specjax.drafters.eagle import output_embedding


class ExitAdapter(nnx.Module):
    """One exit layer's low-rank correction as a Flax NNX module: ``norm`` [D] (ones),
    ``down`` [D, r] (scaled normal), ``up`` [r, D] (zeros: the untrained adapter is the
    plain early exit). Its state is the plain pytree ``{"norm", "down", "up"}``."""

    def __init__(self, target_cfg, key: Array, rank: int = 64, dtype=jnp.float32):
        d = target_cfg.hidden_size
        if rank < 1:
            raise ValueError(f"adapter rank must be >= 1, got {rank}")
        self.eps = float(target_cfg.rms_norm_eps)
        self.norm = nnx.Param(jnp.ones((d,), dtype))
        self.down = nnx.Param((jax.random.normal(key, (d, rank)) / d ** 0.5).astype(dtype))
        self.up = nnx.Param(jnp.zeros((rank, d), dtype))

    def __call__(self, hidden: Float[Array, "... D"]) -> Float[Array, "... D"]:
        """The corrected residual stream ``h + (rms_norm(h) · g) A B``."""
        down, up = self.down[...], self.up[...]
        z = blocks.rms_norm(hidden, self.norm[...], self.eps).astype(down.dtype)
        # ...: any leading axes, d: model width, r: adapter rank
        low = jnp.einsum("...d,dr->...r", z, down)
        return hidden + jnp.einsum("...r,rd->...d", low, up).astype(hidden.dtype)


@functools.lru_cache(maxsize=None)
def _graphdef(eps: float):
    cfg = types.SimpleNamespace(hidden_size=1, rms_norm_eps=eps)
    return nnx.split(nnx.eval_shape(lambda: ExitAdapter(cfg, jax.random.key(0), 1)))[0]


def init_adapter(target_cfg, key: Array, rank: int = 64, dtype=jnp.float32) -> dict:
    """A fresh ``ExitAdapter``'s parameters as a plain pytree."""
    return nnx.to_pure_dict(nnx.state(ExitAdapter(target_cfg, key, rank, dtype)))


def init_heads(target_cfg, layers: Sequence[int], key: Array, rank: int = 64) -> dict:
    """``{str(layer): adapter}`` for each exit layer in ``[1, num_layers)``."""
    bad = [l for l in layers if not 1 <= l < target_cfg.num_layers]
    if bad or not layers or len(set(layers)) != len(layers):
        raise ValueError(f"exit layers must be distinct and in [1, {target_cfg.num_layers - 1}]"
                         f", got {list(layers)}")
    keys = jax.random.split(key, len(layers))
    return {str(l): init_adapter(target_cfg, k, rank) for l, k in zip(layers, keys)}


def adapt(hp: dict, hidden: Float[Array, "... D"], eps: float) -> Float[Array, "... D"]:
    """``ExitAdapter`` with parameters ``hp`` applied to ``hidden`` (``vocab_ids``, if
    present, is not a parameter and is ignored here)."""
    adapter = nnx.merge(_graphdef(float(eps)), {k: hp[k] for k in ("norm", "down", "up")})
    return adapter(hidden)


def exit_head(target, tparams, hp: dict | None, hidden: Float[Array, "... D"]
              ) -> Float[Array, "... V"]:
    """Logits of an exit with adapter ``hp`` (``None``: the target's plain head).

    When ``hp`` has ``vocab_ids`` (the vocabulary it was distilled on), only those rows of
    the LM head are computed and every other token gets the dtype's lowest logit, so the
    exit never proposes a token its training did not constrain; the target still verifies
    every draft, so decoding stays lossless."""
    if hp is None:
        return target.logits(tparams, hidden)
    z = adapt(hp, hidden, target.config.rms_norm_eps)
    ids = hp.get("vocab_ids")
    if ids is None:
        return target.logits(tparams, z)
    sub = target.logits(tparams, z, head=output_embedding(target, tparams)[ids])
    full = jnp.full((*sub.shape[:-1], target.config.vocab_size), jnp.finfo(sub.dtype).min,
                    sub.dtype)
    return full.at[..., ids].set(sub)


__all__ = ["ExitAdapter", "init_adapter", "init_heads", "adapt", "exit_head"]
