"""Encoder-decoder targets in the decoder-only loops.

An encoder-decoder model (``specjax.models.T5``) decodes from a source: its ``prompts`` are
the encoder's inputs. The host wrappers (``generate``, ``speculative_generate``,
``hsd_generate``) call ``bind_sources`` once per batch: the encoder runs once (jitted), its
cross-attention keys and values are bound to the parameters, and the decoder starts from
``decoder_start_token_id``. The jitted loops then run unchanged.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import sharding

_SOURCE_BUCKET = 128  # source buffers are padded to a multiple of this: no per-length compile


def is_encoder_decoder(model: Any) -> bool:
    """Whether ``model`` decodes from an encoded source (it has ``encode`` and ``bind``)."""
    return bool(model.is_encoder_decoder)


def source_buffer(model, sources: Sequence[Sequence[int]],
                  source_size: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded ``[B, S]`` source ids and their lengths; ``ValueError`` for an empty
    source, an id outside the vocabulary, or a source longer than the encoder's buffer
    (``source_size``, default: the longest source rounded up to 128, at most the model's
    ``max_source_positions``)."""
    cfg = model.config
    if not sources:
        raise ValueError("no sources given")
    lens = [len(s) for s in sources]
    if min(lens) < 1:
        raise ValueError("every source needs at least one token")
    limit = cfg.max_source_positions
    size = source_size or min(-(-max(lens) // _SOURCE_BUCKET) * _SOURCE_BUCKET, limit)
    row = int(np.argmax(lens))
    if lens[row] > min(size, limit):
        raise ValueError(f"row {row}: a source of {lens[row]} tokens does not fit the encoder's "
                         f"cache of {min(size, limit)} positions")
    buf = np.zeros((len(sources), size), np.int32)
    for i, s in enumerate(sources):
        buf[i, : len(s)] = s
    if buf.max() >= cfg.vocab_size or buf.min() < 0:
        raise ValueError(f"source token ids must lie in [0, {cfg.vocab_size})")
    return buf, np.asarray(lens, np.int32)


def encode(model, params, sources: Sequence[Sequence[int]], source_size: int | None = None,
           mesh=None):
    """The bound parameters of ``model`` for a batch of sources (one jitted encoder run;
    with ``mesh``, the sources' rows over its ``data`` axis)."""
    buf, lens = source_buffer(model, sources, source_size)
    buf, lens = (jnp.asarray(buf), jnp.asarray(lens)) if mesh is None else (
        sharding.rows(mesh, buf), sharding.rows(mesh, lens))
    enc = _ENCODE(model, params, buf, lens)
    return model.bind(params, enc)


_ENCODE = jax.jit(lambda model, params, src, lens: model.encode(params, src, lens),
                  static_argnums=0)


def bind_sources(model, params, sources: Sequence[Sequence[int]],
                 source_size: int | None = None, mesh=None) -> tuple[Any, list[list[int]]]:
    """``(bound params, decoder prompts)`` for an encoder-decoder ``model``; for any other
    model, ``(params, sources)``. With a ``mesh`` the weights are placed on it first
    (``sharding.shard_params``, so the encoder runs sharded) and the bound source after."""
    if mesh is not None:
        params = sharding.shard_params(model.config, params, mesh)
    if not is_encoder_decoder(model):
        return params, [list(s) for s in sources]
    start = model.config.decoder_start_token_id
    bound = encode(model, params, sources, source_size, mesh)
    if mesh is not None:
        bound = {**bound, "source": sharding.place_source(bound["source"], mesh)}
    return bound, [[start] for _ in sources]


def bind_drafter(drafter, dparams, target, sources: Sequence[Sequence[int]],
                 source_size: int | None = None):
    """``dparams`` of a drafter for an encoder-decoder target: a draft encoder-decoder model
    encodes the same sources with its own weights; other drafters are unchanged.

    A decoder-only draft model drafts from the decoder's tokens alone (lossless, but blind
    to the source); one with another vocabulary is refused with a message saying so."""
    dmodel = drafter.draft_model
    if dmodel is None or not is_encoder_decoder(target):
        return dparams
    if not is_encoder_decoder(dmodel):
        dv, tv = dmodel.config.vocab_size, target.config.vocab_size
        if dv != tv:
            raise ValueError(
                f"vocabulary mismatch: the target is an encoder-decoder model with {tv} tokens "
                f"and the draft model is a decoder-only {type(dmodel).__name__} with {dv}; "
                "draft with an encoder-decoder model of the target's vocabulary, an early "
                "exit, an EAGLE head or the n-gram drafter")
        return dparams
    return encode(dmodel, dparams, sources, source_size)


__all__ = ["is_encoder_decoder", "source_buffer", "encode", "bind_sources", "bind_drafter"]
