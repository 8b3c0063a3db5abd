"""ReDrafter: one recurrent draft head, beam search, and a deduplicated tree of the beams.

The head reads the target's feature ``h`` at the last accepted token (its last hidden
state after the final norm, the LM head's input; fixed for the whole draft) and the
target's own embedding ``e_i`` of the previous draft token, starting from the root::

    s_0 = 0,   s_i = SiLU(U s_{i-1} + W e_i + b)
    x = [h; s_i],   x <- x + SiLU(A_k x + c_k)  (k = 1..blocks),   logits_i = x · O

``logits_i`` is over the draft vocabulary: the target's whole vocabulary, or its most
frequent tokens (``vocab_ids``; drafted indices map back to target ids).

Each round, ``specjax.core.beams.beam_search`` grows ``width`` beams of ``length`` tokens
by summed log-probability; beams that share a prefix share its nodes in the packed tree,
which is verified in one target forward. Beam search is a deterministic selection, so
the draft has one-hot ``q`` (``Draft.probs`` is None) and tree rejection sampling keeps
decoding lossless at any temperature.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jaxtyping import Array, Float, Int

from specjax.core import beams as beam_lib
from specjax.core.verify import Draft
from specjax.drafters import base
from specjax.drafters.blocks import features


# ----------------------------------------------------------------------------- the head

class RedrafterHead(nnx.Module):
    """The ReDrafter head as a Flax NNX module over a target of width ``D``.

    Parameters: ``rnn_u``, ``rnn_w`` ``[D, D]``, ``rnn_b`` ``[D]``; ``blocks``, each
    ``{"w": [2D, 2D], "b": [2D]}`` (zero at init, so every block starts as the identity);
    ``out`` ``[2D, V_draft]``. Its state is that plain pytree; ``head_graphdef`` and
    ``nnx.merge`` rebuild the module from it inside ``jit``.
    """

    def __init__(self, hidden_size: int, draft_vocab: int, key: Array, blocks: int = 2,
                 dtype=jnp.float32):
        d = hidden_size
        ku, kw, ko = jax.random.split(key, 3)
        self.rnn_u = nnx.Param((jax.random.normal(ku, (d, d)) * d ** -0.5).astype(dtype))
        self.rnn_w = nnx.Param((jax.random.normal(kw, (d, d)) * d ** -0.5).astype(dtype))
        self.rnn_b = nnx.Param(jnp.zeros((d,), dtype))
        self.blocks = nnx.data([{"w": nnx.Param(jnp.zeros((2 * d, 2 * d), dtype)),
                                 "b": nnx.Param(jnp.zeros((2 * d,), dtype))}
                                for _ in range(blocks)])
        self.out = nnx.Param((jax.random.normal(ko, (2 * d, draft_vocab))
                              * (2 * d) ** -0.5).astype(dtype))

    def recur(self, s: Float[Array, "... D"], emb: Float[Array, "... D"]) -> Float[Array, "... D"]:
        """One step of the recurrence: ``SiLU(U s + W e + b)``."""
        chex.assert_equal_shape([s, emb])
        u, w = self.rnn_u[...], self.rnn_w[...]
        # ...: any leading axes; d, e: D
        z = (jnp.einsum("...d,de->...e", s.astype(u.dtype), u)
             + jnp.einsum("...d,de->...e", emb.astype(w.dtype), w) + self.rnn_b[...])
        return jax.nn.silu(z)

    def __call__(self, h: Float[Array, "... D"], s: Float[Array, "... D"]) -> Float[Array, "... V"]:
        """Float32 draft logits from the target's feature ``h`` and the state ``s``."""
        out = self.out[...]
        x = jnp.concatenate([h.astype(out.dtype), s.astype(out.dtype)], axis=-1)
        for blk in self.blocks:  # e, f: 2D
            x = x + jax.nn.silu(jnp.einsum("...e,ef->...f", x, blk["w"][...]) + blk["b"][...])
        return jnp.einsum("...e,ev->...v", x, out).astype(jnp.float32)  # v: draft vocabulary


@functools.lru_cache(maxsize=None)
def head_graphdef(hidden_size: int, draft_vocab: int, blocks: int):
    """The ``RedrafterHead`` graph for these sizes (shapes come from the params)."""
    return nnx.split(nnx.eval_shape(
        lambda: RedrafterHead(hidden_size, draft_vocab, jax.random.key(0), blocks)))[0]


def init_head(hidden_size: int, draft_vocab: int, key: Array, blocks: int = 2,
              dtype=jnp.float32) -> dict:
    """A fresh ``RedrafterHead``'s parameters as a plain pytree."""
    return nnx.to_pure_dict(nnx.state(RedrafterHead(hidden_size, draft_vocab, key, blocks,
                                                    dtype)))


def head_sizes(hp: dict) -> tuple[int, int, int]:
    """``(hidden_size, draft_vocab, blocks)`` of a head's parameters."""
    return hp["rnn_u"].shape[0], hp["out"].shape[1], len(hp["blocks"])


def module(hp: dict) -> RedrafterHead:
    """The ``RedrafterHead`` with parameters ``hp`` (usable inside ``jit``)."""
    return nnx.merge(head_graphdef(*head_sizes(hp)), _as_state(hp))


def exportable(hp: dict) -> dict:
    """The parameters with ``blocks`` keyed by string, as checkpoints and JSON store them."""
    return {**hp, "blocks": {str(k): v for k, v in _as_state(hp)["blocks"].items()}}


def _as_state(hp: dict) -> dict:
    """The parameters with ``blocks`` keyed by int, as ``nnx`` states them (a restored
    checkpoint may key them by string)."""
    blocks = hp["blocks"]
    if isinstance(blocks, (list, tuple)):
        blocks = dict(enumerate(blocks))
    return {**hp, "blocks": {int(k): v for k, v in blocks.items()}}


def unroll(hp: dict, h: Float[Array, "... D"], emb: Float[Array, "... L D"]
           ) -> Float[Array, "... L V"]:
    """Teacher-forced head: draft logits at each of ``L`` steps, step ``i`` having read the
    embeddings ``emb[..., :i+1]`` (the root's first), all from the feature ``h``."""
    head = module(hp)

    def step(s, e):
        s = head.recur(s, e)
        return s, s

    emb_t = jnp.moveaxis(emb, -2, 0)
    _, states = jax.lax.scan(step, jnp.zeros_like(emb_t[0]), emb_t)
    states = jnp.moveaxis(states, 0, -2)  # [..., L, D]
    return head(jnp.broadcast_to(h[..., None, :], states.shape), states)


# ----------------------------------------------------------------------------- the drafter

@struct.dataclass
class RedrafterState:
    """The target's feature at the last accepted token (the root's predecessor)."""

    h: Float[Array, "B D"]


@dataclasses.dataclass(frozen=True)
class RedrafterDrafter(base.OnTarget):
    """ReDrafter: ``width`` beams of ``length`` tokens from the recurrent head, verified as
    one tree with shared prefixes merged (``dedup``; False verifies every beam's nodes as
    its own chain, the reference's layout, for comparison).

    ``verify_widths`` compiles one verification width per node count from ``length + 1``
    (one beam) to ``width·length + 1`` (no shared prefix), so every node that dedup saves
    narrows the round's target forward.
    """

    target: Any
    width: int = 4
    length: int = 4
    dedup: bool = True

    chain = False  # beams are verified as one tree (or, without dedup, chains side by side)
    # needs_features, feature_layers (the last layer), draft_model (None): OnTarget's

    @property
    def depth(self) -> int:
        return self.length

    @property
    def num_nodes(self) -> int:
        return self.width * self.length

    @property
    def verify_widths(self) -> tuple[int, ...]:
        if not self.dedup:
            return (self.num_nodes + 1,)
        return tuple(range(self.length + 1, self.num_nodes + 2))

    def check(self, target) -> None:
        self.check_target(target)
        beam_lib.check_sizes(self.width, self.length)

    def check_params(self, dparams) -> None:
        """Refuses a head made for another target (width, vocabulary) with a clear message."""
        d, v, _ = head_sizes(dparams["head"])
        cfg = self.target.config
        if d != cfg.hidden_size:
            raise ValueError(f"the ReDrafter head reads features of width {d}, but the target's "
                             f"hidden size is {cfg.hidden_size}: it was trained for another model")
        ids = dparams.get("vocab_ids")
        n = cfg.vocab_size if ids is None else ids.shape[0]
        if v != n:
            raise ValueError(f"the ReDrafter head drafts over {v} tokens, but its draft "
                             f"vocabulary has {n} (the target's vocabulary: {cfg.vocab_size})")
        if ids is not None and (int(jnp.min(ids)) < 0 or int(jnp.max(ids)) >= cfg.vocab_size):
            raise ValueError(f"draft vocabulary ids must lie in [0, {cfg.vocab_size})")
        beam_lib.check_sizes(self.width, self.length, v)

    def init(self, dparams, ctx, chunk: int) -> RedrafterState:
        last = (ctx.prompt_len - 1)[:, None, None]
        h = jnp.take_along_axis(ctx.hidden, last, axis=1)[:, 0]
        return RedrafterState(h=features(self.target, ctx.params, h))

    def propose(self, dparams, state: RedrafterState, ctx, key, sampler):
        tp, head = ctx.params, module(dparams["head"])
        ids = dparams.get("vocab_ids")
        to_ids = (lambda t: t) if ids is None else (lambda t: ids[t])
        root = jnp.take_along_axis(ctx.tokens, (ctx.length - 1)[:, None], axis=1)[:, 0]
        b, w = root.shape[0], self.width
        h = jnp.broadcast_to(state.h[:, None], (b, w, state.h.shape[-1]))

        def step(st, toks):  # toks: target ids at the first step, draft indices after
            s, first = st
            tid = jnp.where(first, toks, to_ids(jnp.clip(toks, 0, head.out[...].shape[1] - 1)))
            s = head.recur(s, self.target.embed(tp, tid).astype(s.dtype))
            return jax.nn.log_softmax(head(h, s), axis=-1), (s, jnp.zeros_like(first))

        s0 = jnp.zeros((b, w, state.h.shape[-1]), head.out[...].dtype)
        found, _ = beam_lib.beam_search(step, (s0, jnp.ones((b, w), bool)), root, w, self.length)
        tokens = to_ids(found.tokens).astype(jnp.int32)
        if self.dedup:
            draft = beam_lib.to_draft(beam_lib.pack(tokens))
        else:
            draft = chains(tokens)
        return draft, state, ctx.cache

    def commit(self, dparams, state: RedrafterState, ctx, result) -> RedrafterState:
        """Keeps the target's feature at the last accepted node (the root if none)."""
        last = jnp.take_along_axis(result.path, jnp.maximum(result.accepted - 1, 0)[:, None],
                                   axis=1)[:, 0]
        idx = jnp.where(result.accepted > 0, last + 1, 0)
        h = jnp.take_along_axis(ctx.hidden, idx[:, None, None], axis=1)[:, 0]
        return state.replace(h=features(self.target, ctx.params, h).astype(state.h.dtype))


def chains(tokens: Int[Array, "B W L"]) -> Draft:
    """Every beam as its own chain below the root (no shared nodes): ``W·L`` nodes."""
    b, w, l = tokens.shape
    par = np.asarray([-1 if i == 0 else k * l + i - 1 for k in range(w) for i in range(l)],
                     np.int32)
    flat = tokens.reshape(b, w * l)
    return Draft(tokens=flat, parents=jnp.broadcast_to(jnp.asarray(par), flat.shape),
                 valid=jnp.ones(flat.shape, bool))


def draft_params(head: dict, vocab_ids=None) -> dict:
    """What ``RedrafterDrafter`` reads: the head and, for a reduced draft vocabulary, the
    target ids of its entries."""
    out = {"head": _as_state(head)}
    if vocab_ids is not None:
        out["vocab_ids"] = jnp.asarray(vocab_ids, jnp.int32)
    return out


__all__ = ["RedrafterHead", "RedrafterDrafter", "RedrafterState", "init_head", "unroll",
           "features", "chains", "draft_params", "exportable"]
