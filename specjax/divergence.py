"""Greedy equality with a stated tolerance: where a method's greedy output leaves ``ar``'s,
was it a near tie that the verification forward's width flipped, or a real mismatch?

With float32 products a speculative method's greedy tokens equal ``ar``'s exactly. With
bfloat16 products they may not: a verification forward over ``W`` tokens rounds differently
from ``ar``'s one-token forwards, and a near tie can flip. ``classify`` measures both sides
of that claim at the first position ``k`` where the outputs differ:

* the **margin**: ``ar``'s logits there, from one-token forwards over the common prefix
  (prompt + ``ar[:k]``; its last ``W`` tokens run one at a time as ``ar`` runs them, the
  rest prefilled in chunks as a prompt is): ``ar``'s token against the method's
  (``token_margin``; the top-1/top-2 margin when the method took ``ar``'s runner-up) and
  against the best other token (``margin``). This is a replay, not ``ar``'s own numbers:
  on a tie closer than bfloat16 rounding it can rank the method's token first (a negative
  margin);
* the **width gap**: the largest ``|logit|`` difference between one width-``W`` forward
  (a chain, with tree attention as verification runs it) and ``W`` one-token forwards over
  the same tokens, the last ``W`` of the common prefix (fewer where it is shorter): every
  compared position's prefix is ``ar``'s own and the last one is the divergence point.
  Later positions matter: at the first one a width-``W`` forward differs from a one-token
  forward by float32 rounding (about 1e-7 even with bfloat16 products on this CPU); the
  difference grows where keys and values computed in the wide forward round to bfloat16
  differently from those written by one-token steps.

The divergence is a **near tie** when ``token_margin <= 2 * tolerance * gap`` (tolerance 1
by default), else a **real mismatch**: when every logit can move by up to ``gap`` between
the two ways of computing it, the difference of two logits can move by up to twice that. ``W`` is the method's widest verification forward
(``verification_width``: draft nodes + 1), since which width verified the diverging round
is not recorded; a per-width policy may have verified it narrower (on SmolLM2-135M with
bfloat16 products the gap measured 0.16-0.26 logits at width 8 and 0.22-0.50 at 25). The
gap covers one verification's worth of width effects; a method's cache also holds keys and
values written by its earlier verification forwards, which the gap does not model.

The cost per diverging prompt: one prefill and one width-``W`` forward plus ``W`` one-token
forwards, in one jitted program per width and cache size (SmolLM2-135M on 2 CPU cores:
about 1 s a prompt, 3 s more for the first of a width). Equal outputs cost nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from specjax._compile import AotCache

KINDS = ("equal", "near_tie", "mismatch")


@dataclasses.dataclass(frozen=True)
class Divergence:
    """The first position where a method's greedy output leaves ``ar``'s, classified.

    ``position``: index in the generated tokens. ``ar_token`` / ``method_token``: the ids
    there (``-1`` where that output had already ended). ``margin``: ``ar``'s logit of its
    token minus the largest other logit (negative where the replay's argmax differs from
    ``ar``'s token: a tie within the replay's own rounding). ``token_margin``: ``ar``'s
    logit of its token minus that of the method's. ``gap``: max ``|logit|`` difference
    between a width-``width`` forward and one-token forwards over ``compared`` positions
    of ``ar``'s chain; ``gap_here``: the same at the divergence position alone;
    ``wide_token``: the width-``width`` forward's argmax there. ``kind``: ``near_tie`` or
    ``mismatch``. Margins and gaps are ``None`` where an output ended early (a mismatch)."""

    position: int
    ar_token: int
    method_token: int
    margin: float | None
    token_margin: float | None
    gap: float | None
    gap_here: float | None
    wide_token: int | None
    width: int
    compared: int
    kind: str

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, rec: dict) -> "Divergence":
        """The record ``as_dict`` made (extra keys, such as ``report``'s ``prompt``, are
        ignored)."""
        return cls(**{f.name: rec[f.name] for f in dataclasses.fields(cls)})

    def line(self) -> str:
        """One line naming the position, tokens, margin and gap."""
        head = (f"token {self.position}: ar {self.ar_token}, method {self.method_token}")
        if self.token_margin is None:
            return f"{head} (one output ended early)"
        rel = "<=" if self.kind == "near_tie" else ">"
        return (f"{head}, margin {self.token_margin:.3g} {rel} 2 x width-{self.width} gap "
                f"{self.gap:.3g}")


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where ``a`` and ``b`` differ (a length counts), or None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def verification_width(decoder) -> int | None:
    """The widest target forward ``decoder`` verifies in: ``num_nodes + 1`` for a
    ``Speculative`` decoder (its last compiled width), the target level's widest for
    ``HSD``, 1 for ``AR``; None for anything else."""
    from specjax.core.decoding import AR
    from specjax.core.speculative import Speculative
    from specjax.hsd.loop import HSD

    if isinstance(decoder, Speculative):
        return int(decoder.widths[-1])
    if isinstance(decoder, HSD):
        return int(decoder.level_widths()[-1][-1])
    if isinstance(decoder, AR):
        return 1
    return None


def _probe(params, buf, n_prefill, chain, valid, *, model, chunk):
    """Prefills ``buf[:n_prefill]``, then runs ``chain`` once as a width-``W`` chain and
    once as ``W`` one-token forwards. Returns per position the max ``|logit|`` difference,
    the wide forward's argmax, and the one-token logits at the last valid position."""
    import jax.numpy as jnp
    from jax import lax

    from specjax.core import tree
    from specjax.core.decoding import prefill

    w = chain.shape[0]
    cache = model.init_cache(1, buf.shape[0])
    _, cache = prefill(model, params, buf[None], n_prefill[None], cache, chunk)
    parents = tree.chain(1, w - 1)
    wide, _, _ = model.forward(params, chain[None], tree.positions(cache.length, parents),
                               cache, tree.attention_mask(parents))

    def step(c, tok):
        logits, _, c = model.forward(params, tok[None, None], c.length[:, None], c)
        return c.advance(1), logits[0, 0]

    _, steps = lax.scan(step, cache, chain)
    gaps = jnp.max(jnp.abs(wide[0] - steps), axis=-1)
    return gaps, jnp.argmax(wide[0], axis=-1), steps[valid - 1]


_PROBE = AotCache(_probe, ("model", "chunk"))


def _capacity(need: int, chunk: int, limit: int) -> int:
    """Cache slots for ``need`` entries: ``chunk`` times a power of two (few compiles),
    or just enough chunks near the model's context ``limit``."""
    chunks = -(-max(need, 1) // chunk)
    cap = chunk * (1 << (chunks - 1).bit_length())
    return cap if cap <= limit else chunk * chunks


def width_gap(model, params, prefix: Sequence[int], width: int, chunk: int = 64,
              capacity: int = 0):
    """``(gaps, wide_tokens, ref_logits)`` over the last ``min(width, len(prefix))``
    tokens of ``prefix``: per position, the max ``|logit|`` difference between one
    width-``width`` chain forward and one-token forwards (numpy ``[n]``); the wide
    forward's argmax ``[n]``; and the one-token logits after the whole ``prefix`` ``[V]``
    (what ``ar`` computes there). The cache holds at least ``capacity`` slots: calls
    given the same value (what the longest prompt needs) share one compiled program."""
    import jax.numpy as jnp

    n = min(width, len(prefix))
    start = len(prefix) - n
    cap = _capacity(max(start + width, capacity), chunk, model.config.max_position_embeddings)
    buf = np.zeros(cap, np.int32)
    buf[:start] = prefix[:start]
    chain = np.full(width, prefix[-1], np.int32)
    chain[:n] = prefix[start:]
    (gaps, wide, ref), _ = _PROBE(params, jnp.asarray(buf), jnp.asarray(start, jnp.int32),
                                  jnp.asarray(chain), jnp.asarray(n, jnp.int32),
                                  model=model, chunk=chunk)
    return np.asarray(gaps)[:n], np.asarray(wide)[:n], np.asarray(ref, np.float64)


def judge(ref_logits, ar_token: int, method_token: int, gap: float,
          tolerance: float = 1.0) -> tuple[float, float, str]:
    """``(margin, token_margin, kind)`` from ``ar``'s logits at the divergence: ``margin``
    = its token's logit minus the best other one, ``token_margin`` = its token's minus the
    method's; ``kind`` is ``near_tie`` when ``token_margin <= 2 * tolerance * gap`` (each of
    the two logits can move by ``gap``), else
    ``mismatch``."""
    ref = np.asarray(ref_logits, np.float64)
    others = np.delete(ref, ar_token)
    margin = float(ref[ar_token] - others.max())
    token_margin = float(ref[ar_token] - ref[method_token])
    kind = "near_tie" if token_margin <= 2 * tolerance * gap else "mismatch"
    return margin, token_margin, kind


def classify(lm, prompt: Sequence[int], ar_tokens: Sequence[int],
             method_tokens: Sequence[int], width: int, *, chunk: int = 64,
             tolerance: float = 1.0, capacity: int = 0) -> Divergence | None:
    """None when the two greedy outputs are equal; else the first divergence, classified
    (see the module docstring). ``lm`` has ``model`` and ``params`` (an encoder-decoder
    model's source ``prompt`` is encoded first); ``width`` is the method's verification
    width (``verification_width``); ``chunk`` its prefill chunk; ``capacity`` as in
    ``width_gap``."""
    from specjax.core import encdec

    k = first_difference(ar_tokens, method_tokens)
    if k is None:
        return None
    a = int(ar_tokens[k]) if k < len(ar_tokens) else -1
    b = int(method_tokens[k]) if k < len(method_tokens) else -1
    if a < 0 or b < 0:  # one output stopped where the other went on: never a tie
        return Divergence(k, a, b, None, None, None, None, None, int(width), 0, "mismatch")
    params, (dec_prompt,) = encdec.bind_sources(lm.model, lm.params, [list(prompt)])
    prefix = list(dec_prompt) + [int(t) for t in ar_tokens[:k]]
    gaps, wide, ref = width_gap(lm.model, params, prefix, int(width), chunk, capacity)
    gap = float(gaps.max())
    margin, token_margin, kind = judge(ref, a, b, gap, tolerance)
    return Divergence(k, a, b, margin, token_margin, gap, float(gaps[-1]), int(wide[-1]),
                      int(width), len(gaps), kind)


def tally(records: Sequence[Divergence | None]) -> dict:
    """Per prompt a classification (None: equal) -> counts ``{equal, near_tie, mismatch}``."""
    out = dict.fromkeys(KINDS, 0)
    for r in records:
        out["equal" if r is None else r.kind] += 1
    return out


def report(records: Sequence[tuple[Any, Divergence | None]]) -> dict:
    """``(prompt id, classification)`` pairs as JSON: the counts of ``tally`` and one
    record per diverging prompt (``prompt`` plus the ``Divergence`` fields)."""
    return {**tally([r for _, r in records]),
            "records": [{"prompt": p, **r.as_dict()} for p, r in records if r is not None]}


__all__ = ["Divergence", "KINDS", "classify", "first_difference", "judge", "report",
           "tally", "verification_width", "width_gap"]
