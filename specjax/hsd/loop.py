"""Hierarchical speculative decoding (HSD, Algorithm 1) as nested ``lax.while_loop``s.

A hierarchy is a static tuple of levels, cheapest first, ending with the target. Level 0
drafts ``T[0]`` tokens by itself (prompt lookup, or autoregressively with an early exit).
Every level ``k >= 1`` asks the level below for tokens until it holds at least ``T[k-1]``
of them, scores them in one forward pass and verifies them with ``specjax.core.verify``; the
verified tokens, with level ``k``'s own probabilities, are what level ``k + 1`` verifies in
turn. The hierarchy is static, so a Python recursion over levels builds the nested loops.

Guarantees: with ``Greedy`` the output equals the target's argmax rollout; with ``Sample``
it is distributed as the target's (temperature, top-k, top-p applied), whatever the lower
levels do, because each level's emitted tokens are distributed as that level's model and
their probabilities are passed up as the draft distribution.

Bookkeeping. All levels share one token buffer. Level ``k`` has committed ``n[k]`` tokens;
``n[K] <= ... <= n[0]`` and the committed sequences are prefixes of one another. A model
level's cache holds at least the first ``n[k] - 2`` positions; each of its forwards
recomputes position ``n[k] - 2`` so that a cache one step behind (after a bonus token from
above) needs no special case. When level ``k`` accepts ``a`` of its drafts, every level
below restarts from level ``k``'s new length and drops what it had beyond.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax
from jaxtyping import Array, Bool, Int

from specjax import sharding
from specjax.core import encdec, sampling, tree, widths as width_policy
from specjax.core import decoder
from specjax.core.decoder import (Batch, DecodeOutput, Request, Stats, after_prompt, eos_cut,
                                  is_eos, pad_after)
from specjax.core.decoding import prefill_first
from specjax.sharding import constrain_cache
from specjax.drafters import Context, NGramDrafter, target_head
from specjax.drafters.base import take_tokens
from specjax.drafters.early_exit import exit_logits
from specjax.core.verify import Draft, trim, verify


@dataclasses.dataclass(frozen=True)
class Exit:
    """A level that scores with the target's first ``layer`` layers and ``head``
    (``head(target, tparams, hparams, hidden) -> logits``); ``layer=None`` is the target.

    ``temperature`` (draft levels only) makes the level draw, and verify the level below,
    at its own temperature (0: greedy) instead of the target's; the level above verifies
    against the distribution it actually drew from, so the output stays the target's.
    """

    layer: int | None = None
    head: Callable = target_head
    temperature: float | None = None

    def draws(self, target_sampler: sampling.Sampler) -> sampling.Sampler:
        """The sampler this level draws and verifies with."""
        if self.temperature is None:
            return target_sampler
        if self.temperature == 0:
            return sampling.Greedy()
        if isinstance(target_sampler, sampling.Sample):
            return target_sampler.replace(temperature=float(self.temperature))
        return sampling.Sample(temperature=float(self.temperature))

    def reports(self, target_sampler: sampling.Sampler) -> sampling.Sampler:
        """The sampler whose probabilities are reported as this level's q (the one it
        draws with: anything else breaks losslessness)."""
        return self.draws(target_sampler)

    def score(self, target, tparams, hparams, tokens, positions, cache):
        if self.layer is None:
            logits, _, cache = target.forward(tparams, tokens, positions, cache)
            return logits, cache
        logits, cache = exit_logits(target, tparams, self.layer, self.head, hparams, tokens,
                                    positions, cache)
        return logits.astype(jnp.float32), cache


@dataclasses.dataclass(frozen=True)
class NGram:
    """A bottom level that drafts by prompt lookup (deterministic; costs almost nothing)."""

    drafter: NGramDrafter = NGramDrafter()


Level = Exit | NGram


@dataclasses.dataclass(frozen=True)
class Hierarchy:
    """``levels`` cheapest first, the last being ``Exit()`` (the target); ``T[k]`` is how
    many tokens level ``k + 1`` collects from level ``k`` before it verifies them.

    ``horizontal = h > 0`` is the paper's horizontal heuristic: every level ``k >= 2``
    verifies, after the tokens collected from level ``k - 1``, ``h`` more tokens that level
    0 drafts straight on (each with the q it was drawn from, so it stays lossless).
    """

    levels: tuple[Level, ...]
    T: tuple[int, ...]
    horizontal: int = 0  # level 0 appends this many tokens to every verification above level 1

    def check(self, target) -> None:
        """Raises ``ValueError`` for a hierarchy that cannot run on ``target``."""
        if len(self.levels) < 2:
            raise ValueError("a hierarchy needs a drafter and the target (>= 2 levels)")
        if len(self.T) != len(self.levels) - 1:
            raise ValueError(f"{len(self.levels)} levels need {len(self.levels) - 1} T values, "
                             f"got {len(self.T)}")
        if any(int(t) < 1 for t in self.T):
            raise ValueError(f"every T must be >= 1, got {self.T}")
        if self.horizontal < 0:
            raise ValueError(f"horizontal must be >= 0, got {self.horizontal}")
        if self.horizontal and isinstance(self.levels[0], NGram) \
                and self.levels[0].drafter.depth < self.horizontal:
            raise ValueError(f"the n-gram drafter proposes {self.levels[0].drafter.depth} "
                             f"tokens, fewer than horizontal={self.horizontal}")
        if self.levels[-1] != Exit():
            raise ValueError("the last level must be the target, Exit() (it samples at the "
                             "target's own temperature)")
        for k, lvl in enumerate(self.levels[:-1]):
            if isinstance(lvl, NGram):
                if k != 0:
                    raise ValueError("an n-gram level can only be the bottom level")
                if lvl.drafter.depth < self.T[0]:
                    raise ValueError(f"the n-gram drafter proposes {lvl.drafter.depth} "
                                     f"tokens, fewer than T[0]={self.T[0]}")
            elif not isinstance(lvl, Exit) or lvl.layer is None:
                raise ValueError(f"level {k} must be NGram or Exit(layer) below the target")
            elif not 1 <= lvl.layer < target.config.num_layers:
                raise ValueError(f"exit layer {lvl.layer} outside [1, "
                                 f"{target.config.num_layers - 1}]")
            elif lvl.temperature is not None and lvl.temperature < 0:
                raise ValueError(f"level {k}: temperature must be >= 0 (0: greedy), got "
                                 f"{lvl.temperature}")
        layers = [l.layer for l in self.levels[:-1] if isinstance(l, Exit)]
        if layers != sorted(set(layers)):
            raise ValueError(f"exit layers must increase up the hierarchy, got {layers}")

    @property
    def buffer(self) -> tuple[int, ...]:
        """``M[k]``: the most drafts level ``k`` verifies at once (``M[0] = 0``): level
        ``k - 1``'s overshoot past ``T[k-1]`` and, above level 1, the horizontal tokens."""
        m = [0, self.T[0]]
        for k in range(2, len(self.levels)):
            m.append(self.T[k - 1] + m[k - 1] + self.horizontal)
        return tuple(m)


@struct.dataclass
class HSDState:
    tokens: Int[Array, "B C"]
    n: Int[Array, "L B"]  # committed length per level
    caches: tuple  # per level: KVCache, or None for an n-gram level
    q: tuple  # q[k]: [B, M_k, V] probabilities of level k-1's tokens (None if deterministic)
    key: Array
    done: Bool[Array, "B"]
    req: Request
    stats: Stats  # per level: forward passes (or lookups), drafts verified, accepted


HSDOutput = DecodeOutput  # the name ``hsd_generate``'s result had before the one protocol


# ----------------------------------------------------------------------------- helpers

def _write(tokens: Int[Array, "B C"], pos: Int[Array, "B T"], vals: Int[Array, "B T"],
           mask: Bool[Array, "B T"]) -> Int[Array, "B C"]:
    """``tokens[b, pos[b, i]] = vals[b, i]`` where ``mask``; other writes are dropped."""
    pos = jnp.where(mask, pos, tokens.shape[1])
    rows = jnp.arange(tokens.shape[0])[:, None]
    return tokens.at[rows, pos].set(vals.astype(tokens.dtype), mode="drop")


def _sel(active: Bool[Array, "B"], new: Array, old: Array) -> Array:
    return jnp.where(active.reshape(active.shape + (1,) * (new.ndim - 1)), new, old)


def _set_row(x: Int[Array, "L B"], k: int, active: Bool[Array, "B"], val) -> Array:
    return x.at[k].set(jnp.where(active, val, x[k]))


@dataclasses.dataclass(frozen=True)
class _Run:
    """One traced decode: the static hierarchy plus the per-call arrays it closes over."""

    target: Any
    h: Hierarchy
    tparams: Any
    hparams: tuple
    sampler: Any
    prompt_len: Array
    widths: tuple = ()  # per level: the verification widths compiled (HSD.level_widths)

    @property
    def top(self) -> int:
        return len(self.h.levels) - 1

    def draws(self, k: int) -> sampling.Sampler:
        """Level ``k``'s sampler: the target's at the top, else the level's own."""
        return self.sampler if k == self.top else self.h.levels[k].draws(self.sampler)

    def reports(self, k: int) -> sampling.Sampler:
        return self.sampler if k == self.top else self.h.levels[k].reports(self.sampler)

    def score(self, k: int, s: HSDState, start, width: int):
        """Level ``k``'s logits ``[B, width, V]`` for positions ``start - 1 + i`` and its
        cache with those tokens written (length unchanged). A cache that lags behind
        ``start - 1`` (by at most ``top - k``) is caught up in the same forward."""
        return self._score(k, s.tokens, s.caches[k], start, width)

    def _score(self, k: int, tokens, cache, start, width: int):
        lag_max = self.top - k
        base = cache.length
        idx = base[:, None] + jnp.arange(width + lag_max)[None]
        logits, cache = self.h.levels[k].score(self.target, self.tparams, self.hparams[k],
                                               take_tokens(tokens, idx), idx, cache)
        if lag_max == 0:  # the top level's cache never lags: start - 1 == base
            return logits, cache
        col = (start - 1 - base)[:, None] + jnp.arange(width)[None]
        return jnp.take_along_axis(logits, col[:, :, None], axis=1), cache

    def verify_round(self, k: int, s: HSDState, start, draft: Draft, d, active, key):
        """Level ``k`` scores ``draft`` (its ``M[k]`` chain slots, the first ``d`` valid) in
        one forward and verifies it: ``(accepted [B], next token [B], p, cache, width)``, with
        ``p`` this level's probabilities ``[B, M[k] + 1, V]`` for the level above (None
        when it verifies deterministically or is the top).

        The forward runs at the narrowest of level ``k``'s compiled widths that holds every
        active row's drafts and bonus token (``HSD.level_widths``), and verification runs
        inside it on the slots that width holds: a round whose lookup missed is one
        ordinary decoding step, as in ``specjax.core.speculative``. ``p`` is zero past the
        width; the level above reads only the tokens this level emits."""
        full = self.h.buffer[k] + 1
        ws = self.widths[k] if self.widths else (full,)
        wants_p = k < self.top and s.q[k + 1] is not None

        def at(w, tokens, cache, start, draft, key):
            logits, cache = self._score(k, tokens, cache, start, w)
            res = verify(logits, trim(draft, w - 1), key, self.draws(k))
            p = None
            if wants_p:
                b, v = logits.shape[0], logits.shape[-1]
                p = sampling.probs(logits.reshape(-1, v), self.reports(k)).reshape(b, w, v)
                p = jnp.pad(p, ((0, 0), (0, full - w), (0, 0)))
            return res.accepted, res.next_token, p, cache

        fns = [functools.partial(at, w) for w in ws]
        ops = (s.tokens, s.caches[k], start, draft, key)
        if len(ws) == 1:
            return (*fns[0](*ops), full)
        # a chain's need is its count d (Speculative reads it off a tree's valid mask)
        need = 1 + jnp.max(jnp.where(active, d, 0), initial=0)
        branch = width_policy.narrowest(ws, need)
        return (*lax.switch(branch, fns, *ops), jnp.asarray(ws)[branch])

    def _lookup(self, tokens, at) -> Draft:
        """The n-gram bottom level's draft after each row's first ``at`` tokens (prompt
        lookup in them and, for an encoder-decoder target, in its source)."""
        ctx = Context(tokens=tokens, length=at, prompt_len=self.prompt_len, cache=None,
                      params=self.tparams, source=self.target.source_tokens(self.tparams))
        return self.h.levels[0].drafter.propose(None, (), ctx, None, sampling.Greedy())[0]

    def draft0(self, s: HSDState, active) -> HSDState:
        """Level 0 writes ``T[0]`` drafts after ``n[1]`` (fewer for an n-gram miss)."""
        lvl, t0, start = self.h.levels[0], self.h.T[0], s.n[1]
        if isinstance(lvl, NGram):
            d = self._lookup(s.tokens, start)
            valid = d.valid[:, :t0] & active[:, None]
            tokens = _write(s.tokens, start[:, None] + jnp.arange(t0)[None], d.tokens[:, :t0],
                            valid)
            return s.replace(tokens=tokens, n=_set_row(s.n, 0, active, start + jnp.sum(valid, 1)),
                             stats=s.stats.add(0, forwards=active))
        tokens, cache, q, key = self._sample0(s, active, start, t0, s.q[1], jnp.zeros_like(start))
        qs = s.q if q is None else (s.q[0], _sel(active, q, s.q[1])) + s.q[2:]
        caches = (cache,) + s.caches[1:]
        return s.replace(tokens=tokens, n=_set_row(s.n, 0, active, start + t0), caches=caches,
                         q=qs, key=key, stats=s.stats.add(0, forwards=active * t0))

    def _sample0(self, s: HSDState, active, start, count: int, q, q_off):
        """Level 0 (an exit) draws ``count`` tokens after position ``start``; their q go to
        slots ``q_off + i`` of ``q`` (when not None). Returns tokens, level 0's cache (length
        ``start + count`` on active rows), q and the key."""
        logits, cache = self.score(0, s, start, 1)
        cache = cache.replace(length=start)
        rows = jnp.arange(start.shape[0])

        def body(i, c):
            tokens, cache, q, key, logits = c
            key, sub = jax.random.split(key)
            x = sampling.sample(sub, logits, self.draws(0))
            if q is not None:
                q = q.at[rows, q_off + i].set(sampling.probs(logits, self.reports(0)),
                                              mode="drop")
            pos = (start + i)[:, None]
            tokens = _write(tokens, pos, x[:, None], active[:, None])
            lg, cache = self.h.levels[0].score(self.target, self.tparams, self.hparams[0],
                                               x[:, None], pos, cache)
            return tokens, cache.advance(1), q, key, lg[:, 0]

        tokens, cache, q, key, _ = lax.fori_loop(
            0, count, body, (s.tokens, cache, q, s.key, logits[:, 0]))
        # the last forward (of the last draft) is one step ahead of what is needed; its
        # slot stays below the cache length, so it is kept
        cache = cache.replace(length=jnp.where(active, start + count, s.caches[0].length))
        return tokens, cache, q, key

    def extend(self, k: int, s: HSDState, active) -> tuple[HSDState, Array]:
        """The horizontal heuristic: level 0 drafts ``h`` tokens after level ``k - 1``'s,
        for level ``k`` to verify with them. Returns the state and each row's count."""
        h, lvl, at = self.h.horizontal, self.h.levels[0], s.n[k - 1]
        q_off = at - s.n[k]
        if isinstance(lvl, NGram):
            d = self._lookup(s.tokens, at)
            valid = (jnp.cumprod(d.valid[:, :h], axis=1) > 0) & active[:, None]
            tokens = _write(s.tokens, at[:, None] + jnp.arange(h)[None], d.tokens[:, :h], valid)
            q = list(s.q)
            if q[k] is not None:  # deterministic drafts: one-hot q
                oh = jax.nn.one_hot(d.tokens[:, :h], q[k].shape[-1], dtype=q[k].dtype)
                rows = jnp.arange(at.shape[0])[:, None]
                q[k] = q[k].at[rows, q_off[:, None] + jnp.arange(h)[None]].set(oh, mode="drop")
            return (s.replace(tokens=tokens, q=tuple(q), stats=s.stats.add(0, forwards=active)),
                    jnp.sum(valid, 1))
        tokens, cache, q, key = self._sample0(s, active, at, h, s.q[k], q_off)
        qs = list(s.q)
        if q is not None:
            qs[k] = _sel(active, q, s.q[k])
        return (s.replace(tokens=tokens, caches=(cache,) + s.caches[1:], q=tuple(qs), key=key,
                          stats=s.stats.add(0, forwards=active * h)),
                jnp.where(active, h, 0))

    def fill(self, k: int, s: HSDState, active) -> HSDState:
        """Level ``k - 1`` produces until level ``k`` holds ``T[k-1]`` drafts per row."""
        if k == 1:
            return self.draft0(s, active)
        start, t = s.n[k], self.h.T[k - 1]
        need = lambda s: active & (s.n[k - 1] - start < t)
        return lax.while_loop(lambda s: jnp.any(need(s)),
                              lambda s: self.step(k - 1, s, need(s)), s)

    def step(self, k: int, s: HSDState, active) -> HSDState:
        """Level ``k >= 1``: fill, verify in one forward, emit ``accepted + 1`` tokens, and
        restart every level below from the new length."""
        start = s.n[k]
        s = self.fill(k, s, active)
        m, b = self.h.buffer[k], start.shape[0]
        d = s.n[k - 1] - start
        if self.h.horizontal and k >= 2:
            s, extra = self.extend(k, s, active)
            d = d + extra
        pos = start[:, None] + jnp.arange(m)[None]
        draft = Draft(tokens=take_tokens(s.tokens, pos), parents=tree.chain(b, m),
                      valid=jnp.arange(m)[None] < d[:, None], probs=s.q[k])
        key, sub = jax.random.split(s.key)
        accepted, nxt, p, cache, width = self.verify_round(k, s, start, draft, d, active, sub)
        new_n = start + accepted + 1
        tokens = _write(s.tokens, (start + accepted)[:, None], nxt[:, None], active[:, None])
        q = list(s.q)
        if p is not None:  # this level's p, for the level above
            off = start - s.n[k + 1]
            put = jax.vmap(lambda qq, pp, o: lax.dynamic_update_slice_in_dim(qq, pp, o, 0))
            q[k + 1] = _sel(active, put(q[k + 1], p, off), q[k + 1])
        caches = list(s.caches)
        caches[k] = cache.replace(length=jnp.where(active, new_n - 1, s.caches[k].length))
        n = _set_row(s.n, k, active, new_n)
        for j in range(k):
            n = _set_row(n, j, active, new_n)
            if caches[j] is not None:
                ln = caches[j].length
                caches[j] = caches[j].replace(
                    length=jnp.where(active, jnp.minimum(ln, new_n - 1), ln))
        return s.replace(tokens=tokens, n=n, caches=tuple(caches), q=tuple(q), key=key,
                         stats=self._count(k, s.stats, active, d, accepted, width))

    def _count(self, k: int, stats: Stats, active, d, accepted, width) -> Stats:
        """Level ``k``'s forward, drafts and acceptances; at the top, the width verified."""
        stats = stats.add(k, forwards=active, drafted=jnp.where(active, d, 0),
                          accepted=jnp.where(active, accepted, 0))
        if k < self.top:
            return stats
        return stats.replace(verified=stats.verified + width * active)


@dataclasses.dataclass(frozen=True)
class _LevelDraft:
    """What a width policy reads of a drafter, for one verifying level of a hierarchy."""

    num_nodes: int
    verify_widths: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class HSD:
    """Hierarchical speculative decoding as pure, jittable pieces: ``init`` prefills and
    emits each row's first token, ``step`` runs one round of the target (its levels below
    fill, verify and commit recursively) for every unfinished row, ``loop`` rounds until
    every row is done, ``output`` packs the result. ``hsd_generate`` runs exactly these.
    With ``mesh``, every level's cache is pinned to ``specjax.sharding.cache_spec``."""

    target: Any
    hierarchy: Hierarchy
    chunk: int = 64
    mesh: Any = None
    widths: Any = None  # a specjax.core.widths policy or its name; None: Auto()

    @property
    def model(self):
        return self.target

    @property
    def scratch(self) -> int:
        """Lower levels run ahead of the target: every level's buffer and bonus tokens."""
        return sum(m + 1 for m in self.hierarchy.buffer) + 2 * self.top + 2

    def bind(self, params, prompts, source_size=None, mesh=None):
        """``(tparams, hparams)`` checked against the hierarchy (``hparams`` None: every
        level's default head), sources encoded for an encoder-decoder target, the head
        parameters replicated. Raises ``ValueError`` for an invalid hierarchy or policy."""
        tparams, hparams = params
        self.hierarchy.check(self.target)
        self.level_widths()  # a bad policy fails before compiling
        tparams, prompts = encdec.bind_sources(self.target, tparams, prompts, source_size, mesh)
        hparams = tuple(hparams) if hparams is not None else (None,) * (self.top + 1)
        if len(hparams) != self.top + 1:
            raise ValueError(f"{len(hparams)} head parameter entries for {self.top + 1} levels")
        return (tparams, sharding.replicated(mesh, hparams)), prompts

    @property
    def top(self) -> int:
        return len(self.hierarchy.levels) - 1

    def level_widths(self) -> tuple[tuple[int, ...], ...]:
        """Per level ``k``, the verification widths compiled (``()`` at level 0, which
        does not verify). Level ``k`` verifies up to ``M[k]`` drafts at width ``M[k] + 1``;
        only an n-gram bottom can hand level 1 no draft at all (a lookup miss), so under a
        per-width policy (``PerWidth``, ``Auto`` on CPU) level 1 over an n-gram compiles
        ``(1, M[1] + 1)``, as ``NGramDrafter.verify_widths`` does for ``Speculative``, and
        a miss costs one ordinary decoding step; every other level, and every level under
        ``Padded`` (``Auto`` on accelerators), compiles one width."""
        policy = width_policy.as_policy(self.widths)
        if isinstance(policy, width_policy.Fixed):
            raise ValueError(f"HSD takes a width policy ({', '.join(width_policy.NAMES)}), "
                             f"not fixed widths {policy.values}: its levels verify at "
                             f"different widths")
        out = [()]
        for k in range(1, self.top + 1):
            m = self.hierarchy.buffer[k]
            misses = k == 1 and isinstance(self.hierarchy.levels[0], NGram)
            level = _LevelDraft(m, (1, m + 1) if misses else (m + 1,))
            out.append(tuple(policy.widths(level)))
        return tuple(out)

    def init(self, params, batch: Batch) -> HSDState:
        (tparams, _), target, hierarchy = params, self.target, self.hierarchy
        top, b, req = self.top, batch.tokens.shape[0], Request.of(batch)
        prompt, prompt_len = batch.tokens, batch.lengths
        first, cache, key, _ = prefill_first(target, tparams, batch, self.chunk, self.mesh)
        tokens = prompt.at[jnp.arange(b), prompt_len].set(first)
        vocab = target.config.vocab_size
        # q[k]: level k - 1's probabilities, kept where level k verifies by sampling
        samples = lambda k: isinstance(req.sampler if k == top else
                                       hierarchy.levels[k].draws(req.sampler), sampling.Sample)
        q = (None,) + tuple(
            jnp.zeros((b, hierarchy.buffer[k], vocab), jnp.float32)
            if samples(k) and isinstance(hierarchy.levels[k - 1], Exit) else None
            for k in range(1, top + 1))
        return HSDState(
            tokens=tokens, n=jnp.broadcast_to(prompt_len + 1, (top + 1, b)),
            caches=tuple(None if isinstance(l, NGram) else cache for l in hierarchy.levels),
            q=q, key=key, done=req.stops(first, jnp.ones((b,), jnp.int32)), req=req,
            stats=Stats.zeros(top + 1, b))

    def step(self, params, s: HSDState) -> HSDState:
        tparams, hparams = params
        run = _Run(self.target, self.hierarchy, tparams, tuple(hparams), s.req.sampler,
                   s.req.prompt_len, self.level_widths())
        s = run.step(self.top, s, ~s.done)
        caches = tuple(constrain_cache(c, self.mesh) for c in s.caches)
        return s.replace(caches=caches, done=s.done | _ends(s.tokens, s.req, s.n[self.top]))

    def done(self, s: HSDState) -> Bool[Array, "B"]:
        return s.done

    def loop(self, params, s: HSDState) -> HSDState:
        return decoder.loop(self, params, s)

    def output(self, s: HSDState) -> DecodeOutput:
        req = s.req
        out = after_prompt(s.tokens, req.prompt_len, req.max_out)
        # the target's committed tokens, cut at the first EOS (lower levels wrote drafts past)
        lengths = eos_cut(out, jnp.minimum(s.n[self.top] - req.prompt_len, req.budget),
                          req.eos_ids)
        return DecodeOutput(tokens=pad_after(out, lengths), lengths=lengths, stats=s.stats)


def _ends(tokens, req: Request, n) -> Bool[Array, "B"]:
    """A row ends once it holds ``budget`` new tokens or an EOS among them. (Whether any
    EOS lies in the whole committed span, not where the first is: ``eos_cut`` would need
    the span gathered out of the buffer every round.)"""
    c = tokens.shape[1]
    span = jnp.arange(c)[None]
    new = (span >= req.prompt_len[:, None]) & (span < n[:, None])
    eos = jnp.any(new & is_eos(tokens, req.eos_ids), 1)
    return eos | (n - req.prompt_len >= req.budget)


def hsd_generate(target, tparams, hierarchy: Hierarchy, prompts: Sequence[Sequence[int]], *,
                 max_new_tokens: int | Sequence[int], hparams: Sequence | None = None,
                 sampler: sampling.Sampler = sampling.Greedy(), key: Array | None = None,
                 eos_ids: Sequence[int] = (), cache_size: int | None = None,
                 chunk: int = 64, source_size: int | None = None, mesh=None,
                 widths: "width_policy.WidthPolicy | str | None" = None) -> DecodeOutput:
    """Decodes a batch of prompts with ``hierarchy``; lossless like ``speculative_generate``:
    ``decode`` with ``HSD(target, hierarchy, chunk, mesh, widths)`` and parameters
    ``(tparams, hparams)``.
    For an encoder-decoder ``target`` (T5) the prompts are the sources (encoded once).

    ``hparams[k]`` are level ``k``'s head parameters (``None`` for the default head). Each
    row stops after an EOS id (kept) or its budget. Invalid hierarchies and prompts that do
    not fit the cache raise ``ValueError`` before anything is compiled. With a ``mesh``,
    rows are split over ``data`` and the target's weights over ``model``
    (``specjax.sharding``); head parameters are replicated. ``widths`` is the
    verification-width policy (``specjax.core.widths``, see ``HSD.level_widths``; default
    ``Auto()``); every policy gives the same tokens.
    """
    dec = HSD(target, hierarchy, chunk, mesh, widths)
    return decoder.decode(dec, (tparams, hparams), prompts, max_new_tokens=max_new_tokens,
                          sampler=sampler, key=key, eos_ids=eos_ids, cache_size=cache_size,
                          source_size=source_size)


__all__ = ["Exit", "NGram", "Hierarchy", "HSD", "HSDState", "HSDOutput", "hsd_generate"]
