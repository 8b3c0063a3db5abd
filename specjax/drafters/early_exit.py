"""``EarlyExitDrafter``: the target's first layers and a head, reading the target's own KV
cache."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from specjax.drafters.base import Context, TopKTree, _check_sizes, _grow, take_tokens


def target_head(target, tparams, dparams, hidden):
    """The target's own final norm and LM head (the default early-exit head)."""
    return target.logits(tparams, hidden)


@dataclasses.dataclass(frozen=True)
class EarlyExitDrafter(TopKTree):
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

    # chain: TopKTree's (width 1)
    needs_features = False  # its exit reads the target's cache, not its hidden states
    feature_layers = ()
    draft_model = None  # the target's own layers, not a model of its own

    def check(self, target) -> None:
        _check_sizes(self.depth, self.width)
        if target != self.target:
            raise ValueError("an EarlyExitDrafter must be built on the target it drafts for")
        if not 1 <= self.layer < target.config.num_layers:
            raise ValueError(f"early-exit layer {self.layer} outside [1, "
                             f"{target.config.num_layers - 1}]")

    def init(self, dparams, ctx: Context, chunk: int):
        return ()

    def _run(self, dparams, tparams, cache, tok, pos):
        _, hid, cache = self.target.forward(tparams, tok, pos, cache, exit_layer=self.layer,
                                            compute_logits=False)
        return self.head(self.target, tparams, dparams, hid[self.layer][:, -1]), cache.advance(1)

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
