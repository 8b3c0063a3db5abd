"""Speculative decoding: draft, verify in one target forward, commit; one ``lax.while_loop``.

Each round a drafter proposes ``N`` nodes below the root (the last emitted token); the
target runs ``[root, nodes]`` with tree attention, ``verify`` picks the accepted path and
the next token, and the cache keeps the root and the accepted path in place. Rows are
independent: each stops at EOS or its budget, and its outcome is per row.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax
from jaxtyping import Array, Bool, Int

from specjax.core import encdec, sampling, tree
from specjax._compile import AotCache
from specjax.core.decoding import PAD, Rows, prefill, prepare, stops
from specjax.drafters.base import Context
from specjax.models.kv_cache import KVCache
from specjax.core.verify import Draft, Rejection, Rule, VerifyResult, sanitize, verify


@struct.dataclass
class SpecOutput(Rows):
    """Generated tokens ``[B, M]`` (``PAD`` after each row's end) and per-row statistics.

    ``target_forwards`` counts the prefill that yields the first token plus one per round;
    ``accepted_at[b, i]`` counts rounds whose accepted path reached draft position ``i``;
    ``verified_tokens`` sums the width (root and draft slots) of every round's verification
    forward, the narrowest compiled width that held the round's valid nodes.
    """

    tokens: Int[Array, "B M"]
    lengths: Int[Array, "B"]
    target_forwards: Int[Array, "B"]
    accepted_at: Int[Array, "B D"]
    verified_tokens: Int[Array, "B"]
    compile_s: float = struct.field(pytree_node=False, default=0.0)

    @property
    def tau(self) -> float:
        """Tokens emitted per target forward, over the batch."""
        return float(np.sum(self.lengths) / np.sum(self.target_forwards))

    def acceptance_by_position(self) -> np.ndarray:
        """Fraction of rounds whose accepted path reached each draft position."""
        rounds = np.sum(self.target_forwards - 1)
        return np.sum(np.asarray(self.accepted_at), axis=0) / max(int(rounds), 1)


@struct.dataclass
class SpecState:
    tokens: Int[Array, "B C"]
    length: Int[Array, "B"]
    num: Int[Array, "B"]
    done: Bool[Array, "B"]
    cache: KVCache
    dstate: Any
    key: Array
    rounds: Int[Array, "B"]
    accepted_at: Int[Array, "B D"]
    verified: Int[Array, "B"]


def _keep_count(emitted, n_emit, num, budget, eos_ids, active):
    """How many of a round's emitted tokens a row keeps: up to its first EOS and budget."""
    d1 = emitted.shape[1]
    is_eos = jnp.any(emitted[:, :, None] == eos_ids[None, None, :], -1)
    is_eos = is_eos & (jnp.arange(d1)[None] < n_emit[:, None])
    first = jnp.where(jnp.any(is_eos, -1), jnp.argmax(is_eos, -1) + 1, n_emit)
    return jnp.where(active, jnp.minimum(first, budget - num), 0)


def _pad_result(res: VerifyResult, depth: int) -> VerifyResult:
    extra = depth - res.path.shape[1]
    if extra == 0:
        return res
    pad = lambda x: jnp.pad(x, ((0, 0), (0, extra)), constant_values=PAD)
    return res.replace(path=pad(res.path), tokens=pad(res.tokens))


def _verify_width(w: int, target, rule, depth: int, tparams, draft: Draft, root, length, cache,
                  key, sampler):
    """Target forward over the root and the first ``w - 1`` nodes, then verification."""
    n = w - 1
    d = Draft(tokens=draft.tokens[:, :n], parents=draft.parents[:, :n],
              valid=draft.valid[:, :n], probs=None if draft.probs is None else draft.probs[:, :n])
    d = sanitize(d, target.config.vocab_size)  # a malformed node is inert, never run as is
    toks = jnp.concatenate([root, d.tokens], axis=1)
    logits, hidden, cache = target.forward(tparams, toks, tree.positions(length - 1, d.parents),
                                           cache, tree.attention_mask(d.parents, d.valid))
    res = verify(logits, d, key, sampler, rule=rule, depth=min(depth, max(n, 1)), sanitized=True)
    h = hidden[target.config.num_layers]
    h = jnp.pad(h, ((0, 0), (0, draft.tokens.shape[1] + 1 - w), (0, 0)))
    return _pad_result(res, depth), cache, h


def _round(s: SpecState, *, target, tparams, drafter, dparams, prompt_len, budget, sampler,
           eos_ids, rule, depth, widths) -> SpecState:
    b = s.tokens.shape[0]
    ctx = Context(tokens=s.tokens, length=s.length, prompt_len=prompt_len, cache=s.cache,
                  params=tparams)
    key, k_draft, k_verify = jax.random.split(s.key, 3)
    draft, dstate, cache = drafter.propose(dparams, s.dstate, ctx, k_draft, sampler)
    root = jnp.take_along_axis(s.tokens, (s.length - 1)[:, None], axis=1)
    # the narrowest verify width that holds every row's valid nodes (trees are ordered
    # parents first, so a prefix of the nodes is a consistent subtree)
    live = draft.valid & ~s.done[:, None]
    need = 1 + jnp.max(jnp.where(live, jnp.arange(draft.tokens.shape[1])[None] + 1, 0))
    branch = jnp.sum(jnp.asarray(widths)[None, :] < need)
    fns = [functools.partial(_verify_width, w, target, rule, depth) for w in widths]
    branch = jnp.minimum(branch, len(widths) - 1)
    res, cache, hidden = lax.switch(branch, fns, tparams, draft, root, s.length, cache, k_verify,
                                    sampler)

    active = ~s.done
    keep = _keep_count(res.tokens, res.accepted + 1, s.num, budget, eos_ids, active)
    slot = s.length[:, None] + jnp.arange(depth + 1)[None]
    slot = jnp.where(jnp.arange(depth + 1)[None] < keep[:, None], slot, s.tokens.shape[1])
    tokens = s.tokens.at[jnp.arange(b)[:, None], slot].set(res.tokens, mode="drop")
    src = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), res.path + 1], axis=1)
    cache = cache.commit(src, keep, window=widths[-1])
    num = s.num + keep
    kept = jnp.take_along_axis(tokens, (s.length + keep - 1)[:, None], axis=1)[:, 0]
    done = s.done | (active & stops(kept, num, budget, eos_ids))
    ctx = Context(tokens=tokens, length=s.length + keep, prompt_len=prompt_len, cache=cache,
                  params=tparams, hidden=hidden)
    dstate = drafter.commit(dparams, dstate, ctx, res)
    reached = jnp.arange(depth)[None] < res.accepted[:, None]
    return SpecState(tokens=tokens, length=s.length + keep, num=num, done=done, cache=cache,
                     dstate=dstate, key=key, rounds=s.rounds + active,
                     accepted_at=s.accepted_at + (reached & active[:, None]),
                     verified=s.verified + jnp.asarray(widths)[branch] * active)


def _speculate(tparams, dparams, prompt, prompt_len, budget, sampler, key, eos_ids, *,
               target, drafter, rule, capacity: int, max_out: int, chunk: int,
               depth: int, widths: tuple[int, ...]) -> SpecOutput:
    b = prompt.shape[0]
    cache = target.init_cache(b, capacity, target.param_dtype(tparams))
    h_all = None
    if getattr(drafter, "needs_features", False):
        h_last, cache, h_all = prefill(target, tparams, prompt, prompt_len, cache, chunk, True)
    else:
        h_last, cache = prefill(target, tparams, prompt, prompt_len, cache, chunk)
    key, sub = jax.random.split(key)
    first = sampling.sample(sub, target.logits(tparams, h_last), sampler)
    tokens = prompt.at[jnp.arange(b), prompt_len].set(first)
    length = prompt_len + 1
    ctx = Context(tokens=tokens, length=length, prompt_len=prompt_len, cache=cache,
                  params=tparams, hidden=h_all)
    one = jnp.ones((b,), jnp.int32)
    state = SpecState(tokens=tokens, length=length, num=one,
                      done=stops(first, one, budget, eos_ids), cache=cache,
                      dstate=drafter.init(dparams, ctx, chunk), key=key,
                      rounds=jnp.zeros((b,), jnp.int32),
                      accepted_at=jnp.zeros((b, depth), jnp.int32),
                      verified=jnp.zeros((b,), jnp.int32))
    body = lambda s: _round(s, target=target, tparams=tparams, drafter=drafter,
                            dparams=dparams, prompt_len=prompt_len, budget=budget,
                            sampler=sampler, eos_ids=eos_ids, rule=rule, depth=depth,
                            widths=widths)
    state = lax.while_loop(lambda s: jnp.any(~s.done), body, state)
    idx = prompt_len[:, None] + jnp.arange(max_out)[None]
    out = jnp.take_along_axis(state.tokens, jnp.minimum(idx, capacity - 1), axis=1)
    out = jnp.where(jnp.arange(max_out)[None] < state.num[:, None], out, PAD)
    return SpecOutput(tokens=out, lengths=state.num, target_forwards=state.rounds + 1,
                      accepted_at=state.accepted_at, verified_tokens=state.verified)


_SPECULATE = AotCache(_speculate, ("target", "drafter", "rule", "capacity", "max_out", "chunk",
                                   "depth", "widths"))


def speculative_generate(target, tparams, drafter, dparams, prompts: Sequence[Sequence[int]],
                         *, max_new_tokens: int | Sequence[int],
                         sampler: sampling.Sampler = sampling.Greedy(),
                         key: Array | None = None, eos_ids: Sequence[int] = (),
                         rule: Rule = Rejection(), cache_size: int | None = None,
                         chunk: int = 64, widths: Sequence[int] | None = None,
                         source_size: int | None = None) -> SpecOutput:
    """Decodes a batch of prompts with ``drafter`` proposing and ``target`` verifying.

    Lossless: with ``Greedy`` the tokens equal ``generate``'s argmax rollout; with ``Sample``
    and the default ``Rejection`` rule they are distributed as the target's. ``Typical`` is
    lossy. Each row stops after an EOS id (kept) or its budget. The cache needs room for
    the prompt, the budget and one round's draft; this is checked before compiling.

    ``widths`` are the verification widths compiled (default ``drafter.verify_widths``):
    each round runs the narrowest one that holds the root and every valid node, so a round
    without a draft costs one ordinary decoding step.

    For an encoder-decoder ``target`` (T5) the prompts are the sources, encoded once by the
    target and, for a draft encoder-decoder model, by the draft (``specjax.core.encdec``).
    """
    dparams = encdec.bind_drafter(drafter, dparams, target, prompts, source_size)
    drafter.check(target)
    tparams, prompts = encdec.bind_sources(target, tparams, prompts, source_size)
    n = drafter.num_nodes
    widths = tuple(sorted(set(drafter.verify_widths if widths is None else widths)))
    if widths[0] < 1 or widths[-1] != n + 1:
        raise ValueError(f"verification widths {widths} must lie in [1, {n + 1}] and include "
                         f"{n + 1} (the root and all {n} draft nodes)")
    x = prepare(target, prompts, max_new_tokens, sampler=sampler, key=key, eos_ids=eos_ids,
                cache_size=cache_size, chunk=chunk, extra=n + 1)
    out, compile_s = _SPECULATE(tparams, dparams, x.tokens, x.lengths, x.budgets, sampler, x.key,
                                x.eos, target=target, drafter=drafter, rule=rule,
                                capacity=x.capacity, max_out=x.max_out, chunk=chunk,
                                depth=drafter.depth, widths=widths)
    return out.replace(compile_s=compile_s)


__all__ = ["speculative_generate", "SpecOutput"]
