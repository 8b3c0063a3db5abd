"""The numerical operations every model port and draft head is built from: products with
the weights as the left operand at padded widths (``project``), RMS norm, rotary
embeddings, grouped-query attention over an explicit cache, and the fused or split
projections of a Llama-style layer. Pure functions of arrays; no model is named here.

Every weight is ``[out, in]``; activations are feature-major ``[D, B, T]`` inside a layer.
Products accumulate in float32; norms and RoPE run in float32.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

Params = Mapping[str, Any]


def fast_width(n: int) -> int:
    """The column count ``project`` multiplies at for ``n`` columns on this backend.

    On XLA:CPU a product with 2-3 or 5-7 (or 9-15, ...) columns falls back to a kernel that
    costs several times the next multiple of the GEMM's 4- and 8-column micro-tiles, so
    widths are padded: 1 stays a matrix-vector product, 2-4 become 4, wider ones the next
    multiple of 8 (measured in docs/results/width_cost_cpu.json). Other backends run ``n``.
    """
    if n <= 1 or jax.default_backend() != "cpu":
        return n
    return 4 if n <= 4 else -(-n // 8) * 8


def project(w: Float[Array, "O I"], x: Float[Array, "I N"]) -> Float[Array, "f32 O N"]:
    """``w @ x`` accumulated in float32, with the weights as the left operand and ``N``
    padded to ``fast_width(N)`` zero columns that are dropped again. ``x`` is cast to
    ``w``'s dtype: the models hand ``w`` in their ``compute_dtype`` (``DecoderParts``), so
    with float32 compute a column's result depends on how wide the forward was by float32
    rounding only, which keeps speculative verification equal to one-token decoding."""
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


def apply_rope(x: Float[Array, "N H B T"], positions: Int[Array, "B T"],
               inv_freq: Float[Array, "H2"]) -> Float[Array, "N H B T"]:
    """Rotates feature-major query/key heads by their positions (HF's half-split convention)."""
    ang = inv_freq[:, None, None] * positions[None].astype(jnp.float32)  # [H/2,B,T]
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=1)
    return out.astype(x.dtype)


def rms_norm(x: Array, weight: Array, eps: float, axis: int = -1) -> Array:
    """RMSNorm over ``axis`` computed in float32 and cast back before the gain, as HF Llama
    does. ``axis=0`` normalizes a feature-major ``[D, ...]`` array."""
    xf = x.astype(jnp.float32)
    xf = xf * lax.rsqrt(jnp.mean(xf * xf, axis=axis, keepdims=True) + eps)
    if axis in (0, -x.ndim) and x.ndim > 1:
        weight = weight.reshape((-1,) + (1,) * (x.ndim - 1))
    return weight * xf.astype(x.dtype)


QUERY_BLOCK = 128
"""Queries per block of a capacity-0 forward (``_new_only``): block ``i`` attends only to the
keys up to its last query, so a long causal forward skips most of the masked half."""


def _new_only(qf, k_new, v_new, mask, softcap, bias, shape):
    """``attention`` over the new keys alone (no cache slots), causally: ``mask`` and the
    causal mask together. The queries go in blocks of ``QUERY_BLOCK``, each over the keys
    up to its end (what the causal mask lets it see), with the same scores, mask and
    softmax as the whole."""
    b, nk, g, t, hd = shape
    q5 = qf.reshape(b, nk, g, t, hd)
    mask = mask & jnp.tril(jnp.ones((t, t), bool))[None]
    outs = []
    for lo in range(0, t, QUERY_BLOCK):
        hi = min(lo + QUERY_BLOCK, t)  # queries [lo, hi) see keys [0, hi)
        sc = jnp.einsum("bkgqh,bknh->bkgqn", q5[:, :, :, lo:hi], k_new[:, :, :hi],
                        ).astype(jnp.float32)
        if softcap is not None:
            sc = softcap * jnp.tanh(sc / softcap)
        if bias is not None:
            sc = sc + jnp.broadcast_to(bias, (b, nk, g, t, t))[:, :, :, lo:hi, :hi]
        sc = jnp.where(mask[:, None, None, lo:hi, :hi], sc, jnp.finfo(jnp.float32).min)
        p = jax.nn.softmax(sc, axis=-1).astype(v_new.dtype)
        outs.append(jnp.einsum("bkgqn,bknh->bkgqh", p, v_new[:, :, :hi],
                               preferred_element_type=jnp.float32))
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=3)


def attention(q, k_new, v_new, k_cache, v_cache, length, mask, visible=None, *,
               scale: float | None = None, softcap: float | None = None, bias=None):
    """Grouped-query attention of new tokens over the committed cache and each other.

    q: [B,K,G,T,H]; k_new, v_new: [B,K,T,H]; k_cache: [B,K,H,S]; v_cache: [B,K,S,H]; length: [B];
    mask: [B,T,T]. Query ``i`` sees cache slots ``< length`` (or, if given, the slots ``s``
    with ``visible[b, i, s]``, [B,1,S] or [B,T,S]) and new keys ``j`` with ``mask[b, i, j]``.
    A cache of capacity 0 (S = 0) leaves the new tokens alone, causally (``mask`` and the
    causal mask together): a forward that keeps no cache (``text_corpus``'s feature pass).
    Scores are scaled by ``scale`` (default ``H ** -0.5``) and, with ``softcap``, squashed
    to ``softcap * tanh(score / softcap)`` before masking (Gemma 2). ``bias`` is an optional
    pair of additive score biases ``(over cache slots, over new keys)``, broadcastable to
    [B,K,G,T,S] and [B,K,G,T,T] (T5's relative positions). Returns [B,K,G,T,H].
    The cache is only read here, and written after, so XLA can update it in place inside a
    decode loop. New keys and values are rounded to the cache's dtype first: a token that
    sees another new token then reads exactly what it would read from the cache had that
    token been decoded one step earlier (with a bfloat16 cache, the full-precision keys
    made a verification forward differ from one-token decoding by about 1 % of a logit).
    """
    k_new, v_new = k_new.astype(k_cache.dtype), v_new.astype(v_cache.dtype)
    b, nk, g, t, hd = q.shape
    s = k_cache.shape[3]
    scale = 1 / math.sqrt(hd) if scale is None else scale
    qf = q.reshape(b, nk, g * t, hd) * jnp.asarray(scale, q.dtype)
    if s == 0:  # a cache of capacity 0: the new tokens alone (a teacher-forced forward)
        return _new_only(qf, k_new, v_new, mask, softcap, None if bias is None else bias[1],
                         (b, nk, g, t, hd))
    # b batch, k kv-head, s cache slot, n new key, q = (g query heads per kv-head, t query), h head dim
    old = jnp.einsum("bkqh,bkhs->bkqs", qf, k_cache).astype(jnp.float32).reshape(b, nk, g, t, s)
    new = jnp.einsum("bkqh,bknh->bkqn", qf, k_new).astype(jnp.float32).reshape(b, nk, g, t, t)
    if softcap is not None:
        old, new = (softcap * jnp.tanh(x / softcap) for x in (old, new))
    if bias is not None:
        old, new = old + bias[0], new + bias[1]
    if visible is None:
        visible = (jnp.arange(s)[None, :] < length[:, None])[:, None, :]  # [B,1,S]
    neg = jnp.finfo(jnp.float32).min
    old = jnp.where(visible[:, None, None], old, neg)
    new = jnp.where(mask[:, None, None], new, neg)
    # one softmax over [cache slots, new keys], without concatenating the two score blocks
    top = jnp.maximum(old.max(-1, keepdims=True), new.max(-1, keepdims=True))
    e_old, e_new = jnp.exp(old - top), jnp.exp(new - top)
    inv = 1.0 / (e_old.sum(-1, keepdims=True) + e_new.sum(-1, keepdims=True))
    p_old = (e_old * inv).astype(v_cache.dtype).reshape(b, nk, g * t, s)
    p_new = (e_new * inv).astype(v_cache.dtype).reshape(b, nk, g * t, t)
    f32 = jnp.float32
    out = (jnp.einsum("bkqs,bksh->bkqh", p_old, v_cache, preferred_element_type=f32)
           + jnp.einsum("bkqn,bknh->bkqh", p_new, v_new, preferred_element_type=f32))
    return out.reshape(b, nk, g, t, hd)


def rope_attention(lp: Params, h: Float[Array, "D B T"], nq: int, nk: int, hd: int,
                   positions, inv_freq, k_cache, v_cache, length, mask, visible=None, *,
                   qk_norm=None, scale: float | None = None, softcap: float | None = None):
    """The self-attention of a RoPE layer (Llama's, Gemma's) over its normed input ``h``:
    projections (``qkv_heads``), ``qk_norm(heads, gain)`` of queries and keys with the
    gains ``q_norm``/``k_norm`` when given, RoPE at ``positions``, ``attention`` (with its
    ``visible``, ``scale`` and ``softcap``) and the output projection ``o``, unbiased.
    Returns ``(out [D, B, T], k [B, K, H, T], v [B, K, T, H])``: the new keys and values in
    the cache's layouts, read here but not written."""
    _, b, t = h.shape
    q, k, v = qkv_heads(lp, h, nq, nk, hd)  # [N,H,B,T], biased where the layer has biases
    if qk_norm is not None:
        q, k = qk_norm(q, lp["q_norm"]), qk_norm(k, lp["k_norm"])
    q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
    q = q.reshape(nk, nq // nk, hd, b, t).transpose(3, 0, 1, 4, 2)  # [B,K,G,T,H]
    v = v.transpose(2, 0, 3, 1)  # [B,K,T,H]
    att = attention(q, k.transpose(2, 0, 3, 1), v, k_cache, v_cache, length, mask, visible,
                    scale=scale, softcap=softcap)
    out = dense(lp["o"], att.transpose(1, 2, 4, 0, 3).reshape(nq * hd, b, t))
    return out, k.transpose(2, 0, 1, 3), v


def qkv_heads(lp: Params, h: Float[Array, "D B T"], nq: int, nk: int, hd: int):
    """Queries, keys and values ``[N, H, B, T]`` (float32) of a layer whose weights are fused
    (``qkv``, the single-device layout) or split (``q``, ``k``, ``v``: the layout
    ``specjax.sharding`` shards by heads). Both give the same numbers.

    Projection biases (Qwen2's q/k/v biases) are added when the layer has them: fused
    ``qkv_b`` ``[(Nq + 2 Nkv) * H]`` beside ``qkv``, or split ``q_b`` ``[Nq * H]``, ``k_b``,
    ``v_b`` ``[Nkv * H]`` beside ``q``, ``k``, ``v``; a layer without them is unbiased."""
    _, b, t = h.shape
    if "qkv" in lp:
        qkv = _biased(dense(lp["qkv"], h), lp.get("qkv_b")).reshape(nq + 2 * nk, hd, b, t)
        return jnp.split(qkv, [nq, nq + nk], axis=0)
    return tuple(_biased(dense(lp[n], h), lp.get(n + "_b")).reshape(c, hd, b, t)
                 for n, c in (("q", nq), ("k", nk), ("v", nk)))


def _biased(y: Float[Array, "O B T"], bias: Float[Array, "O"] | None) -> Float[Array, "O B T"]:
    """``y`` plus a per-row ``bias`` (added in float32, as the product accumulates); ``y``
    itself without one."""
    return y if bias is None else y + bias.astype(jnp.float32)[:, None, None]


def head_norm(x: Float[Array, "N H B T"], weight: Float[Array, "H"], eps: float
              ) -> Float[Array, "N H B T"]:
    """RMSNorm of every head of feature-major queries or keys over its ``H`` features, with
    one gain ``weight`` shared by the heads (Qwen3's ``q_norm``/``k_norm``, applied before
    RoPE): float32 statistics, cast back before the gain, as ``rms_norm``."""
    xf = x.astype(jnp.float32)
    xf = xf * lax.rsqrt(jnp.mean(xf * xf, axis=1, keepdims=True) + eps)
    return weight.reshape(1, -1, 1, 1) * xf.astype(x.dtype)


def gate_up(lp: Params, h: Float[Array, "D B T"], f: int):
    """The MLP's gate and up projections ``[F, B, T]``, from fused (``gate_up``) or split
    (``gate``, ``up``) weights."""
    if "gate_up" in lp:
        return jnp.split(dense(lp["gate_up"], h), [f], axis=0)
    return dense(lp["gate"], h), dense(lp["up"], h)


def head_logits(head: Float[Array, "V D"], h: Float[Array, "... D"]) -> Float[Array, "... V"]:
    """``h @ head.T`` as float32 logits (accumulated in float32 for bfloat16 weights too),
    computed weights-left (``project``): ``h`` is cast to ``head``'s dtype.

    The barrier keeps XLA from folding the final transpose into the product's output
    layout, which made an 8-column LM head cost twice as much on XLA:CPU."""
    lead = h.shape[:-1]
    flat = h.reshape(-1, h.shape[-1]).astype(head.dtype)
    out = lax.optimization_barrier(project(head, flat.T)).T  # [N, V]
    return out.reshape(*lead, head.shape[0]).astype(jnp.float32)


__all__ = ["fast_width", "project", "dense", "apply_rope", "rms_norm", "attention",
           "rope_attention", "qkv_heads", "head_norm", "gate_up", "head_logits"]
