"""EAGLE heads unrolled on their own outputs (EAGLE-3's training-time test), and their loss.

Drafting runs the head on its own output: at tree level ``s`` the node after the committed
position ``p`` reads the head's output for its parent and the drafted token, at position
``p + s``, and attends to the committed positions ``<= p`` and to its own ancestors. A
teacher-forced head (``s = 0`` only) never sees its own outputs in training. ``unroll``
runs ``k`` such steps over every position of a sequence at once, with the teacher's tokens:
entry ``p`` of step ``s`` is the chain that starts after position ``p``, and its attention
sees step 0's keys at positions ``<= p`` and the keys of entry ``p`` at steps ``1 .. s``
(the drafting tree's visibility, through the same cache).

``Kind`` says which head is trained: ``EAGLE2`` (the target's final-normed last hidden state
in, regression to the next feature plus cross-entropy through the target's LM head) or
``EAGLE3`` (the fused streams entering layers 2, L/2 and L-3 in, cross-entropy over its own
draft vocabulary, no regression). At ``k = 1`` the loss is the plain teacher-forced loss.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Int

from specjax.drafters import blocks, eagle, eagle3
from specjax.train import glue


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """``k`` unrolled steps, step ``s`` weighted ``decay ** s``; ``noise``: uniform noise on
    step 0's input features relative to their RMS. Each field is a flag of ``train
    onpolicy`` (``glue.option``), checked here."""

    k: int = glue.option(1, "training-time test: steps the head is unrolled on its own "
                            "outputs", low=1, flag="--ttt")
    decay: float = glue.option(0.8, "training-time test: unrolled step s weighs decay ** s",
                               flag="--ttt-decay")
    w_reg: float = glue.w_reg(1.0, "EAGLE-2: weight of the feature regression")
    w_ce: float = glue.w_ce(0.1, "EAGLE-2: weight of the cross-entropy against the target's "
                                 "distribution (EAGLE-3 trains on the cross-entropy alone)")
    noise: float = glue.noise(0.1, "uniform noise on step 0's input features, relative to "
                                   "their RMS")

    def __post_init__(self):
        glue.check_fields(self)
        if self.w_reg + self.w_ce <= 0:
            raise ValueError(f"w_reg={self.w_reg}, w_ce={self.w_ce}: the loss weights are "
                             ">= 0, not both 0")


@dataclasses.dataclass(frozen=True)
class Kind:
    """A head family: ``name`` is ``"eagle"`` (EAGLE-1/2) or ``"eagle3"``."""

    name: str

    def layers(self, cfg) -> tuple[int, ...]:
        """The target layers whose residual streams the training data holds (the last one
        always: it gives the target's own next-token distribution)."""
        n = cfg.num_layers
        return (n,) if self.name == "eagle" else eagle3.fused_layers(n) + (n,)

    def spec(self, cfg) -> blocks.LayerSpec:
        return blocks.LayerSpec.of(cfg) if self.name == "eagle" else eagle3.layer_spec(cfg)


EAGLE2, EAGLE3 = Kind("eagle"), Kind("eagle3")


def shift(x: Float[Array, "B T F"], s: int) -> Array:
    """``x[:, p + s]`` at entry ``p`` (zero past the end); ``s = -1`` is the previous position
    (zero at the start)."""
    if s >= 0:
        return jnp.pad(x, ((0, 0), (0, s)) + ((0, 0),) * (x.ndim - 2))[:, s:]
    return jnp.pad(x, ((0, 0), (-s, 0)) + ((0, 0),) * (x.ndim - 2))[:, :s]


def visibility(b: int, t: int, k: int, s: int) -> Array:
    """Which of the ``k * t`` cache slots entry ``p`` of step ``s`` sees: step 0's slots
    ``<= p`` and slot ``r * t + p`` for ``1 <= r < s`` (its own earlier steps)."""
    slot = jnp.arange(k * t)[None, :]
    p = jnp.arange(t)[:, None]
    vis = (slot < t) & (slot <= p)
    for r in range(1, s):
        vis = vis | (slot == r * t + p)
    return jnp.broadcast_to(vis, (b, t, k * t))


def unroll(kind: Kind, target, hp, tparams, tokens: Int[Array, "B T"],
           prev0: Float[Array, "B T F"], k: int) -> list[Float[Array, "B T D"]]:
    """The head's outputs at steps ``0 .. k-1``. Step 0 reads ``prev0`` (the target's
    features of the previous positions) and runs causally; step ``s`` reads, at entry ``p``,
    token ``p + s`` and the head's own step ``s - 1`` output, at position ``p + s``."""
    b, t = tokens.shape
    spec = kind.spec(target.config)
    layers = eagle.num_layers(hp) if kind.name == "eagle" else 1
    kc, vc = blocks.empty_kv(spec, b, k * t, hp["fc"].dtype, layers)
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    eye = jnp.broadcast_to(jnp.eye(t, dtype=bool), (b, t, t))
    outs, prev = [], prev0
    for s in range(k):
        toks = shift(tokens, s)
        mask, vis = (blocks.causal(b, t), None) if s == 0 else (eye, visibility(b, t, k, s))
        length = blocks.filled(b, s * t)
        if kind.name == "eagle":
            out, kc, vc = eagle.head_forward(target, hp, tparams, toks, prev, pos + s, kc, vc,
                                             length, mask, vis)
        else:
            emb = hp["embed"][toks] if "embed" in hp else target.embed(tparams, toks)
            out, kc, vc = eagle3.apply_head(spec, hp, emb, prev, pos + s, kc, vc, length, mask,
                                            vis)
        outs.append(out)
        prev = out
    return outs


def _noised(x, key, noise: float):
    if not noise:
        return x
    rms = jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True))
    return x + noise * rms * jax.random.uniform(key, x.shape, minval=-1, maxval=1)


def step_terms(kind: Kind, target, hp, tparams, feats, nxt, out, vocab_ids, cfg: LossConfig):
    """Per-position loss and whether the head's top-1 (a target id) is ``nxt``, the
    sequence's next token (the target's own greedy choice on its answers), for outputs
    ``out`` whose teacher is ``feats`` (already shifted)."""
    d = target.config.hidden_size
    f = blocks.features(target, tparams, feats[..., -d:])  # the target's own feature
    emb = eagle.output_embedding(target, tparams)
    emb = emb if vocab_ids is None else emb[vocab_ids]
    t_logits = target.unembed(tparams, f, emb)
    if kind.name == "eagle":
        h_logits = target.unembed(tparams, out, emb)
        reg = jnp.mean(optax.huber_loss(out, f, delta=1.0), -1)
        loss = cfg.w_reg * reg + cfg.w_ce * _ce(t_logits, h_logits)
    else:
        h_logits = eagle3.draft_logits(kind.spec(target.config), hp, out)
        loss = _ce(t_logits, h_logits)
    h_top = jnp.argmax(h_logits, -1)
    h_top = h_top if vocab_ids is None else vocab_ids[h_top]
    return loss, h_top == nxt


def _ce(t_logits, h_logits):
    """Cross-entropy of the head's distribution against the target's (renormalised on the
    same rows)."""
    return -jnp.sum(jax.nn.softmax(t_logits, -1) * jax.nn.log_softmax(h_logits, -1), -1)


def loss_fn(hp, tparams, tokens: Int[Array, "B T"], feats: Float[Array, "B T F"],
            mask: Float[Array, "B T"], key, vocab_ids, *, kind: Kind, target,
            cfg: LossConfig):
    """Weighted mean over steps of the masked mean loss, and per-step metrics.

    ``feats[:, i]`` holds the target's residual streams at position ``i`` after
    ``kind.layers`` (concatenated); ``mask[:, i]`` marks positions whose feature and next
    token are known. The head's sequence is ``eagle.head_inputs``' (entry ``p``: token
    ``p + 1`` beside feature ``p``); step ``s``'s entry ``p`` is scored against position
    ``p + s + 1``.
    ``vocab_ids``: the draft vocabulary (EAGLE-3: the head's rows; EAGLE-2: the rows its
    cross-entropy is taken over), or None for the whole vocabulary."""
    d = target.config.hidden_size
    if kind.name == "eagle":
        inp = blocks.features(target, tparams, feats[..., -d:])
    else:
        inp = feats[..., :-d]
    # the head's sequence (``eagle.head_inputs``): entry p pairs token p + 1 with feature p
    prev0 = _noised(inp[:, :-1], key, cfg.noise)
    tokens, feats, mask = tokens[:, 1:], feats[:, 1:], mask[:, 1:]
    outs = unroll(kind, target, hp, tparams, tokens, prev0, cfg.k)
    total, wsum, metrics = 0.0, 0.0, {}
    for s, out in enumerate(outs):
        m = shift(mask, s) * mask  # the chain's start and its step-s position both known
        loss, hit = step_terms(kind, target, hp, tparams, shift(feats, s),
                               shift(tokens, s + 1), out, vocab_ids, cfg)
        n = jnp.maximum(jnp.sum(m), 1.0)
        ls = jnp.sum(loss * m) / n
        total, wsum = total + cfg.decay ** s * ls, wsum + cfg.decay ** s
        metrics[f"loss{s}"] = ls
        metrics[f"acc{s}"] = jnp.sum(hit * m) / n
    loss = total / wsum
    metrics["loss"] = loss
    return loss, metrics


__all__ = ["EAGLE2", "EAGLE3", "Kind", "LossConfig", "loss_fn", "shift", "step_terms",
           "unroll", "visibility"]
