"""``EarlyExitDrafter``: the target's first layers and a head, reading the target's own KV
cache."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from specjax.drafters.base import (Context, OnTarget, TopKTree, _check_sizes, _grow,
                                   take_tokens)


def target_head(target, tparams, dparams, hidden):
    """The target's own final norm and LM head (the default early-exit head)."""
    return target.logits(tparams, hidden)


def exit_logits(target, tparams, layer: int, head: Callable, hparams, tokens, positions,
                cache, last: bool = False):
    """An early exit's scores: the target's first ``layer`` layers over ``tokens`` at
    ``positions`` (their K/V written into ``cache`` past its length, which is unchanged),
    then ``head(target, tparams, hparams, hidden)``. Returns ``(logits, cache)``: logits
    ``[B, T, V]`` at every token, or with ``last`` ``[B, V]`` at the last token only (the
    head runs on that one). ``EarlyExitDrafter`` and ``specjax.hsd.Exit`` score with it."""
    _, hid, cache = target.forward(tparams, tokens, positions, cache, exit_layer=layer,
                                   compute_logits=False)
    h = hid[layer][:, -1] if last else hid[layer]
    return head(target, tparams, hparams, h), cache


@dataclasses.dataclass(frozen=True)
class EarlyExitDrafter(OnTarget, TopKTree):
    """The target's first ``layer`` layers and a head (default: the target's final norm and
    LM head; ``head(target, tparams, dparams, hidden) -> logits`` plugs in another).

    It reads the target's committed cache for those layers, which holds exactly what the
    truncated model would compute, and writes only scratch slots past it.
    """

    target: Any
    layer: int
    depth: int = 4
    width: int = 1
    head: Callable = target_head

    # chain: TopKTree's (width 1); draft_model: OnTarget's (None)
    needs_features = False  # its exit reads the target's cache, not its hidden states
    feature_layers = ()

    def check(self, target) -> None:
        _check_sizes(self.depth, self.width)
        self.check_target(target)
        if not 1 <= self.layer < target.config.num_layers:
            raise ValueError(f"early-exit layer {self.layer} outside [1, "
                             f"{target.config.num_layers - 1}]")

    def init(self, dparams, ctx: Context, chunk: int):
        return ()

    def _run(self, dparams, tparams, cache, tok, pos):
        logits, cache = exit_logits(self.target, tparams, self.layer, self.head, dparams, tok,
                                    pos, cache, last=True)
        return logits, cache.advance(1)

    def propose(self, dparams, state, ctx: Context, key, sampler):
        root = ctx.length - 1
        logits, cache = self._run(dparams, ctx.params, ctx.cache,
                                  take_tokens(ctx.tokens, root[:, None]), root[:, None])
        step = lambda c, tok, p: self._run(dparams, ctx.params, c, tok, p)
        draft, cache = _grow(step, cache, logits, ctx.length, self.depth, self.width, key,
                             sampler)
        return draft, state, cache.replace(length=ctx.cache.length)

    def commit(self, dparams, state, ctx, result):
        return state
