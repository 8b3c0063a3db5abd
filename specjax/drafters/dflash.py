"""DFlash: a block-diffusion drafter that drafts a whole block of tokens in one forward,
conditioned on the target's hidden states (z-lab, arXiv 2602.06036).

The drafter is a few Qwen3-style decoder layers at the target's width. Each round it reads
one block ``[root, MASK, ..., MASK]`` of ``block_size`` tokens (the root is the last
emitted token, which the target has not yet run), embedded by the target, at positions
``root_pos ..``; its queries attend, without a causal mask, to the whole block and to the
*context*: every earlier position's target features, fused once per token::

    c_t = hidden_norm(fc([h_{l1+1}; ...; h_{ln+1}]_t))          (target_layers l1..ln)
    K = k_norm(k_proj [c; x]) rotated,   V = v_proj [c; x]        (each layer's own k/v)
    x += o_proj(attn(q_norm(q_proj(input_norm x)), K, V));  x += mlp(post_norm x)
    logits = lm_head_target(norm(x))   at block slots 1 .. block_size - 1

``h_{l+1}`` is the residual stream after target layer ``l`` (HF ``hidden_states[l + 1]``).
The context is not normed by ``input_norm`` (z-lab's "KV injection"), and its K/V depend on
its own token alone, so they are computed once, when the target verifies the token, and
kept in the drafter's cache (slot = position).

The draft is greedy: the argmax at each slot (a chain), or with ``topk > 1`` a tree over the
block: the same per-slot distributions expanded as EAGLE-2 expands (path value = product of
the slots' probabilities) and the ``total_tokens`` best nodes kept (``eagle.expand``,
``eagle.rerank``). Either way ``Draft.probs`` is None: verification against the target
keeps decoding lossless at any temperature.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jaxtyping import Array, Float, Int

from specjax.core import tree
from specjax.core.verify import Draft
from specjax.drafters import base, blocks, eagle
from specjax.models import kv_cache
from specjax.models.kv_cache import KVCache
from specjax.models.ops import (apply_rope, attention, dense, gate_up, head_norm,
                                rms_norm)


def default_target_layers(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """z-lab's default ``target_layer_ids`` (``build_target_layer_ids``): the middle layer
    for one draft layer, else ``num_draft_layers`` evenly spread over ``[1, N - 3]``;
    clipped into ``[0, N)`` for targets too shallow for that span (the tests' toys)."""
    n, k = num_target_layers, num_draft_layers
    if k == 1:
        ids = [n // 2]
    else:
        ids = [int(round(1 + i * (n - 4) / (k - 1))) for i in range(k)]
    return tuple(min(max(i, 0), n - 1) for i in ids)


@dataclasses.dataclass(frozen=True)
class DFlashSpec:
    """A DFlash drafter's sizes (hashable, static): its decoder layers' geometry (``layer``,
    width = the target's hidden size), how many layers, the block it drafts (``block_size``
    tokens: the root and ``block_size - 1`` masks), the mask token's id (a row of the
    target's embedding) and the target layers whose outputs it fuses (z-lab's
    ``target_layer_ids``, 0-based)."""

    layer: blocks.LayerSpec
    num_layers: int
    block_size: int
    mask_id: int
    target_layers: tuple[int, ...]

    def __post_init__(self):
        if self.num_layers < 1 or self.block_size < 2 or not self.target_layers:
            raise ValueError(f"a DFlash drafter needs >= 1 layer, a block of >= 2 tokens and "
                             f">= 1 target layer, got {self.num_layers}, {self.block_size}, "
                             f"{self.target_layers}")

    @classmethod
    def of(cls, target_cfg, num_layers: int = 1, block_size: int = 4,
           mask_id: int | None = None, target_layers: tuple[int, ...] | None = None
           ) -> "DFlashSpec":
        """A drafter at the target's geometry (``mask_id`` default: the target's last id;
        ``target_layers`` default: ``default_target_layers``)."""
        layers = target_layers or default_target_layers(target_cfg.num_layers, num_layers)
        return cls(layer=blocks.LayerSpec.of(target_cfg), num_layers=num_layers,
                   block_size=block_size,
                   mask_id=target_cfg.vocab_size - 1 if mask_id is None else mask_id,
                   target_layers=tuple(layers))

    @property
    def feature_width(self) -> int:
        return len(self.target_layers) * self.layer.width


def layer_shapes(spec: DFlashSpec) -> dict[str, tuple[int, ...]]:
    """One draft layer's weights ``[out, in]`` (split q/k/v and gate/up: the context and
    the block go through ``k`` and ``v`` separately)."""
    s = spec.layer
    d, hd, f = s.width, s.head_dim, s.intermediate_size
    return {"attn_norm": (d,), "q": (s.num_heads * hd, d), "k": (s.num_kv_heads * hd, d),
            "v": (s.num_kv_heads * hd, d), "o": (d, s.num_heads * hd), "q_norm": (hd,),
            "k_norm": (hd,), "mlp_norm": (d,), "gate": (f, d), "up": (f, d), "down": (d, f)}


def param_shapes(spec: DFlashSpec) -> dict:
    """Every weight's shape: ``{"fc", "hidden_norm", "norm", "layers": [...]}``."""
    d = spec.layer.width
    return {"fc": (d, spec.feature_width), "hidden_norm": (d,), "norm": (d,),
            "layers": [layer_shapes(spec) for _ in range(spec.num_layers)]}


def init_params(spec: DFlashSpec, key: Array, dtype=jnp.float32, scale: float = 0.05) -> dict:
    """Random parameters (norm gains 1, weights normal with ``scale``), for tests, training
    from scratch and timing."""
    leaf = lambda x: isinstance(x, tuple)  # noqa: E731 -- a shape
    paths, treedef = jax.tree_util.tree_flatten_with_path(param_shapes(spec), is_leaf=leaf)
    keys = jax.random.split(key, len(paths))
    out = [jnp.ones(s, dtype) if "norm" in jax.tree_util.keystr(p)
           else (jax.random.normal(k, s) * scale).astype(dtype) for (p, s), k in zip(paths, keys)]
    return jax.tree.unflatten(treedef, out)


def check_params(spec: DFlashSpec, dp: dict) -> None:
    """``ValueError`` naming the first weight missing, unexpected or of another shape."""
    want = param_shapes(spec)
    if set(dp) != set(want):
        raise ValueError(f"DFlash parameters have keys {sorted(dp)}; expected "
                         f"{sorted(want)}")
    if len(dp["layers"]) != spec.num_layers:
        raise ValueError(f"DFlash parameters have {len(dp['layers'])} layers; the spec "
                         f"says {spec.num_layers}")
    flat = [("", dp, want)] + [(f"layers[{i}].", p, w) for i, (p, w) in
                                   enumerate(zip(dp["layers"], want["layers"]))]
    for prefix, p, w in flat:
        for name, shape in w.items():
            if name == "layers":
                continue
            got = tuple(getattr(p.get(name), "shape", ()) or ()) if name in p else None
            if got != tuple(shape):
                raise ValueError(f"DFlash weight {prefix}{name} has shape {got}; expected "
                                 f"{tuple(shape)}")


# ----------------------------------------------------------------------------- the forward

def context(spec: DFlashSpec, p, feats: Float[Array, "B T F"]) -> Float[Array, "D B T"]:
    """The fused context ``hidden_norm(fc(feats))``, feature-major."""
    c = dense(p["fc"], feats.transpose(2, 0, 1))
    return rms_norm(c, p["hidden_norm"], spec.layer.rms_norm_eps, axis=0)


def _kv(spec: DFlashSpec, lp, x: Float[Array, "D B T"], positions: Int[Array, "B T"]):
    """One layer's keys ``[B, K, H, T]`` (normed, rotated) and values ``[B, K, T, H]``."""
    s = spec.layer
    _, b, t = x.shape
    k = dense(lp["k"], x).reshape(s.num_kv_heads, s.head_dim, b, t)
    k = apply_rope(head_norm(k, lp["k_norm"], s.rms_norm_eps), positions,
                   s.rope_scaling.inv_freq(s.head_dim, s.rope_theta))
    v = dense(lp["v"], x).reshape(s.num_kv_heads, s.head_dim, b, t)
    return k.transpose(2, 0, 1, 3), v.transpose(2, 0, 3, 1)


def context_kv(spec: DFlashSpec, p, feats: Float[Array, "B T F"],
               positions: Int[Array, "B T"]) -> list[tuple[Array, Array]]:
    """Every layer's K/V of context tokens with target features ``feats`` at
    ``positions``: what the drafter's cache holds for them."""
    c = context(spec, p, feats)
    return [_kv(spec, lp, c, positions) for lp in p["layers"]]


def _layer(spec: DFlashSpec, lp, x: Float[Array, "D B T"], positions, k_ctx, v_ctx, length,
           visible=None, mask=None) -> Float[Array, "D B T"]:
    """One draft layer on the block ``x``: attention over the block (all of it, or the
    ``mask`` [B, T, T] of several blocks at once) and the context slots ``< length`` (or
    ``visible``), then the MLP."""
    s = spec.layer
    _, b, t = x.shape
    nq, nk, hd = s.num_heads, s.num_kv_heads, s.head_dim
    h = rms_norm(x, lp["attn_norm"], s.rms_norm_eps, axis=0)
    q = dense(lp["q"], h).reshape(nq, hd, b, t)
    q = apply_rope(head_norm(q, lp["q_norm"], s.rms_norm_eps), positions,
                   s.rope_scaling.inv_freq(hd, s.rope_theta))
    q = q.reshape(nk, nq // nk, hd, b, t).transpose(3, 0, 1, 4, 2)  # [B,K,G,T,H]
    k, v = _kv(spec, lp, h, positions)
    mask = jnp.ones((b, t, t), bool) if mask is None else mask  # a block sees itself whole
    att = attention(q, k.transpose(0, 1, 3, 2), v, k_ctx, v_ctx, length, mask, visible)
    x = x + dense(lp["o"], att.transpose(1, 2, 4, 0, 3).reshape(nq * hd, b, t))
    gate, up = gate_up(lp, rms_norm(x, lp["mlp_norm"], s.rms_norm_eps, axis=0),
                       s.intermediate_size)
    return x + dense(lp["down"], jax.nn.silu(gate) * up)


def block_hidden(spec: DFlashSpec, p, emb: Float[Array, "B T D"], positions: Int[Array, "B T"],
                 caches: list[tuple[Array, Array]], length: Int[Array, "B"] | None,
                 visible=None, mask=None) -> Float[Array, "B T D"]:
    """The drafter's normed output over a block embedded as ``emb`` at ``positions``,
    reading each layer's context K/V ``caches[i]`` (slots ``< length``, or ``visible``
    [B, T, S]); ``mask`` [B, T, T]: which block tokens see which (default all: one block;
    training runs many blocks at once, each seeing itself)."""
    x = emb.transpose(2, 0, 1).astype(jnp.float32)
    for lp, (kc, vc) in zip(p["layers"], caches):
        x = _layer(spec, lp, x, positions, kc, vc, length, visible, mask)
    return rms_norm(x, p["norm"], spec.layer.rms_norm_eps, axis=0).transpose(1, 2, 0)


def block_inputs(spec: DFlashSpec, root: Int[Array, "B"]) -> Int[Array, "B T"]:
    """The block ``[root, MASK, ..., MASK]``."""
    masks = jnp.full((root.shape[0], spec.block_size - 1), spec.mask_id, jnp.int32)
    return jnp.concatenate([root[:, None].astype(jnp.int32), masks], axis=1)


def draft_logits(target, tparams, h: Float[Array, "... D"]) -> Float[Array, "... V"]:
    """Float32 logits of the drafter's normed output through the target's LM head, with
    the family's transform of it (``unembed``: Gemma 2's soft-cap)."""
    return target.unembed(tparams, h)


# ----------------------------------------------------------------------------- the drafter

@struct.dataclass
class DFlashState:
    """The drafter's cache: per layer, the context K/V at slot = position, ``length``
    context tokens (``Context.length - 1``: every token but the root)."""

    cache: KVCache


@dataclasses.dataclass(frozen=True)
class DFlashDrafter(base.ChainOrTree, base.OnTarget):
    """DFlash over ``target``: one drafter forward per round drafts ``depth`` tokens (default
    ``block_size - 1``) as a chain (``topk == 1``), or as a tree of ``total_tokens`` nodes
    from the ``topk`` best tokens at each block slot. ``spec``: the drafter's sizes."""

    target: Any
    spec: DFlashSpec
    depth: int | None = None
    topk: int = 1
    total_tokens: int | None = None

    def __post_init__(self):
        """``depth`` None: the whole block; ``total_tokens`` None: ``depth`` for a chain,
        every node a tree drafts otherwise."""
        if self.depth is None:
            object.__setattr__(self, "depth", self.spec.block_size - 1)
        self._default_total()

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return tuple(l + 1 for l in self.spec.target_layers)

    def check(self, target) -> None:
        self.check_target(target)
        cfg, spec, d = target.config, self.spec, self.depth
        if target.is_encoder_decoder:
            raise ValueError("DFlash drafts for decoder-only targets")
        bad = [l for l in spec.target_layers if not 0 <= l < cfg.num_layers]
        if bad:
            raise ValueError(f"the DFlash drafter fuses target layers {spec.target_layers}; "
                             f"{bad} do not exist in a {cfg.num_layers}-layer target")
        if spec.layer.width != cfg.hidden_size:
            raise ValueError(f"the DFlash drafter is {spec.layer.width} wide, the target "
                             f"{cfg.hidden_size}: its block is embedded by the target")
        if not 0 <= spec.mask_id < cfg.vocab_size:
            raise ValueError(f"the DFlash mask id {spec.mask_id} is not in the target's "
                             f"vocabulary of {cfg.vocab_size}")
        if not 1 <= d <= spec.block_size - 1:
            raise ValueError(f"DFlash depth {d} must lie in [1, {spec.block_size - 1}] (a "
                             f"block of {spec.block_size} drafts {spec.block_size - 1})")
        if self.topk < 1 or self.topk > cfg.vocab_size:
            raise ValueError(f"DFlash topk={self.topk} must lie in [1, {cfg.vocab_size}]")
        if not self.chain and not d <= self.num_nodes <= eagle.pool_size(d, self.topk):
            raise ValueError(f"DFlash total_tokens={self.num_nodes} must lie in [{d}, "
                             f"{eagle.pool_size(d, self.topk)}] for depth {d}, topk "
                             f"{self.topk}")

    def check_params(self, dparams) -> None:
        check_params(self.spec, dparams)

    def init(self, dparams, ctx, chunk: int) -> DFlashState:
        b, c = ctx.tokens.shape
        pos = jnp.broadcast_to(jnp.arange(c), (b, c))
        kv = context_kv(self.spec, dparams, ctx.hidden, pos)
        pad = self.depth + 1  # a commit writes up to depth + 1 slots past length
        dtype = dparams["fc"].dtype
        ks = tuple(jnp.pad(k, ((0, 0),) * 3 + ((0, pad),)).astype(dtype) for k, _ in kv)
        vs = tuple(jnp.pad(v, ((0, 0), (0, 0), (0, pad), (0, 0))).astype(dtype) for _, v in kv)
        return DFlashState(cache=KVCache(k=ks, v=vs, length=ctx.prompt_len.astype(jnp.int32)))

    def block_logits(self, dparams, tparams, cache: KVCache, root, root_pos):
        """Logits ``[B, depth, V]`` of block slots ``1 .. depth`` for ``root`` at
        ``root_pos`` over the context in ``cache``."""
        toks = block_inputs(self.spec, root)
        pos = root_pos[:, None] + jnp.arange(self.spec.block_size)[None]
        h = block_hidden(self.spec, dparams, self.target.embed(tparams, toks), pos,
                         list(zip(cache.k, cache.v)), cache.length)
        return draft_logits(self.target, tparams, h[:, 1:1 + self.depth])

    def propose(self, dparams, state: DFlashState, ctx, key, sampler):
        b = ctx.tokens.shape[0]
        root_pos = ctx.length - 1
        root = jnp.take_along_axis(ctx.tokens, root_pos[:, None], axis=1)[:, 0]
        logits = self.block_logits(dparams, ctx.params, state.cache, root, root_pos)
        if self.chain:
            toks = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            draft = Draft(tokens=toks, parents=tree.chain(b, self.depth),
                          valid=jnp.ones(toks.shape, bool))
            return draft, state, ctx.cache
        logq = jax.nn.log_softmax(logits, axis=-1)  # [B, depth, V]
        k = self.topk

        def step(inner, d, tokens, parent):  # every branch sees the same slot d + 1
            return jnp.broadcast_to(logq[:, d][:, None], (b, k, logq.shape[-1])), inner

        pool, _ = eagle.expand(logq[:, 0], step, (), self.depth, k)
        t = eagle.rerank(pool, self.num_nodes, root_pos)
        draft = Draft(tokens=t.tokens, parents=t.parents, valid=jnp.ones(t.tokens.shape, bool))
        return draft, state, ctx.cache

    def commit(self, dparams, state: DFlashState, ctx, result) -> DFlashState:
        """Writes the context K/V of the root and the accepted path (the target's features
        of the verification forward) at their positions; ``length`` becomes
        ``ctx.length - 1``."""
        cache = state.cache
        nodes = jnp.concatenate([jnp.zeros((result.path.shape[0], 1), jnp.int32),
                                 jnp.maximum(result.path, -1) + 1], axis=1)
        h = jnp.take_along_axis(ctx.hidden, nodes[:, :, None], axis=1)
        pos = cache.length[:, None] + jnp.arange(nodes.shape[1])[None]
        kv = context_kv(self.spec, dparams, h.astype(dparams["fc"].dtype), pos)
        ks = tuple(kv_cache.write(kc, cache.length, k.astype(kc.dtype), axis=3)
                   for kc, (k, _) in zip(cache.k, kv))
        vs = tuple(kv_cache.write(vc, cache.length, v.astype(vc.dtype), axis=2)
                   for vc, (_, v) in zip(cache.v, kv))
        return DFlashState(cache=KVCache(k=ks, v=vs, length=(ctx.length - 1).astype(jnp.int32)))


__all__ = ["DFlashDrafter", "DFlashSpec", "DFlashState", "block_hidden", "block_inputs",
           "check_params", "context", "context_kv", "default_target_layers", "draft_logits",
           "init_params", "layer_shapes", "param_shapes"]
