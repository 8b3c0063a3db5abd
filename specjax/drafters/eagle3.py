"""EAGLE-3: a draft head over the target's fused low, middle and high hidden states, with
its own reduced draft vocabulary, drafting EAGLE-2's dynamic tree.

At position ``i`` the head reads the embedding of token ``i`` and a hidden state: at the
positions the target has verified, ``fc`` of the target's residual streams entering layers
``2``, ``L // 2`` and ``L - 3`` (HF ``hidden_states[idx]``, before any norm), concatenated
in that order; at the positions it drafts, its own output for the parent node (``fc`` is
skipped). One decoder layer attends over ``[input_layernorm(emb); hidden_norm(h)]``
(``2D`` wide) with ``h`` as the residual::

    h = fc([h_2; h_{L/2}; h_{L-3}])  or  h = f̂_parent
    f̂ = layer(h, emb)                       logits = lm_head(norm(f̂))   (draft vocabulary)

A draft id ``j`` is the target id ``vocab_ids[j]`` (``j + d2t[j]`` in the published
checkpoints).

**EAGLE 3.1** (vLLM's ``fc_norm`` and ``norm_output``) changes two things, each optional:
``hp["fc_norm"]`` ``[n, D_target]`` normalizes each of the ``n`` fused streams with its own
RMSNorm before ``fc`` (``fc([norm_0(h_2); norm_1(h_{L/2}); norm_2(h_{L-3})])``), and
``post_norm`` feeds the head's output back *after* the final norm (``f̂ = norm(layer(h,
emb))``, and ``logits = lm_head(f̂)``, so the logits are the same function of the layer's
output). Without either, the computation is EAGLE-3's, op for op.

The draft is deterministic (``EagleDrafter``'s tree), so verification against the
full-vocabulary target stays lossless at any temperature.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from specjax.drafters import blocks
from specjax.drafters.eagle import EagleDrafter
from specjax.models import kv_cache
from specjax.models.ops import dense, head_logits, rms_norm


def fused_layers(num_layers: int) -> tuple[int, int, int]:
    """The target layers whose entering hidden states EAGLE-3 fuses: ``2``, ``L // 2`` and
    ``L - 3`` (``ValueError`` for a target too shallow to have them)."""
    layers = (2, num_layers // 2, num_layers - 3)
    if min(layers) < 0 or max(layers) >= num_layers:
        raise ValueError(f"EAGLE-3 fuses the hidden states entering layers {layers}, which a "
                         f"{num_layers}-layer target does not have")
    return layers


def layer_spec(target_cfg) -> blocks.LayerSpec:
    """The head layer at the target's geometry, its attention reading ``2D`` features."""
    return blocks.LayerSpec.of(target_cfg, in_width=2 * target_cfg.hidden_size)


def apply_head(spec: blocks.LayerSpec, hp, emb: Float[Array, "B T D"],
               h: Float[Array, "B T F"], positions: Int[Array, "B T"], k_cache, v_cache,
               length, mask, visible=None, post_norm: bool = False
               ) -> tuple[Float[Array, "B T D"], Array, Array]:
    """The EAGLE-3 layer on ``hp`` (``{"fc" [D, F], "embed_norm", "hidden_norm", "layer",
    "norm", "lm_head"}``, weights ``[out, in]``, and EAGLE 3.1's optional ``"fc_norm"``
    ``[n, F / n]``): ``h`` wider than ``D`` is a fused target feature and goes through
    ``fc`` first (each of its ``n`` streams RMS-normalized by its ``fc_norm`` row before,
    where ``hp`` has one); a ``D``-wide ``h`` is the head's own output. Returns the layer's
    output (before ``norm``; after it with ``post_norm``, EAGLE 3.1's post-norm feedback)
    and the one-layer cache with the new tokens' K/V written at slot ``length``."""
    lp, eps = hp["layer"], spec.rms_norm_eps
    ht = h.transpose(2, 0, 1)  # [F,B,T]
    if h.shape[-1] == spec.width:
        x = ht.astype(jnp.float32)
    elif "fc_norm" in hp:  # EAGLE 3.1: one RMSNorm per fused stream, then fc
        parts = jnp.split(ht, hp["fc_norm"].shape[0], axis=0)
        x = dense(hp["fc"], jnp.concatenate(
            [rms_norm(part, w, eps, axis=0) for part, w in zip(parts, hp["fc_norm"])], axis=0))
    else:
        x = dense(hp["fc"], ht)
    e = rms_norm(emb.transpose(2, 0, 1).astype(x.dtype), hp["embed_norm"], eps, axis=0)
    a_in = jnp.concatenate([e, rms_norm(x, hp["hidden_norm"], eps, axis=0)], axis=0)
    att, k, v = blocks.self_attention(spec, lp, a_in, positions, k_cache, v_cache, length, mask,
                                      visible)
    x = x + att
    x = x + blocks.swiglu(lp, rms_norm(x, lp["mlp_norm"], eps, axis=0), spec.intermediate_size)
    if post_norm:  # EAGLE 3.1: the normed output is both the feedback and lm_head's input
        x = rms_norm(x, hp["norm"], eps, axis=0)
    return (x.transpose(1, 2, 0), kv_cache.write(k_cache, length, k, axis=3),
            kv_cache.write(v_cache, length, v, axis=2))


def draft_logits(spec: blocks.LayerSpec, hp, out: Float[Array, "... D"],
                 post_norm: bool = False) -> Float[Array, "... Vd"]:
    """Float32 logits over the draft vocabulary: ``lm_head(norm(out))``; with ``post_norm``
    (``out`` is ``apply_head``'s post-norm output) ``lm_head(out)``."""
    if post_norm:
        return head_logits(hp["lm_head"], out)
    return head_logits(hp["lm_head"], rms_norm(out, hp["norm"], spec.rms_norm_eps))


def init_head(target_cfg, key: Array, draft_vocab: int, dtype=jnp.float32,
              spec: blocks.LayerSpec | None = None) -> dict:
    """Random parameters of the published shapes (``fc`` [D, 3D], q/k/v over ``2D``, an
    ``lm_head`` of ``draft_vocab`` rows), for tests and timing."""
    spec = layer_spec(target_cfg) if spec is None else spec
    d = spec.width
    shapes = blocks.layer_shapes(spec)
    del shapes["attn_norm"]  # the attention's input norms are embed_norm and hidden_norm
    keys = jax.random.split(key, len(shapes) + 2)
    rnd = lambda k, s, scale: (jax.random.normal(k, s) * scale).astype(dtype)  # noqa: E731
    layer = {n: rnd(k, s, 0.05) for (n, s), k in zip(shapes.items(), keys)}
    layer["mlp_norm"] = jnp.ones((d,), dtype)
    return {"fc": rnd(keys[-2], (d, 3 * target_cfg.hidden_size), 0.05),
            "embed_norm": jnp.ones((d,), dtype), "hidden_norm": jnp.ones((d,), dtype),
            "layer": layer, "norm": jnp.ones((d,), dtype),
            "lm_head": rnd(keys[-1], (draft_vocab, d), 0.05)}


def draft_params(head: dict, target, vocab_ids) -> dict:
    """What ``Eagle3Drafter`` reads: the head and the target id of each draft id
    (``ValueError`` unless they are distinct ids of the target's vocabulary, one per
    ``lm_head`` row)."""
    ids = np.asarray(vocab_ids)
    v, n = target.config.vocab_size, head["lm_head"].shape[0]
    if ids.shape != (n,):
        raise ValueError(f"the head drafts {n} ids, but its vocabulary map has shape "
                         f"{ids.shape}")
    if ids.min() < 0 or ids.max() >= v or len(np.unique(ids)) != n:
        raise ValueError(f"the draft vocabulary must map to distinct target ids in [0, {v})")
    return {"head": head, "vocab_ids": jnp.asarray(ids, jnp.int32)}


@dataclasses.dataclass(frozen=True)
class Eagle3Drafter(EagleDrafter):
    """EAGLE-3: ``EagleDrafter``'s dynamic tree (``depth`` levels expanding the ``topk``
    best nodes, ``total_tokens`` kept) drafted by an EAGLE-3 head (``apply_head``) over the
    target's hidden states after ``layers`` (default ``fused_layers``) and its draft
    vocabulary. ``spec``: the head layer's sizes (default ``layer_spec(target.config)``).
    ``post_norm``: EAGLE 3.1's post-norm feedback (``apply_head``); the head's ``fc_norm``,
    where it has one, is read from its parameters."""

    layers: tuple[int, ...] | None = None
    post_norm: bool = False

    @property
    def layer_spec(self) -> blocks.LayerSpec:
        return layer_spec(self.target.config) if self.spec is None else self.spec

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return fused_layers(self.target.config.num_layers) if self.layers is None else self.layers

    def check(self, target) -> None:
        super().check(target)
        n, spec = target.config.num_layers, self.layer_spec
        bad = [l for l in self.feature_layers if not 0 <= l < n]
        if bad:
            raise ValueError(f"EAGLE-3 fuses layers {self.feature_layers}; {bad} do not exist "
                             f"in a {n}-layer target")
        if spec.in_width != 2 * spec.width:
            raise ValueError(f"an EAGLE-3 layer's attention reads 2D = {2 * spec.width} "
                             f"features, not {spec.in_width}")

    def check_params(self, dparams) -> None:
        n = dparams["vocab_ids"].shape[0]
        if self.topk > n:
            raise ValueError(f"topk={self.topk} exceeds the draft vocabulary ({n} tokens)")
        want = len(self.feature_layers) * self.target.config.hidden_size
        got = dparams["head"]["fc"].shape[1]
        if got != want:
            raise ValueError(f"the head's fc reads {got} features, but {len(self.feature_layers)}"
                             f" fused layers of width {self.target.config.hidden_size} give "
                             f"{want}")
        fc_norm = dparams["head"].get("fc_norm")
        want = (len(self.feature_layers), self.target.config.hidden_size)
        if fc_norm is not None and tuple(fc_norm.shape) != want:
            raise ValueError(f"the head's fc_norm has shape {tuple(fc_norm.shape)}: one RMSNorm "
                             f"per fused layer of width {want[1]} is {want}")

    def _features(self, tparams, hidden):
        return hidden  # the fused streams, as Context.hidden concatenates them

    def _head(self, dparams, tparams, tokens, prev, positions, k, v, length, mask,
              visible=None):
        hp = dparams["head"]
        emb = hp["embed"][tokens] if "embed" in hp else self.target.embed(tparams, tokens)
        return apply_head(self.layer_spec, hp, emb, prev, positions, k, v, length, mask,
                          visible, post_norm=self.post_norm)

    def _logq(self, dparams, tparams, f):
        return jax.nn.log_softmax(draft_logits(self.layer_spec, dparams["head"], f,
                                               post_norm=self.post_norm), axis=-1)


__all__ = ["Eagle3Drafter", "apply_head", "draft_logits", "draft_params", "fused_layers",
           "init_head", "layer_spec"]
