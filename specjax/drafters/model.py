"""``ModelDrafter``: any specjax model with the target's vocabulary drafts a chain or a
top-k tree from its own KV cache."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from specjax.core.decoding import prefill
from specjax.core.verify import VerifyResult
from specjax.drafters.base import Context, TopKTree, _check_sizes, _grow, take_tokens
from specjax.models.kv_cache import KVCache


@dataclasses.dataclass(frozen=True)
class ModelDrafter(TopKTree):
    """Any specjax model as the draft, with its own KV cache: a chain of ``depth`` tokens
    (``width == 1``) or a top-``width`` tree. Its vocabulary must equal the target's."""

    model: Any
    depth: int = 4
    width: int = 1

    # chain: TopKTree's (width 1)
    needs_features = False
    feature_layers = ()

    @property
    def draft_model(self):
        """The model it drafts with (``dparams`` are its parameters)."""
        return self.model

    def check(self, target) -> None:
        _check_sizes(self.depth, self.width)
        if self.model.config.vocab_size != target.config.vocab_size:
            raise ValueError(f"vocabulary mismatch: the draft model has "
                             f"{self.model.config.vocab_size} tokens and the target "
                             f"{target.config.vocab_size}; drafts must use the target's ids")

    def init(self, dparams, ctx: Context, chunk: int):
        cache = self.model.init_cache(ctx.tokens.shape[0], ctx.cache.capacity)
        return prefill(self.model, dparams, ctx.tokens, ctx.prompt_len, cache, chunk)[1]

    def propose(self, dparams, cache: KVCache, ctx: Context, key, sampler):
        # slots < length - 2 are always valid after a round: re-run the last two tokens
        start = ctx.length - 2
        pos = start[:, None] + jnp.arange(2)[None]
        logits, _, cache = self.model.forward(dparams, take_tokens(ctx.tokens, pos), pos,
                                              cache.replace(length=start))
        cache = cache.advance(2)

        def step(c, tok, p):
            lg, _, c = self.model.forward(dparams, tok, p, c)
            return lg[:, 0], c.advance(1)

        draft, cache = _grow(step, cache, logits[:, 1], ctx.length, self.depth, self.width,
                             key, sampler)
        return draft, cache, ctx.cache

    def commit(self, dparams, cache, ctx, result: VerifyResult):
        return cache
