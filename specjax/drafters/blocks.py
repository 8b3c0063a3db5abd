"""The building blocks of draft heads, over the model contract alone (``specjax.models.base``).

A draft head is built from these, not from a model port: RMS norm, grouped-query
self-attention with RoPE (over an explicit one-layer K/V cache, or a whole sequence under a
causal mask), a SwiGLU MLP, and the decoder layer that chains them (pre-norm residual
blocks, the Llama layout). Their numbers are exactly those of ``specjax.models.llama``'s
layer: every weight is ``[out, in]`` and the left operand of its product (``project``),
products accumulate in float32, norms and RoPE run in float32 (``tests/test_eagle.py``
checks the equality bit for bit).

A ``LayerSpec`` holds a layer's sizes. The attention's input width (``in_width``) is its
own: EAGLE-2 feeds it the residual stream (``D``), EAGLE-3 a ``2D`` concatenation with its
own q/k/v projections.

The target's feature, which EAGLE and ReDrafter heads read, is ``features``: the target's
last hidden state after its final norm (the LM head's input).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Bool, Float, Int

from specjax.models import kv_cache
from specjax.models.base import ModelConfig, RopeScaling

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


# ----------------------------------------------------------------------------- primitives

def rms_norm(x: Array, weight: Array, eps: float, axis: int = -1) -> Array:
    """RMSNorm over ``axis`` computed in float32 and cast back before the gain (HF Llama's
    order). ``axis=0`` normalizes a feature-major ``[D, ...]`` array."""
    xf = x.astype(jnp.float32)
    xf = xf * lax.rsqrt(jnp.mean(xf * xf, axis=axis, keepdims=True) + eps)
    if axis in (0, -x.ndim) and x.ndim > 1:
        weight = weight.reshape((-1,) + (1,) * (x.ndim - 1))
    return weight * xf.astype(x.dtype)


def fast_width(n: int) -> int:
    """The column count ``project`` multiplies at for ``n`` columns: on XLA:CPU, 2-4 become
    4 and wider products the next multiple of 8 (narrow odd widths fall off the GEMM's fast
    micro-tiles); 1 and every width on other backends stay as they are."""
    if n <= 1 or jax.default_backend() != "cpu":
        return n
    return 4 if n <= 4 else -(-n // 8) * 8


def project(w: Float[Array, "O I"], x: Float[Array, "I N"]) -> Float[Array, "O N"]:
    """``w @ x`` accumulated in float32 (``x`` cast to ``w``'s dtype), the columns padded to
    ``fast_width(N)`` with zeros that are dropped again. Returns float32."""
    n = x.shape[1]
    m = fast_width(n)
    x = x.astype(w.dtype)
    if m != n:
        x = jnp.pad(x, ((0, 0), (0, m - n)))
    # o out features, i in features, n columns (tokens)
    y = jnp.einsum("oi,in->on", w, x, preferred_element_type=jnp.float32)
    return y[:, :n] if m != n else y


def dense(w: Float[Array, "O I"], x: Float[Array, "I B T"]) -> Float[Array, "O B T"]:
    """``project`` over a feature-major ``[I, B, T]`` stream."""
    i, b, t = x.shape
    return project(w, x.reshape(i, b * t)).reshape(w.shape[0], b, t)


def head_logits(head: Float[Array, "V D"], h: Float[Array, "... D"]) -> Float[Array, "... V"]:
    """``h @ head.T`` as float32 logits, weights-left (``project``; ``h`` cast to ``head``'s
    dtype). The barrier keeps XLA from folding the transpose into the product's layout."""
    lead = h.shape[:-1]
    flat = h.reshape(-1, h.shape[-1]).astype(head.dtype)
    out = lax.optimization_barrier(project(head, flat.T)).T  # [N, V]
    return out.reshape(*lead, head.shape[0]).astype(jnp.float32)


def apply_rope(x: Float[Array, "N H B T"], positions: Int[Array, "B T"],
               inv_freq: Float[Array, "H2"]) -> Float[Array, "N H B T"]:
    """Rotates feature-major heads by their positions (HF's half-split convention), in
    float32, cast back to ``x``'s dtype."""
    ang = inv_freq[:, None, None] * positions[None].astype(jnp.float32)  # [H/2,B,T]
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=1)
    return out.astype(x.dtype)


def attend(q: Float[Array, "B K G T H"], k_new: Float[Array, "B K T H"],
           v_new: Float[Array, "B K T H"], k_cache: Float[Array, "B K H S"],
           v_cache: Float[Array, "B K S H"], length: Int[Array, "B"],
           mask: Bool[Array, "B T T"], visible: Bool[Array, "B _ S"] | None = None
           ) -> Float[Array, "B K G T H"]:
    """Grouped-query attention of new tokens over a cache and each other, scaled by
    ``H ** -0.5``: query ``i`` sees cache slots ``< length`` (or those with
    ``visible[b, i, s]``) and new keys ``j`` with ``mask[b, i, j]``. New keys and values are
    rounded to the cache's dtype first, so a new key reads as it would from the cache. One
    float32 softmax over both score blocks; the cache is only read."""
    k_new, v_new = k_new.astype(k_cache.dtype), v_new.astype(v_cache.dtype)
    b, nk, g, t, hd = q.shape
    s = k_cache.shape[3]
    qf = q.reshape(b, nk, g * t, hd) * jnp.asarray(1 / math.sqrt(hd), q.dtype)
    # b batch, k kv-head, s cache slot, n new key, q = (g query heads per kv-head, t query), h head dim
    old = jnp.einsum("bkqh,bkhs->bkqs", qf, k_cache).astype(jnp.float32).reshape(b, nk, g, t, s)
    new = jnp.einsum("bkqh,bknh->bkqn", qf, k_new).astype(jnp.float32).reshape(b, nk, g, t, t)
    if visible is None:
        visible = (jnp.arange(s)[None, :] < length[:, None])[:, None, :]  # [B,1,S]
    neg = jnp.finfo(jnp.float32).min
    old = jnp.where(visible[:, None, None], old, neg)
    new = jnp.where(mask[:, None, None], new, neg)
    top = jnp.maximum(old.max(-1, keepdims=True), new.max(-1, keepdims=True))
    e_old, e_new = jnp.exp(old - top), jnp.exp(new - top)
    inv = 1.0 / (e_old.sum(-1, keepdims=True) + e_new.sum(-1, keepdims=True))
    p_old = (e_old * inv).astype(v_cache.dtype).reshape(b, nk, g * t, s)
    p_new = (e_new * inv).astype(v_cache.dtype).reshape(b, nk, g * t, t)
    f32 = jnp.float32
    out = (jnp.einsum("bkqs,bksh->bkqh", p_old, v_cache, preferred_element_type=f32)
           + jnp.einsum("bkqn,bknh->bkqh", p_new, v_new, preferred_element_type=f32))
    return out.reshape(b, nk, g, t, hd)


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
    _, b, t = h.shape
    nq, nk, hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
    if "qkv" in p:
        qkv = dense(p["qkv"], h).reshape(nq + 2 * nk, hd, b, t)
        return jnp.split(qkv, [nq, nq + nk], axis=0)
    return tuple(dense(p[n], h).reshape(c, hd, b, t) for n, c in (("q", nq), ("k", nk), ("v", nk)))


def self_attention(spec: LayerSpec, p: Params, h: Float[Array, "I B T"],
                   positions: Int[Array, "B T"], k_cache, v_cache, length, mask,
                   visible=None):
    """Grouped-query self-attention with RoPE of an (already normed) feature-major input
    ``h`` over a one-layer cache (``attend``): the output ``[D, B, T]`` after ``o``, and the
    new tokens' keys ``[B, K, H, T]`` and values ``[B, K, T, H]`` (the cache's layouts),
    not yet written."""
    _, b, t = h.shape
    nq, nk, hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
    inv_freq = spec.rope_scaling.inv_freq(hd, spec.rope_theta)
    q, k, v = qkv_heads(spec, p, h)  # [N,H,B,T]
    q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
    q = q.reshape(nk, nq // nk, hd, b, t).transpose(3, 0, 1, 4, 2)  # [B,K,G,T,H]
    v = v.transpose(2, 0, 3, 1)  # [B,K,T,H]
    att = attend(q, k.transpose(2, 0, 3, 1), v, k_cache, v_cache, length, mask, visible)
    out = dense(p["o"], att.transpose(1, 2, 4, 0, 3).reshape(nq * hd, b, t))
    return out, k.transpose(2, 0, 1, 3), v


def swiglu(p: Params, h: Float[Array, "D B T"], f: int) -> Float[Array, "D B T"]:
    """The SwiGLU MLP ``down(silu(gate h) * up h)`` of a feature-major input, from fused
    (``gate_up``, gate first) or split (``gate``, ``up``) weights; ``f`` is the inner width."""
    if "gate_up" in p:
        gate, up = jnp.split(dense(p["gate_up"], h), [f], axis=0)
    else:
        gate, up = dense(p["gate"], h), dense(p["up"], h)
    return dense(p["down"], jax.nn.silu(gate) * up)


def decoder_layer(spec: LayerSpec, p: Params, x: Float[Array, "B T D"], k_cache, v_cache,
                  length, mask, positions, visible=None):
    """One pre-norm decoder layer (attention then SwiGLU, each with its residual) on a
    batch-major stream, with a one-layer cache: returns the new stream and the cache with
    the new tokens' K/V written at slot ``length``. ``visible`` ([B,T,S]) replaces the
    default cache visibility (slots ``< length``): a draft tree sees its ancestors' scratch
    slots. Needs ``in_width == width`` (the attention reads the normed stream)."""
    xt = x.transpose(2, 0, 1)  # [D,B,T]
    h = rms_norm(xt, p["attn_norm"], spec.rms_norm_eps, axis=0)
    att, k, v = self_attention(spec, p, h, positions, k_cache, v_cache, length, mask, visible)
    xt = xt + att
    h = rms_norm(xt, p["mlp_norm"], spec.rms_norm_eps, axis=0)
    xt = xt + swiglu(p, h, spec.intermediate_size)
    return (xt.transpose(1, 2, 0), kv_cache.write(k_cache, length, k, axis=3),
            kv_cache.write(v_cache, length, v, axis=2))


def empty_kv(spec: LayerSpec, batch: int, slots: int, dtype) -> tuple[Array, Array]:
    """A zero one-layer cache ``(k [B,K,H,S], v [B,K,S,H])`` of ``slots`` slots."""
    return (jnp.zeros((batch, spec.num_kv_heads, spec.head_dim, slots), dtype),
            jnp.zeros((batch, spec.num_kv_heads, slots, spec.head_dim), dtype))


def causal(batch: int, t: int) -> Bool[Array, "B T T"]:
    """The causal mask of ``t`` new tokens, per row."""
    return jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (batch, t, t))


__all__ = ["LayerSpec", "features", "rms_norm", "project", "dense", "head_logits",
           "apply_rope", "attend", "layer_shapes", "qkv_heads", "self_attention", "swiglu",
           "decoder_layer", "empty_kv", "causal"]
