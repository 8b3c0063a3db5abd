"""One decoder protocol, one request layout, one statistics record and one host loop.

``AR``, ``Speculative`` and ``specjax.hsd.HSD`` are ``Decoder``s: small frozen objects
holding only static settings (the model, the drafter or hierarchy, the width policy), with
pure, jittable pieces that take pytrees and return pytrees:

* ``init(params, batch) -> state`` prefills ``batch`` (a ``Batch`` from ``prepare``) and
  emits each row's first token;
* ``step(params, state) -> state`` runs one round for every unfinished row (finished rows
  are left unchanged);
* ``done(state) -> [B] bool`` says which rows are finished;
* ``output(state) -> DecodeOutput`` packs the tokens and the ``Stats``.

``scratch`` is how many cache slots one round may write past a row's budget, which
``prepare`` reserves. ``bind(params, prompts, source_size, mesh)`` places the parameters
and, for an encoder-decoder target, encodes the sources. ``decode(decoder, params,
prompts, ...)`` runs any decoder: it checks and lays out the batch, then compiles
``init``, a ``lax.while_loop`` of ``step`` until ``done``, and ``output`` once per
decoder, batch size and shape bucket (``specjax._compile.AotCache``).
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax
from jaxtyping import Array, Bool, Int

from specjax import sharding
from specjax.core import sampling
from specjax.core.verify import PAD  # noqa: F401  (the token id after a row's last token)
from specjax._compile import AotCache


@struct.dataclass
class Batch:
    """A decode call's inputs, checked and laid out on the host (``prepare``): prompts
    right-padded into a ``[B, capacity]`` buffer, per-row lengths and budgets, EOS ids,
    the PRNG key and the sampler. A pytree: ``capacity`` (cache slots per row) and
    ``max_out`` (the output width) are static, so it passes into ``jax.jit``."""

    tokens: Int[Array, "B C"]
    lengths: Int[Array, "B"]
    budgets: Int[Array, "B"]
    eos: Int[Array, "E"]
    key: Array
    sampler: Any = sampling.Greedy()
    capacity: int = struct.field(pytree_node=False, default=0)
    max_out: int = struct.field(pytree_node=False, default=0)


@struct.dataclass
class Request:
    """The per-call settings every decoder's state carries: each row's prompt length and
    budget, the EOS ids, the sampler, and the (static) output width."""

    prompt_len: Int[Array, "B"]
    budget: Int[Array, "B"]
    eos_ids: Int[Array, "E"]
    sampler: Any
    max_out: int = struct.field(pytree_node=False, default=0)

    @classmethod
    def of(cls, batch: Batch) -> "Request":
        return cls(prompt_len=batch.lengths, budget=batch.budgets, eos_ids=batch.eos,
                   sampler=batch.sampler, max_out=batch.max_out)

    def stops(self, tok: Int[Array, "B"], num: Int[Array, "B"]) -> Bool[Array, "B"]:
        """Whether a row ends after emitting ``tok`` as its ``num``-th token."""
        return stops(tok, num, self.budget, self.eos_ids)


@struct.dataclass
class Stats:
    """Per-row counts every decoder keeps, over levels ``k`` (the last is the target):
    ``forwards[k, b]`` forward passes (or lookups) of level ``k``, the target's prefill
    included; ``drafted[k, b]`` draft tokens level ``k`` verified and ``accepted[k, b]``
    how many of them it accepted; ``accepted_at[b, i]`` rounds whose accepted path reached
    draft position ``i``; ``verified[b]`` the summed width (root and draft slots) of the
    target's forwards after prefill. ``AR`` has one level, ``Speculative`` two (the drafter's
    proposals, the target), ``HSD`` one per level of its hierarchy."""

    forwards: Int[Array, "L B"]
    drafted: Int[Array, "L B"]
    accepted: Int[Array, "L B"]
    accepted_at: Int[Array, "B D"]
    verified: Int[Array, "B"]

    @classmethod
    def zeros(cls, levels: int, batch: int, depth: int = 0) -> "Stats":
        """Zero counts, except one prefill forward of the target (the last level)."""
        z = jnp.zeros((levels, batch), jnp.int32)
        return cls(forwards=z.at[-1].set(1), drafted=z, accepted=z,
                   accepted_at=jnp.zeros((batch, depth), jnp.int32),
                   verified=jnp.zeros((batch,), jnp.int32))

    def add(self, k: int, *, forwards=0, drafted=0, accepted=0) -> "Stats":
        """Adds per-row counts ``[B]`` (or scalars) at level ``k``."""
        return self.replace(forwards=self.forwards.at[k].add(forwards),
                            drafted=self.drafted.at[k].add(drafted),
                            accepted=self.accepted.at[k].add(accepted))


@struct.dataclass
class DecodeOutput:
    """Generated tokens ``[B, N]`` (``PAD`` after each row's end), per-row counts and the
    decoder's ``Stats`` per row; ``compile_s``: seconds this call spent compiling."""

    tokens: Int[Array, "B N"]
    lengths: Int[Array, "B"]
    stats: Stats
    compile_s: float = struct.field(pytree_node=False, default=0.0)

    def to_lists(self) -> list[list[int]]:
        """Each row's generated tokens, without padding."""
        toks, lens = np.asarray(self.tokens), np.asarray(self.lengths)
        return [toks[b, : lens[b]].tolist() for b in range(toks.shape[0])]

    @property
    def target_forwards(self) -> Int[Array, "B"]:
        """Per row: the target's forwards, prefill included."""
        return self.stats.forwards[-1]

    @property
    def forwards(self) -> Int[Array, "L"]:
        """Per level: forwards summed over rows."""
        return jnp.sum(self.stats.forwards, axis=1)

    @property
    def drafted(self) -> Int[Array, "L"]:
        return jnp.sum(self.stats.drafted, axis=1)

    @property
    def accepted(self) -> Int[Array, "L"]:
        return jnp.sum(self.stats.accepted, axis=1)

    @property
    def accepted_at(self) -> Int[Array, "B D"]:
        return self.stats.accepted_at

    @property
    def verified_tokens(self) -> Int[Array, "B"]:
        return self.stats.verified

    @property
    def tau(self) -> float:
        """Tokens emitted per target forward, over the batch."""
        return float(np.sum(self.lengths) / max(int(np.sum(self.target_forwards)), 1))

    @property
    def acceptance(self) -> np.ndarray:
        """Per verifying level ``k >= 1``: accepted / drafted (the empirical alpha)."""
        d, a = np.asarray(self.drafted, float), np.asarray(self.accepted, float)
        return a[1:] / np.maximum(d[1:], 1)

    def acceptance_by_position(self) -> np.ndarray:
        """Fraction of rounds whose accepted path reached each draft position."""
        rounds = np.sum(np.asarray(self.target_forwards) - 1)
        return np.sum(np.asarray(self.accepted_at), axis=0) / max(int(rounds), 1)


@runtime_checkable
class Decoder(Protocol):
    """What ``decode`` runs (see the module docstring)."""

    chunk: int  # prefill chunk: the cache capacity is a multiple of it
    mesh: Any

    @property
    def model(self) -> Any:
        """The model whose tokens are emitted (the target)."""

    @property
    def scratch(self) -> int:
        """Cache slots one round may write past a row's prompt and budget."""

    def bind(self, params, prompts: Sequence[Sequence[int]], source_size: int | None,
             mesh) -> tuple[Any, list]:
        """Checks the decoder against its parameters and places them; for an
        encoder-decoder target, encodes the sources: ``(params, decoder prompts)``."""

    def init(self, params, batch: Batch) -> Any: ...

    def step(self, params, state) -> Any: ...

    def done(self, state) -> Bool[Array, "B"]: ...

    def output(self, state) -> DecodeOutput: ...


def is_eos(tokens: Int[Array, "*S"], eos_ids: Int[Array, "E"]) -> Bool[Array, "*S"]:
    """Whether each token is one of ``eos_ids`` (elementwise; no ids: all False)."""
    return jnp.any(tokens[..., None] == eos_ids, axis=-1)


def eos_cut(tokens: Int[Array, "B T"], n: Int[Array, "B"], eos_ids: Int[Array, "E"]
            ) -> Int[Array, "B"]:
    """How many of each row's first ``n`` tokens it keeps: through its first EOS among
    them (the EOS is kept), all ``n`` when there is none. Tokens at ``n`` and after are
    never read, so they may be anything."""
    eos = is_eos(tokens, eos_ids) & (jnp.arange(tokens.shape[1])[None] < n[:, None])
    return jnp.where(jnp.any(eos, -1), jnp.argmax(eos, -1) + 1, n)


def after_prompt(tokens: Int[Array, "B C"], prompt_len: Int[Array, "B"], max_out: int
                 ) -> Int[Array, "B M"]:
    """Each row's ``M = max_out`` buffer slots from the end of its prompt on (an index
    past the buffer reads its last slot): the generated tokens of a decoder that appends
    them to the prompt, before ``pad_after`` cuts them to length."""
    idx = prompt_len[:, None] + jnp.arange(max_out)[None]
    return jnp.take_along_axis(tokens, jnp.minimum(idx, tokens.shape[1] - 1), axis=1)


def pad_after(tokens: Int[Array, "B T"], n: Int[Array, "B"]) -> Int[Array, "B T"]:
    """``tokens`` with each row's slots from ``n`` on set to ``PAD``."""
    return jnp.where(jnp.arange(tokens.shape[1])[None] < n[:, None], tokens, PAD)


def stops(tok: Int[Array, "B"], num: Int[Array, "B"], budget: Int[Array, "B"],
          eos_ids: Int[Array, "E"]) -> Bool[Array, "B"]:
    """Whether a row ends after emitting ``tok`` as its ``num``-th token."""
    return is_eos(tok, eos_ids) | (num >= budget)


def loop(dec: Decoder, params, state):
    """``dec.step`` until every row is ``dec.done``: one ``lax.while_loop``, jittable."""
    return lax.while_loop(lambda s: jnp.any(~dec.done(s)), lambda s: dec.step(params, s),
                          state)


def _run(params, batch: Batch, *, dec: Decoder) -> DecodeOutput:
    return dec.output(loop(dec, params, dec.init(params, batch)))


_RUN = AotCache(_run, ("dec",))


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


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def check_request(prompts, max_new_tokens) -> None:
    """Raises a one-line ``TypeError`` naming the argument unless ``prompts`` is a sequence
    of 1-D sequences of integer token ids and ``max_new_tokens`` an int or a sequence of
    ints. Floats are refused, integer-valued ones (``5.0``) too: a float where an id or a
    budget belongs is a mistake to report, never to truncate. Values (ranges, lengths)
    are checked by ``prepare``."""
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__"):
        raise TypeError(f"prompts must be a sequence of prompts, each a sequence of integer "
                        f"token ids, got {type(prompts).__name__}")
    for i, p in enumerate(prompts):
        if isinstance(p, (str, bytes)) or not hasattr(p, "__len__"):
            raise TypeError(f"prompts[{i}] must be a sequence of integer token ids, got "
                            f"{type(p).__name__} (a batch of one prompt is [ids])")
        a = np.asarray(p)
        if a.ndim != 1:
            raise TypeError(f"prompts[{i}] must be a 1-D sequence of integer token ids, got "
                            f"shape {a.shape}")
        if a.size and a.dtype.kind not in "iu":
            bad = next((x for x in p if not _is_int(x)), a.tolist()[0])
            bad = bad.item() if hasattr(bad, "item") else bad
            raise TypeError(f"prompts[{i}] must hold integer token ids, got {a.dtype.name} "
                            f"values such as {bad!r} (floats are refused, not truncated)")
    n = max_new_tokens
    if hasattr(n, "dtype"):  # a numpy or JAX scalar or array: its dtype says it
        if np.dtype(n.dtype).kind not in "iu" or np.ndim(n) > 1:
            raise TypeError(f"max_new_tokens must be an int (or one int per prompt), got an "
                            f"array of {np.dtype(n.dtype).name} of shape {np.shape(n)}")
        return
    if _is_int(n):
        return
    if isinstance(n, (str, bytes)) or not hasattr(n, "__len__"):
        raise TypeError(f"max_new_tokens must be an int (or one int per prompt), got "
                        f"{type(n).__name__} {n!r}")
    for i, b in enumerate(n):
        if not _is_int(b):
            raise TypeError(f"max_new_tokens[{i}] must be an int, got {type(b).__name__} "
                            f"{b!r}")


def prepare(model, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int], *,
            sampler: sampling.Sampler = sampling.Greedy(), key: Array | None = None,
            eos_ids: Sequence[int] = (), cache_size: int | None = None, chunk: int = 64,
            extra: int = 0, mesh=None) -> Batch:
    """Checks a batch against ``model`` and lays it out (``plan_shapes``): prompts present,
    a key when sampling, one budget per prompt, token ids in the vocabulary, and room for
    prompt + budget + ``extra`` scratch slots. Raises ``ValueError`` before any compile."""
    check_request(prompts, max_new_tokens)
    if not len(prompts):
        raise ValueError("no prompts given")
    if isinstance(sampler, sampling.Sample) and key is None:
        raise ValueError("sampling needs an explicit PRNG key (key=jax.random.key(seed))")
    lens = [len(p) for p in prompts]
    budgets = ([int(max_new_tokens)] * len(prompts) if np.ndim(max_new_tokens) == 0
               else [int(n) for n in np.asarray(max_new_tokens).tolist()])
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
                 sampler=sampler, capacity=capacity, max_out=max_out)


def decode(dec: Decoder, params, prompts: Sequence[Sequence[int]], *,
           max_new_tokens: int | Sequence[int], sampler: sampling.Sampler = sampling.Greedy(),
           key: Array | None = None, eos_ids: Sequence[int] = (),
           cache_size: int | None = None, source_size: int | None = None) -> DecodeOutput:
    """Decodes a batch of prompts of any lengths with any ``Decoder``.

    Each row stops after an id in ``eos_ids`` (which is kept) or after its budget;
    ``Sample`` needs an explicit ``key``. Token ids and budgets must be integers: a float,
    even an integer-valued one, is a ``TypeError`` naming the argument (``check_request``),
    never truncated. Invalid settings, and prompts that do not fit the
    cache (prompt + budget + ``dec.scratch``) or the model's context, raise ``ValueError``
    before anything is compiled. Calls with the same decoder, batch size, cache capacity
    and output bucket reuse one compilation; ``compile_s`` of the result says how long this
    call spent compiling. With ``dec.mesh``, rows are split over its ``data`` axis; on a
    mesh that spans processes, every process passes the same prompts and gets the whole
    output (``sharding.gather``, once, after the loop).
    """
    check_request(prompts, max_new_tokens)  # before anything is placed or encoded
    params, prompts = dec.bind(params, prompts, source_size, dec.mesh)
    batch = prepare(dec.model, prompts, max_new_tokens, sampler=sampler, key=key,
                    eos_ids=eos_ids, cache_size=cache_size, chunk=dec.chunk, extra=dec.scratch,
                    mesh=dec.mesh)
    out, compile_s = _RUN(params, batch, dec=dec)
    return sharding.gather(out).replace(compile_s=compile_s)


__all__ = ["Batch", "Decoder", "DecodeOutput", "PAD", "Request", "Stats", "decode", "loop",
           "plan_shapes", "prepare", "check_request", "stops", "is_eos", "eos_cut",
           "after_prompt", "pad_after"]
