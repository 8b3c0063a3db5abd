"""T5 encoder-decoder (original T5, T5 v1.1, Flan-T5) as pure JAX functions.

The decoder follows the decoder-only model contract, with the forward every port shares
(``DecoderParts.forward``): the loops, drafters and verifiers of specjax run on it
unchanged. What the decoder reads from the source lives in its parameters: ``T5.encode``
runs the encoder once per batch of sources and computes every decoder layer's
cross-attention keys and values, and ``bind`` adds them to the weights. The decoder's
self-attention cache is an ordinary ``KVCache`` with the same commit contract as every
other model.

Architecture (HF ``T5ForConditionalGeneration``):

* RMS layer norm without bias or mean; pre-norm residual blocks; no dropout at inference;
* no absolute positions: a learned bias per (relative-position bucket, head) is added to the
  attention scores, bidirectional in the encoder and causal in the decoder, and shared by all
  layers of a stack; cross-attention has none;
* attention scores are not scaled by ``head_dim ** -0.5``;
* feed-forward: ReLU (original T5) or gated GELU with the tanh approximation (v1.1, Flan);
* the LM head is the shared embedding scaled by ``d_model ** -0.5`` (original T5) or an
  untied matrix (v1.1, Flan).

The decoder's relative bias is computed from each new token's own position
(``positions``), not from its index in the forward: siblings of a draft tree at equal depth
get equal bias, as the equivalent chains would.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, Mapping

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Bool, Float, Int

from specjax import sharding
from specjax.models.base import DECODER_PARTITIONING
from specjax.models.decoder import Block, DecoderParts
from specjax.models.kv_cache import KVCache
from specjax.models.llama import RopeScaling
from specjax.models.ops import attention, dense, qkv_heads, rms_norm

Params = Mapping[str, Any]


def _t5_fused(cfg) -> dict:
    fused = {"cross_kv": (("cross_k", "cross_v"), [cfg.num_heads * cfg.head_dim])}
    if cfg.gated:  # T5 v1.1 / Flan: wi = [gate; up]
        fused["wi"] = (("gate", "up"), [cfg.intermediate_size])
    return fused


# the decoder layer's, plus cross-attention (split by heads as self-attention is) and the
# plain T5 MLP (``wi`` rows, ``wo`` columns); relative-bias tables stay whole
_H, _M = sharding.HEADS, sharding.MLP
T5_PARTITIONING = DECODER_PARTITIONING.extend(
    {"cross_q": (_H, None), "cross_k": (_H, None), "cross_v": (_H, None),
     "cross_o": (None, _H), "wi": (_M, None), "wo": (None, _M)}, _t5_fused)


@dataclasses.dataclass(frozen=True)
class T5Config:
    """Architecture of one T5 size. ``num_layers`` counts decoder layers (what the decoding
    loops and early exits see); ``num_encoder_layers`` the encoder's."""

    partitioning: ClassVar = T5_PARTITIONING  # its weights' logical axes (sharding)
    vocab_size: int
    hidden_size: int  # d_model
    intermediate_size: int  # d_ff
    num_layers: int
    num_encoder_layers: int
    num_heads: int
    head_dim: int  # d_kv
    num_buckets: int = 32
    max_distance: int = 128
    gated: bool = True  # gated-gelu (v1.1, Flan) or plain (original T5)
    activation: str = "gelu_new"  # "relu" or "gelu_new" (tanh-approximated GELU)
    tie_embeddings: bool = False  # LM head = shared embedding
    scale_output: bool = False  # multiply the decoder output by d_model ** -0.5
    rms_norm_eps: float = 1e-6
    decoder_start_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 0
    max_position_embeddings: int = 2048  # decoder cache bound (relative positions: no limit)
    max_source_positions: int = 2048  # encoder input bound

    def __post_init__(self):
        if self.activation not in ("relu", "gelu_new"):
            raise ValueError(f"unsupported T5 activation {self.activation!r} (relu, gelu_new)")

    # the rest of the model contract (``specjax.models.ModelConfig``): one K/V head per
    # query head, and the RoPE numbers a draft head built on the decoder uses (T5 itself
    # has relative position biases, no RoPE)
    @property
    def num_kv_heads(self) -> int:
        return self.num_heads

    rope_theta = 10000.0
    rope_scaling = RopeScaling()


#: the layer shapes of public checkpoints (weights must come from a local directory)
T5_SMALL = T5Config(vocab_size=32128, hidden_size=512, intermediate_size=2048, num_layers=6,
                    num_encoder_layers=6, num_heads=8, head_dim=64, gated=False,
                    activation="relu", tie_embeddings=True, scale_output=True)
T5_V1_1_SMALL = T5Config(vocab_size=32128, hidden_size=512, intermediate_size=1024,
                         num_layers=8, num_encoder_layers=8, num_heads=6, head_dim=64)
FLAN_T5_BASE = T5Config(vocab_size=32128, hidden_size=768, intermediate_size=2048,
                        num_layers=12, num_encoder_layers=12, num_heads=12, head_dim=64)


@struct.dataclass
class EncodedSource:
    """What the decoder reads from a batch of sources, computed once by ``T5.encode``.

    Attributes:
      tokens: ``[B, S]`` source ids, ``-1`` after each row's length (the n-gram drafter
        copies from them);
      valid: ``[B, S]`` whether a slot holds a source token;
      k: one ``[B, H, Dh, S]`` cross-attention key array per decoder layer;
      v: one ``[B, H, S, Dh]`` cross-attention value array per decoder layer.
    """

    tokens: Int[Array, "B S"]
    valid: Bool[Array, "B S"]
    k: tuple[Array, ...]
    v: tuple[Array, ...]


def relative_bucket(rel: Int[Array, "..."], bidirectional: bool, num_buckets: int,
                    max_distance: int) -> Int[Array, "..."]:
    """T5's bucket of a relative position ``key - query``: exact below ``num_buckets / 4``
    (``/ 2`` when causal) and logarithmic up to ``max_distance``; causal buckets fold every
    future key into bucket 0."""
    rel = rel.astype(jnp.int32)
    n, out = num_buckets, jnp.zeros_like(rel)
    if bidirectional:
        n //= 2
        out = (rel > 0).astype(jnp.int32) * n
        rel = jnp.abs(rel)
    else:
        rel = -jnp.minimum(rel, 0)
    exact = n // 2
    scaled = (jnp.log(jnp.maximum(rel, 1).astype(jnp.float32) / exact)
              / math.log(max_distance / exact) * (n - exact))
    large = jnp.minimum(exact + scaled.astype(jnp.int32), n - 1)
    return out + jnp.where(rel < exact, rel, large)


def _bias(table: Float[Array, "NB H"], rel: Int[Array, "B T S"], cfg: T5Config,
          bidirectional: bool) -> Float[Array, "B H 1 T S"]:
    """Additive scores per head for relative positions ``rel``."""
    bucket = relative_bucket(rel, bidirectional, cfg.num_buckets, cfg.max_distance)
    return jnp.moveaxis(table[bucket], -1, 1)[:, :, None].astype(jnp.float32)


def _act(cfg: T5Config, x: Array) -> Array:
    return jax.nn.relu(x) if cfg.activation == "relu" else jax.nn.gelu(x, approximate=True)


def _ffn(cfg: T5Config, lp: Params, x: Float[Array, "D B T"]) -> Float[Array, "D B T"]:
    """The feed-forward sublayer with its residual (feature-major)."""
    h = rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps, axis=0)
    if not cfg.gated:
        a = _act(cfg, dense(lp["wi"], h))
    elif "wi" in lp:  # fused [2F, D], gate first (the single-device layout)
        gate, up = jnp.split(dense(lp["wi"], h), 2, axis=0)
        a = _act(cfg, gate) * up
    else:  # split ``gate``, ``up`` (the layout specjax.sharding shards by columns)
        a = _act(cfg, dense(lp["gate"], h)) * dense(lp["up"], h)
    return x + dense(lp["wo"], a)


def _self_qkv(cfg: T5Config, lp: Params, h: Float[Array, "D B T"]):
    """Self-attention queries, keys and values ``[B, N, T, Dh]`` from fused (``qkv``) or
    split (``q``, ``k``, ``v``) weights: ``llama.qkv_heads`` with a K/V head per query head."""
    n = cfg.num_heads
    return tuple(y.transpose(2, 0, 3, 1) for y in qkv_heads(lp, h, n, n, cfg.head_dim))


def _cross_kv(lp: Params, out: Float[Array, "D B S"]):
    """A decoder layer's cross-attention keys and values ``[H*Dh, B, S]`` of the encoder
    output, from fused (``cross_kv``) or split (``cross_k``, ``cross_v``) weights."""
    if "cross_kv" in lp:
        return jnp.split(dense(lp["cross_kv"], out), 2, axis=0)
    return dense(lp["cross_k"], out), dense(lp["cross_v"], out)


def _heads(x: Float[Array, "HD B T"], n: int) -> Float[Array, "B N T Dh"]:
    hd, b, t = x.shape
    return x.reshape(n, hd // n, b, t).transpose(2, 0, 3, 1)


def _merge(att: Float[Array, "B N T Dh"]) -> Float[Array, "HD B T"]:
    b, n, t, dh = att.shape
    return att.transpose(1, 3, 0, 2).reshape(n * dh, b, t)


def _dense_attention(q: Float[Array, "B N T Dh"], k: Float[Array, "B N Dh S"],
                     v: Float[Array, "B N S Dh"], visible: Bool[Array, "B T S"],
                     bias: Array | None = None) -> Float[Array, "B N T Dh"]:
    """Unscaled softmax attention over ``S`` keys (encoder and cross-attention)."""
    # b batch, n head, t query, s key, h head dim
    s = jnp.einsum("bnth,bnhs->bnts", q, k).astype(jnp.float32)
    if bias is not None:
        s = s + bias[:, :, 0]
    s = jnp.where(visible[:, None], s, jnp.finfo(jnp.float32).min)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    return jnp.einsum("bnts,bnsh->bnth", p, v)


@dataclasses.dataclass(frozen=True)
class T5(DecoderParts):
    """A T5 model bound to its configuration (hashable, so it can be static).

    ``params`` for ``forward`` (``DecoderParts.forward`` over the decoder's ``layer_block``)
    are the weights bound to a source (``bind``): the decoder cannot run without the
    encoder's output. ``encode`` needs the weights only.
    """

    config: T5Config
    compute_dtype: Any = jnp.float32
    is_encoder_decoder = True

    # ------------------------------------------------------------------ the encoder
    def encoder_output(self, params: Params, source: Int[Array, "B S"],
                       source_len: Int[Array, "B"]) -> Float[Array, "B S D"]:
        """The encoder's final-norm output over each row's first ``source_len`` tokens
        (bidirectional; slots past a row's length are attended by nothing)."""
        cfg, enc = self.config, params["encoder"]
        b, s = source.shape
        valid = jnp.arange(s)[None] < source_len[:, None]
        pos = jnp.arange(s)
        rel = jnp.broadcast_to(pos[None, :] - pos[:, None], (b, s, s))
        bias = _bias(enc["rel_bias"], rel, cfg, bidirectional=True)
        x = params["embed"][jnp.where(valid, source, 0)].transpose(2, 0, 1)  # [D,B,S]
        see = jnp.broadcast_to(valid[:, None, :], (b, s, s))
        for lp in map(self.compute, enc["layers"]):
            h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps, axis=0)
            q, k, v = _self_qkv(cfg, lp, h)
            att = _dense_attention(q, k.transpose(0, 1, 3, 2), v, see, bias)
            x = x + dense(lp["o"], _merge(att))
            x = _ffn(cfg, lp, x)
        return rms_norm(x, enc["final_norm"], cfg.rms_norm_eps, axis=0).transpose(1, 2, 0)

    def encode(self, params: Params, source: Int[Array, "B S"],
               source_len: Int[Array, "B"]) -> EncodedSource:
        """Runs the encoder once and computes every decoder layer's cross-attention keys
        and values: what the decoder reads of the source."""
        out = self.encoder_output(params, source, source_len).transpose(2, 0, 1)  # [D,B,S]
        valid = jnp.arange(source.shape[1])[None] < source_len[:, None]
        ks, vs = [], []
        for lp in map(self.compute, params["layers"]):
            k, v = _cross_kv(lp, out)
            ks.append(_heads(k, self.config.num_heads).transpose(0, 1, 3, 2))
            vs.append(_heads(v, self.config.num_heads))
        return EncodedSource(tokens=jnp.where(valid, source, -1).astype(jnp.int32), valid=valid,
                             k=tuple(ks), v=tuple(vs))

    @staticmethod
    def bind(params: Params, source: EncodedSource) -> dict:
        """The weights with an encoded source: what ``forward`` and every loop take."""
        return {**params, "source": source}

    def source_tokens(self, params: Params) -> Int[Array, "B S"] | None:
        """The bound source's ids (``-1`` past each row's end), or None for weights not
        bound to a source (``bind``)."""
        src = params.get("source") if isinstance(params, Mapping) else None
        return None if src is None else src.tokens

    # ------------------------------------------------------------------ the decoder
    def embed(self, params: Params, tokens: Int[Array, "B T"]) -> Float[Array, "B T D"]:
        """The decoder's input embeddings (the shared table, unscaled)."""
        return params["embed"][tokens]

    def final_norm(self, params: Params, hidden: Float[Array, "... D"]) -> Float[Array, "... D"]:
        """The decoder's final norm, times ``d_model ** -0.5`` for a tied head: exactly
        what the LM head reads."""
        h = rms_norm(hidden, params["final_norm"], self.config.rms_norm_eps)
        if self.config.scale_output:
            h = h * jnp.asarray(self.config.hidden_size ** -0.5, h.dtype)
        return h

    def layer_block(self, params: Params, cache: KVCache, mask: Bool[Array, "B T T"],
                    positions: Int[Array, "B T"], n: int) -> Block:
        """The decoder layer for ``DecoderParts.forward``: self-attention against the cache
        (unscaled, no RoPE) with the relative bias of each new token's position ``p`` to
        cache slot ``s`` (which holds position ``s``) and to new token ``j`` (at
        ``positions[b, j]``), then cross-attention to the bound source (``bind``: layer
        ``i`` reads ``params["source"]``'s ``k[i]``, ``v[i]``), then the feed-forward."""
        cfg, src, length = self.config, params["source"], cache.length
        b, t = positions.shape
        rel = lambda keys: _bias(params["rel_bias"], keys - positions[:, :, None], cfg, False)
        bias = (rel(jnp.arange(cache.capacity)[None, None, :]), rel(positions[:, None, :]))
        see_src = jnp.broadcast_to(src.valid[:, None, :], (b, t, src.valid.shape[1]))

        def block(i, lp, x, k_cache, v_cache):
            h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps, axis=0)
            q, k, v = _self_qkv(cfg, lp, h)
            att = attention(q[:, :, None], k, v, k_cache, v_cache, length, mask, scale=1.0,
                            bias=bias)[:, :, 0]
            x = x + dense(lp["o"], _merge(att))
            h = rms_norm(x, lp["cross_norm"], cfg.rms_norm_eps, axis=0)
            q = _heads(dense(lp["cross_q"], h), cfg.num_heads)
            x = x + dense(lp["cross_o"], _merge(_dense_attention(q, src.k[i], src.v[i],
                                                                 see_src)))
            return _ffn(cfg, lp, x), k.transpose(0, 1, 3, 2), v
        return block


def layer_shapes(cfg: T5Config, decoder: bool) -> dict[str, tuple[int, ...]]:
    """Shape of each weight of one layer, all ``[out, in]`` (torch's layout). ``qkv`` stacks
    Q, K and V; ``wi`` is ``[2F, D]`` (gate ``wi_0`` first) when gated, else ``[F, D]``."""
    d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim
    shapes = {"attn_norm": (d,), "qkv": (3 * hd, d), "o": (d, hd), "mlp_norm": (d,),
              "wi": ((2 if cfg.gated else 1) * f, d), "wo": (d, f)}
    if decoder:
        shapes.update(cross_norm=(d,), cross_q=(hd, d), cross_kv=(2 * hd, d), cross_o=(d, hd))
    return shapes


def init_params(cfg: T5Config, key: Array, dtype=jnp.float32) -> dict:
    """Random parameters with the right shapes (for tests and toy models)."""
    keys = iter(jax.random.split(key, cfg.num_layers + cfg.num_encoder_layers + 4))

    def layer(decoder):
        shapes = layer_shapes(cfg, decoder)
        ws = {n: (jax.random.normal(k, s) * 0.05).astype(dtype)
              for (n, s), k in zip(shapes.items(), jax.random.split(next(keys), len(shapes)))}
        for n in ws:
            if n.endswith("norm"):
                ws[n] = ws[n] + 1
        return ws

    rel = lambda: (jax.random.normal(next(keys), (cfg.num_buckets, cfg.num_heads))).astype(dtype)
    d = cfg.hidden_size
    params = {"embed": jax.random.normal(next(keys), (cfg.vocab_size, d)).astype(dtype),
              "encoder": {"rel_bias": rel(),
                          "layers": [layer(False) for _ in range(cfg.num_encoder_layers)],
                          "final_norm": jnp.ones((d,), dtype)},
              "rel_bias": rel(), "layers": [layer(True) for _ in range(cfg.num_layers)],
              "final_norm": jnp.ones((d,), dtype)}
    if not cfg.tie_embeddings:
        params["lm_head"] = (jax.random.normal(next(keys), (cfg.vocab_size, d)) * 0.05
                             ).astype(dtype)
    return params


__all__ = ["T5", "T5Config", "EncodedSource", "T5_SMALL", "T5_V1_1_SMALL", "FLAN_T5_BASE",
           "relative_bucket", "init_params", "layer_shapes"]
