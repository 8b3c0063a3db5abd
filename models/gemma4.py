"""Gemma 4 text decoder (E2B, E4B, 26B-A4B, 31B) as pure JAX functions.

The forward is the shared layer loop (``specjax.models.decoder.run_layers``) over Gemma 4's
layer; what Gemma 4 adds to Gemma 3 (``specjax.models.gemma``):

* per-layer attention geometry: sliding layers have ``num_kv_heads`` heads of ``head_dim``,
  full layers ``num_global_kv_heads`` of ``global_head_dim`` (transformers sets the heads
  where K is used as V); the KV cache is per layer, of each layer's shape;
* full layers rotate with *proportional* RoPE: only the first ``partial_rotary_factor`` of
  each head's frequency pairs turn (base ``rope_theta``), the rest keep frequency 0;
* ``attention_k_eq_v``: full layers have no V projection; values are the keys before
  their norm and RoPE;
* q- and k-norm with gains, a v-norm without one; attention scores are not scaled;
* norm gains are the stored multiplier itself (Gemma 3 stores ``w`` for ``1 + w``);
* per-layer embeddings (E2B/E4B): a second, packed embedding and a projection of the
  input embedding give each layer a ``hidden_size_per_layer_input`` signal, gated into
  the stream after the MLP;
* KV sharing: the last ``num_kv_shared_layers`` layers attend to the keys and values of
  the last earlier layer of their type and keep no cache (``Gemma4Config.kv_from``);
  KV-shared layers' MLPs are twice as wide with ``use_double_wide_mlp``;
* the MoE block (26B-A4B): beside the dense MLP, a router picks ``top_k_experts`` of
  ``num_experts`` per token; both outputs are normed and summed;
* every layer ends by multiplying the stream by its ``layer_scalar``;
* final logits soft-capped (``final_logit_softcapping``), embeddings tied.

As in Gemma 3, the cache keeps every position (slot ``s`` holds position ``s``) and sliding
windows are masks: a query at position ``p`` sees keys at positions ``p - window < k <= p``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, Mapping

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Bool, Float, Int

from specjax.models import kv_cache
from specjax.models.base import DECODER_PARTITIONING, RopeScaling
from specjax.models.decoder import DecoderParts, run_layers
from specjax.models.gemma import _window_masks, rms_norm
from specjax.models.kv_cache import KVCache
from specjax.models.llama import stacked_layers
from specjax.models.ops import apply_rope, attention, dense
from specjax.sharding import MOE_MLP, VOCAB

Params = Mapping[str, Any]
SLIDING, FULL = "sliding", "full"

# Gemma 4's own weights beside a decoder layer's: the experts' stacked [E, out, in] weights
# split by an expert's MLP width, the per-layer embedding table by its vocabulary
GEMMA4_PARTITIONING = DECODER_PARTITIONING.extend({
    "experts_gate": (None, MOE_MLP, None), "experts_up": (None, MOE_MLP, None),
    "experts_down": (None, None, MOE_MLP), "ple_embed": (VOCAB, None)})


@dataclasses.dataclass(frozen=True)
class Gemma4Config:
    """Architecture of one Gemma 4 text decoder. ``layer_types[i]`` is ``"sliding"`` (window
    ``sliding_window``, ``num_kv_heads`` x ``head_dim``, RoPE base ``rope_local_theta``) or
    ``"full"`` (``global_head_dim``, ``num_global_kv_heads``; proportional RoPE over
    ``partial_rotary_factor`` of each head, base ``rope_theta``). ``num_experts`` 0: no MoE
    block; ``hidden_size_per_layer_input`` 0: no per-layer embeddings."""

    partitioning: ClassVar = GEMMA4_PARTITIONING
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    global_head_dim: int | None = None  # None: head_dim
    num_global_kv_heads: int | None = None  # None: num_kv_heads
    attention_k_eq_v: bool = False
    sliding_window: int = 512
    rope_theta: float = 1_000_000.0
    rope_local_theta: float = 10_000.0
    partial_rotary_factor: float = 1.0
    rope_scaling: RopeScaling = RopeScaling()  # the contract's field: always the default
    final_logit_softcapping: float | None = None
    hidden_size_per_layer_input: int = 0
    vocab_size_per_layer_input: int = 0
    num_kv_shared_layers: int = 0
    use_double_wide_mlp: bool = False
    num_experts: int = 0
    top_k_experts: int = 0
    moe_intermediate_size: int = 0
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = True
    max_position_embeddings: int = 131072

    def __post_init__(self):
        if len(self.layer_types) != self.num_layers or \
                set(self.layer_types) - {SLIDING, FULL}:
            raise ValueError(f"layer_types must name {self.num_layers} layers, each "
                             f"{SLIDING!r} or {FULL!r}; got {self.layer_types}")
        for kind in set(self.layer_types):
            k, _ = self.geometry(kind)
            if self.num_heads % k:
                raise ValueError(f"num_heads={self.num_heads} is not a multiple of the "
                                 f"{kind} layers' {k} K/V heads")
        if not 0 <= self.num_kv_shared_layers < self.num_layers:
            raise ValueError(f"num_kv_shared_layers={self.num_kv_shared_layers} must lie in "
                             f"[0, {self.num_layers})")
        if self.num_kv_shared_layers:
            kept = set(self.layer_types[:self.num_layers - self.num_kv_shared_layers])
            if kept != set(self.layer_types):
                raise ValueError("every layer type of the KV-shared layers needs an earlier "
                                 "layer of that type that keeps its keys and values")
        if self.num_experts and not 1 <= self.top_k_experts <= self.num_experts:
            raise ValueError(f"top_k_experts={self.top_k_experts} must lie in [1, "
                             f"{self.num_experts}]")
        if not 0.0 <= self.partial_rotary_factor <= 1.0 or self.sliding_window < 1:
            raise ValueError("partial_rotary_factor must lie in [0, 1] and sliding_window "
                             "be >= 1")

    def geometry(self, kind: str) -> tuple[int, int]:
        """``(K/V heads, head dim)`` of the layers of ``kind``."""
        if kind == SLIDING:
            return self.num_kv_heads, self.head_dim
        return (self.num_global_kv_heads or self.num_kv_heads,
                self.global_head_dim or self.head_dim)

    @property
    def first_shared(self) -> int:
        """The first layer that shares another's keys and values (``num_layers``: none)."""
        return self.num_layers - self.num_kv_shared_layers

    @property
    def kv_from(self) -> tuple[int, ...]:
        """Per layer, the layer whose keys and values it attends to: itself, or, from
        ``first_shared`` on, the last layer of its type before ``first_shared``."""
        f = self.first_shared
        last = {t: max(i for i in range(f) if self.layer_types[i] == t)
                for t in set(self.layer_types)}
        return tuple(i if i < f else last[self.layer_types[i]]
                     for i in range(self.num_layers))

    @property
    def kv_layers(self) -> dict[str, int]:
        """Per layer type, the last layer that keeps keys and values: what a Gemma 4
        assistant attends to (transformers' ``shared_kv_states``)."""
        f = self.first_shared
        return {t: max(i for i in range(f) if self.layer_types[i] == t)
                for t in sorted(set(self.layer_types))}

    def mlp_width(self, i: int) -> int:
        """Layer ``i``'s dense MLP width (doubled on KV-shared layers with
        ``use_double_wide_mlp``)."""
        wide = self.use_double_wide_mlp and i >= self.first_shared
        return self.intermediate_size * (2 if wide else 1)


def layer_types(num_layers: int, period: int) -> tuple[str, ...]:
    """Gemma 4's layout: every ``period``-th layer full, the others sliding, the last full
    (as transformers forces it)."""
    return tuple(FULL if (i + 1) % period == 0 or i == num_layers - 1 else SLIDING
                 for i in range(num_layers))


# The released sizes' text decoders (their config.json text_config; shapes for the device
# check and random-weight timing; real weights load from an HF directory)
_RELEASED = dict(vocab_size=262144, head_dim=256, global_head_dim=512, rope_theta=1e6,
                 rope_local_theta=1e4, partial_rotary_factor=0.25, final_logit_softcapping=30.0)
GEMMA4_E2B = Gemma4Config(
    hidden_size=1536, intermediate_size=6144, num_layers=35, num_heads=8, num_kv_heads=1,
    layer_types=layer_types(35, 5), sliding_window=512, hidden_size_per_layer_input=256,
    vocab_size_per_layer_input=262144, num_kv_shared_layers=20, use_double_wide_mlp=True,
    **_RELEASED)
GEMMA4_E4B = Gemma4Config(
    hidden_size=2560, intermediate_size=10240, num_layers=42, num_heads=8, num_kv_heads=2,
    layer_types=layer_types(42, 6), sliding_window=512, hidden_size_per_layer_input=256,
    vocab_size_per_layer_input=262144, num_kv_shared_layers=18, **_RELEASED)
GEMMA4_26B_A4B = Gemma4Config(
    hidden_size=2816, intermediate_size=2112, num_layers=30, num_heads=16, num_kv_heads=8,
    layer_types=layer_types(30, 6), num_global_kv_heads=2, attention_k_eq_v=True,
    sliding_window=1024, num_experts=128, top_k_experts=8, moe_intermediate_size=704,
    max_position_embeddings=262144, **_RELEASED)
GEMMA4_31B = Gemma4Config(
    hidden_size=5376, intermediate_size=21504, num_layers=60, num_heads=32, num_kv_heads=16,
    layer_types=layer_types(60, 6), num_global_kv_heads=4, attention_k_eq_v=True,
    sliding_window=1024, max_position_embeddings=262144, **_RELEASED)


def rope_freqs(head_dim: int, theta: float, partial: float = 1.0) -> Float[Array, "H2"]:
    """Proportional RoPE's inverse frequencies (transformers' ``proportional`` type): the
    first ``int(partial * head_dim // 2)`` pairs at ``theta ** (-2j / head_dim)``, the rest
    0 (left unrotated). ``partial`` 1 is plain RoPE."""
    turning = int(partial * head_dim // 2)
    inv = 1.0 / theta ** (jnp.arange(0, 2 * turning, 2, dtype=jnp.float32) / head_dim)
    return jnp.concatenate([inv, jnp.zeros(head_dim // 2 - turning, jnp.float32)])


def layer_freqs(cfg: Gemma4Config) -> dict[str, Array]:
    """RoPE inverse frequencies per layer type."""
    return {SLIDING: rope_freqs(cfg.head_dim, cfg.rope_local_theta),
            FULL: rope_freqs(cfg.geometry(FULL)[1], cfg.rope_theta, cfg.partial_rotary_factor)}


def _norm(x: Array, gain: Array | None, eps: float, axis: int) -> Array:
    """RMSNorm over ``axis`` in float32, times ``gain`` (none: the v-norm), cast back."""
    if gain is not None:
        return rms_norm(x, gain, eps, axis)
    xf = x.astype(jnp.float32)
    return (xf * lax.rsqrt(jnp.mean(xf * xf, axis=axis, keepdims=True) + eps)).astype(x.dtype)


def queries(cfg: Gemma4Config, lp: Params, h: Float[Array, "D B T"], kind: str, positions,
            inv_freq) -> Float[Array, "B K G T H"]:
    """Queries of a layer of ``kind`` over its normed input: projected, q-normed and
    rotated, grouped by K/V head (``ops.attention``'s layout)."""
    nk, hd = cfg.geometry(kind)
    _, b, t = h.shape
    q = dense(lp["q"], h).reshape(cfg.num_heads, hd, b, t)
    q = apply_rope(_norm(q, lp["q_norm"], cfg.rms_norm_eps, 1), positions, inv_freq)
    return q.reshape(nk, cfg.num_heads // nk, hd, b, t).transpose(3, 0, 1, 4, 2)


def keys_values(cfg: Gemma4Config, lp: Params, h: Float[Array, "D B T"], kind: str,
                positions, inv_freq):
    """A layer's new keys ``[B, K, H, T]`` (k-normed, rotated) and values ``[B, K, T, H]``
    (v-normed; the raw keys where ``attention_k_eq_v`` leaves the layer no ``v``)."""
    nk, hd = cfg.geometry(kind)
    _, b, t = h.shape
    k = dense(lp["k"], h).reshape(nk, hd, b, t)
    v = dense(lp["v"], h).reshape(nk, hd, b, t) if "v" in lp else k
    k = apply_rope(_norm(k, lp["k_norm"], cfg.rms_norm_eps, 1), positions, inv_freq)
    v = _norm(v, None, cfg.rms_norm_eps, 1)
    return k.transpose(2, 0, 1, 3), v.transpose(2, 0, 3, 1)


def _attend(cfg: Gemma4Config, lp: Params, q, k, v, k_cache, v_cache, length, mask, visible):
    """Attention of ``q`` over the cache and the new ``k``, ``v`` (scale 1), projected out."""
    b, nk, g, t, hd = q.shape
    att = attention(q, k.transpose(0, 1, 3, 2), v, k_cache, v_cache, length, mask, visible,
                    scale=1.0)
    return dense(lp["o"], att.transpose(1, 2, 4, 0, 3).reshape(nk * g * hd, b, t))


def mlp(cfg: Gemma4Config, lp: Params, h: Float[Array, "D B T"]) -> Float[Array, "D B T"]:
    """The dense GeGLU MLP (tanh-approximated GELU)."""
    return dense(lp["down"], jax.nn.gelu(dense(lp["gate"], h), approximate=True)
                 * dense(lp["up"], h))


def route(cfg: Gemma4Config, lp: Params, x: Float[Array, "D N"]):
    """The router over the residual stream ``x``: top-k expert ids ``[N, k]`` and weights
    (softmax over all experts in float32, renormalized over the top k, times each expert's
    ``expert_scale``)."""
    r = _norm(x, None, cfg.rms_norm_eps, 0).astype(jnp.float32)
    r = r * lp["router_scale"].astype(jnp.float32)[:, None] * cfg.hidden_size ** -0.5
    probs = jax.nn.softmax(dense(lp["router"], r[:, :, None])[:, :, 0].T, axis=-1)
    w, idx = lax.top_k(probs, cfg.top_k_experts)
    w = w / jnp.sum(w, axis=-1, keepdims=True)
    return idx, w * lp["expert_scale"].astype(jnp.float32)[idx]


def experts(cfg: Gemma4Config, lp: Params, h: Float[Array, "D N"], idx: Int[Array, "N k"],
            w: Float[Array, "N k"]) -> Float[Array, "D N"]:
    """The chosen experts' GeGLU MLPs on ``h``, summed with weights ``w``. Few tokens
    (``N * k`` below the expert count: decoding, verification) gather their experts'
    weights; more run every expert and weigh the unchosen ones by 0."""
    gate, up, down = lp["experts_gate"], lp["experts_up"], lp["experts_down"]
    n, e = h.shape[1], gate.shape[0]
    f32 = jnp.float32
    hx = h.astype(gate.dtype)
    if n * cfg.top_k_experts < e:
        g = jnp.einsum("nkfd,dn->nkf", gate[idx], hx, preferred_element_type=f32)
        u = jnp.einsum("nkfd,dn->nkf", up[idx], hx, preferred_element_type=f32)
        a = (jax.nn.gelu(g, approximate=True) * u).astype(down.dtype)
        y = jnp.einsum("nkdf,nkf->nkd", down[idx], a, preferred_element_type=f32)
        return jnp.einsum("nkd,nk->dn", y, w)
    g = jnp.einsum("efd,dn->enf", gate, hx, preferred_element_type=f32)
    u = jnp.einsum("efd,dn->enf", up, hx, preferred_element_type=f32)
    a = (jax.nn.gelu(g, approximate=True) * u).astype(down.dtype)
    y = jnp.einsum("edf,enf->end", down, a, preferred_element_type=f32)
    full = jnp.zeros((n, e), f32).at[jnp.arange(n)[:, None], idx].add(w)
    return jnp.einsum("end,ne->dn", y, full)


def feed_forward(cfg: Gemma4Config, lp: Params, x: Float[Array, "D B T"]) -> Float[Array, "D B T"]:
    """The block after attention: ``x`` plus the normed MLP output, or with the MoE block
    the normed sum of the normed MLP and normed expert outputs (the router reads ``x``)."""
    eps = cfg.rms_norm_eps
    y = mlp(cfg, lp, rms_norm(x, lp["mlp_norm"], eps, axis=0))
    if cfg.num_experts:
        d, b, t = x.shape
        flat = x.reshape(d, b * t)
        idx, w = route(cfg, lp, flat)
        z = experts(cfg, lp, rms_norm(flat, lp["moe_pre_norm"], eps, axis=0), idx, w)
        z = rms_norm(z.reshape(d, b, t).astype(x.dtype), lp["moe_out_norm"], eps, axis=0)
        y = rms_norm(y, lp["mlp_out_norm"], eps, axis=0) + z
    return x + rms_norm(y, lp["post_mlp_norm"], eps, axis=0)


def _block(cfg: Gemma4Config, i: int, lp: Params, x, k_cache, v_cache, length, mask,
           positions, inv_freq, visible, ple, shared=None):
    """Layer ``i`` over the feature-major stream ``x`` ([D, B, T]): attention (its own new
    K/V, or ``shared``: the source layer's), the feed-forward block, the per-layer input
    and the layer scalar. Returns ``(x, k, v)`` (``k``, ``v`` None for a sharing layer)."""
    eps, kind = cfg.rms_norm_eps, cfg.layer_types[i]
    h = rms_norm(x, lp["attn_norm"], eps, axis=0)
    q = queries(cfg, lp, h, kind, positions, inv_freq)
    k, v = keys_values(cfg, lp, h, kind, positions, inv_freq) if shared is None else shared
    o = _attend(cfg, lp, q, k, v, k_cache, v_cache, length, mask, visible)
    x = feed_forward(cfg, lp, x + rms_norm(o, lp["post_attn_norm"], eps, axis=0))
    if ple is not None:
        g = jax.nn.gelu(dense(lp["ple_gate"], x), approximate=True) * ple[i]
        x = x + rms_norm(dense(lp["ple_proj"], g), lp["ple_norm"], eps, axis=0)
    x = x * lp["layer_scalar"].astype(x.dtype)[0]
    return (x, k, v) if shared is None else (x, None, None)


@dataclasses.dataclass(frozen=True)
class Gemma4(DecoderParts):
    """A Gemma 4 text decoder bound to its configuration (hashable: a static argument).
    Follows the model contract ``specjax.models.Model``; its KV cache has one entry per
    layer that keeps keys and values (the first ``config.first_shared``), each of its
    layer type's shape."""

    config: Gemma4Config
    compute_dtype: Any = jnp.float32

    def embed(self, params: Params, tokens: Int[Array, "B T"]) -> Float[Array, "B T D"]:
        """Token embeddings scaled by ``sqrt(hidden_size)`` (rounded to the weight dtype)."""
        e = params["embed"]
        return e[tokens] * jnp.asarray(math.sqrt(self.config.hidden_size), e.dtype)

    def final_norm(self, params: Params, hidden: Float[Array, "... D"]) -> Float[Array, "... D"]:
        return rms_norm(hidden, params["final_norm"], self.config.rms_norm_eps)

    def logit_transform(self, logits: Float[Array, "... V"]) -> Float[Array, "... V"]:
        """The final soft-cap, ``cap * tanh(logits / cap)``."""
        cap = self.config.final_logit_softcapping
        return logits if cap is None else cap * jnp.tanh(logits / cap)

    def init_cache(self, batch: int, capacity: int, dtype=None) -> KVCache:
        """An empty cache: one ``[B, K, H, S]`` / ``[B, K, S, H]`` pair per layer that keeps
        keys and values, of its layer type's ``(K, H)``."""
        c, dt = self.config, self.compute_dtype if dtype is None else dtype
        shapes = [c.geometry(c.layer_types[i]) for i in range(c.first_shared)]
        return KVCache(k=tuple(jnp.zeros((batch, k, h, capacity), dt) for k, h in shapes),
                       v=tuple(jnp.zeros((batch, k, capacity, h), dt) for k, h in shapes),
                       length=jnp.zeros((batch,), jnp.int32))

    def per_layer_inputs(self, params: Params, tokens, emb) -> Float[Array, "L P B T"] | None:
        """Each layer's per-layer input (None without per-layer embeddings): the packed
        token embedding (scaled by ``sqrt(P)``) plus the normed projection of the input
        embedding ``emb`` ([D, B, T]), over ``sqrt(2)``."""
        c = self.config
        p = c.hidden_size_per_layer_input
        if not p:
            return None
        _, b, t = emb.shape
        table = params["ple_embed"]
        tok = table[tokens] * jnp.asarray(math.sqrt(p), table.dtype)  # [B, T, L*P]
        tok = tok.astype(jnp.float32).reshape(b, t, c.num_layers, p).transpose(2, 3, 0, 1)
        proj = dense(self.compute(params["ple_model_proj"]), emb) * c.hidden_size ** -0.5
        proj = rms_norm(proj.reshape(c.num_layers, p, b, t), params["ple_proj_norm"],
                        c.rms_norm_eps, axis=1)
        return (proj + tok) * 2.0 ** -0.5

    def forward(self, params: Params, tokens: Int[Array, "B T"], positions: Int[Array, "B T"],
                cache: KVCache, mask: Bool[Array, "B T T"] | None = None, *,
                exit_layer: int | None = None, return_layers: tuple[int, ...] = (),
                compute_logits: bool = True):
        """``DecoderParts.forward``'s contract, with the per-layer inputs computed from the
        tokens and the KV-shared layers reading their source layer's keys and values
        (``run_layers``' ``kv_from``); a sliding layer's query at position ``p`` sees keys
        at positions ``> p - sliding_window``."""
        if stacked_layers(params["layers"]):
            raise ValueError("Gemma 4 runs its layers unrolled: give per-layer weights")
        c = self.config
        n = self.layers_to_run(exit_layer, return_layers)
        b, t = tokens.shape
        mask = kv_cache.causal_mask(b, t) if mask is None else mask
        x = self.embed(params, tokens).astype(jnp.float32).transpose(2, 0, 1)  # [D, B, T]
        ple = self.per_layer_inputs(params, tokens, x)
        inv = layer_freqs(c)
        masks = {FULL: (None, mask)}
        if SLIDING in c.layer_types[:n]:
            masks[SLIDING] = _window_masks(c, cache.length, mask, positions, cache.capacity)

        def block(i, lp, x, kc, vc, shared=None):
            vis, m = masks[c.layer_types[i]]
            return _block(c, i, self.compute(lp), x, kc, vc, cache.length, m, positions,
                          inv[c.layer_types[i]], vis, ple, shared)

        hidden, cache = run_layers(block, params["layers"], cache, x, n, return_layers,
                                   kv_from=c.kv_from)
        hidden = {l: h.transpose(1, 2, 0) for l, h in hidden.items()}
        logits = self.logits(params, hidden[n]) if compute_logits else None
        return logits, hidden, cache


def layer_shapes(cfg: Gemma4Config, i: int) -> dict[str, tuple[int, ...]]:
    """Shape of each weight of layer ``i``, all ``[out, in]`` (``q``, ``k``, ``v`` split;
    no ``k``, ``v``, ``k_norm`` on a KV-shared layer, no ``v`` on a full layer with
    ``attention_k_eq_v``)."""
    d, kind = cfg.hidden_size, cfg.layer_types[i]
    nk, hd = cfg.geometry(kind)
    f = cfg.mlp_width(i)
    s = {"attn_norm": (d,), "q": (cfg.num_heads * hd, d), "q_norm": (hd,),
         "o": (d, cfg.num_heads * hd), "post_attn_norm": (d,), "mlp_norm": (d,),
         "gate": (f, d), "up": (f, d), "down": (d, f), "post_mlp_norm": (d,),
         "layer_scalar": (1,)}
    if i < cfg.first_shared:
        s.update(k=(nk * hd, d), k_norm=(hd,))
        if not (cfg.attention_k_eq_v and kind == FULL):
            s["v"] = (nk * hd, d)
    if cfg.hidden_size_per_layer_input:
        p = cfg.hidden_size_per_layer_input
        s.update(ple_gate=(p, d), ple_proj=(d, p), ple_norm=(d,))
    if cfg.num_experts:
        e, m = cfg.num_experts, cfg.moe_intermediate_size
        s.update(router=(e, d), router_scale=(d,), expert_scale=(e,),
                 experts_gate=(e, m, d), experts_up=(e, m, d), experts_down=(e, d, m),
                 moe_pre_norm=(d,), mlp_out_norm=(d,), moe_out_norm=(d,))
    return s


def top_shapes(cfg: Gemma4Config) -> dict[str, tuple[int, ...]]:
    """Shape of each weight outside the layers."""
    d = cfg.hidden_size
    s = {"embed": (cfg.vocab_size, d), "final_norm": (d,)}
    if not cfg.tie_embeddings:
        s["lm_head"] = (cfg.vocab_size, d)
    p = cfg.hidden_size_per_layer_input
    if p:
        s.update(ple_embed=(cfg.vocab_size_per_layer_input, cfg.num_layers * p),
                 ple_model_proj=(cfg.num_layers * p, d), ple_proj_norm=(p,))
    return s


def _is_gain(name: str) -> bool:
    return name.endswith("norm") or name in ("layer_scalar", "router_scale", "expert_scale")


def init_params(cfg: Gemma4Config, key: Array, dtype=jnp.float32, scale: float = 0.05) -> Params:
    """Random parameters of the right shapes (tests, toys, the device check): gains near
    1, weights normal with ``scale``."""
    def draw(shapes: dict, k) -> dict:
        keys = jax.random.split(k, len(shapes))
        return {n: ((1.0 + 0.1 * jax.random.normal(kk, s)) if _is_gain(n)
                    else jax.random.normal(kk, s) * scale).astype(dtype)
                for (n, s), kk in zip(shapes.items(), keys)}

    keys = jax.random.split(key, cfg.num_layers + 1)
    params = draw(top_shapes(cfg), keys[-1])
    params["layers"] = [draw(layer_shapes(cfg, i), keys[i]) for i in range(cfg.num_layers)]
    return params


__all__ = ["Gemma4", "Gemma4Config", "GEMMA4_PARTITIONING", "SLIDING", "FULL", "layer_types",
           "GEMMA4_E2B", "GEMMA4_E4B", "GEMMA4_26B_A4B", "GEMMA4_31B", "rope_freqs",
           "layer_freqs", "queries", "keys_values", "mlp", "route", "experts",
           "feed_forward", "layer_shapes", "top_shapes", "init_params"]
