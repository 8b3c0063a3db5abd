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
from flax import struct
from jax import lax
from jaxtyping import Array, Bool, Int

from specjax import sharding
from specjax.core import encdec, sampling, tree, widths as width_policy
from specjax.core import decoder
from specjax.core.decoder import (PAD, Batch, DecodeOutput, Request, Stats, after_prompt,
                                  eos_cut, pad_after)
from specjax.core.decoding import hidden_features, prefill_first
from specjax.sharding import constrain_cache
from specjax.core.drafter import Context
from specjax.models.kv_cache import KVCache
from specjax.core.verify import Draft, Rejection, Rule, VerifyResult, sanitize, trim, verify


SpecOutput = DecodeOutput  # the name ``speculative_generate``'s result had before


@struct.dataclass
class SpecState:
    """``Speculative``'s loop state: the token buffer (prompt, then generated tokens) with
    per-row lengths, stop flags, the target's cache, the drafter's state, the key, the
    request and the statistics (level 0: the drafter's proposals; level 1: the target)."""

    tokens: Int[Array, "B C"]
    length: Int[Array, "B"]
    num: Int[Array, "B"]
    done: Bool[Array, "B"]
    cache: KVCache
    dstate: Any
    key: Array
    req: Request
    stats: Stats


def _keep_count(emitted, n_emit, num, budget, eos_ids, active):
    """How many of a round's emitted tokens a row keeps: up to its first EOS and budget."""
    return jnp.where(active, jnp.minimum(eos_cut(emitted, n_emit, eos_ids), budget - num), 0)


def _pad_result(res: VerifyResult, depth: int) -> VerifyResult:
    extra = depth - res.path.shape[1]
    if extra == 0:
        return res
    pad = lambda x: jnp.pad(x, ((0, 0), (0, extra)), constant_values=PAD)
    return res.replace(path=pad(res.path), tokens=pad(res.tokens))


def _verify_width(w: int, target, rule, depth: int, layers: tuple[int, ...], tparams,
                  draft: Draft, root, length, cache, key, sampler):
    """Target forward over the root and the first ``w - 1`` nodes, then verification; the
    hidden states after ``layers`` concatenated (``hidden_features``; none for ``()``)."""
    n = w - 1
    d = sanitize(trim(draft, n), target.config.vocab_size)  # a malformed node is inert
    toks = jnp.concatenate([root, d.tokens], axis=1)
    logits, hidden, cache = target.forward(tparams, toks, tree.positions(length - 1, d.parents),
                                           cache, tree.attention_mask(d.parents, d.valid),
                                           return_layers=layers)
    res = verify(logits, d, key, sampler, rule=rule, depth=min(depth, max(n, 1)), sanitized=True)
    h = hidden_features(hidden, layers or (target.config.num_layers,))
    h = jnp.pad(h, ((0, 0), (0, draft.tokens.shape[1] + 1 - w), (0, 0)))
    return _pad_result(res, depth), cache, h


@dataclasses.dataclass(frozen=True)
class Speculative:
    """Speculative decoding with any drafter (n-gram, early exit, a draft model, EAGLE-2,
    ReDrafter), a ``specjax.core.decoder.Decoder`` whose parameters are ``(tparams,
    dparams)``: ``init`` prefills and emits each row's first token, ``step`` runs one
    draft-verify-commit round for every unfinished row (finished rows are left unchanged).
    Lossless as ``speculative_generate`` (which runs exactly these).

    ``widths``: which verification widths are compiled, one target forward each: a
    policy of ``specjax.core.widths`` (default ``Auto()``: the drafter's widths on CPU,
    one padded width ``num_nodes + 1`` on accelerators), its name, or the widths
    themselves. It is resolved here to the ascending tuple (the last being
    ``drafter.num_nodes + 1``); each round runs the narrowest that holds its valid nodes.
    With ``mesh``, the cache is pinned to ``specjax.sharding.cache_spec``."""

    target: Any
    drafter: Any
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
    def model(self):
        return self.target

    @property
    def depth(self) -> int:
        return self.drafter.depth

    @property
    def scratch(self) -> int:
        """One round writes the root and every draft node past the committed length."""
        return self.drafter.num_nodes + 1

    def bind(self, params, prompts, source_size=None, mesh=None):
        """``(tparams, dparams)`` checked against the target, sources encoded for an
        encoder-decoder target (by the draft model too), the drafter's replicated."""
        tparams, dparams = params
        dparams = encdec.bind_drafter(self.drafter, dparams, self.target, prompts, source_size)
        self.drafter.check(self.target)
        tparams, prompts = encdec.bind_sources(self.target, tparams, prompts, source_size, mesh)
        return (tparams, sharding.replicated(mesh, dparams)), prompts

    def init(self, params, batch: Batch) -> SpecState:
        (tparams, dparams), target, drafter = params, self.target, self.drafter
        b, req = batch.tokens.shape[0], Request.of(batch)
        prompt, prompt_len = batch.tokens, batch.lengths
        first, cache, key, h_all = prefill_first(
            target, tparams, batch, self.chunk, self.mesh,
            drafter.feature_layers if drafter.needs_features else False)
        tokens = prompt.at[jnp.arange(b), prompt_len].set(first)
        length = prompt_len + 1
        ctx = Context(tokens=tokens, length=length, prompt_len=prompt_len, cache=cache,
                      params=tparams, hidden=h_all, source=target.source_tokens(tparams))
        one = jnp.ones((b,), jnp.int32)
        return SpecState(tokens=tokens, length=length, num=one, done=req.stops(first, one),
                         cache=cache, dstate=drafter.init(dparams, ctx, self.chunk), key=key,
                         req=req, stats=Stats.zeros(2, b, self.depth))

    def step(self, params, s: SpecState) -> SpecState:
        (tparams, dparams), target, drafter = params, self.target, self.drafter
        depth, widths, req = self.depth, self.widths, s.req
        b, source = s.tokens.shape[0], target.source_tokens(tparams)
        ctx = Context(tokens=s.tokens, length=s.length, prompt_len=req.prompt_len,
                      cache=s.cache, params=tparams, source=source)
        key, k_draft, k_verify = jax.random.split(s.key, 3)
        draft, dstate, cache = drafter.propose(dparams, s.dstate, ctx, k_draft, req.sampler)
        if drafter.chain:  # a chain drafter's parents, as constants (the tree work folds away)
            draft = draft.replace(parents=tree.chain(b, draft.tokens.shape[1]))
        root = jnp.take_along_axis(s.tokens, (s.length - 1)[:, None], axis=1)
        # the narrowest verify width that holds every row's valid nodes (trees are ordered
        # parents first, so a prefix of the nodes is a consistent subtree)
        live = draft.valid & ~s.done[:, None]
        need = 1 + jnp.max(jnp.where(live, jnp.arange(draft.tokens.shape[1])[None] + 1, 0),
                           initial=0)  # a drafter may propose no nodes at all
        branch = width_policy.narrowest(widths, need)
        layers = drafter.feature_layers if drafter.needs_features else ()
        fns = [functools.partial(_verify_width, w, target, self.rule, depth, layers)
               for w in widths]
        res, cache, hidden = lax.switch(branch, fns, tparams, draft, root, s.length, cache,
                                        k_verify, req.sampler)

        active = ~s.done
        keep = _keep_count(res.tokens, res.accepted + 1, s.num, req.budget, req.eos_ids,
                           active)
        slot = s.length[:, None] + jnp.arange(depth + 1)[None]
        slot = jnp.where(jnp.arange(depth + 1)[None] < keep[:, None], slot, s.tokens.shape[1])
        tokens = s.tokens.at[jnp.arange(b)[:, None], slot].set(res.tokens, mode="drop")
        if drafter.chain:  # the accepted path is nodes 0..a-1, already at length+1..length+a
            cache = constrain_cache(cache.advance(keep), self.mesh)
        else:
            src = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), res.path + 1], axis=1)
            cache = constrain_cache(cache.commit(src, keep, window=widths[-1]), self.mesh)
        num = s.num + keep
        kept = jnp.take_along_axis(tokens, (s.length + keep - 1)[:, None], axis=1)[:, 0]
        done = s.done | (active & req.stops(kept, num))
        ctx = Context(tokens=tokens, length=s.length + keep, prompt_len=req.prompt_len,
                      cache=cache, params=tparams, hidden=hidden, source=source)
        dstate = drafter.commit(dparams, dstate, ctx, res)
        return s.replace(tokens=tokens, length=s.length + keep, num=num, done=done, cache=cache,
                         dstate=dstate, key=key,
                         stats=self._count(s.stats, active, live, res,
                                           jnp.asarray(widths)[branch]))

    def _count(self, stats: Stats, active, live, res: VerifyResult, width) -> Stats:
        reached = jnp.arange(self.depth)[None] < res.accepted[:, None]
        stats = stats.add(0, forwards=active).add(
            1, forwards=active, drafted=jnp.sum(live, axis=1),
            accepted=jnp.where(active, res.accepted, 0))
        return stats.replace(accepted_at=stats.accepted_at + (reached & active[:, None]),
                             verified=stats.verified + width * active)

    def done(self, s: SpecState) -> Bool[Array, "B"]:
        return s.done

    def loop(self, params, s: SpecState) -> SpecState:
        return decoder.loop(self, params, s)

    def output(self, s: SpecState) -> DecodeOutput:
        out = after_prompt(s.tokens, s.req.prompt_len, s.req.max_out)
        return DecodeOutput(tokens=pad_after(out, s.num), lengths=s.num, stats=s.stats)


def speculative_generate(target, tparams, drafter, dparams, prompts: Sequence[Sequence[int]],
                         *, max_new_tokens: int | Sequence[int],
                         sampler: sampling.Sampler = sampling.Greedy(),
                         key: Array | None = None, eos_ids: Sequence[int] = (),
                         rule: Rule = Rejection(), cache_size: int | None = None,
                         chunk: int = 64,
                         widths: "width_policy.WidthPolicy | Sequence[int] | str | None" = None,
                         source_size: int | None = None, mesh=None) -> DecodeOutput:
    """Decodes a batch of prompts with ``drafter`` proposing and ``target`` verifying:
    ``decode`` with ``Speculative(target, drafter, widths, rule, chunk, mesh)`` and
    parameters ``(tparams, dparams)``.

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
    spec = Speculative(target, drafter, widths, rule, chunk, mesh)  # checks the widths
    return decoder.decode(spec, (tparams, dparams), prompts, max_new_tokens=max_new_tokens,
                          sampler=sampler, key=key, eos_ids=eos_ids, cache_size=cache_size,
                          source_size=source_size)


__all__ = ["speculative_generate", "SpecOutput", "SpecState", "Speculative"]
