"""Llama-family decoder (SmolLM2, Llama 2/3.x, Qwen2/2.5, Qwen3, Mistral-style GQA) as pure
JAX functions. Qwen2 adds q/k/v projection biases (``LlamaConfig.attention_bias``), Qwen3
a per-head RMSNorm of queries and keys before RoPE (``LlamaConfig.qk_norm``).

The parameters are a plain pytree with one dict of weights per layer, and the layers are
unrolled: on CPU, XLA copies each layer's weights out of a stacked array inside ``lax.scan``
before its matmuls, which measured twice as slow per token for SmolLM2-135M (see
docs/design.md). An early exit after layer ``l`` runs the first ``l`` layer dicts. The
forward is the one every port shares (``specjax.models.decoder``: ``DecoderParts.forward``
states the model contract); this module gives it the layer, ``_block``.

``Llama(config, scan_layers=True)`` is MaxText's and the gemma library's layout:
``params["layers"]`` is one dict of arrays with a leading layer axis (``stack_layers``),
the KV cache is stacked the same way, and a forward is one ``lax.scan`` over the layers, so
it compiles one layer body instead of ``num_layers``. It decoded Llama-3.1-8B's shape 2.9x
slower per token than unrolled layers on an H200 (docs/device_check_h200.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Mapping

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from specjax.models import kv_cache
from specjax.models.ops import (apply_rope, attention, dense, fast_width, gate_up,  # noqa: F401
                                head_logits, head_norm, project, qkv_heads, rms_norm,
                                rope_attention)
from specjax.models.base import DECODER_PARTITIONING, RopeScaling  # RopeScaling: re-exported
from specjax.models.decoder import Block, DecoderParts  # DecoderParts: re-exported
from specjax.models.kv_cache import KVCache

Params = Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Architecture of one Llama-family model size.

    ``attention_bias``: the q, k and v projections have biases (Qwen2/2.5; Llama and Qwen3
    with ``attention_bias`` in their config.json), kept per layer as ``qkv_b`` (fused) or
    ``q_b``, ``k_b``, ``v_b`` (split). ``o_bias``: the output projection has one too (``o_b``
    ``[D]``: Llama's and Qwen3's ``attention_bias`` biases all four, Qwen2 never ``o``).
    ``qk_norm``: queries and keys get a per-head RMSNorm over ``head_dim`` before RoPE, with
    gains ``q_norm`` and ``k_norm`` ``[head_dim]`` and epsilon ``rms_norm_eps`` (Qwen3).
    """

    partitioning: ClassVar = DECODER_PARTITIONING  # its weights' logical axes (sharding)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = True
    max_position_embeddings: int = 8192
    attention_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")


SMOLLM2_135M = LlamaConfig(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
    num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5,
    tie_embeddings=True, max_position_embeddings=8192)


def rope_inv_freq(head_dim: int, theta: float,
                  s: RopeScaling = RopeScaling()) -> Float[Array, "H2"]:
    """Inverse frequencies of the rotary embedding with base ``theta``, after scaling
    (``RopeScaling.inv_freq``)."""
    return s.inv_freq(head_dim, theta)


def _layer(cfg: LlamaConfig, lp: Params, x: Float[Array, "D B T"], k_cache, v_cache, length,
           mask, positions, visible=None):
    """One decoder layer over a feature-major residual stream ``x`` ([D, B, T]); returns the
    new stream and this layer's K/V cache.

    New K/V are written at slot ``length``; ``visible`` ([B,T,S]) replaces the default
    cache visibility (slots ``< length``), which lets a draft tree see its ancestors' scratch
    entries. Every weight is ``[out, in]`` and the left operand of its product (``project``)."""
    x, k, v = _block(cfg, lp, x, k_cache, v_cache, length, mask, positions, visible)
    return (x, kv_cache.write(k_cache, length, k, axis=3),
            kv_cache.write(v_cache, length, v, axis=2))


def _block(cfg: LlamaConfig, lp: Params, x: Float[Array, "D B T"], k_cache, v_cache, length,
           mask, positions, visible=None):
    """``_layer`` without the cache write: the new stream and the new tokens' keys
    ``[B, K, H, T]`` and values ``[B, K, T, H]`` (the cache's layouts), for the caller to
    write (per layer, or into a stacked cache).

    The layer's optional weights are used where ``lp`` has them (``check_layer_keys``
    says whether they match a ``LlamaConfig``): q/k/v biases (``qkv_b`` or ``q_b``,
    ``k_b``, ``v_b``, inside ``qkv_heads``), ``o_b`` after the output projection, and
    ``q_norm``/``k_norm`` per-head norms of queries and keys before RoPE."""
    eps = cfg.rms_norm_eps
    inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    h = rms_norm(x, lp["attn_norm"], eps, axis=0)
    qk_norm = (lambda y, gain: head_norm(y, gain, eps)) if "q_norm" in lp else None  # Qwen3
    o, k, v = rope_attention(lp, h, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, positions,
                             inv_freq, k_cache, v_cache, length, mask, visible, qk_norm=qk_norm)
    x = x + (o if "o_b" not in lp else o + lp["o_b"].astype(jnp.float32)[:, None, None])
    h = rms_norm(x, lp["mlp_norm"], eps, axis=0)
    gate, up = gate_up(lp, h, cfg.intermediate_size)
    x = x + dense(lp["down"], jax.nn.silu(gate) * up)
    return x, k, v


def check_layer_keys(cfg: LlamaConfig, lp: Params) -> None:
    """``ValueError`` unless one layer's weights carry exactly the extras ``cfg`` asks for:
    q/k/v biases (``qkv_b``, or ``q_b``/``k_b``/``v_b``) iff ``attention_bias``, ``o_b`` iff
    ``o_bias``, ``q_norm`` and ``k_norm`` iff ``qk_norm``. Runs at trace time (key checks
    only), so a config and weights that disagree fail instead of computing another model."""
    variants = {"attention_bias": (("qkv_b",), ("q_b", "k_b", "v_b")), "o_bias": (("o_b",),),
                "qk_norm": (("q_norm", "k_norm"),)}
    for field, layouts in variants.items():
        want = getattr(cfg, field)
        present = {n for names in layouts for n in names if n in lp}
        ok = any(present == set(names) for names in layouts) if want else not present
        if not ok:
            raise ValueError(f"LlamaConfig.{field}={want}, but the layer's weights carry "
                             f"{sorted(present) or 'none'} of its tensors "
                             f"({' or '.join('+'.join(n) for n in layouts)})")


def layer(cfg: LlamaConfig, lp: Params, x: Float[Array, "B T D"], k_cache, v_cache, length,
          mask, positions, visible=None):
    """``_layer`` on a batch-major ``[B, T, D]`` stream (for draft heads built on one layer)."""
    y, k_cache, v_cache = _layer(cfg, lp, x.transpose(2, 0, 1), k_cache, v_cache, length, mask,
                                 positions, visible)
    return y.transpose(1, 2, 0), k_cache, v_cache


@dataclasses.dataclass(frozen=True)
class Llama(DecoderParts):
    """A Llama-family model bound to its configuration. Hashable, so it can be static.

    ``scan_layers``: run the layers under one ``lax.scan`` over stacked weights
    (``stack_layers(params)``) and a stacked KV cache (``init_cache``), which compiles one
    layer body, not ``num_layers`` (the layout accelerators want). The default unrolls
    per-layer dicts, which measured twice as fast per token on XLA:CPU. Both compute the
    same numbers (``tests/test_scan.py``)."""

    config: LlamaConfig
    compute_dtype: Any = jnp.float32
    scan_layers: bool = False

    def embed(self, params: Params, tokens: Int[Array, "B T"]) -> Float[Array, "B T D"]:
        """The input embeddings of ``tokens``."""
        return params["embed"][tokens]

    def final_norm(self, params: Params, hidden: Float[Array, "... D"]) -> Float[Array, "... D"]:
        """The final norm: what the LM head reads (EAGLE's feature)."""
        return rms_norm(hidden, params["final_norm"], self.config.rms_norm_eps)

    def layer_block(self, params: Params, cache: KVCache, mask: Bool[Array, "B T T"],
                    positions: Int[Array, "B T"], n: int) -> Block:
        """``_block`` against ``cache``'s committed slots, for ``DecoderParts.forward``.
        ``ValueError`` first unless the weights and cache are laid out as ``scan_layers``
        says (``check_layout``) and each layer that runs carries exactly the config's
        extras (``check_layer_keys``)."""
        cfg, layers, length = self.config, params["layers"], cache.length
        check_layout(params, cache, self.scan_layers)
        for lp in ([layers] if self.scan_layers else [layers[i] for i in range(n)]):
            check_layer_keys(cfg, lp)
        return lambda i, lp, x, k, v: _block(cfg, lp, x, k, v, length, mask, positions)


def stacked_layers(layers: Any) -> bool:
    """Whether ``params["layers"]`` holds stacked weights (a dict of ``[L, ...]`` arrays)
    rather than per-layer dicts: a list, or a dict keyed by layer index, as
    ``nnx.to_pure_dict`` writes a list."""
    return isinstance(layers, Mapping) and not all(isinstance(k, int) for k in layers)


def check_layout(params: Params, cache: KVCache, scan_layers: bool) -> None:
    """``ValueError`` unless the weights and the cache are laid out as the model runs them:
    stacked (a dict of ``[L, ...]`` arrays, a stacked cache) for ``scan_layers``, per-layer
    (a list of dicts, per-layer cache arrays) otherwise."""
    stacked = stacked_layers(params["layers"])
    if stacked != scan_layers:
        raise ValueError(
            "the model runs its layers " + ("under lax.scan (scan_layers=True) and needs "
            "stacked weights: stack_layers(params)" if scan_layers else "unrolled "
            "(scan_layers=False) and needs a list of layer dicts: unstack_layers(params)"))
    if cache.stacked != scan_layers:
        raise ValueError(f"the KV cache is {'stacked' if cache.stacked else 'per layer'}, but "
                         f"the model has scan_layers={scan_layers}: build it with the "
                         f"model's init_cache")


def stack_layers(params: Params) -> Params:
    """``params`` with ``"layers"`` as one dict of arrays with a leading layer axis (what
    ``scan_layers=True`` runs), from a list of per-layer dicts. Idempotent."""
    layers = params["layers"]
    if stacked_layers(layers):
        return params
    if isinstance(layers, Mapping):  # keyed by layer index
        layers = [layers[i] for i in range(len(layers))]
    return {**params, "layers": jax.tree.map(lambda *a: jnp.stack(a), *layers)}


def unstack_layers(params: Params) -> Params:
    """The inverse of ``stack_layers``: ``"layers"`` as a list of per-layer dicts."""
    layers = params["layers"]
    if not stacked_layers(layers):
        return params
    n = len(next(iter(jax.tree.leaves(layers))))
    return {**params, "layers": [jax.tree.map(lambda a: a[i], layers) for i in range(n)]}


def init_params(cfg: LlamaConfig, key: Array, dtype=jnp.float32) -> Params:
    """Random parameters with the right shapes (for tests and toy models)."""
    d = cfg.hidden_size
    keys = jax.random.split(key, cfg.num_layers + 2)
    layers = []
    for lk in keys[: cfg.num_layers]:
        shapes = layer_shapes(cfg)
        ws = {n: (jax.random.normal(k, s) * 0.05).astype(dtype)
              for (n, s), k in zip(shapes.items(), jax.random.split(lk, len(shapes)))}
        for norm in ("attn_norm", "mlp_norm", "q_norm", "k_norm"):
            if norm in ws:
                ws[norm] = ws[norm] + 1
        layers.append(ws)
    params = {"embed": (jax.random.normal(keys[-2], (cfg.vocab_size, d)) * 0.05).astype(dtype),
              "layers": layers, "final_norm": jnp.ones((d,), dtype)}
    if not cfg.tie_embeddings:
        params["lm_head"] = (jax.random.normal(keys[-1], (cfg.vocab_size, d)) * 0.05).astype(dtype)
    return params


def layer_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Shape of each weight of one decoder layer, all ``[out, in]`` (torch's layout).

    ``qkv`` is [(Nq + 2 Nkv) * H, D]: the Q, K and V projections stacked, each head's rows
    in HF's half-split RoPE order. ``gate_up`` is [2F, D], gate first. Weights are the left
    operand of every product, the layout XLA:CPU multiplies fastest at 1-32 columns
    (docs/design.md). With ``attention_bias``, ``qkv_b`` [(Nq + 2 Nkv) * H] holds the
    Q, K and V biases in ``qkv``'s row order; with ``o_bias``, ``o_b`` [D]; with
    ``qk_norm``, ``q_norm`` and ``k_norm`` [H] are the per-head gains.
    """
    d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    n_qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * hd
    shapes = {
        "attn_norm": (d,), "qkv": (n_qkv, d),
        "o": (d, cfg.num_heads * hd), "mlp_norm": (d,), "gate_up": (2 * f, d), "down": (d, f),
    }
    if cfg.attention_bias:
        shapes["qkv_b"] = (n_qkv,)
    if cfg.o_bias:
        shapes["o_b"] = (d,)
    if cfg.qk_norm:
        shapes.update(q_norm=(hd,), k_norm=(hd,))
    return shapes


def top_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Shape of each weight outside the decoder layers."""
    shapes = {"embed": (cfg.vocab_size, cfg.hidden_size), "final_norm": (cfg.hidden_size,)}
    if not cfg.tie_embeddings:
        shapes["lm_head"] = (cfg.vocab_size, cfg.hidden_size)
    return shapes
