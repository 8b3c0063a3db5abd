"""Gemma 4's MTP assistants: a drafter that ships with the model, with no cache of its own.

A Gemma 4 assistant (transformers' ``Gemma4AssistantForCausalLM``) is a few Gemma 4 decoder
layers of its own width that keep no keys or values: each layer's queries attend to the
target's cached keys and values, those of the target's last sliding and last full layer
that keep them (``Gemma4Config.kv_layers``). One drafting step, for the root (the last
emitted token, at position ``p``; the target's cache holds positions ``< p``)::

    x  = pre_proj [embed_target(token); h]             h: the target's final-normed state
    x  = layers(x)     queries rotated at p, over the target's K/V (no mask among nodes)
    hn = norm(x);  logits = lm_head(hn)  (or over the top centroids' tokens);  h' = post_proj hn

and the next step feeds the drafted token with ``h'``, still at position ``p``. The first
``h`` is the target's state at ``p - 1`` (the one that predicted the root).

Because a step reads nothing but the target's cache and its own input, nodes never see each
other: a dynamic tree (EAGLE-2's expansion and reranking, ``eagle.expand`` and
``eagle.rerank``) costs one batched step per depth, and needs no tree attention inside the
drafter. A chain (``topk == 1``) costs one step per token, as transformers'
``SinglePositionMultiTokenCandidateGenerator`` runs it.

What the queries see: full layers every committed slot ``< p``; sliding layers the last
``sliding_window + 1`` of them (transformers' bidirectional window, flipped). transformers'
assisted generation also shows the assistant the target's K/V at slot ``p`` after a round
that rejected a draft (the first rejected draft's, left in the cache) and past the window
every rejected draft; ``reads_rejected`` reproduces the first within the window, for
comparing drafts with it, chains only. Drafts are argmax (``Draft.probs`` None): with a
sampling target, verification against the target keeps decoding lossless.
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
from specjax.drafters import base, eagle
from specjax.drafters.blocks import features
from specjax.models.gemma import rms_norm
from specjax.models.gemma4 import FULL, SLIDING, Gemma4Config, feed_forward, layer_freqs, queries
from specjax.models.ops import dense, head_logits


@dataclasses.dataclass(frozen=True)
class MTPSpec:
    """An assistant's sizes: ``text``, its decoder layers (a ``Gemma4Config`` of its own
    width whose layers keep no K/V: their geometry per type is the target's), the width
    it reads and writes back (``backbone_hidden_size``: the target's), and the centroid
    head (``ordered``: ``num_centroids`` clusters of ``vocab / num_centroids`` tokens, of
    which the ``centroid_top_k`` best are scored)."""

    text: Gemma4Config
    backbone_hidden_size: int
    ordered: bool = False
    num_centroids: int = 2048
    centroid_top_k: int = 32

    def __post_init__(self):
        t = self.text
        if t.num_experts or t.hidden_size_per_layer_input or t.use_double_wide_mlp:
            raise ValueError("an assistant's layers have no experts, per-layer inputs or "
                             "double-wide MLPs")
        if self.ordered and (t.vocab_size % self.num_centroids or
                             not 1 <= self.centroid_top_k <= self.num_centroids):
            raise ValueError(f"{self.num_centroids} centroids must divide the vocabulary of "
                             f"{t.vocab_size}, and centroid_top_k={self.centroid_top_k} lie "
                             f"in [1, {self.num_centroids}]")

    @classmethod
    def of(cls, target: Gemma4Config, hidden: int, intermediate: int, heads: int,
           layers: int = 4, ordered: bool = False, num_centroids: int = 2048,
           centroid_top_k: int = 32) -> "MTPSpec":
        """An assistant for ``target``: ``layers`` layers (the last full, the others
        sliding, as Google's), the target's geometry per layer type, RoPE and window."""
        types = (SLIDING,) * (layers - 1) + (FULL,)
        nk, hd = target.geometry(SLIDING)
        text = dataclasses.replace(
            target, hidden_size=hidden, intermediate_size=intermediate, num_layers=layers,
            num_heads=heads, layer_types=types, num_kv_shared_layers=0,
            hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, num_experts=0,
            top_k_experts=0, moe_intermediate_size=0, use_double_wide_mlp=False,
            final_logit_softcapping=None, tie_embeddings=True)
        return cls(text, target.hidden_size, ordered, num_centroids, centroid_top_k)


def param_shapes(spec: MTPSpec) -> dict:
    """Every weight's shape: ``pre_proj``, ``post_proj``, ``embed`` (the tied LM head),
    ``final_norm``, ``centroids`` and ``token_ordering`` (ordered heads), ``layers``."""
    t = spec.text
    d, big, f = t.hidden_size, spec.backbone_hidden_size, t.intermediate_size
    layers = []
    for kind in t.layer_types:
        hd = t.geometry(kind)[1]
        layers.append({"attn_norm": (d,), "q": (t.num_heads * hd, d), "q_norm": (hd,),
                       "o": (d, t.num_heads * hd), "post_attn_norm": (d,), "mlp_norm": (d,),
                       "gate": (f, d), "up": (f, d), "down": (d, f), "post_mlp_norm": (d,),
                       "layer_scalar": (1,)})
    s = {"pre_proj": (d, 2 * big), "post_proj": (big, d), "embed": (t.vocab_size, d),
         "final_norm": (d,), "layers": layers}
    if spec.ordered:
        s.update(centroids=(spec.num_centroids, d), token_ordering=(t.vocab_size,))
    return s


def init_params(spec: MTPSpec, key: Array, dtype=jnp.float32, scale: float = 0.05) -> dict:
    """Random weights (gains near 1; ``token_ordering`` a random permutation), for tests,
    the device check and training from scratch."""
    leaf = lambda x: isinstance(x, tuple)  # noqa: E731 -- a shape
    paths, treedef = jax.tree_util.tree_flatten_with_path(param_shapes(spec), is_leaf=leaf)
    keys = jax.random.split(key, len(paths) + 1)
    out = []
    for (p, s), k in zip(paths, keys):
        name = jax.tree_util.keystr(p)
        if "token_ordering" in name:
            out.append(jax.random.permutation(k, s[0]).astype(jnp.int32))
        elif "norm" in name or "layer_scalar" in name:
            out.append((1.0 + 0.1 * jax.random.normal(k, s)).astype(dtype))
        else:
            out.append((jax.random.normal(k, s) * scale).astype(dtype))
    return jax.tree.unflatten(treedef, out)


def check_params(spec: MTPSpec, ap: dict) -> None:
    """``ValueError`` naming the first weight missing, unexpected or of another shape."""
    want = param_shapes(spec)
    if set(ap) != set(want) or len(ap["layers"]) != len(want["layers"]):
        raise ValueError(f"assistant parameters have keys {sorted(ap)} and "
                         f"{len(ap.get('layers', []))} layers; expected {sorted(want)} and "
                         f"{len(want['layers'])}")
    pairs = [("", ap, want)] + [(f"layers[{i}].", p, w) for i, (p, w) in
                                enumerate(zip(ap["layers"], want["layers"]))]
    for prefix, p, w in pairs:
        for name, shape in w.items():
            if name != "layers" and tuple(np.shape(p.get(name))) != tuple(shape):
                raise ValueError(f"assistant weight {prefix}{name} has shape "
                                 f"{tuple(np.shape(p.get(name)))}; expected {tuple(shape)}")


# ----------------------------------------------------------------------------- one step

def visible_slots(kind: str, window: int, end: Int[Array, "B"], capacity: int):
    """``[B, 1, S]``: the target cache slots an assistant layer of ``kind`` reads, when its
    queries see slots ``< end``: all of them (full), or the last ``window + 1`` (sliding)."""
    s = jnp.arange(capacity)[None, None, :]
    vis = s < end[:, None, None]
    return vis & (s >= (end - window - 1)[:, None, None]) if kind == SLIDING else vis


def read_cache(q: Float[Array, "B K G T H"], k_cache, v_cache, visible) -> Array:
    """Attention of ``q`` over cache slots ``visible`` ([B, 1, S]) alone (scale 1, no new
    keys): ``[B, K, G, T, H]``. The cache is only read (in place)."""
    f32 = jnp.float32
    sc = jnp.einsum("bkgth,bkhs->bkgts", q.astype(k_cache.dtype), k_cache,
                    preferred_element_type=f32)
    sc = jnp.where(visible[:, None, None], sc, jnp.finfo(f32).min)
    p = jax.nn.softmax(sc, axis=-1).astype(v_cache.dtype)
    return jnp.einsum("bkgts,bksh->bkgth", p, v_cache, preferred_element_type=f32)


def head_scores(spec: MTPSpec, ap, hn: Float[Array, "N D"]) -> Float[Array, "N V"]:
    """Float32 logits of normed states ``hn``: the tied LM head (no soft-cap, as the
    reference), or with ``ordered`` only the tokens of the ``centroid_top_k`` best
    centroids scored, every other token at the smallest scored logit minus 1 (per row;
    the reference takes that minimum over its whole batch)."""
    if not spec.ordered:
        return head_logits(ap["embed"], hn)
    t = spec.text
    per = t.vocab_size // spec.num_centroids
    top = jax.lax.top_k(head_logits(ap["centroids"], hn), spec.centroid_top_k)[1]  # [N, k]
    canon = ap["token_ordering"].reshape(spec.num_centroids, per)[top].reshape(hn.shape[0], -1)
    rows = ap["embed"][canon]  # [N, k * per, D]
    sel = jnp.einsum("nmd,nd->nm", rows, hn.astype(rows.dtype),
                     preferred_element_type=jnp.float32)
    out = jnp.broadcast_to(jnp.min(sel, axis=1, keepdims=True) - 1.0, (hn.shape[0], t.vocab_size))
    return out.at[jnp.arange(hn.shape[0])[:, None], canon].set(sel)


def step(spec: MTPSpec, ap, target, tparams, cache, kv_layers: dict[str, int],
         tokens: Int[Array, "B N"], h: Float[Array, "B N E"], pos: Int[Array, "B"],
         visible: dict) -> tuple[Float[Array, "B N V"], Float[Array, "B N E"]]:
    """One assistant step on ``N`` nodes per row, all at position ``pos``: logits of their
    next tokens and the states fed back (``post_proj`` of the normed output). ``cache``
    is the target's KV cache, read in place at ``kv_layers`` (per layer type)."""
    t = spec.text
    b, n = tokens.shape
    z = jnp.concatenate([target.embed(tparams, tokens).astype(jnp.float32),
                         h.astype(jnp.float32)], axis=-1)
    x = dense(ap["pre_proj"], z.transpose(2, 0, 1))  # [D, B, N]
    positions = jnp.broadcast_to(pos[:, None], (b, n))
    inv = layer_freqs(t)
    for kind, lp in zip(t.layer_types, ap["layers"]):
        hh = rms_norm(x, lp["attn_norm"], t.rms_norm_eps, axis=0)
        q = queries(t, lp, hh, kind, positions, inv[kind])
        src = kv_layers[kind]
        att = read_cache(q, cache.k[src], cache.v[src], visible[kind])
        _, nk, g, _, hd = att.shape
        o = dense(lp["o"], att.transpose(1, 2, 4, 0, 3).reshape(nk * g * hd, b, n))
        x = feed_forward(t, lp, x + rms_norm(o, lp["post_attn_norm"], t.rms_norm_eps, axis=0))
        x = x * lp["layer_scalar"].astype(x.dtype)[0]
    hn = rms_norm(x, ap["final_norm"], t.rms_norm_eps, axis=0)  # [D, B, N]
    h_next = dense(ap["post_proj"], hn).transpose(1, 2, 0)
    flat = hn.transpose(1, 2, 0).reshape(b * n, -1)
    return head_scores(spec, ap, flat).reshape(b, n, -1), h_next


# ----------------------------------------------------------------------------- the drafter

@struct.dataclass
class MTPState:
    """The target's final-normed state that predicted the root (``[B, E]``), and, with
    ``reads_rejected``, whether each row's last round left a rejected draft at the root's
    slot (``[B]`` int32, 0 or 1)."""

    h: Float[Array, "B E"]
    stale: Int[Array, "B"]


@dataclasses.dataclass(frozen=True)
class MTPDrafter(base.ChainOrTree, base.OnTarget):
    """A Gemma 4 assistant over its Gemma 4 ``target``: a chain of ``depth`` tokens
    (``topk`` 1), or a tree of ``total_tokens`` nodes grown over ``depth`` levels from
    the ``topk`` best tokens of the ``topk`` best nodes of each level, one batched
    assistant step per level. ``spec``: the assistant's sizes."""

    target: Any
    spec: MTPSpec
    depth: int = 4
    topk: int = 1
    total_tokens: int | None = None
    reads_rejected: bool = False

    def __post_init__(self):
        self._default_total()

    def check(self, target) -> None:
        self.check_target(target)
        if not isinstance(target.config, Gemma4Config):
            raise ValueError(f"a Gemma 4 assistant drafts for a Gemma 4 target, not "
                             f"{type(target.config).__name__}")
        check_target(self.spec, target.config)
        d, k = self.depth, self.topk
        if d < 1 or k < 1 or k > target.config.vocab_size:
            raise ValueError(f"mtp depth and topk must be >= 1 (topk within the "
                             f"vocabulary), got depth={d}, topk={k}")
        if not self.chain and not d <= self.num_nodes <= eagle.pool_size(d, k):
            raise ValueError(f"mtp total_tokens={self.num_nodes} must lie in [{d}, "
                             f"{eagle.pool_size(d, k)}] for depth {d}, topk {k}")
        if self.reads_rejected and not self.chain:
            raise ValueError("reads_rejected reproduces transformers' chains only")

    def check_params(self, dparams) -> None:
        check_params(self.spec, dparams)

    def _h(self, tparams, hidden):
        """The target's final-normed states (what the assistant reads)."""
        return features(self.target, tparams, hidden)

    def init(self, dparams, ctx, chunk: int) -> MTPState:
        last = (ctx.prompt_len - 1)[:, None, None]
        h = jnp.take_along_axis(ctx.hidden, last, axis=1)[:, 0]
        b = h.shape[0]
        return MTPState(h=self._h(ctx.params, h).astype(jnp.float32),
                        stale=jnp.zeros((b,), jnp.int32))

    def _visible(self, ctx, state: MTPState, pos) -> dict:
        """Per assistant layer type, the target cache slots its queries read this round."""
        t = self.spec.text
        end = pos + (state.stale if self.reads_rejected else 0)
        return {k: visible_slots(k, t.sliding_window, end, ctx.cache.capacity)
                for k in set(t.layer_types)}

    def _step(self, dparams, ctx, vis, tokens, h, pos):
        return step(self.spec, dparams, self.target, ctx.params, ctx.cache,
                    self.target.config.kv_layers, tokens, h, pos, vis)

    def propose(self, dparams, state: MTPState, ctx, key, sampler):
        b = ctx.tokens.shape[0]
        pos = ctx.length - 1
        vis = self._visible(ctx, state, pos)  # the same slots for every step of the round
        root = jnp.take_along_axis(ctx.tokens, pos[:, None], axis=1)
        logits, h = self._step(dparams, ctx, vis, root, state.h[:, None], pos)
        if self.chain:
            toks = [jnp.argmax(logits[:, 0], -1).astype(jnp.int32)]
            for _ in range(self.depth - 1):
                logits, h = self._step(dparams, ctx, vis, toks[-1][:, None], h, pos)
                toks.append(jnp.argmax(logits[:, 0], -1).astype(jnp.int32))
            toks = jnp.stack(toks, axis=1)
            draft = Draft(tokens=toks, parents=tree.chain(b, self.depth),
                          valid=jnp.ones(toks.shape, bool))
            return draft, state, ctx.cache
        k = self.topk

        def level(h_prev, d, tokens, parent):  # the chosen nodes of level d, one batch
            h_in = jnp.take_along_axis(h_prev, parent[:, :, None], axis=1)
            lg, h_out = self._step(dparams, ctx, vis, tokens, h_in, pos)
            return jax.nn.log_softmax(lg, axis=-1), h_out

        h0 = jnp.broadcast_to(h, (b, k, h.shape[-1]))
        pool, _ = eagle.expand(jax.nn.log_softmax(logits[:, 0], -1), level, h0, self.depth, k)
        t = eagle.rerank(pool, self.num_nodes, pos)
        draft = Draft(tokens=t.tokens, parents=t.parents, valid=jnp.ones(t.tokens.shape, bool))
        return draft, state, ctx.cache

    def commit(self, dparams, state: MTPState, ctx, result) -> MTPState:
        """The target's state at the last accepted node (the root where none was), which
        predicted the new root; with ``reads_rejected``, whether a draft was rejected."""
        a = result.accepted
        last = jnp.where(a > 0, jnp.take_along_axis(
            result.path, jnp.maximum(a - 1, 0)[:, None], axis=1)[:, 0] + 1, 0)
        h = jnp.take_along_axis(ctx.hidden, last[:, None, None], axis=1)[:, 0]
        return MTPState(h=self._h(ctx.params, h).astype(jnp.float32),
                        stale=(a < self.depth).astype(jnp.int32))


def check_target(spec: MTPSpec, target: Gemma4Config, where: str = "the assistant") -> None:
    """``ValueError`` unless the assistant fits ``target``: the width it reads, the
    vocabulary, and per layer type the K/V geometry of the target layer it attends to."""
    t = spec.text
    if spec.backbone_hidden_size != target.hidden_size:
        raise ValueError(f"{where}: backbone_hidden_size {spec.backbone_hidden_size} is not "
                         f"the target's hidden size {target.hidden_size} (an assistant for "
                         "another Gemma 4 size)")
    if t.vocab_size != target.vocab_size:
        raise ValueError(f"{where}: vocabulary of {t.vocab_size} tokens, the target's has "
                         f"{target.vocab_size}")
    for kind in sorted(set(t.layer_types)):
        if kind not in target.layer_types:
            raise ValueError(f"{where}: its {kind} layers read a {kind} target layer; the "
                             "target has none")
        if t.geometry(kind) != target.geometry(kind):
            raise ValueError(f"{where}: its {kind} layers attend to (K/V heads, head dim) "
                             f"{t.geometry(kind)}; the target's {kind} layers keep "
                             f"{target.geometry(kind)}")
        if t.num_heads % target.geometry(kind)[0]:
            raise ValueError(f"{where}: {t.num_heads} query heads are not a multiple of "
                             f"the target's {target.geometry(kind)[0]} {kind} K/V heads")


__all__ = ["MTPSpec", "MTPState", "MTPDrafter", "param_shapes", "init_params", "check_params",
           "check_target", "step", "head_scores", "read_cache", "visible_slots"]
