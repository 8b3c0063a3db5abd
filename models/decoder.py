"""The decoder every port shares: ``DecoderParts`` (cache, dtypes, LM head rows, the forward
of the model contract) and ``run_layers``, the one layer loop of Llama, Gemma and T5's
decoder.

A family plugs in one hook, ``layer_block``: it checks the weights and returns the ``Block``
that computes one layer (attention against the cache, MLP, norms). The loop around it is
the same for every family: embedding, then per layer the block and the write of its new
keys and values into the cache, unrolled (one traced copy per layer) or under one
``lax.scan`` over stacked weights, then the final norm and LM head.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Bool, Float, Int

from specjax.models import kv_cache
from specjax.models.kv_cache import KVCache
from specjax.models.ops import head_logits

Params = Mapping[str, Any]

Block = Callable[..., tuple[Array, Array, Array]]
"""``block(i, lp, x, k_cache, v_cache) -> (x, k, v)``: layer ``i`` (a Python int when the
layers are unrolled, a traced index under ``lax.scan``) with weights ``lp`` over the
feature-major stream ``x`` ``[D, B, T]`` and its cache arrays ``k_cache`` ``[B, K, H, S]``
and ``v_cache`` ``[B, K, S, H]``, which it only reads. Returns the new stream and the new
tokens' keys ``[B, K, H, T]`` and values ``[B, K, T, H]`` (the cache's layouts)."""


def run_layers(block: Block, layers, cache: KVCache, x: Float[Array, "D B T"], n: int,
               return_layers: tuple[int, ...], *, scan: bool = False,
               kv_from: tuple[int, ...] | None = None) -> tuple[dict[int, Array], KVCache]:
    """The first ``n`` layers of ``layers`` over ``x``, each ``block`` followed by the write
    of its new K/V at slots ``cache.length[b] + j`` of its layer (``cache.length`` unchanged).

    ``kv_from`` (unrolled layers only): per layer, the layer whose keys and values it
    attends to: itself, or an earlier layer for one that shares them (Gemma 4's KV
    sharing). A sharing layer has no cache entry of its own and writes none: its block is
    called as ``block(i, lp, x, k_cache, v_cache, shared)`` with the source layer's cache
    arrays and, as ``shared``, the ``(k, v)`` that layer computed for the new tokens, and
    returns ``(x, None, None)``. ``cache.k`` then holds the layers that keep a cache.

    ``scan``: ``layers`` is one dict of ``[L, ...]`` arrays and ``cache`` stacked, and the
    layers run as one ``lax.scan`` (one compiled body); otherwise ``layers[i]`` is layer
    ``i``'s dict and each layer is traced on its own. Returns ``(hidden, cache)``: ``hidden``
    maps ``l`` to the stream after ``l`` layers ([D,B,T]; ``0`` is ``x``) for ``l`` in
    ``return_layers``, and always holds ``n``."""
    if scan:
        if kv_from is not None:
            raise ValueError("layers that share keys and values run unrolled (scan=False)")
        return _scanned(block, layers, cache, x, n, return_layers)
    return _unrolled(block, layers, cache, x, n, return_layers, kv_from)


def _unrolled(block: Block, layers, cache: KVCache, x, n: int, return_layers, kv_from=None):
    """``run_layers`` with one traced copy of each layer (per-layer weights and cache)."""
    hidden = {0: x} if 0 in return_layers else {}
    ks, vs = list(cache.k), list(cache.v)
    fresh = {}  # layer -> its new (k, v), for the layers that share them
    for i in range(n):
        src = i if kv_from is None else kv_from[i]
        if src != i:
            x, _, _ = block(i, layers[i], x, ks[src], vs[src], fresh[src])
        else:
            x, k, v = block(i, layers[i], x, ks[i], vs[i])
            ks[i] = kv_cache.write(ks[i], cache.length, k, axis=3)
            vs[i] = kv_cache.write(vs[i], cache.length, v, axis=2)
            fresh[i] = (k, v)
        if i + 1 in return_layers:
            hidden[i + 1] = x
    hidden[n] = x
    return hidden, cache.replace(k=tuple(ks), v=tuple(vs))


def _scanned(block: Block, layers, cache: KVCache, x, n: int, return_layers):
    """``run_layers`` as one ``lax.scan`` over layer indices: each step reads its weights
    and cache at index ``i`` of the stacked arrays and writes only its new K/V into the
    stacked cache (carried, so updated in place). The streams after the ``return_layers``
    inside ``(0, n)`` come from the scan's outputs."""
    length = cache.length
    inner = sorted(l for l in set(return_layers) if 0 < l < n)
    at = lambda a, i: lax.dynamic_index_in_dim(a, i, keepdims=False)

    def body(carry, i):
        y, ks, vs = carry
        y, k, v = block(i, jax.tree.map(lambda a: at(a, i), layers), y, at(ks, i), at(vs, i))
        ks = kv_cache.write_layer(ks, i, length, k, axis=3)
        vs = kv_cache.write_layer(vs, i, length, v, axis=2)
        return (y, ks, vs), (y if inner else None)

    (y, ks, vs), ys = lax.scan(body, (x, cache.k, cache.v), jnp.arange(n))
    hidden = {l: ys[l - 1] for l in inner}
    if 0 in return_layers:
        hidden[0] = x
    hidden[n] = y
    return hidden, cache.replace(k=ks, v=vs)


class DecoderParts:
    """What every decoder port here shares: its cache, dtypes, LM head rows, the check of
    which layers a forward runs, and ``forward`` itself. Needs the fields ``config`` and
    ``compute_dtype``, and the methods ``embed``, ``final_norm`` and ``layer_block`` (the
    family's hook: the block of each layer, ``run_layers``); ``logit_transform`` where the
    family changes the LM head's output.

    ``compute_dtype`` is the dtype every weight product takes its inputs in and the KV
    cache's default dtype; products accumulate in float32 and logits are float32 either
    way. The default, float32, multiplies bfloat16-stored weights as float32 and caches in
    float32, so a verification forward differs from one-token decoding by float32 rounding
    only, as with float32 weights, and greedy speculative output stays ``ar``'s.
    ``jnp.bfloat16`` rounds activations, keys and values to bfloat16 (faster where the
    hardware multiplies bfloat16, half the cache); that rounding turns the float32
    differences between a wide and a one-token forward into bfloat16-sized ones, and greedy
    output can then leave ``ar``'s on near-ties (docs/guide.md, "bfloat16").
    """

    is_encoder_decoder = False  # T5 says True: its prompts are sources to encode
    scan_layers = False  # Llama's field: its layers under one lax.scan over stacked weights

    def __post_init__(self):
        dt = jnp.dtype(self.compute_dtype)
        if not jnp.issubdtype(dt, jnp.floating):
            raise ValueError(f"compute_dtype must be a floating dtype, got {dt}")
        object.__setattr__(self, "compute_dtype", dt)  # hashable and comparable as a static

    def compute(self, weights):
        """``weights``' floating-point arrays in ``compute_dtype``: what the products take.
        Stored weights are unchanged (a cast inside a jitted forward)."""
        dt = self.compute_dtype
        return jax.tree.map(
            lambda a: a.astype(dt) if jnp.issubdtype(a.dtype, jnp.floating) else a, weights)

    def init_cache(self, batch: int, capacity: int, dtype=None) -> KVCache:
        """An empty KV cache of ``capacity`` slots per row, in ``dtype`` (default: the
        model's ``compute_dtype``, so keys and values are kept as the products made them);
        stacked (one array with a leading layer axis) for a model with ``scan_layers``."""
        c = self.config
        return KVCache.zeros(c.num_layers, batch, capacity, c.num_kv_heads, c.head_dim,
                             self.compute_dtype if dtype is None else dtype,
                             stacked=self.scan_layers)

    def param_dtype(self, params: Params):
        """The dtype its weights are stored in (its embedding's). Products, KV caches and
        draft heads use ``compute_dtype``."""
        return params["embed"].dtype

    def output_head(self, params: Params) -> Float[Array, "V D"]:
        """The LM head as ``[V, D]`` rows (the embedding when tied)."""
        return params["embed"] if self.config.tie_embeddings else params["lm_head"]

    def logit_transform(self, logits: Float[Array, "... V"]) -> Float[Array, "... V"]:
        """What the family does to the LM head's float32 output (Gemma 2's soft-cap);
        nothing by default."""
        return logits

    def unembed(self, params: Params, normed: Float[Array, "... D"],
                head: Array | None = None) -> Float[Array, "... V"]:
        """Float32 logits of features that already passed the final norm (what an EAGLE
        head predicts): the LM head (``head`` rows ``[V', D]`` override it), then the
        family's ``logit_transform``. ``logits`` is this after ``final_norm``, so a draft
        head scored through it gets the family's scaling and soft-capping too."""
        rows = self.output_head(params) if head is None else head
        return self.logit_transform(head_logits(self.compute(rows), normed))

    def logits(self, params: Params, hidden: Float[Array, "... D"],
               head: Array | None = None) -> Float[Array, "... V"]:
        """Float32 logits of hidden states: ``final_norm``, then ``unembed``."""
        return self.unembed(params, self.final_norm(params, hidden), head)

    def source_tokens(self, params: Params) -> Int[Array, "B S"] | None:
        """The source ids the decoder reads: None for a decoder-only model (``T5``
        returns its bound source's)."""
        return None

    def layers_to_run(self, exit_layer: int | None, return_layers: tuple[int, ...]) -> int:
        """How many layers a forward runs; ``ValueError`` for an exit or a returned layer
        outside them."""
        total = self.config.num_layers
        n = total if exit_layer is None else exit_layer
        if not 1 <= n <= total:
            raise ValueError(f"exit_layer={exit_layer} outside [1, {total}]")
        bad = [l for l in return_layers if not 0 <= l <= n]
        if bad:
            raise ValueError(f"return_layers {bad} outside [0, {n}] (layers that run)")
        return n

    def layer_block(self, params: Params, cache: KVCache, mask: Bool[Array, "B T T"],
                    positions: Int[Array, "B T"], n: int) -> Block:
        """The family's hook: checks ``params`` and ``cache`` for a forward of ``n`` layers
        and returns the ``Block`` of each layer (weights given in ``compute_dtype``)."""
        raise NotImplementedError

    def forward(
        self,
        params: Params,
        tokens: Int[Array, "B T"],
        positions: Int[Array, "B T"],
        cache: KVCache,
        mask: Bool[Array, "B T T"] | None = None,
        *,
        exit_layer: int | None = None,
        return_layers: tuple[int, ...] = (),
        compute_logits: bool = True,
    ) -> tuple[Float[Array, "B T V"] | None, dict[int, Array], KVCache]:
        """Runs new tokens against the cache.

        Guarantees:
          * new token ``i`` of row ``b`` attends to cache slots ``[0, length[b])`` and to the
            new tokens ``j`` with ``mask[b, i, j]`` (default: causal), and is rotated by
            ``positions[b, i]`` (what a family's layers narrow or add to, its
            ``layer_block`` says: Gemma's sliding windows, T5's relative biases);
          * its K/V are written at slot ``length[b] + i`` of each layer that runs;
            ``cache.length`` is unchanged (advance or commit afterwards). The caller keeps
            ``length + T <= capacity`` (``generate`` checks it before running);
          * only the first ``exit_layer`` layers run (default: all); the logits then come
            from the final norm and LM head applied after that layer (an early exit);
          * ``hidden`` maps ``l`` to the residual stream after ``l`` layers (``0`` is the
            embedding) for ``l`` in ``return_layers``, and always holds the last layer run.

        Returns ``(logits [B,T,V] float32 or None, hidden, cache)``.
        """
        n = self.layers_to_run(exit_layer, return_layers)
        b, t = tokens.shape
        if mask is None:
            mask = kv_cache.causal_mask(b, t)
        block = self.layer_block(params, cache, mask, positions, n)
        step = lambda i, lp, *rest: block(i, self.compute(lp), *rest)
        x = self.embed(params, tokens).astype(jnp.float32).transpose(2, 0, 1)  # [D,B,T] f32
        hidden, cache = run_layers(step, params["layers"], cache, x, n, return_layers,
                                   scan=self.scan_layers)
        hidden = {l: h.transpose(1, 2, 0) for l, h in hidden.items()}
        logits = self.logits(params, hidden[n]) if compute_logits else None
        return logits, hidden, cache


__all__ = ["Block", "DecoderParts", "run_layers"]
