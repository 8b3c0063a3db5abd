"""Speculative decoding: draft, verify in one target forward, commit; one ``lax.while_loop``.

Each round a drafter proposes ``N`` nodes below the root (the last emitted token); the
target runs ``[root, nodes]`` with tree attention, ``verify`` picks the accepted path and
the next token, and the cache keeps the root and the accepted path in place. Rows are
independent: each stops at EOS or its budget, and its outcome is per row.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax
from jaxtyping import Array, Bool, Int

from specjax import sharding
from specjax.core import encdec, sampling, tree, widths as width_policy
from specjax._compile import AotCache
from specjax.core.decoding import PAD, Rows, prefill, prepare, stops
from specjax.sharding import constrain_cache
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
    """``Speculative``'s loop state: the token buffer (prompt, then generated tokens) with
    per-row lengths, stop flags, the target's cache, the drafter's state, statistics, and
    the per-call settings (prompt lengths, budgets, EOS ids, sampler)."""

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
    prompt_len: Int[Array, "B"]
    budget: Int[Array, "B"]
    eos_ids: Int[Array, "E"]
    sampler: Any


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


@dataclasses.dataclass(frozen=True)
class Speculative:
    """Speculative decoding with any drafter (n-gram, early exit, a draft model, EAGLE-2,
    ReDrafter) as pure, jittable pieces: ``init`` prefills and emits each row's first
    token, ``step`` runs one draft-verify-commit round for every unfinished row (finished
    rows are left unchanged), ``loop`` rounds until every row is done, ``output`` packs
    the result. Lossless as ``speculative_generate`` (which runs exactly these).

    ``widths``: which verification widths are compiled, one target forward each: a
    policy of ``specjax.core.widths`` (default ``Auto()``: the drafter's widths on CPU,
    one padded width ``num_nodes + 1`` on accelerators), its name, or the widths
    themselves. It is resolved here to the ascending tuple (the last being
    ``drafter.num_nodes + 1``); each round runs the narrowest that holds its valid nodes.
    With ``mesh``, the cache is pinned to ``specjax.sharding.cache_spec``."""

    target: Any
    drafter: Any
    capacity: int
    max_out: int
    widths: Any = None  # a width policy, its name or widths; resolved to a tuple
    rule: Rule = Rejection()
    chunk: int = 64
    mesh: Any = None

    def __post_init__(self):
        n = self.drafter.num_nodes
        widths = width_policy.resolve(self.drafter, self.widths)
        if widths[0] < 1 or widths[-1] != n + 1:
            raise ValueError(f"verification widths {widths} must lie in [1, {n + 1}] and "
                             f"include {n + 1} (the root and all {n} draft nodes)")
        object.__setattr__(self, "widths", widths)

    @property
    def depth(self) -> int:
        return self.drafter.depth

    def init(self, tparams, dparams, prompt: Int[Array, "B C"], prompt_len: Int[Array, "B"],
             budget: Int[Array, "B"], key: Array, eos_ids: Int[Array, "E"],
             sampler: sampling.Sampler = sampling.Greedy()) -> SpecState:
        target, drafter, b = self.target, self.drafter, prompt.shape[0]
        cache = constrain_cache(target.init_cache(b, self.capacity),
                                self.mesh)
        h_all = None
        if getattr(drafter, "needs_features", False):
            h_last, cache, h_all = prefill(target, tparams, prompt, prompt_len, cache,
                                           self.chunk, True)
        else:
            h_last, cache = prefill(target, tparams, prompt, prompt_len, cache, self.chunk)
        key, sub = jax.random.split(key)
        first = sampling.sample(sub, target.logits(tparams, h_last), sampler)
        tokens = prompt.at[jnp.arange(b), prompt_len].set(first)
        length = prompt_len + 1
        ctx = Context(tokens=tokens, length=length, prompt_len=prompt_len, cache=cache,
                      params=tparams, hidden=h_all)
        one = jnp.ones((b,), jnp.int32)
        return SpecState(tokens=tokens, length=length, num=one,
                         done=stops(first, one, budget, eos_ids), cache=cache,
                         dstate=drafter.init(dparams, ctx, self.chunk), key=key,
                         rounds=jnp.zeros((b,), jnp.int32),
                         accepted_at=jnp.zeros((b, self.depth), jnp.int32),
                         verified=jnp.zeros((b,), jnp.int32), prompt_len=prompt_len,
                         budget=budget, eos_ids=eos_ids, sampler=sampler)

    def step(self, tparams, dparams, s: SpecState) -> SpecState:
        target, drafter, depth, widths = self.target, self.drafter, self.depth, self.widths
        b = s.tokens.shape[0]
        ctx = Context(tokens=s.tokens, length=s.length, prompt_len=s.prompt_len, cache=s.cache,
                      params=tparams)
        key, k_draft, k_verify = jax.random.split(s.key, 3)
        draft, dstate, cache = drafter.propose(dparams, s.dstate, ctx, k_draft, s.sampler)
        chain = bool(getattr(drafter, "chain", False))
        if chain:  # a chain drafter's parents, as constants (the tree work folds away)
            draft = draft.replace(parents=tree.chain(b, draft.tokens.shape[1]))
        root = jnp.take_along_axis(s.tokens, (s.length - 1)[:, None], axis=1)
        # the narrowest verify width that holds every row's valid nodes (trees are ordered
        # parents first, so a prefix of the nodes is a consistent subtree)
        live = draft.valid & ~s.done[:, None]
        need = 1 + jnp.max(jnp.where(live, jnp.arange(draft.tokens.shape[1])[None] + 1, 0),
                           initial=0)  # a drafter may propose no nodes at all
        branch = jnp.minimum(jnp.sum(jnp.asarray(widths)[None, :] < need), len(widths) - 1)
        fns = [functools.partial(_verify_width, w, target, self.rule, depth) for w in widths]
        res, cache, hidden = lax.switch(branch, fns, tparams, draft, root, s.length, cache,
                                        k_verify, s.sampler)

        active = ~s.done
        keep = _keep_count(res.tokens, res.accepted + 1, s.num, s.budget, s.eos_ids, active)
        slot = s.length[:, None] + jnp.arange(depth + 1)[None]
        slot = jnp.where(jnp.arange(depth + 1)[None] < keep[:, None], slot, s.tokens.shape[1])
        tokens = s.tokens.at[jnp.arange(b)[:, None], slot].set(res.tokens, mode="drop")
        if chain:  # the accepted path is nodes 0..a-1, already at slots length+1..length+a
            cache = constrain_cache(cache.advance(keep), self.mesh)
        else:
            src = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), res.path + 1], axis=1)
            cache = constrain_cache(cache.commit(src, keep, window=widths[-1]), self.mesh)
        num = s.num + keep
        kept = jnp.take_along_axis(tokens, (s.length + keep - 1)[:, None], axis=1)[:, 0]
        done = s.done | (active & stops(kept, num, s.budget, s.eos_ids))
        ctx = Context(tokens=tokens, length=s.length + keep, prompt_len=s.prompt_len,
                      cache=cache, params=tparams, hidden=hidden)
        dstate = drafter.commit(dparams, dstate, ctx, res)
        reached = jnp.arange(depth)[None] < res.accepted[:, None]
        return s.replace(tokens=tokens, length=s.length + keep, num=num, done=done, cache=cache,
                         dstate=dstate, key=key, rounds=s.rounds + active,
                         accepted_at=s.accepted_at + (reached & active[:, None]),
                         verified=s.verified + jnp.asarray(widths)[branch] * active)

    def loop(self, tparams, dparams, s: SpecState) -> SpecState:
        return lax.while_loop(lambda s: jnp.any(~s.done),
                              lambda s: self.step(tparams, dparams, s), s)

    def output(self, s: SpecState) -> SpecOutput:
        idx = s.prompt_len[:, None] + jnp.arange(self.max_out)[None]
        out = jnp.take_along_axis(s.tokens, jnp.minimum(idx, self.capacity - 1), axis=1)
        out = jnp.where(jnp.arange(self.max_out)[None] < s.num[:, None], out, PAD)
        return SpecOutput(tokens=out, lengths=s.num, target_forwards=s.rounds + 1,
                          accepted_at=s.accepted_at, verified_tokens=s.verified)


def _speculate(tparams, dparams, prompt, prompt_len, budget, sampler, key, eos_ids, *,
               spec: Speculative) -> SpecOutput:
    s = spec.init(tparams, dparams, prompt, prompt_len, budget, key, eos_ids, sampler)
    return spec.output(spec.loop(tparams, dparams, s))


_SPECULATE = AotCache(_speculate, ("spec",))


def speculative_generate(target, tparams, drafter, dparams, prompts: Sequence[Sequence[int]],
                         *, max_new_tokens: int | Sequence[int],
                         sampler: sampling.Sampler = sampling.Greedy(),
                         key: Array | None = None, eos_ids: Sequence[int] = (),
                         rule: Rule = Rejection(), cache_size: int | None = None,
                         chunk: int = 64,
                         widths: "width_policy.WidthPolicy | Sequence[int] | str | None" = None,
                         source_size: int | None = None, mesh=None) -> SpecOutput:
    """Decodes a batch of prompts with ``drafter`` proposing and ``target`` verifying.

    Lossless: with ``Greedy`` the tokens equal ``generate``'s argmax rollout; with ``Sample``
    and the default ``Rejection`` rule they are distributed as the target's. ``Typical`` is
    lossy. Each row stops after an EOS id (kept) or its budget. The cache needs room for
    the prompt, the budget and one round's draft; this is checked before compiling.

    ``widths`` picks the verification widths compiled, one target forward each
    (``specjax.core.widths``; default ``Auto()``): each round runs the narrowest one that
    holds the root and every valid node. ``"padded"`` compiles one forward at
    ``num_nodes + 1`` (what accelerators want); ``"per-width"`` the drafter's own
    ``verify_widths``, so that on CPU a round without a draft costs one decoding step.

    For an encoder-decoder ``target`` (T5) the prompts are the sources, encoded once by the
    target and, for a draft encoder-decoder model, by the draft (``specjax.core.encdec``).

    With a ``mesh``, rows are split over ``data`` and the target's weights over ``model``
    (``specjax.sharding``); the drafter's parameters are replicated.
    """
    dparams = encdec.bind_drafter(drafter, dparams, target, prompts, source_size)
    drafter.check(target)
    tparams, prompts = encdec.bind_sources(target, tparams, prompts, source_size, mesh)
    n = drafter.num_nodes
    Speculative(target, drafter, 1, 1, widths)  # checks the widths before any other work
    x = prepare(target, prompts, max_new_tokens, sampler=sampler, key=key, eos_ids=eos_ids,
                cache_size=cache_size, chunk=chunk, extra=n + 1, mesh=mesh)
    dparams = sharding.replicated(mesh, dparams)
    spec = Speculative(target, drafter, x.capacity, x.max_out, widths, rule, chunk, mesh)
    out, compile_s = _SPECULATE(tparams, dparams, x.tokens, x.lengths, x.budgets, sampler, x.key,
                                x.eos, spec=spec)
    return out.replace(compile_s=compile_s)


__all__ = ["speculative_generate", "SpecOutput", "SpecState", "Speculative"]
