"""Autoregressive decoding (``AR``, a ``specjax.core.decoder.Decoder``) and the chunked
prefill every decoder starts with; batched, with per-row stops.

Shapes are bucketed so that a new prompt length or token budget does not recompile: the
prompt buffer is as wide as the cache (a multiple of 128 by default), prefill runs in
fixed-size chunks for as many chunks as the longest prompt needs, and budgets, lengths and
sampler settings are arrays.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax
from jaxtyping import Array, Bool, Int

from specjax.core import decoder, encdec, sampling
from specjax.core.decoder import PAD, Batch, DecodeOutput, Request, Stats
from specjax.sharding import constrain_cache
from specjax.models.kv_cache import KVCache



def over_chunks(body, carry, prompt_len: Int[Array, "B"], chunk: int):
    """``carry = body(start, positions, carry)`` for ``start = 0, chunk, 2·chunk, ...``, as
    many chunks as the longest prompt needs (at least one token of some row in each), in
    one ``lax.fori_loop``; ``positions`` ``[B, chunk]`` are ``start + arange(chunk)``.
    Returns the last carry. The chunked prefill of the target and of an EAGLE head."""
    b = prompt_len.shape[0]
    n_chunks = (jnp.max(prompt_len) + chunk - 1) // chunk

    def step(i, c):
        start = i * chunk
        return body(start, jnp.broadcast_to(start + jnp.arange(chunk), (b, chunk)), c)

    return lax.fori_loop(0, n_chunks, step, carry)


def prefill(model, params, prompt: Int[Array, "B S"], prompt_len: Int[Array, "B"],
            cache: KVCache, chunk: int, keep_hidden: bool | tuple[int, ...] = False):
    """Writes each row's prompt into the cache in chunks of ``chunk`` tokens.

    Returns the last layer's hidden state at each row's final prompt token ``[B, D]`` and
    the cache with ``length == prompt_len``; with ``keep_hidden``, also the hidden states
    at every prompt slot (meaningful below ``prompt_len``): ``True``, the last layer's
    ``[B, S, D]``; a tuple of layers, the residual streams after each of them concatenated
    in that order ``[B, S, len(layers) * D]`` (``hidden_features``), from the same
    forwards.
    """
    b = prompt.shape[0]
    depth = model.config.num_layers
    layers = (depth,) if keep_hidden is True else tuple(keep_hidden or ())
    d = model.config.hidden_size * len(layers)
    dtype = jnp.float32  # hidden states are float32 (bfloat16 weights accumulate in it)

    def body(start, pos, carry):
        h_last, c, h_all = carry
        toks = lax.dynamic_slice_in_dim(prompt, start, chunk, axis=1)
        _, hidden, c = model.forward(params, toks, pos, c, compute_logits=False,
                                     return_layers=layers)
        c = c.replace(length=c.length + chunk)
        idx = prompt_len - 1 - start
        here = (idx >= 0) & (idx < chunk)
        h = hidden[depth][jnp.arange(b), jnp.clip(idx, 0, chunk - 1)]
        if keep_hidden:
            h_all = lax.dynamic_update_slice_in_dim(h_all, hidden_features(hidden, layers),
                                                    start, axis=1)
        return jnp.where(here[:, None], h, h_last), c, h_all

    h0 = jnp.zeros((b, model.config.hidden_size), dtype)
    h_all = jnp.zeros((b, prompt.shape[1] if keep_hidden else 0, d), dtype)
    cache = cache.replace(length=jnp.zeros_like(cache.length))
    h_last, cache, h_all = over_chunks(body, (h0, cache, h_all), prompt_len, chunk)
    cache = cache.replace(length=prompt_len.astype(jnp.int32))
    return (h_last, cache, h_all) if keep_hidden else (h_last, cache)


def prefill_first(model, params, batch: Batch, chunk: int, mesh=None,
                  keep_hidden: bool | tuple[int, ...] = False):
    """The start every decoder shares: a fresh cache (pinned to ``mesh``'s cache layout),
    ``batch``'s prompts prefilled into it (``prefill``), and each row's first token drawn
    from the target's logits at its last prompt token with ``batch.sampler``.

    Returns ``(first [B], cache, key, hidden)``: the cache holds the prompts
    (``length == batch.lengths``); ``key`` is ``batch.key``'s first half after one split,
    the second having drawn ``first``; ``hidden`` is ``prefill``'s per-slot hidden states
    with ``keep_hidden``, else None."""
    cache = constrain_cache(model.init_cache(batch.tokens.shape[0], batch.capacity), mesh)
    out = prefill(model, params, batch.tokens, batch.lengths, cache, chunk, keep_hidden)
    h_last, cache = out[:2]
    key, sub = jax.random.split(batch.key)
    first = sampling.sample(sub, model.logits(params, h_last), batch.sampler)
    return first, cache, key, (out[2] if keep_hidden else None)


def hidden_features(hidden: dict, layers: tuple[int, ...]) -> Array:
    """The residual streams after each of ``layers`` (a forward's ``hidden`` with them
    returned), concatenated on the feature axis in that order: ``[..., len(layers) * D]``
    (the last layer alone for EAGLE-2; layers 2, L/2 and L-3 for EAGLE-3)."""
    hs = [hidden[l] for l in layers]
    return hs[0] if len(hs) == 1 else jnp.concatenate(hs, axis=-1)


@struct.dataclass
class DecodeState:
    """``AR``'s loop state: generated tokens so far (``PAD`` after ``num``), the per-row
    stop flags, the last token, the cache, the key, the request and the statistics."""

    tokens: Int[Array, "B N"]
    num: Int[Array, "B"]
    done: Bool[Array, "B"]
    last: Int[Array, "B"]
    cache: KVCache
    key: Array
    req: Request
    stats: Stats


@dataclasses.dataclass(frozen=True)
class AR:
    """Autoregressive decoding, a ``specjax.core.decoder.Decoder``: ``init`` prefills and
    emits each row's first token, ``step`` emits one more token for every unfinished row
    (finished rows are left unchanged). Static settings only, so the object is a valid
    static argument of ``jax.jit``. With ``mesh``, the cache is pinned to
    ``specjax.sharding.cache_spec`` (pass parameters placed by ``shard_params``)."""

    model: Any
    chunk: int = 64
    mesh: Any = None

    scratch = 0  # one token per step: nothing is written past the budget

    def bind(self, params, prompts, source_size=None, mesh=None):
        return encdec.bind_sources(self.model, params, prompts, source_size, mesh)

    def init(self, params, batch: Batch) -> DecodeState:
        model, b = self.model, batch.tokens.shape[0]
        req = Request.of(batch)
        first, cache, key, _ = prefill_first(model, params, batch, self.chunk, self.mesh)
        one = jnp.ones((b,), jnp.int32)
        return DecodeState(
            tokens=jnp.full((b, batch.max_out), PAD, jnp.int32).at[:, 0].set(first), num=one,
            done=req.stops(first, one), last=first, cache=cache, key=key, req=req,
            stats=Stats.zeros(1, b))

    def step(self, params, s: DecodeState) -> DecodeState:
        logits, _, cache = self.model.forward(params, s.last[:, None], s.cache.length[:, None],
                                              s.cache)
        key, sub = jax.random.split(s.key)
        tok = sampling.sample(sub, logits[:, 0], s.req.sampler)
        active = ~s.done
        max_out = s.tokens.shape[1]
        slot = jnp.where(active, s.num, max_out)  # done rows write out of bounds: dropped
        num = s.num + active
        b = tok.shape[0]
        stats = s.stats.add(0, forwards=active)
        return s.replace(
            tokens=s.tokens.at[jnp.arange(b), slot].set(tok, mode="drop"), num=num,
            done=s.done | s.req.stops(tok, num), last=jnp.where(active, tok, s.last),
            cache=constrain_cache(cache.advance(active), self.mesh), key=key,
            stats=stats.replace(verified=stats.verified + active))

    def done(self, s: DecodeState) -> Bool[Array, "B"]:
        return s.done

    def loop(self, params, s: DecodeState) -> DecodeState:
        return decoder.loop(self, params, s)

    def output(self, s: DecodeState) -> DecodeOutput:
        return DecodeOutput(tokens=s.tokens, lengths=s.num, stats=s.stats)


GenerateOutput = DecodeOutput  # the name ``generate``'s result had before the one protocol


def generate(model, params, prompts: Sequence[Sequence[int]], *,
             max_new_tokens: int | Sequence[int], sampler: sampling.Sampler = sampling.Greedy(),
             key: Array | None = None, eos_ids: Sequence[int] = (),
             cache_size: int | None = None, chunk: int = 64,
             source_size: int | None = None, mesh=None) -> DecodeOutput:
    """Decodes a batch of prompts of any lengths, one token per target forward: ``decode``
    with ``AR(model, chunk, mesh)``.

    For an encoder-decoder ``model`` (T5) the prompts are the sources: the encoder runs
    once, and the decoder starts from its ``decoder_start_token_id`` (``source_size`` fixes
    the encoder's buffer; see ``specjax.core.encdec``).

    Each row stops after an id in ``eos_ids`` (which is kept) or after its budget. Greedy
    rows are exactly the argmax rollout of ``model``; ``Sample`` needs an explicit ``key``.
    Calls with the same batch size, cache capacity and output bucket reuse one compilation;
    ``compile_s`` of the result says how long this call spent compiling.

    With a ``mesh`` (``specjax.sharding.make_mesh``), rows are split over its ``data`` axis
    and the weights over ``model`` (``shard_params``; already placed weights are kept).
    """
    return decoder.decode(AR(model, chunk, mesh), params, prompts,
                          max_new_tokens=max_new_tokens, sampler=sampler, key=key,
                          eos_ids=eos_ids, cache_size=cache_size, source_size=source_size)
