"""Self-calibration for HSD: what each candidate drafter costs here and how often each
pair agrees, measured on real prompts, and the hierarchy that minimises predicted latency.

Candidates, cheapest first: ``ngram`` (prompt lookup), ``exit L`` (the target's first
``L`` layers and an exit head) for each exit layer, and ``target``. Model indices follow
that order, as ``specjax.hsd.hierarchy`` expects.

* ``alpha[i][j]`` (``i < j``) is the mean over decoded positions of ``1 - TV(p_i, p_j)``,
  with ``p`` the sampler-transformed next-token distribution (a one-hot at the argmax when
  greedy), teacher-forced on the target's own output. The n-gram candidate's distribution
  is a one-hot on its first proposed token, and zero where it proposes nothing.
* ``cost[name][w]`` is the median wall time of one forward of ``w`` tokens (for ``ngram``,
  one lookup) with a filled cache, in milliseconds.
* ``round_overhead`` is what a round spends beyond its forwards (verification and
  bookkeeping), measured on one ``HSD.step``; ``decode_position`` is the mean cache length
  of the calibration's decoded positions, at which the costs are measured.
* ``level_costs`` turns those into the scalar costs of ``hierarchy.latency`` for one
  hierarchy, at the widths ``specjax.hsd`` actually runs each level.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.hsd import hierarchy as hier
from specjax.hsd import loop as hsd
from specjax.hsd.spec import HierarchySpec
from specjax.core import decoder, sampling
from specjax.core.decoder import Batch
from specjax.drafters import Context, NGramDrafter
from specjax.drafters.exit_heads import exit_head
from specjax._timing import median_ms


def names(layers: Sequence[int]) -> list[str]:
    """Candidate names, cheapest first: ``ngram``, ``exit L`` ..., ``target``."""
    return ["ngram"] + [f"exit {l}" for l in layers] + ["target"]


def _layer_logits(target, tparams, heads: dict, toks: np.ndarray, layers: Sequence[int]):
    """``{layer: logits [T, V]}`` and the target's ``[T, V]``, teacher-forced on ``toks``."""
    t = toks[None]
    pos = jnp.arange(t.shape[1])[None]
    cache = target.init_cache(1, t.shape[1])
    logits, hid, _ = target.forward(tparams, t, pos, cache, return_layers=tuple(layers))
    return ({l: exit_head(target, tparams, heads.get(l), hid[l])[0] for l in layers},
            logits[0])


def agreement(target, tparams, heads: dict, layers: Sequence[int], seqs, prompt_lens,
              sampler=sampling.Greedy(), ngram: NGramDrafter = NGramDrafter(),
              progress=None, draft_sampler=None) -> tuple[np.ndarray, int]:
    """``(alpha, positions)``: the ``(K+1) x (K+1)`` agreement matrix of the candidates
    (upper triangle filled) over every decoded position of ``seqs`` (token lists whose
    first ``prompt_lens[b]`` tokens are the prompt). Exit candidates draw with
    ``draft_sampler`` (default: ``sampler``, the target's), as HSD levels with their own
    temperature do. Each sequence is run on its own, padded to the longest one's length, so
    the forward compiles once per call."""
    draft_sampler = sampler if draft_sampler is None else draft_sampler
    n = len(layers) + 2
    pairs = list(zip(*np.triu_indices(n, 1)))

    @jax.jit
    def overlap(tp, hp, toks, lo, hi):
        """Sums over positions ``lo <= t < hi`` of ``sum_v min(p_i, p_j)`` for each pair."""
        exits, final = _layer_logits(target, tp, hp, toks, layers)
        ps = [_ngram_probs(ngram, toks, lo, final.shape[-1])]
        ps += [sampling.probs(exits[l], draft_sampler) for l in layers]
        ps.append(sampling.probs(final, sampler))
        c = toks.shape[0]
        keep = ((jnp.arange(c) >= lo - 1) & (jnp.arange(c) < hi - 1))[:, None]
        ps = [p * keep for p in ps]  # row i predicts token i + 1
        return jnp.stack([jnp.sum(jnp.minimum(ps[i], ps[j])) for i, j in pairs])

    total, count = np.zeros(len(pairs)), 0
    width = -(-max(map(len, seqs), default=1) // 64) * 64  # past ``hi``: masked
    for seq, pl in zip(seqs, prompt_lens):
        if len(seq) <= pl:
            continue
        toks = np.zeros(width, np.int32)
        toks[:len(seq)] = seq
        total += np.asarray(overlap(tparams, heads, jnp.asarray(toks), pl, len(seq)))
        count += len(seq) - pl
        if progress is not None:
            progress.update(1)
    alpha = np.zeros((n, n))
    alpha[tuple(np.array(pairs).T)] = np.clip(total / max(count, 1), 0.0, 1.0)
    return alpha, count


def _ngram_probs(ngram: NGramDrafter, toks: jnp.ndarray, prompt_len, vocab: int) -> jnp.ndarray:
    """Row ``i``: one-hot of the n-gram drafter's first proposal for token ``i + 1`` given
    tokens ``0..i`` (zero where it proposes nothing)."""
    c = toks.shape[0]
    lengths = jnp.arange(1, c + 1, dtype=jnp.int32)
    ctx = Context(tokens=jnp.broadcast_to(toks, (c, c)), length=lengths,
                  prompt_len=jnp.full((c,), prompt_len, jnp.int32), cache=None, params=None)
    d, _, _ = ngram.propose(None, (), ctx, None, sampling.Greedy())
    return jax.nn.one_hot(d.tokens[:, 0], vocab) * d.valid[:, :1]


def forward_costs(target, tparams, heads: dict, layers: Sequence[int], widths: Sequence[int],
                  *, capacity: int = 1024, filled: int = 512, repeats: int = 9,
                  ngram: NGramDrafter = NGramDrafter(), progress=None) -> dict:
    """``{name: {width: ms}}``: the median time of one forward (exit head included) at each
    width with ``filled`` tokens in a cache of ``capacity`` (grown to hold them);
    ``ngram``: one lookup."""
    capacity = max(capacity, -(-(filled + max(widths) + 1) // 64) * 64)
    cache = target.init_cache(1, capacity)
    cache = cache.replace(length=jnp.asarray([filled], jnp.int32))
    out: dict = {}
    for name, layer in zip(names(layers)[1:], list(layers) + [None]):
        lvl = hsd.Exit() if layer is None else hsd.Exit(layer, exit_head)
        f = jax.jit(lambda tp, hp, t, p, c, lvl=lvl: lvl.score(target, tp, hp, t, p, c)[0])
        out[name] = {}
        for w in widths:
            toks = jnp.ones((1, w), jnp.int32)
            pos = filled + jnp.arange(w)[None]
            out[name][int(w)] = median_ms(f, tparams, heads.get(layer), toks, pos, cache,
                                           repeats=repeats)
            if progress is not None:
                progress.update(1)
    hist = jnp.ones((1, capacity), jnp.int32)
    ctx = Context(tokens=hist, length=jnp.asarray([filled], jnp.int32),
                  prompt_len=jnp.asarray([filled // 2], jnp.int32), cache=None, params=None)
    look = jax.jit(lambda c: ngram.propose(None, (), c, None, sampling.Greedy())[0].tokens)
    out["ngram"] = {1: median_ms(look, ctx, repeats=repeats)}
    return out


def ngram_hit_rate(seqs, prompt_lens, ngram: NGramDrafter = NGramDrafter()) -> float:
    """The fraction of decoded positions of ``seqs`` at which the n-gram drafter proposes a
    token at all (whatever it proposes). Under per-width verification a miss costs level 1
    a width-1 forward instead of a full one (``specjax.hsd.HSD.level_widths``)."""
    hits, count = 0, 0
    for seq, pl in zip(seqs, prompt_lens):
        if len(seq) <= pl:
            continue
        toks = np.zeros(-(-len(seq) // 64) * 64, np.int32)
        toks[:len(seq)] = seq
        c = toks.shape[0]
        ctx = Context(tokens=jnp.broadcast_to(jnp.asarray(toks), (c, c)),
                      length=jnp.arange(1, c + 1, dtype=jnp.int32),
                      prompt_len=jnp.full((c,), pl, jnp.int32), cache=None, params=None)
        valid = np.asarray(_propose_valid(ngram, ctx))
        hits += int(valid[pl - 1:len(seq) - 1].sum())  # row i proposes for token i + 1
        count += len(seq) - pl
    return hits / max(count, 1)


@jax.jit(static_argnums=0)
def _propose_valid(ngram: NGramDrafter, ctx: Context):
    return ngram.propose(None, (), ctx, None, sampling.Greedy())[0].valid[:, 0]


def decode_position(seqs, prompt_lens) -> int:
    """The mean cache length over every decoded position of ``seqs`` (each token list's
    first ``prompt_lens[b]`` tokens are its prompt): the cache length at which a
    calibration's costs describe the decode they predict."""
    pos = [p for seq, pl in zip(seqs, prompt_lens) for p in range(pl, len(seq))]
    return int(round(float(np.mean(pos)))) if pos else 0


def round_overhead(target, tparams, *, filled: int = 512, T: int = 4, repeats: int = 5,
                   rounds: tuple[int, int] = (4, 20), seed: int = 0) -> dict:
    """What one decoding round spends beyond its model forwards, in milliseconds, measured
    inside the decoding loop.

    Decodes with the hierarchy ``ngram:T,target`` after a prompt of ``filled`` tokens that
    repeats a period of 16 (so lookups propose), with one compiled program run at two
    budgets; the difference in time over the difference in target rounds is the time of
    one round in the loop (prefill and packing cancel). Subtracts the target's forward at
    the round's width ``T + 1`` and one lookup, timed alone. The rest (verification,
    cache and buffer bookkeeping, the loop's control, copies XLA adds around branches) is
    what every verifying level adds per forward. Returns ``{"round_ms", "loop_round_ms",
    "forward_ms", "lookup_ms", "filled", "T"}``."""
    rng = np.random.default_rng(seed)
    period = rng.integers(3, target.config.vocab_size, 16)
    h = hsd.Hierarchy((hsd.NGram(), hsd.Exit()), (T,))
    n_max = rounds[1] * (T + 1)
    dec = hsd.HSD(target, h)
    capacity = -(-(filled + n_max + dec.scratch + 64) // 64) * 64
    prompt = np.zeros((1, capacity), np.int32)  # the token buffer, as decoding lays it out
    prompt[0, :filled] = np.resize(period, filled)
    prompt, one = jnp.asarray(prompt), jnp.ones((1,), jnp.int32)

    @jax.jit
    def decode(tparams, budget):
        batch = Batch(tokens=prompt, lengths=one * filled, budgets=budget,
                      eos=jnp.asarray([-1], jnp.int32), key=jax.random.key(0),
                      capacity=capacity, max_out=n_max)
        params = (tparams, (None, None))
        return decoder.loop(dec, params, dec.init(params, batch)).stats.forwards[-1, 0]

    def timed(budget: int) -> tuple[float, int]:
        b = one * budget
        n = int(decode(tparams, b))
        return median_ms(decode, tparams, b, repeats=repeats), n

    (t0, r0), (t1, r1) = timed(rounds[0]), timed(n_max)
    loop_round = (t1 - t0) / max(r1 - r0, 1)
    cost = forward_costs(target, tparams, {}, [], [T + 1], capacity=capacity,
                         filled=filled + n_max // 2, repeats=repeats)
    fwd, look = cost["target"][T + 1], cost["ngram"][1]
    return {"round_ms": max(loop_round - fwd - look, 0.0), "loop_round_ms": loop_round,
            "forward_ms": fwd, "lookup_ms": look, "filled": int(filled), "T": int(T)}


# ----------------------------------------------------------------------------- tuning

def _cost_at(table: dict, width: int) -> float:
    """Cost at ``width``: linear between measured widths, extended linearly past the two
    widest (and clamped below the narrowest). A wider forward never costs less than a
    narrower one, so each measured value is first raised to the largest at any narrower
    width: timing noise cannot make an extrapolated cost fall, or go negative."""
    ws = sorted(int(w) for w in table)
    vs = np.maximum.accumulate([table[w] if w in table else table[str(w)] for w in ws])
    if width > ws[-1] and len(ws) > 1:
        return float(vs[-1] + (width - ws[-1]) * (vs[-1] - vs[-2]) / (ws[-1] - ws[-2]))
    return float(np.interp(width, ws, vs))


def level_costs(costs: dict, sigma: Sequence[int], T: Sequence[int],
                layers: Sequence[int], horizontal: int = 0,
                round_ms: float = 0.0, ngram_hit: float = 1.0) -> list[float]:
    """Scalar costs for ``hierarchy.latency`` of ``sigma`` (candidate indices) with ``T``:
    the bottom's cost per drafted token (a width-1 forward, plus the catch-up forward of
    width ``1 + top`` spread over ``T[0]`` tokens), and for each verifying level one forward
    at the width ``specjax.hsd`` runs it (its buffer ``M[k]`` plus ``1 + top - k``; ``M[k]``
    holds the ``horizontal`` tokens above level 1) plus ``round_ms``, the round's own
    overhead (``round_overhead``). Level 1 over an n-gram bottom verifies at full width on
    a fraction ``ngram_hit`` of rounds and at width ``1 + top - 1`` on the others (a lookup
    miss under per-width verification; pass 1.0 for a padded width)."""
    cand = names(layers)
    costs = _int_widths(costs)
    top = len(sigma) - 1
    if top == 0:  # the target alone: one width-1 forward per token
        return [_cost_at(costs[cand[sigma[0]]], 1)]
    buf = [0, T[0]]  # hsd.Hierarchy.buffer: M[k] = T[k-1] + M[k-1] + horizontal
    for k in range(2, len(sigma)):
        buf.append(T[k - 1] + buf[k - 1] + horizontal)
    out = []
    for k, i in enumerate(sigma):
        table = costs[cand[i]]
        if k == 0:
            out.append(table[1] / T[0] if cand[i] == "ngram" else  # one lookup per fill
                       _cost_at(table, 1) + _cost_at(table, 1 + top) / T[0])
        else:
            full = _cost_at(table, buf[k] + 1 + top - k)
            if k == 1 and cand[sigma[0]] == "ngram":
                full = ngram_hit * full + (1 - ngram_hit) * _cost_at(table, 1 + top - k)
            out.append(full + round_ms)
    return out


def horizontal_cost(costs: dict, bottom: int, top: int, h: int, layers: Sequence[int]) -> float:
    """What level 0 spends on ``h`` horizontal drafts for one verification: one lookup (an
    n-gram bottom), or a catch-up forward of width ``1 + top`` and ``h`` width-1 forwards."""
    name = names(layers)[bottom]
    table = _int_widths(costs)[name]
    if name == "ngram":
        return table[1]
    return _cost_at(table, 1 + top) + h * _cost_at(table, 1)


def _int_widths(costs: dict) -> dict:
    return {k: {int(w): v for w, v in t.items()} for k, t in costs.items()}


def predicted_latency(calib: dict, sigma: Sequence[int], T: Sequence[int],
                      model: hier.Model = "exact", horizontal: int = 0) -> float:
    """Predicted milliseconds per target token of one hierarchy under ``calib``, with the
    horizontal heuristic's ``horizontal`` tokens (they act from three levels up), the
    measured round overhead (``calib["round"]["round_ms"]``, 0 in older calibrations) and,
    where the calibration's backend verifies per width (``calib["verify_widths"]``), the
    n-gram drafter's hit rate (``calib["ngram_hit"]``)."""
    sigma, T = tuple(sigma), tuple(T)
    h = horizontal if len(sigma) > 2 else 0
    per_width = calib.get("verify_widths", "padded") == "per-width"
    c = level_costs(calib["cost_ms"], sigma, T, calib["layers"], h,
                    float(calib.get("round", {}).get("round_ms", 0.0)),
                    float(calib.get("ngram_hit", 1.0)) if per_width else 1.0)
    alpha = np.asarray(calib["alpha"], float)[np.ix_(sigma, sigma)]
    c_h = horizontal_cost(calib["cost_ms"], sigma[0], len(sigma) - 1, h, calib["layers"]) \
        if h else 0.0
    return hier.latency(c, alpha, tuple(range(len(sigma))), T, model=model, horizontal=h,
                        horizontal_cost=c_h)


def tune(calib: dict, t_max: int = 8, max_levels: int = 4, model: hier.Model = "exact",
         horizontal: Sequence[int] = (0,)
         ) -> tuple[float, tuple[int, ...], tuple[int, ...], int, list]:
    """``(latency, sigma, T, h, table)``: the hierarchy of at most ``max_levels`` levels
    with the least predicted latency, by enumeration with width-aware costs
    (``level_costs``), over every horizontal-heuristic size ``h`` in ``horizontal`` (it acts
    on three levels or more; two-level rows keep ``h = 0``). ``table`` lists each
    ``(sigma, h)``'s best ``T`` and latency. The n-gram candidate can only be the bottom
    level; ``t_max`` bounds every ``T``, and the n-gram drafter's depth bounds ``T[0]``
    and ``h`` over it."""
    n = len(calib["layers"]) + 2
    if t_max < 1 or max_levels < 2:
        raise ValueError(f"need t_max >= 1 and max_levels >= 2 (a drafter and the target), "
                         f"got {t_max}, {max_levels}")
    hs = sorted({int(h) for h in horizontal})
    if not hs or hs[0] < 0:
        raise ValueError(f"horizontal sizes must be ints >= 0, got {list(horizontal)}")
    depth = NGramDrafter().depth
    best, table = (predicted_latency(calib, (n - 1,), ()), (n - 1,), (), 0), []
    for size in range(1, max_levels):
        for drafts in itertools.combinations(range(n - 1), size):
            if 0 in drafts[1:]:
                continue
            sigma = drafts + (n - 1,)
            for h in (hs if size >= 2 else [0]):
                if sigma[0] == 0 and h > depth:
                    continue
                top = min(((predicted_latency(calib, sigma, T, model, h), T)
                           for T in itertools.product(range(1, t_max + 1), repeat=size)
                           if sigma[0] != 0 or T[0] <= depth),
                          default=None)
                if top is None:
                    continue
                table.append({"sigma": sigma, "T": top[1], "horizontal": h,
                              "latency_ms": top[0]})
                if top[0] < best[0]:
                    best = (top[0], sigma, top[1], h)
    return best[0], best[1], best[2], best[3], table


def hierarchy_from(sigma: Sequence[int], T: Sequence[int], layers: Sequence[int],
                   heads: dict, temperatures: Sequence[float | None] | None = None,
                   horizontal: int = 0) -> tuple[hsd.Hierarchy, tuple]:
    """``(Hierarchy, hparams)`` that ``hsd_generate`` runs for candidate indices ``sigma``;
    ``temperatures[k]`` is exit level ``k``'s own draft temperature (None: the target's)."""
    spec = HierarchySpec.from_sigma(sigma, T, layers, temperatures, horizontal)
    return spec.build(heads, exit_head)


def parse_hierarchy(spec: str, layers: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``"ngram:4,12:3,target"`` -> candidate indices and T values (``HierarchySpec.parse``,
    the one parser of the form; the exit layers must be among ``layers``)."""
    h = HierarchySpec.parse(spec)
    return h.sigma(layers), h.T


def format_hierarchy(sigma: Sequence[int], T: Sequence[int], layers: Sequence[int],
                     temperatures: Sequence[float | None] | None = None,
                     horizontal: int = 0) -> str:
    """The spec ``parse_hierarchy`` reads back, e.g. ``"ngram:4,12@0.5:3,target"``."""
    return HierarchySpec.from_sigma(sigma, T, layers, temperatures, horizontal).format()


def tuned_spec(calib: dict, layers: Sequence[int], t_max: int = 8, max_levels: int = 4,
               horizontal: Sequence[int] = (0,)) -> tuple[HierarchySpec, str | None]:
    """The hierarchy ``tune`` predicts fastest from ``calib`` over exit ``layers``, as a
    ``HierarchySpec`` with the calibration's draft temperatures, and a note: where the
    target alone is predicted fastest, the best hierarchy instead, and the note says so
    (None otherwise)."""
    lat, sigma, T, h, table = tune(calib, t_max, max_levels, horizontal=horizontal)
    note = None
    if len(sigma) == 1:  # the target alone is predicted fastest: run the best hierarchy
        row = min(table, key=lambda r: r["latency_ms"])
        sigma, T, h = row["sigma"], row["T"], row["horizontal"]
        note = (f"the target alone is predicted faster ({lat:.1f} ms/token) than any "
                f"hierarchy (best {row['latency_ms']:.1f}); running that best one")
    return HierarchySpec.from_sigma(sigma, T, layers, draft_temperatures(calib, len(sigma)),
                                    h), note


def draft_temperatures(calib: dict, n_levels: int) -> tuple | None:
    """The draft levels' own temperature a calibration was measured at (None: the
    target's), for ``HierarchySpec.from_sigma``, which applies it to exit levels only."""
    t = calib.get("draft_temperature")
    return None if t is None else tuple([t] * (n_levels - 1) + [None])


__all__ = ["names", "tuned_spec", "draft_temperatures", "agreement", "forward_costs",
           "decode_position", "round_overhead",
           "ngram_hit_rate",
           "level_costs", "horizontal_cost",
           "predicted_latency", "tune",
           "hierarchy_from", "parse_hierarchy", "format_hierarchy"]
