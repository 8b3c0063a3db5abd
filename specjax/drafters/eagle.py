"""EAGLE-2: a draft head over the target's features and a dynamic draft tree.

The head does autoregression over features: at position ``i`` it reads the target's
feature at ``i - 1`` (the final-normed last hidden state, zero before the first token) and
the embedding of token ``i``, and predicts the feature at ``i``; the target's frozen LM head
turns a feature into next-token logits::

    f̂_i = layers(fc([embed(x_i); f_{i-1}]))       logits_{i+1} = f̂_i · Eᵀ

``layers`` is one decoder layer (EAGLE's heads), or more (``init_head(layers=N)``: the
published EAGLE-1/2 layout's ``num_hidden_layers``).

``E`` is the target's output embedding, or its rows for a reduced draft vocabulary (the
most frequent target tokens; drafted ids are mapped back to full ids).

``dynamic_tree`` grows the EAGLE-2 tree inside ``jit`` with static shapes: ``depth``
expansion steps each expand the ``topk`` best nodes of the newest level (by path value, the
product of draft probabilities along the path), and reranking keeps the ``total_tokens``
best nodes of everything drafted. The draft is deterministic (``Draft.probs`` is None), so
tree rejection sampling with one-hot q keeps decoding lossless at any temperature.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax import lax
from jaxtyping import Array, Bool, Float, Int

from specjax.core import tree
from specjax.core.decoding import over_chunks
from specjax.drafters import base, blocks
from specjax.drafters.blocks import features
from specjax.models.kv_cache import KVCache
from specjax.core.verify import Draft


# ----------------------------------------------------------------------------- the head

class EagleHead(nnx.Module):
    """The EAGLE draft head as a Flax NNX module: ``fc`` ([2D, D] and bias) and one
    pre-norm decoder layer (``blocks.decoder_layer``) at the target's width and head
    geometry (``blocks.LayerSpec.of(target_cfg)``).

    Its state is the plain pytree ``{"fc", "fc_b", "layer": {...}}`` that exports,
    checkpoints and the functional ``head_forward`` use; ``nnx.merge(head_graphdef(cfg),
    params)`` rebuilds the module from it inside ``jit``. The layer's output projections
    start small, so a fresh head starts near ``fc``. ``attn_norm=False`` leaves out the
    layer's attention-input norm, as published EAGLE-1/2 heads' layer 0 has none: such a
    head is what SafeAILab/EAGLE's layout holds (``heads.published.save("eagle", ...)``);
    every other parameter is drawn as with the norm.
    """

    def __init__(self, target_cfg, key: Array, dtype=jnp.float32, attn_norm: bool = True):
        d = target_cfg.hidden_size
        self.config = target_cfg
        self.spec = blocks.LayerSpec.of(target_cfg)
        k_fc, k_layer = jax.random.split(key)
        shapes = blocks.layer_shapes(self.spec)
        keys = jax.random.split(k_layer, len(shapes))
        layer = {n: jax.random.normal(k, s) * 0.02 for (n, s), k in zip(shapes.items(), keys)}
        layer["attn_norm"], layer["mlp_norm"] = jnp.ones((d,)), jnp.ones((d,))
        layer["o"], layer["down"] = layer["o"] * 0.1, layer["down"] * 0.1
        if not attn_norm:
            del layer["attn_norm"]
        fc = jnp.concatenate([jax.random.normal(k_fc, (d, d)) * 0.02, jnp.eye(d)], axis=0)
        self.fc = nnx.Param(fc.astype(dtype))
        self.fc_b = nnx.Param(jnp.zeros((d,), dtype))
        self.layer = nnx.data({n: nnx.Param(w.astype(dtype)) for n, w in layer.items()})

    def __call__(self, emb: Float[Array, "B T D"], prev_feat: Float[Array, "B T D"],
                 positions: Int[Array, "B T"], k_cache, v_cache, length, mask,
                 visible=None) -> tuple[Float[Array, "B T D"], Array, Array]:
        """Predicted features from the input embeddings and the previous positions'
        features; K/V of the new tokens are written at slot ``length`` of the head's
        one-layer cache (``apply_head``)."""
        hp = {"fc": self.fc[...], "fc_b": self.fc_b[...],
              "layer": {n: w[...] for n, w in self.layer.items()}}
        return apply_head(self.spec, hp, emb, prev_feat, positions, k_cache, v_cache, length,
                          mask, visible)


def head_layers(hp) -> list:
    """The head's decoder layers in order: ``hp["layer"]``, then ``hp["extra_layers"]``."""
    return [hp["layer"], *hp.get("extra_layers", ())]


def num_layers(hp) -> int:
    """How many decoder layers the head ``hp`` has (static: the pytree's structure)."""
    return len(head_layers(hp))


def apply_head(spec: blocks.LayerSpec, hp, emb: Float[Array, "B T D"],
               prev_feat: Float[Array, "B T D"], positions: Int[Array, "B T"], k_cache, v_cache,
               length, mask, visible=None) -> tuple[Float[Array, "B T D"], Array, Array]:
    """The EAGLE-1/2 head ``layers(fc([emb; prev_feat]))`` on the pytree ``hp``
    (``{"fc" [2D, D], "fc_b" [D], "layer"}``, embedding first, and optionally
    ``"extra_layers"``, a list of layers after ``"layer"``): decoder layers of sizes
    ``spec`` (``blocks.decoder_layer``: a layer without ``attn_norm``, as published heads'
    layer 0, runs its attention on the unnormed ``fc`` output). The cache holds every
    layer's K/V heads side by side (``blocks.empty_kv(..., layers=num_layers(hp))``).
    Returns the predicted features and the cache with the new tokens' K/V written at slot
    ``length``."""
    chex.assert_equal_shape([emb, prev_feat])
    fc = hp["fc"]
    x = jnp.concatenate([emb.astype(fc.dtype), prev_feat.astype(fc.dtype)], axis=-1)
    x = jnp.einsum("bte,ed->btd", x, fc) + hp["fc_b"]  # b batch, t token, e = 2D, d = D
    layers = head_layers(hp)
    if len(layers) == 1:
        return blocks.decoder_layer(spec, hp["layer"], x, k_cache, v_cache, length, mask,
                                    positions, visible)
    nk = spec.num_kv_heads
    if k_cache.shape[1] != len(layers) * nk:
        raise ValueError(f"a {len(layers)}-layer head needs {len(layers) * nk} K/V heads in "
                         f"its cache, got {k_cache.shape[1]} (blocks.empty_kv(layers=...))")
    ks, vs = [], []
    for i, lp in enumerate(layers):
        part = slice(i * nk, (i + 1) * nk)
        x, k, v = blocks.decoder_layer(spec, lp, x, k_cache[:, part], v_cache[:, part],
                                       length, mask, positions, visible)
        ks.append(k)
        vs.append(v)
    return x, jnp.concatenate(ks, axis=1), jnp.concatenate(vs, axis=1)


@functools.lru_cache(maxsize=None)
def head_graphdef(target_cfg, attn_norm: bool = True):
    """The ``EagleHead`` graph for a target configuration (shapes come from the params),
    with or without the layer's ``attn_norm``."""
    return nnx.split(nnx.eval_shape(
        lambda: EagleHead(target_cfg, jax.random.key(0), attn_norm=attn_norm)))[0]


def init_head(target_cfg, key: Array, dtype=jnp.float32, attn_norm: bool = True,
              layers: int = 1) -> dict:
    """A fresh ``EagleHead``'s parameters as a plain pytree; ``attn_norm=False``: without
    the layer's attention-input norm (``layer["attn_norm"]``), the published EAGLE-1/2
    layout, the other parameters equal to the normed head's for the same ``key``.

    ``layers > 1`` adds ``extra_layers``: that many more pre-norm decoder layers (each with
    ``attn_norm``) after ``layer``, drawn as ``layer`` is but with zero output projections
    (``o``, ``down``), so each starts as the identity and the head computes exactly what
    its first layer does (a warm start from a one-layer head keeps its function)."""
    if layers < 1:
        raise ValueError(f"an EAGLE head has at least one layer, got layers={layers}")
    hp = nnx.to_pure_dict(nnx.state(EagleHead(target_cfg, key, dtype, attn_norm)))
    if layers > 1:
        keys = jax.random.split(jax.random.fold_in(key, 1), layers - 1)
        hp["extra_layers"] = [_identity_layer(target_cfg, k, dtype) for k in keys]
    return hp


def _identity_layer(target_cfg, key: Array, dtype) -> dict:
    """A pre-norm decoder layer drawn as ``EagleHead``'s, its ``o`` and ``down`` zero."""
    layer = dict(nnx.to_pure_dict(nnx.state(EagleHead(target_cfg, key, dtype)))["layer"])
    layer["o"], layer["down"] = jnp.zeros_like(layer["o"]), jnp.zeros_like(layer["down"])
    return layer


def output_embedding(target, tparams) -> Float[Array, "V D"]:
    """The target's LM head as ``[V, D]`` (the tied embedding for SmolLM2)."""
    return target.output_head(tparams)


def head_forward(target, hp, tparams, tokens: Int[Array, "B T"], prev_feat: Float[Array, "B T D"],
                 positions: Int[Array, "B T"], k_cache, v_cache, length, mask,
                 visible=None, spec: blocks.LayerSpec | None = None
                 ) -> tuple[Float[Array, "B T D"], Array, Array]:
    """The head with parameters ``hp`` on ``tokens``, embedded by the target (or by the
    head's own ``"embed"`` rows where it carries them); see ``apply_head``. ``spec``: the
    head layer's sizes (default: the target's, ``LayerSpec.of(target.config)``)."""
    spec = blocks.LayerSpec.of(target.config) if spec is None else spec
    emb = hp["embed"][tokens] if "embed" in hp else target.embed(tparams, tokens)
    return apply_head(spec, hp, emb, prev_feat, positions, k_cache, v_cache, length, mask,
                      visible)


def training_forward(target, hp, tparams, tokens: Int[Array, "B T"],
                     prev_feat: Float[Array, "B T D"]) -> Float[Array, "B T D"]:
    """Teacher-forced head over whole sequences (causal, no cache): predicted features."""
    b, t = tokens.shape
    zk, zv = blocks.empty_kv(blocks.LayerSpec.of(target.config), b, t, hp["fc"].dtype,
                             num_layers(hp))
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    out, _, _ = head_forward(target, hp, tparams, tokens, prev_feat, pos, zk, zv,
                             blocks.filled(b, 0), blocks.causal(b, t))
    return out


def head_inputs(tokens: Int[Array, "B T"], feats: Float[Array, "B T D"]
                ) -> tuple[Int[Array, "B T-1"], Float[Array, "B T-1 D"]]:
    """The head's input sequence over a context of ``T`` tokens, in EAGLE's layout: entry
    ``t`` (at position ``t``) pairs token ``t + 1`` with the target's feature at ``t``, for
    ``t < T - 1``; token 0 has no entry. It is the sequence SafeAILab/EAGLE's draft layer and
    trainers and SpecForge's build (``input_ids[:, 1:]`` beside the hidden states), so a
    published head drafts here on the context it was trained on, and a head trained here on
    the context EAGLE gives it. Entry ``t``'s output predicts feature ``t + 1`` and token
    ``t + 2``."""
    return tokens[:, 1:], feats[:, :-1]


# ----------------------------------------------------------------------------- the tree

@struct.dataclass
class Pool:
    """Every node drafted in one round, in generation order (level by level).

    ``parent`` indexes the pool (-1: the root); ``value`` is the log path value (what
    expansion ranks by, unless ``by_value`` is off: then ``logq``); ``logq`` is the node's
    own draft log-probability; ``level`` is each node's depth (1: the root's children).
    """

    tokens: Int[Array, "B P"]
    parent: Int[Array, "B P"]
    value: Float[Array, "B P"]
    logq: Float[Array, "B P"]
    level: Int[Array, "P"]


def pool_size(depth: int, topk: int) -> int:
    """Nodes drafted by ``depth`` levels: ``topk`` below the root, then ``topk²`` per level."""
    return topk + (depth - 1) * topk * topk


def expand(root_logq: Float[Array, "B V"], step: Callable, carry, depth: int, topk: int,
           by_value: bool = True, vocab_ids: Int[Array, "V"] | None = None) -> tuple[Pool, Any]:
    """EAGLE-2 expansion. Level 1 is the root's ``topk`` children; each later level is the
    ``topk`` children of each of the ``topk`` best nodes of the level above, ranked by path
    value (``by_value``) or by the node's own confidence.

    ``step(carry, level, tokens[B,K], parent[B,K]) -> (logq[B,K,V], carry)`` runs the head on
    the chosen nodes of ``level`` (a Python int: the levels are unrolled; ``parent`` indexes
    the nodes chosen at ``level - 1``).
    ``vocab_ids`` maps the draft vocabulary's indices to token ids (default: identity).
    """
    ids = (lambda t: t.astype(jnp.int32)) if vocab_ids is None else (lambda t: vocab_ids[t])
    b = root_logq.shape[0]
    lq, tok = lax.top_k(root_logq, topk)
    first = (ids(tok), jnp.full((b, topk), -1, jnp.int32), lq, lq)
    kk = jnp.arange(topk * topk) // topk  # which chosen node a child hangs from

    def level(c, d):
        (tok, par, val, lq), inner, chosen_prev = c
        # choose the topk nodes of this level to expand (level 1 has exactly topk)
        rank = val if by_value else lq
        order = jnp.argsort(-rank, axis=1, stable=True)[:, :topk]
        pick = lambda x: jnp.take_along_axis(x, order, axis=1)
        c_tok, c_val = pick(tok), pick(val)
        c_pool = pick(jnp.broadcast_to(_level_offset(d, topk) + jnp.arange(tok.shape[1]),
                                       tok.shape))
        logq, inner = step(inner, d, c_tok, pick(par_in_prev(par, chosen_prev)))
        clq, ctok = lax.top_k(logq, topk)  # [B, K, K]
        ctok = ids(ctok.reshape(b, -1))
        clq = clq.reshape(b, -1)
        cval = c_val[:, kk] + clq
        cpar = c_pool[:, kk]
        return ((ctok, cpar, cval, clq), inner, c_pool), (ctok, cpar, cval, clq)

    # The levels are unrolled (``depth`` is static and small): no nested loop in the decode
    # round, whose iterations each read a predicate on the host under XLA:GPU, and each
    # level's step sees its level as a constant. Level 1 has exactly topk nodes.
    c, levels = (first, carry, jnp.zeros((b, topk), jnp.int32)), [first]
    for d in range(1, depth):
        c, out = level(c, d)
        levels.append(out)
    carry = c[1]
    flat = lambda i: jnp.concatenate([lv[i] for lv in levels], 1)
    pool = Pool(tokens=flat(0), parent=flat(1), value=flat(2), logq=flat(3),
                level=jnp.asarray(_levels(depth, topk)))
    return pool, carry


def par_in_prev(pool_parent, chosen_prev):
    """Index, among the nodes chosen at the previous level, of each node's parent."""
    hit = pool_parent[:, :, None] == chosen_prev[:, None, :]
    return jnp.argmax(hit, axis=-1).astype(jnp.int32)


def _level_offset(d, topk: int):
    """Pool index of the first node of level ``d`` (1-based)."""
    return jnp.where(d <= 1, 0, topk + (d - 2) * topk * topk)


def _levels(depth: int, topk: int) -> np.ndarray:
    return np.asarray([1] * topk + [d for d in range(2, depth + 1) for _ in range(topk * topk)],
                      np.int32)


@struct.dataclass
class Tree:
    """The chosen draft tree: ``tokens``/``parents`` in the drafter protocol's draft format
    (``specjax.core.drafter``; parents precede children), the ``[N+1, N+1]`` tree-attention mask over ``[root, nodes]``, the
    positions of ``[root, nodes]``, and each node's pool index and value."""

    tokens: Int[Array, "B N"]
    parents: Int[Array, "B N"]
    mask: Bool[Array, "B N+1 N+1"]
    positions: Int[Array, "B N+1"]
    index: Int[Array, "B N"]
    value: Float[Array, "B N"]


def rerank(pool: Pool, total_tokens: int, root_pos: Int[Array, "B"],
           enabled: bool = True) -> Tree:
    """Keeps ``total_tokens`` nodes of the pool as a connected tree.

    Enabled: the best nodes by path value, shallower first on ties. A child's value
    never exceeds its parent's, so every kept node's parent is kept. Without: the first
    ``total_tokens`` nodes level by level (best first within a level), EAGLE-2's ablation.
    """
    b, p = pool.tokens.shape
    if not 1 <= total_tokens <= p:
        raise ValueError(f"total_tokens={total_tokens} must lie in [1, {p}] (the nodes drafted)")
    if enabled:
        order = jnp.argsort(-pool.value, axis=1, stable=True)  # ties: lower index = shallower
    else:
        key = pool.level[None].astype(jnp.float32) * 1e4 - jnp.maximum(pool.value, -1e3)
        order = jnp.argsort(key, axis=1, stable=True)
    sel = jnp.sort(order[:, :total_tokens], axis=1)  # pool order: parents first
    take = lambda x: jnp.take_along_axis(x, sel, axis=1)
    ppar = take(pool.parent)
    # a kept parent's position among the kept nodes is how many kept indices precede it
    parents = jnp.where(ppar < 0, -1, jnp.sum(sel[:, None, :] < ppar[:, :, None], -1))
    parents = parents.astype(jnp.int32)
    depth = take(jnp.broadcast_to(pool.level, (b, p)))
    positions = root_pos[:, None] + jnp.concatenate(
        [jnp.zeros((b, 1), jnp.int32), depth], axis=1)
    return Tree(tokens=take(pool.tokens), parents=parents,
                mask=tree.attention_mask(parents), positions=positions, index=sel,
                value=take(pool.value))


# ----------------------------------------------------------------------------- the drafter

def draft_params(head: dict, target, tparams, vocab_ids=None) -> dict:
    """What ``EagleDrafter`` reads: the head, and the LM-head rows of the draft vocabulary
    (``vocab_ids``, most frequent first; None keeps the target's whole vocabulary)."""
    if vocab_ids is None:
        return {"head": head}
    ids = jnp.asarray(vocab_ids, jnp.int32)
    v = target.config.vocab_size
    if ids.ndim != 1 or int(ids.min()) < 0 or int(ids.max()) >= v:
        raise ValueError(f"draft vocabulary ids must be a 1-D array of ids in [0, {v})")
    if len(np.unique(np.asarray(ids))) != ids.shape[0]:
        raise ValueError("draft vocabulary ids must be distinct")
    return {"head": head, "vocab_ids": ids, "out_embed": output_embedding(target, tparams)[ids]}


@struct.dataclass
class EagleState:
    """The head's cache (every head layer's K/V heads side by side; slot = position =
    entry of ``head_inputs``, ``length`` entries processed) and the target features of the
    entries still to feed it (with ``Context``, the pending entries are
    ``[length, ctx.length - 1)``: entry ``t`` pairs token ``t + 1`` with feature ``t``)."""

    cache: KVCache
    feats: Float[Array, "B M D"]


@dataclasses.dataclass(frozen=True)
class EagleDrafter(base.OnTarget):
    """EAGLE-2: the trained head drafts a dynamic tree of ``total_tokens`` nodes grown over
    ``depth`` levels by expanding the ``topk`` best nodes of each level.

    ``by_value`` ranks expansion by path value (False: by the node's own confidence) and
    ``rerank`` keeps the best nodes overall (False: breadth-first), EAGLE-2's ablations.
    """

    target: Any
    depth: int = 5
    topk: int = 8
    total_tokens: int = 24
    by_value: bool = True
    rerank: bool = True
    spec: blocks.LayerSpec | None = None  # the head layer's sizes (None: the target's)

    chain = False  # drafts are trees
    # needs_features, feature_layers (the last layer), draft_model (None): OnTarget's

    @property
    def layer_spec(self) -> blocks.LayerSpec:
        """The head layer's sizes: ``spec``, or the target's geometry
        (``LayerSpec.of(target.config)``, the heads ``specjax train eagle`` makes)."""
        return blocks.LayerSpec.of(self.target.config) if self.spec is None else self.spec

    @property
    def num_nodes(self) -> int:
        return self.total_tokens

    @property
    def verify_widths(self) -> tuple[int, ...]:
        return (self.total_tokens + 1,)

    @property
    def scratch(self) -> int:
        return self.depth + 1 + (self.depth - 1) * self.topk

    def check(self, target) -> None:
        self.check_target(target)
        if self.depth < 1 or self.topk < 1:
            raise ValueError(f"EAGLE depth and topk must be >= 1, got depth={self.depth}, "
                             f"topk={self.topk}")
        p = pool_size(self.depth, self.topk)
        if not self.depth <= self.total_tokens <= p:
            raise ValueError(f"total_tokens={self.total_tokens} must lie in [depth={self.depth}, "
                             f"{p}]: the tree keeps a path of depth {self.depth}, and depth "
                             f"{self.depth} and topk {self.topk} draft {p} nodes")

    def check_params(self, dparams) -> None:
        v = dparams.get("vocab_ids")
        n = self.target.config.vocab_size if v is None else v.shape[0]
        if self.topk > n:
            raise ValueError(f"topk={self.topk} exceeds the draft vocabulary ({n} tokens)")

    def _embed(self, dparams, tparams):
        return dparams.get("out_embed", output_embedding(self.target, tparams))

    def _logq(self, dparams, tparams, f):
        """Log-probabilities of the head's feature through the target's ``unembed`` (its
        LM head, or the head's ``out_embed`` rows, and the family's logit transform)."""
        return jax.nn.log_softmax(self.target.unembed(tparams, f, self._embed(dparams, tparams)),
                                  axis=-1)

    def _features(self, tparams, hidden):
        """The head's feature input from ``Context.hidden``: the final-normed last layer."""
        return features(self.target, tparams, hidden)

    def _head(self, dparams, tparams, tokens, prev, positions, k, v, length, mask,
              visible=None):
        return head_forward(self.target, dparams["head"], tparams, tokens, prev, positions, k,
                            v, length, mask, visible, spec=self.layer_spec)

    def init(self, dparams, ctx, chunk: int) -> EagleState:
        spec, tp = self.layer_spec, ctx.params
        b, c = ctx.tokens.shape
        dtype = dparams["head"]["fc"].dtype
        cache = KVCache.zeros(1, b, c + self.scratch,
                              spec.num_kv_heads * num_layers(dparams["head"]), spec.head_dim,
                              dtype)
        feats = self._features(tp, ctx.hidden)  # [B, C, F] over the prompt
        pad = lambda x: jnp.pad(x, ((0, 0), (0, 1)) + ((0, 0),) * (x.ndim - 2))  # noqa: E731
        toks, prev = head_inputs(pad(ctx.tokens), pad(feats))  # C entries each, as chunks read
        n = ctx.prompt_len - 1  # entries of the prompt: the last prompt feature is pending

        def body(start, pos, kv):
            k, v = kv
            sl = lambda x: lax.dynamic_slice_in_dim(x, start, chunk, axis=1)
            _, k, v = self._head(dparams, tp, sl(toks), sl(prev), pos, k, v,
                                 jnp.full((b,), start, jnp.int32), blocks.causal(b, chunk))
            return k, v

        k, v = over_chunks(body, (cache.k[0], cache.v[0]), n, chunk)
        pending = jnp.take_along_axis(feats, n[:, None, None], axis=1)
        pending = jnp.pad(pending, ((0, 0), (0, self.depth), (0, 0)))
        return EagleState(cache=KVCache(k=(k,), v=(v,), length=n.astype(jnp.int32)),
                          feats=pending.astype(dtype))

    def propose(self, dparams, state: EagleState, ctx, key, sampler):
        tp = ctx.params
        b, m = state.feats.shape[:2]
        L = state.cache.length
        count = ctx.length - 1 - L  # pending entries (``head_inputs``), the root's last
        pos = L[:, None] + jnp.arange(m)[None]
        toks = jnp.take_along_axis(ctx.tokens, jnp.minimum(pos + 1, ctx.tokens.shape[1] - 1), 1)
        mask = blocks.causal(b, m)
        out, k, v = self._head(dparams, tp, toks, state.feats, pos, state.cache.k[0],
                               state.cache.v[0], L, mask)
        f_root = jnp.take_along_axis(out, jnp.maximum(count - 1, 0)[:, None, None], axis=1)[:, 0]
        base = L + count  # == ctx.length - 1: first scratch slot
        kk, n_scr = self.topk, (self.depth - 1) * self.topk
        root_pos = base - 1  # the root's entry; level d's nodes lie at root_pos + d

        def step(inner, d, tokens, parent):
            k, v, f_prev, anc = inner
            if d == 1:  # children of the root (``d`` is static: the levels are unrolled)
                prev = jnp.broadcast_to(f_root[:, None], f_prev.shape)
                anc = jnp.zeros_like(anc)
            else:
                prev = jnp.take_along_axis(f_prev, parent[:, :, None], axis=1)
                par_anc = jnp.take_along_axis(anc, parent[:, :, None], axis=1)
                own = jax.nn.one_hot((d - 2) * kk + parent, n_scr, dtype=bool)
                anc = par_anc | own  # [B, K, n_scr]
            # the committed slots, and the scratch slots of this node's ancestors
            rel = jnp.arange(k.shape[3])[None, None, :] - base[:, None, None]  # [B, 1, S]
            scr = jnp.take_along_axis(anc, jnp.broadcast_to(jnp.clip(rel, 0, n_scr - 1),
                                                            (b, kk, k.shape[3])), axis=2)
            vis = (rel < 0) | (scr & (rel < n_scr))
            eye = jnp.broadcast_to(jnp.eye(kk, dtype=bool), (b, kk, kk))
            p = jnp.broadcast_to(root_pos[:, None] + d, (b, kk))
            f, k, v = self._head(dparams, tp, tokens, prev, p, k, v, base + (d - 1) * kk, eye,
                                 vis)
            return self._logq(dparams, tp, f), (k, v, f, anc)

        f0 = jnp.zeros((b, kk, f_root.shape[-1]), out.dtype)
        anc0 = jnp.zeros((b, kk, n_scr), bool)
        # the head cache after the levels: their scratch entries lie at slots >= base, which
        # nothing reads before the next round's writes (keeping the cache from before the
        # levels instead made XLA copy the whole head cache twice per round)
        pool, (k, v, _, _) = expand(self._logq(dparams, tp, f_root), step, (k, v, f0, anc0),
                                    self.depth, kk, self.by_value, dparams.get("vocab_ids"))
        t = rerank(pool, self.total_tokens, root_pos, self.rerank)
        draft = Draft(tokens=t.tokens, parents=t.parents, valid=jnp.ones(t.tokens.shape, bool))
        cache = KVCache(k=(k,), v=(v,), length=base)
        return draft, state.replace(cache=cache), ctx.cache

    def commit(self, dparams, state: EagleState, ctx, result) -> EagleState:
        """Queues the target's features of the root and the accepted path for the head."""
        nodes = jnp.concatenate([jnp.zeros((result.path.shape[0], 1), jnp.int32),
                                 jnp.maximum(result.path, -1) + 1], axis=1)
        h = jnp.take_along_axis(ctx.hidden, nodes[:, :, None], axis=1)
        feats = self._features(ctx.params, h)
        return state.replace(feats=feats.astype(state.feats.dtype))
