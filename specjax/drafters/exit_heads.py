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
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float

from specjax.drafters import base, blocks
from specjax.drafters.eagle import output_embedding

SHIPPED = {"smollm2-135m": "heads/smollm2-135m-exits"}  # registry name -> package data


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


def shipped_heads(model_name: str):
    """The directory of the exit heads that ship for ``model_name``, or None
    (``base.shipped_head`` over ``SHIPPED``)."""
    return base.shipped_head(SHIPPED, model_name)


def load_heads(target, path: str | Path, dtype=jnp.float32) -> tuple[dict[int, dict], dict]:
    """``({layer: adapter}, metadata)`` from an exported exit-heads directory; a clear
    ``CheckpointError`` when it is not one, is corrupt, or was made for another model."""
    from specjax import export

    meta = export.read_meta(path, "exit-heads")
    like = init_heads(target.config, meta["layers"], jax.random.key(0), meta["rank"])
    heads, meta = export.load_head(path, "exit-heads", like=like)
    heads = {int(l): jax.tree.map(lambda x: jnp.asarray(x, dtype), hp) for l, hp in heads.items()}
    ids = meta.get("vocab_ids")
    if ids is not None:
        ids = np.asarray(ids, np.int32)
        v = target.config.vocab_size
        if ids.ndim != 1 or not len(ids) or ids.min() < 0 or ids.max() >= v \
                or len(np.unique(ids)) != len(ids):
            raise export.CheckpointError(
                f"{path}: vocab_ids must be distinct token ids in [0, {v})")
        heads = {l: {**hp, "vocab_ids": jnp.asarray(ids)} for l, hp in heads.items()}
    return heads, meta


__all__ = ["ExitAdapter", "init_adapter", "init_heads", "adapt", "exit_head", "load_heads", "shipped_heads"]
