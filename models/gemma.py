"""Gemma-family decoder (Gemma 3 text models; Gemma 2's soft-capping) as pure JAX functions.

The forward every port shares (``DecoderParts.forward``, ``specjax.models.decoder``) over
Gemma's layer, with Llama's cache and weights-left layout; what differs is Gemma's:

* RMSNorm multiplies by its gain in float32 before casting back; gains are stored as the
  multiplier itself (HF's ``1 + w``; GGUF files already store ``1 + w``);
* sandwich norms: each block's input and output are normalized;
* QK-norm (Gemma 3): per-head RMSNorm of queries and keys, before RoPE;
* local layers attend over a sliding window (a query at position ``p`` sees keys ``k`` with
  ``p - window < k <= p``) and rotate with their own RoPE base;
* the embedding is scaled by ``sqrt(hidden_size)`` (rounded to the weight dtype);
* GeGLU (tanh-approximated GELU); queries scaled by ``query_pre_attn_scalar ** -0.5``;
* optional soft-capping of attention scores and final logits (Gemma 2).

The KV cache keeps every position: slot ``s`` holds position ``s``, and windows are masks.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, Mapping

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Bool, Float, Int

from specjax.models.base import DECODER_PARTITIONING
from specjax.models.decoder import Block, DecoderParts
from specjax.models.kv_cache import KVCache
from specjax.models.llama import RopeScaling, rope_inv_freq, stacked_layers
from specjax.models.ops import dense, gate_up, rope_attention

Params = Mapping[str, Any]
SLIDING, FULL = "sliding", "full"


@dataclasses.dataclass(frozen=True)
class GemmaConfig:
    """Architecture of one Gemma-family model size. ``layer_types[i]`` is ``"sliding"``
    (local: window ``sliding_window``, RoPE base ``rope_local_theta``) or ``"full"``
    (global: RoPE base ``rope_theta`` with ``rope_scaling``)."""

    partitioning: ClassVar = DECODER_PARTITIONING  # its weights' logical axes (sharding)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    sliding_window: int = 512
    rope_theta: float = 1_000_000.0
    rope_local_theta: float = 10_000.0
    rope_scaling: RopeScaling = RopeScaling()
    query_pre_attn_scalar: float = 256.0
    qk_norm: bool = True
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = True
    max_position_embeddings: int = 32768

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if len(self.layer_types) != self.num_layers or \
                set(self.layer_types) - {SLIDING, FULL}:
            raise ValueError(f"layer_types must name {self.num_layers} layers, each "
                             f"{SLIDING!r} or {FULL!r}; got {self.layer_types}")
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")


def gemma3_layer_types(num_layers: int, pattern: int = 6) -> tuple[str, ...]:
    """Gemma 3's layout: every ``pattern``-th layer global, the others local."""
    return tuple(FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers))


GEMMA3_270M = GemmaConfig(
    vocab_size=262144, hidden_size=640, intermediate_size=2048, num_layers=18, num_heads=4,
    num_kv_heads=1, head_dim=256, layer_types=gemma3_layer_types(18), sliding_window=512,
    rope_theta=1_000_000.0, rope_local_theta=10_000.0, query_pre_attn_scalar=256.0)


def rms_norm(x: Array, gain: Array, eps: float, axis: int = -1) -> Array:
    """Gemma's RMSNorm over ``axis``: normalized and multiplied by ``gain`` in float32, then
    cast back to ``x``'s dtype. ``gain`` is the multiplier (HF's ``1 + weight``)."""
    xf = x.astype(jnp.float32)
    xf = xf * lax.rsqrt(jnp.mean(xf * xf, axis=axis, keepdims=True) + eps)
    axis = axis % x.ndim
    shape = [1] * x.ndim
    shape[axis] = -1
    return (xf * gain.astype(jnp.float32).reshape(shape)).astype(x.dtype)


def _inv_freqs(cfg: GemmaConfig) -> dict[str, Array]:
    """RoPE inverse frequencies per layer type."""
    return {FULL: rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling),
            SLIDING: rope_inv_freq(cfg.head_dim, cfg.rope_local_theta)}


def _window_masks(cfg: GemmaConfig, length, mask, positions, capacity: int):
    """``(visible [B,T,S], mask [B,T,T])`` of a sliding layer: the committed slots and the
    new keys whose positions lie within the window of each query's position."""
    lo = positions - cfg.sliding_window  # a key at position k is seen iff k > p - window
    slots = jnp.arange(capacity)[None, None, :]
    visible = (slots < length[:, None, None]) & (slots > lo[:, :, None])
    return visible, mask & (positions[:, None, :] > lo[:, :, None])


def _block(cfg: GemmaConfig, lp: Params, x: Float[Array, "D B T"], k_cache, v_cache,
           length, mask, positions, inv_freq, visible=None):
    """One decoder layer over a feature-major residual stream ``x`` ([D, B, T]), which reads
    the cache only: the new stream and the new tokens' keys ``[B, K, H, T]`` and values
    ``[B, K, T, H]`` (a ``decoder.Block``'s, for ``run_layers`` to write)."""
    eps = cfg.rms_norm_eps
    h = rms_norm(x, lp["attn_norm"], eps, axis=0)
    qk_norm = (lambda y, gain: rms_norm(y, gain, eps, axis=1)) if cfg.qk_norm else None
    o, k, v = rope_attention(lp, h, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, positions,
                             inv_freq, k_cache, v_cache, length, mask, visible, qk_norm=qk_norm,
                             scale=cfg.query_pre_attn_scalar ** -0.5,
                             softcap=cfg.attn_logit_softcapping)
    x = x + rms_norm(o, lp["post_attn_norm"], eps, axis=0)
    h = rms_norm(x, lp["mlp_norm"], eps, axis=0)
    gate, up = gate_up(lp, h, cfg.intermediate_size)
    y = dense(lp["down"], jax.nn.gelu(gate, approximate=True) * up)
    x = x + rms_norm(y, lp["post_mlp_norm"], eps, axis=0)
    return x, k, v


@dataclasses.dataclass(frozen=True)
class Gemma(DecoderParts):
    """A Gemma-family model bound to its configuration. Hashable, so it can be static.
    Follows the contract ``specjax.models.Model``, like ``Llama``; its forward is
    ``DecoderParts.forward``, with sliding windows in the local layers (``layer_block``)."""

    config: GemmaConfig
    compute_dtype: Any = jnp.float32

    def embed(self, params: Params, tokens: Int[Array, "B T"]) -> Float[Array, "B T D"]:
        """Token embeddings scaled by ``sqrt(hidden_size)`` (the scale rounded to the
        weight dtype, as the reference does)."""
        e = params["embed"]
        return e[tokens] * jnp.asarray(math.sqrt(self.config.hidden_size), e.dtype)

    def final_norm(self, params: Params, hidden: Float[Array, "... D"]) -> Float[Array, "... D"]:
        """The final norm: what the LM head reads."""
        return rms_norm(hidden, params["final_norm"], self.config.rms_norm_eps)

    def logit_transform(self, logits: Float[Array, "... V"]) -> Float[Array, "... V"]:
        """Gemma 2's final soft-cap, ``cap * tanh(logits / cap)``; none for Gemma 3."""
        cap = self.config.final_logit_softcapping
        return logits if cap is None else cap * jnp.tanh(logits / cap)

    def layer_block(self, params: Params, cache: KVCache, mask: Bool[Array, "B T T"],
                    positions: Int[Array, "B T"], n: int) -> Block:
        """``_block`` for ``DecoderParts.forward``, by layer type: a global layer sees the
        committed slots and ``mask`` and rotates with ``rope_theta``; a local one, at query
        position ``p``, also only keys at positions ``> p - sliding_window`` and rotates
        with ``rope_local_theta``. ``ValueError`` for stacked weights (the layer types
        differ, so the layers run unrolled)."""
        if stacked_layers(params["layers"]):
            raise ValueError("Gemma runs its layers unrolled (its local and global layers "
                             "differ): give per-layer weights, llama.unstack_layers(params)")
        cfg, length = self.config, cache.length
        inv = _inv_freqs(cfg)
        masks = {FULL: (None, mask)}  # layer type -> (visible slots, mask of the new keys)
        if SLIDING in cfg.layer_types[:n]:
            masks[SLIDING] = _window_masks(cfg, length, mask, positions, cache.capacity)

        def block(i, lp, x, k, v):
            kind = cfg.layer_types[i]
            vis, m = masks[kind]
            return _block(cfg, lp, x, k, v, length, m, positions, inv[kind], vis)
        return block


def layer_shapes(cfg: GemmaConfig) -> dict[str, tuple[int, ...]]:
    """Shape of each weight of one decoder layer, all ``[out, in]``; ``qkv`` and ``gate_up``
    stacked as in ``specjax.models.llama.layer_shapes``."""
    d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    shapes = {"attn_norm": (d,), "qkv": ((cfg.num_heads + 2 * cfg.num_kv_heads) * hd, d),
              "o": (d, cfg.num_heads * hd), "post_attn_norm": (d,), "mlp_norm": (d,),
              "gate_up": (2 * f, d), "down": (d, f), "post_mlp_norm": (d,)}
    if cfg.qk_norm:
        shapes.update(q_norm=(hd,), k_norm=(hd,))
    return shapes


def init_params(cfg: GemmaConfig, key: Array, dtype=jnp.float32) -> Params:
    """Random parameters with the right shapes (for tests and toy models)."""
    d = cfg.hidden_size
    keys = jax.random.split(key, cfg.num_layers + 2)
    layers = []
    for lk in keys[: cfg.num_layers]:
        shapes = layer_shapes(cfg)
        ws = {n: (jax.random.normal(k, s) * (0.1 if n.endswith("norm") else 0.05) +
                  (1.0 if n.endswith("norm") else 0.0)).astype(dtype)
              for (n, s), k in zip(shapes.items(), jax.random.split(lk, len(shapes)))}
        layers.append(ws)
    params = {"embed": (jax.random.normal(keys[-2], (cfg.vocab_size, d)) * 0.05).astype(dtype),
              "layers": layers, "final_norm": jnp.ones((d,), dtype)}
    if not cfg.tie_embeddings:
        params["lm_head"] = (jax.random.normal(keys[-1], (cfg.vocab_size, d)) * 0.05).astype(dtype)
    return params
