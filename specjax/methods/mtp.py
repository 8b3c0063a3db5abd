"""``mtp``: a Gemma 4 target with the MTP assistant Google publishes for it, drafting a chain
(as every serving engine runs it) or a dynamic tree (one batched assistant step per level),
and ``hf-mtp``, transformers' assisted generation with the same assistant (a benchmark peer)."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

from specjax.methods.registry import (Built, DraftSizes, Method, Options, SpecError, _cast,
                                       register, speculative)

DEFAULT_DEPTH = 4


@register
@dataclasses.dataclass(frozen=True)
class MTP(DraftSizes, Method):
    """``mtp[:depth]`` (a chain of ``depth`` drafts, default 4) or ``mtp:depth,topk,total``
    (a tree of ``total`` nodes, EAGLE-2's expansion of the ``topk`` best nodes per level),
    over a Gemma 4 assistant directory (``Options.draft_checkpoint``: transformers'
    ``Gemma4AssistantForCausalLM`` layout) and a Gemma 4 target."""

    depth: int = DEFAULT_DEPTH
    topk: int = 1
    total: int | None = None

    kind: ClassVar[str] = "mtp"
    prefixes: ClassVar[tuple[str, ...]] = ("mtp",)
    forms: ClassVar[tuple[str, ...]] = ("mtp[:depth[,topk,total]]",)
    usage: ClassVar[str] = ("mtp[:depth[,topk,total]] (--draft-checkpoint: a Gemma 4 "
                            "assistant; Gemma 4 targets)")
    example: ClassVar[str | None] = "mtp:4,3,8"
    checkpoint: ClassVar[str | None] = "draft_checkpoint"
    family: ClassVar[str | None] = "Gemma4"
    tiny: ClassVar[tuple[str, ...]] = ("mtp:3", "mtp:3,2,5")
    device: ClassVar[tuple[str, ...]] = ("mtp:3", "mtp:5,4,16")

    def check(self, options: Options) -> None:
        """``draft_checkpoint`` is a Gemma 4 assistant directory: config and weight headers
        read and checked (no tensor loads)."""
        from specjax.heads import mtp as heads

        if not options.draft_checkpoint:
            raise SpecError("mtp drafts with a Gemma 4 assistant: pass --draft-checkpoint DIR "
                            "(e.g. google/gemma-4-E4B-it-assistant, downloaded)")
        try:
            heads.read_spec(options.draft_checkpoint)
        except heads.CheckpointError as e:
            raise SpecError(str(e)) from None

    def check_config(self, config, options: Options) -> None:
        """The assistant fits the target: a Gemma 4 of its width, vocabulary and K/V
        geometry."""
        from specjax.heads import mtp as heads

        try:
            heads.check_target(heads.read_spec(options.draft_checkpoint), config,
                               options.draft_checkpoint)
        except heads.CheckpointError as e:
            raise SpecError(str(e)) from None

    def scratch(self, options: Options) -> int | None:
        return (self.depth if self.topk == 1 else self.total) + 1

    def _drafter(self, lm, spec, reads_rejected: bool = False):
        from specjax.drafters.mtp import MTPDrafter

        return MTPDrafter(lm.model, spec, depth=self.depth, topk=self.topk,
                          total_tokens=None if self.topk == 1 else self.total,
                          reads_rejected=reads_rejected)

    def build(self, lm, options: Options) -> Built:
        from specjax.heads import mtp as heads

        spec, params = heads.load(options.draft_checkpoint, lm.model.config)
        drafter = self._drafter(lm, spec)
        drafter.check_params(params)
        return speculative(self, lm, options, drafter, _cast_assistant(params, lm))

    def random(self, lm, options: Options, key) -> Built:
        """A random assistant of the published sizes for the target's width (256 wide
        below a 2,800-wide target, with ordered embeddings, as E2B's and E4B's; 1,024
        wide with the target's query heads, as 26B-A4B's and 31B's), or, for a toy, half
        the target's width with 4 centroids where they divide the vocabulary."""
        from specjax.drafters import mtp

        spec = random_spec(lm.model.config)
        params = mtp.init_params(spec, key, lm.model.compute_dtype, scale=0.2)
        return speculative(self, lm, options, self._drafter(lm, spec), params)


def random_spec(cfg):
    """The assistant ``MTP.random`` builds for a Gemma 4 target of config ``cfg``."""
    from specjax.drafters.mtp import MTPSpec
    from specjax.models.gemma4 import Gemma4Config

    if not isinstance(cfg, Gemma4Config):
        raise SpecError(f"mtp drafts for Gemma 4 targets, not {type(cfg).__name__}")
    if cfg.hidden_size >= 2800:
        return MTPSpec.of(cfg, 1024, 8192, cfg.num_heads)
    if cfg.hidden_size >= 1024:
        return MTPSpec.of(cfg, 256, 2048, 4, ordered=True)
    heads = math.lcm(cfg.geometry("sliding")[0], cfg.geometry("full")[0])
    c = 4 if cfg.vocab_size % 4 == 0 else 1
    return MTPSpec.of(cfg, max(8, cfg.hidden_size // 2), cfg.hidden_size, heads,
                      ordered=c > 1, num_centroids=c, centroid_top_k=min(2, c))


def _cast_assistant(params, lm):
    """The assistant's weights in ``lm``'s compute dtype, ``token_ordering`` kept int32."""
    import jax.numpy as jnp

    params = dict(params)
    order = params.pop("token_ordering", None)
    out = _cast(params, lm)
    if order is not None:
        out["token_ordering"] = jnp.asarray(order, jnp.int32)
    return out
