"""The building blocks of draft heads, over the model contract alone (``specjax.models.base``).

A draft head is built from these, not from a model port: RMS norm, grouped-query
self-attention with RoPE (over an explicit one-layer K/V cache, or a whole sequence under a
causal mask), a SwiGLU MLP, and the decoder layer that chains them (pre-norm residual
blocks, the Llama layout), composed of the numerical operations every model port uses
(``specjax.models.ops``: every weight ``[out, in]`` and the left operand of its product,
products accumulated in float32, norms and RoPE in float32), so their numbers are exactly
those of ``specjax.models.llama``'s layer (``tests/test_blocks.py`` checks it bit for bit).

A ``LayerSpec`` holds a layer's sizes. The attention's input width (``in_width``) is its
own: EAGLE-2 feeds it the residual stream (``D``), EAGLE-3 a ``2D`` concatenation with its
own q/k/v projections.

The target's feature, which EAGLE and ReDrafter heads read, is ``features``: the target's
last hidden state after its final norm (the LM head's input).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from specjax.models import kv_cache
from specjax.models.base import ModelConfig, RopeScaling
from specjax.models.ops import (apply_rope, attention, dense, gate_up, head_logits,  # noqa: F401
                                project, rms_norm)
from specjax.models import ops

Params = Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """The sizes of one draft-head decoder layer (hashable: a static argument).

    ``width`` is the residual width ``D``; ``in_width`` the attention's input width (``D``
    unless the head feeds its attention something wider); RoPE rotates by
    ``rope_scaling.inv_freq(head_dim, rope_theta)``."""

    width: int
    in_width: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling = RopeScaling()

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")

    @classmethod
    def of(cls, cfg: ModelConfig, in_width: int | None = None) -> "LayerSpec":
        """A layer at the width and head geometry of a target's configuration; its
        attention reads ``in_width`` features (default: the target's width)."""
        d = cfg.hidden_size
        return cls(width=d, in_width=d if in_width is None else in_width,
                   num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                   head_dim=cfg.head_dim, intermediate_size=cfg.intermediate_size,
                   rms_norm_eps=float(cfg.rms_norm_eps), rope_theta=float(cfg.rope_theta),
                   rope_scaling=cfg.rope_scaling)


def features(target, tparams, hidden: Float[Array, "... D"]) -> Float[Array, "... D"]:
    """The target's feature: its last hidden state after the final norm (the LM head's
    input), what EAGLE and ReDrafter heads read."""
    return target.final_norm(tparams, hidden)


# ----------------------------------------------------------------------------- blocks

def layer_shapes(spec: LayerSpec) -> dict[str, tuple[int, ...]]:
    """Shape of each weight of one layer, all ``[out, in]``: ``qkv`` stacks the Q, K and V
    projections of the attention input (``in_width``) in HF's half-split RoPE order,
    ``gate_up`` the MLP's gate then up. The names are those of the shipped heads."""
    d, f, hd = spec.width, spec.intermediate_size, spec.head_dim
    return {
        "attn_norm": (spec.in_width,),
        "qkv": ((spec.num_heads + 2 * spec.num_kv_heads) * hd, spec.in_width),
        "o": (d, spec.num_heads * hd), "mlp_norm": (d,), "gate_up": (2 * f, d), "down": (d, f),
    }


def qkv_heads(spec: LayerSpec, p: Params, h: Float[Array, "I B T"]):
    """Queries ``[Nq, H, B, T]``, keys and values ``[Nkv, H, B, T]`` of the attention input
    ``h``, from fused (``qkv``) or split (``q``, ``k``, ``v``: the sharded layout) weights."""
    return ops.qkv_heads(p, h, spec.num_heads, spec.num_kv_heads, spec.head_dim)


def self_attention(spec: LayerSpec, p: Params, h: Float[Array, "I B T"],
                   positions: Int[Array, "B T"], k_cache, v_cache, length, mask,
                   visible=None):
    """Grouped-query self-attention with RoPE of an (already normed) feature-major input
    ``h`` over a one-layer cache (``specjax.models.ops.attention``): the output ``[D, B, T]`` after ``o``, and the
    new tokens' keys ``[B, K, H, T]`` and values ``[B, K, T, H]`` (the cache's layouts),
    not yet written."""
    _, b, t = h.shape
    nq, nk, hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
    inv_freq = spec.rope_scaling.inv_freq(hd, spec.rope_theta)
    q, k, v = qkv_heads(spec, p, h)  # [N,H,B,T]
    q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
    q = q.reshape(nk, nq // nk, hd, b, t).transpose(3, 0, 1, 4, 2)  # [B,K,G,T,H]
    v = v.transpose(2, 0, 3, 1)  # [B,K,T,H]
    att = attention(q, k.transpose(2, 0, 3, 1), v, k_cache, v_cache, length, mask, visible)
    out = dense(p["o"], att.transpose(1, 2, 4, 0, 3).reshape(nq * hd, b, t))
    return out, k.transpose(2, 0, 1, 3), v


def swiglu(p: Params, h: Float[Array, "D B T"], f: int) -> Float[Array, "D B T"]:
    """The SwiGLU MLP ``down(silu(gate h) * up h)`` of a feature-major input, from fused
    (``gate_up``, gate first) or split (``gate``, ``up``) weights; ``f`` is the inner width."""
    gate, up = gate_up(p, h, f)
    return dense(p["down"], jax.nn.silu(gate) * up)


def decoder_layer(spec: LayerSpec, p: Params, x: Float[Array, "B T D"], k_cache, v_cache,
                  length, mask, positions, visible=None):
    """One pre-norm decoder layer (attention then SwiGLU, each with its residual) on a
    batch-major stream, with a one-layer cache: returns the new stream and the cache with
    the new tokens' K/V written at slot ``length``. ``visible`` ([B,T,S]) replaces the
    default cache visibility (slots ``< length``): a draft tree sees its ancestors' scratch
    slots. Needs ``in_width == width`` (the attention reads the normed stream). A layer
    without ``attn_norm`` (layer 0 of a published EAGLE-1/2 head) feeds the stream to its
    attention unnormed."""
    xt = x.transpose(2, 0, 1)  # [D,B,T]
    h = rms_norm(xt, p["attn_norm"], spec.rms_norm_eps, axis=0) if "attn_norm" in p else xt
    att, k, v = self_attention(spec, p, h, positions, k_cache, v_cache, length, mask, visible)
    xt = xt + att
    h = rms_norm(xt, p["mlp_norm"], spec.rms_norm_eps, axis=0)
    xt = xt + swiglu(p, h, spec.intermediate_size)
    return (xt.transpose(1, 2, 0), kv_cache.write(k_cache, length, k, axis=3),
            kv_cache.write(v_cache, length, v, axis=2))


def empty_kv(spec: LayerSpec, batch: int, slots: int, dtype, layers: int = 1
             ) -> tuple[Array, Array]:
    """A zero cache ``(k [B,K,H,S], v [B,K,S,H])`` of ``slots`` slots for a head of
    ``layers`` decoder layers: their K/V heads side by side on the ``K`` axis
    (``layers * num_kv_heads``; layer ``i`` owns ``[i K, (i + 1) K)``)."""
    k = layers * spec.num_kv_heads
    return (jnp.zeros((batch, k, spec.head_dim, slots), dtype),
            jnp.zeros((batch, k, slots, spec.head_dim), dtype))


def filled(batch: int, n: int) -> Int[Array, "B"]:
    """A cache length of ``n`` slots in every row, opaque to XLA. With a constant length,
    the masked scores over a cache that is known empty are themselves a constant, which
    XLA:CPU folds element by element: measured at 26-68 s of compile per batch shape of
    the training-time test (12 x 320 tokens), against 1.3-1.6 s with this barrier."""
    return jax.lax.optimization_barrier(jnp.full((batch,), n, jnp.int32))


def causal(batch: int, t: int) -> Bool[Array, "B T T"]:
    """The causal mask of ``t`` new tokens, per row."""
    return jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (batch, t, t))


__all__ = ["LayerSpec", "features", "rms_norm", "project", "dense", "head_logits",
           "apply_rope", "attention", "layer_shapes", "qkv_heads", "self_attention", "swiglu",
           "decoder_layer", "empty_kv", "filled", "causal"]
