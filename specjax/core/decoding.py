"""Autoregressive decoding: one jitted ``lax.while_loop``, batched, with per-row stops.

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
import numpy as np
from flax import struct
from jax import lax
from jaxtyping import Array, Bool, Float, Int

from specjax import sharding
from specjax.core import encdec, sampling
from specjax._compile import AotCache
from specjax.sharding import constrain_cache
from specjax.models.kv_cache import KVCache

PAD = -1  # token id written after a row's last generated token


class Rows:
    """What every decoding output shares: ``tokens`` ``[B, N]`` with ``lengths`` ``[B]``."""

    def to_lists(self) -> list[list[int]]:
        """Each row's generated tokens, without padding."""
        toks, lens = np.asarray(self.tokens), np.asarray(self.lengths)
        return [toks[b, : lens[b]].tolist() for b in range(toks.shape[0])]


@struct.dataclass
class GenerateOutput(Rows):
    """Generated tokens ``[B, N]`` (``PAD`` after each row's end) and per-row counts."""

    tokens: Int[Array, "B N"]
    lengths: Int[Array, "B"]
    compile_s: float = struct.field(pytree_node=False, default=0.0)


@struct.dataclass
class DecodeState:
    """``AR``'s loop state: generated tokens so far (``PAD`` after ``num``), the per-row
    stop flags, the cache, and the per-call settings (budgets, EOS ids, sampler)."""

    tokens: Int[Array, "B N"]
    num: Int[Array, "B"]
    done: Bool[Array, "B"]
    last: Int[Array, "B"]
    cache: KVCache
    key: Array
    budget: Int[Array, "B"]
    eos_ids: Int[Array, "E"]
    sampler: Any


def stops(tok: Int[Array, "B"], num: Int[Array, "B"], budget: Int[Array, "B"],
          eos_ids: Int[Array, "E"]) -> Bool[Array, "B"]:
    """Whether a row ends after emitting ``tok`` as its ``num``-th token."""
    return jnp.any(tok[:, None] == eos_ids[None, :], axis=-1) | (num >= budget)


def prefill(model, params, prompt: Int[Array, "B S"], prompt_len: Int[Array, "B"],
            cache: KVCache, chunk: int, keep_hidden: bool = False):
    """Writes each row's prompt into the cache in chunks of ``chunk`` tokens.

    Returns the last layer's hidden state at each row's final prompt token ``[B, D]`` and
    the cache with ``length == prompt_len``; with ``keep_hidden``, also the last layer's
    hidden states at every prompt slot ``[B, S, D]`` (meaningful below ``prompt_len``).
    """
    b = prompt.shape[0]
    n_chunks = (jnp.max(prompt_len) + chunk - 1) // chunk
    depth = model.config.num_layers
    d = model.config.hidden_size
    dtype = jnp.float32  # hidden states are float32 (bfloat16 weights accumulate in it)

    def body(i, carry):
        h_last, c, h_all = carry
        start = i * chunk
        toks = lax.dynamic_slice_in_dim(prompt, start, chunk, axis=1)
        pos = jnp.broadcast_to(start + jnp.arange(chunk), (b, chunk))
        _, hidden, c = model.forward(params, toks, pos, c, compute_logits=False)
        c = c.replace(length=c.length + chunk)
        idx = prompt_len - 1 - start
        here = (idx >= 0) & (idx < chunk)
        h = hidden[depth][jnp.arange(b), jnp.clip(idx, 0, chunk - 1)]
        if keep_hidden:
            h_all = lax.dynamic_update_slice_in_dim(h_all, hidden[depth], start, axis=1)
        return jnp.where(here[:, None], h, h_last), c, h_all

    h0 = jnp.zeros((b, d), dtype)
    h_all = jnp.zeros((b, prompt.shape[1] if keep_hidden else 0, d), dtype)
    cache = cache.replace(length=jnp.zeros_like(cache.length))
    h_last, cache, h_all = lax.fori_loop(0, n_chunks, body, (h0, cache, h_all))
    cache = cache.replace(length=prompt_len.astype(jnp.int32))
    return (h_last, cache, h_all) if keep_hidden else (h_last, cache)


@dataclasses.dataclass(frozen=True)
class AR:
    """Autoregressive decoding as pure, jittable pieces (pytrees in, pytrees out, no host
    syncs): ``init`` prefills and emits each row's first token, ``step`` emits one more
    token for every unfinished row (finished rows are left unchanged), ``loop`` steps until
    every row is done, ``output`` packs the result. Static settings live here, so the
    object is a valid static argument of ``jax.jit``; ``prepare`` sizes ``capacity`` and
    ``max_out`` for a batch. With ``mesh``, the cache is pinned to
    ``specjax.sharding.cache_spec`` (pass parameters placed by ``shard_params``)."""

    model: Any
    capacity: int
    max_out: int
    chunk: int = 64
    mesh: Any = None

    def init(self, params, prompt: Int[Array, "B C"], prompt_len: Int[Array, "B"],
             budget: Int[Array, "B"], key: Array, eos_ids: Int[Array, "E"],
             sampler: sampling.Sampler = sampling.Greedy()) -> DecodeState:
        model, b = self.model, prompt.shape[0]
        cache = constrain_cache(model.init_cache(b, self.capacity),
                                self.mesh)
        h_last, cache = prefill(model, params, prompt, prompt_len, cache, self.chunk)
        key, sub = jax.random.split(key)
        first = sampling.sample(sub, model.logits(params, h_last), sampler)
        one = jnp.ones((b,), jnp.int32)
        return DecodeState(
            tokens=jnp.full((b, self.max_out), PAD, jnp.int32).at[:, 0].set(first), num=one,
            done=stops(first, one, budget, eos_ids), last=first, cache=cache, key=key,
            budget=budget, eos_ids=eos_ids, sampler=sampler)

    def step(self, params, s: DecodeState) -> DecodeState:
        logits, _, cache = self.model.forward(params, s.last[:, None], s.cache.length[:, None],
                                              s.cache)
        key, sub = jax.random.split(s.key)
        tok = sampling.sample(sub, logits[:, 0], s.sampler)
        active = ~s.done
        slot = jnp.where(active, s.num, self.max_out)  # done rows write out of bounds: dropped
        num = s.num + active
        b = tok.shape[0]
        return s.replace(
            tokens=s.tokens.at[jnp.arange(b), slot].set(tok, mode="drop"), num=num,
            done=s.done | stops(tok, num, s.budget, s.eos_ids),
            last=jnp.where(active, tok, s.last),
            cache=constrain_cache(cache.advance(active), self.mesh), key=key)

    def loop(self, params, s: DecodeState) -> DecodeState:
        return lax.while_loop(lambda s: jnp.any(~s.done), lambda s: self.step(params, s), s)

    def output(self, s: DecodeState) -> GenerateOutput:
        return GenerateOutput(tokens=s.tokens, lengths=s.num)


def _decode(params, prompt, prompt_len, budget, sampler, key, eos_ids, *, dec: AR
            ) -> GenerateOutput:
    return dec.output(dec.loop(params, dec.init(params, prompt, prompt_len, budget, key,
                                                eos_ids, sampler)))


_DECODE = AotCache(_decode, ("dec",))


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def plan_shapes(prompt_lens: Sequence[int], budgets: Sequence[int], max_positions: int,
                cache_size: int | None, chunk: int, extra: int = 0) -> tuple[int, int]:
    """The (cache capacity, output width) a call compiles for; raises if a row cannot fit.

    Each row needs its prompt, its budget and ``extra`` scratch slots (one round's draft).
    Raises ``ValueError`` naming the row when that exceeds the cache or the model's
    context, before anything is compiled or run.
    """
    if min(prompt_lens) < 1:
        raise ValueError("every prompt needs at least one token")
    if min(budgets) < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {min(budgets)}")
    need = [p + n + extra for p, n in zip(prompt_lens, budgets)]
    row = int(np.argmax(need))
    what = (f"row {row}: prompt of {prompt_lens[row]} tokens + {budgets[row]} new tokens"
            + (f" + {extra} draft slots" if extra else ""))
    if need[row] > max_positions:
        raise ValueError(f"{what} exceeds the model's context of {max_positions} positions")
    if cache_size is None:
        capacity = min(_round_up(need[row], 128), _round_up(max_positions, chunk))
    else:
        if cache_size % chunk:
            raise ValueError(f"cache_size={cache_size} must be a multiple of the prefill "
                             f"chunk ({chunk})")
        capacity = cache_size
    if need[row] > capacity:
        raise ValueError(f"{what} = {need[row]} does not fit the cache of {capacity} entries")
    max_out = max(16, 1 << (max(budgets) - 1).bit_length())
    return capacity, max_out


@dataclasses.dataclass(frozen=True)
class Batch:
    """A decode call's inputs, checked and laid out on the host: prompts right-padded into a
    ``[B, capacity]`` buffer, per-row lengths and budgets, EOS ids and the PRNG key."""

    tokens: Int[Array, "B C"]
    lengths: Int[Array, "B"]
    budgets: Int[Array, "B"]
    eos: Int[Array, "E"]
    key: Array
    capacity: int
    max_out: int


def prepare(model, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int], *,
            sampler: sampling.Sampler = sampling.Greedy(), key: Array | None = None,
            eos_ids: Sequence[int] = (), cache_size: int | None = None, chunk: int = 64,
            extra: int = 0, mesh=None) -> Batch:
    """Checks a batch against ``model`` and lays it out (``plan_shapes``): prompts present,
    a key when sampling, one budget per prompt, token ids in the vocabulary, and room for
    prompt + budget + ``extra`` scratch slots. Raises ``ValueError`` before any compile."""
    if not prompts:
        raise ValueError("no prompts given")
    if isinstance(sampler, sampling.Sample) and key is None:
        raise ValueError("sampling needs an explicit PRNG key (key=jax.random.key(seed))")
    lens = [len(p) for p in prompts]
    budgets = ([max_new_tokens] * len(prompts) if isinstance(max_new_tokens, (int, np.integer))
               else list(max_new_tokens))
    if len(budgets) != len(prompts):
        raise ValueError(f"{len(budgets)} budgets for {len(prompts)} prompts")
    capacity, max_out = plan_shapes(lens, budgets, model.config.max_position_embeddings,
                                    cache_size, chunk, extra)
    buf = np.zeros((len(prompts), capacity), np.int32)
    for i, p in enumerate(prompts):
        buf[i, : len(p)] = p
    vocab = model.config.vocab_size
    if buf.max() >= vocab or buf.min() < 0:
        raise ValueError(f"prompt token ids must lie in [0, {vocab})")
    if mesh is not None:
        sharding.check_batch(len(prompts), mesh)
        sharding.check_model(model.config, mesh)
    return Batch(tokens=sharding.rows(mesh, jnp.asarray(buf)),
                 lengths=sharding.rows(mesh, jnp.asarray(lens, jnp.int32)),
                 budgets=sharding.rows(mesh, jnp.asarray(budgets, jnp.int32)),
                 eos=sharding.replicated(mesh, jnp.asarray(list(eos_ids) or [PAD], jnp.int32)),
                 key=sharding.replicated(mesh, jax.random.key(0) if key is None else key),
                 capacity=capacity, max_out=max_out)


def generate(model, params, prompts: Sequence[Sequence[int]], *,
             max_new_tokens: int | Sequence[int], sampler: sampling.Sampler = sampling.Greedy(),
             key: Array | None = None, eos_ids: Sequence[int] = (),
             cache_size: int | None = None, chunk: int = 64,
             source_size: int | None = None, mesh=None) -> GenerateOutput:
    """Decodes a batch of prompts of any lengths, one token per target forward (``AR``).

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
    params, prompts = encdec.bind_sources(model, params, prompts, source_size, mesh)
    x = prepare(model, prompts, max_new_tokens, sampler=sampler, key=key, eos_ids=eos_ids,
                cache_size=cache_size, chunk=chunk, mesh=mesh)
    dec = AR(model, x.capacity, x.max_out, chunk, mesh)
    out, compile_s = _DECODE(params, x.tokens, x.lengths, x.budgets, sampler, x.key, x.eos,
                             dec=dec)
    return out.replace(compile_s=compile_s)
