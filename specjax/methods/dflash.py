"""``dflash``: a block-diffusion drafter (DFlash) drafting a block in one forward, verified
as a chain or, from the top-k tokens of each block slot, as a tree."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from specjax.methods.registry import (Built, DraftSizes, Method, Options, SpecError, _cast,
                                       register, speculative)


RANDOM_BLOCK = 16  # the block of a random drafter without sizes (z-lab's published b16)


@register
@dataclasses.dataclass(frozen=True)
class DFlash(DraftSizes, Method):
    """``dflash[:depth]`` (a chain of the first ``depth`` block slots; default the whole
    block) or ``dflash:depth,topk,total`` (a tree of ``total`` nodes from the ``topk`` best
    tokens at each slot), over a DFlash drafter directory (``Options.draft_checkpoint``:
    z-lab's hub layout, ``config.json`` and ``model.safetensors``)."""

    depth: int | None = None
    topk: int = 1
    total: int | None = None

    kind: ClassVar[str] = "dflash"
    prefixes: ClassVar[tuple[str, ...]] = ("dflash",)
    forms: ClassVar[tuple[str, ...]] = ("dflash[:depth[,topk,total]]",)
    usage: ClassVar[str] = "dflash[:depth[,topk,total]] (--draft-checkpoint: a DFlash drafter)"
    example: ClassVar[str | None] = "dflash:15,4,32"
    checkpoint: ClassVar[str | None] = "draft_checkpoint"
    tiny: ClassVar[tuple[str, ...]] = ("dflash:3", "dflash:3,2,5")
    device: ClassVar[tuple[str, ...]] = ("dflash", "dflash:15,4,32")

    def check(self, options: Options) -> None:
        """``draft_checkpoint`` is a DFlash drafter directory whose config fits the spec."""
        from specjax.heads import dflash as heads

        if not options.draft_checkpoint:
            raise SpecError("dflash drafts with a DFlash drafter: pass --draft-checkpoint DIR "
                            "(a z-lab hub directory, config.json and model.safetensors, or "
                            "one `specjax train dflash` wrote)")
        try:
            spec = heads.read_spec(options.draft_checkpoint)
        except heads.CheckpointError as e:
            raise SpecError(str(e)) from None
        if self.depth is not None and self.depth > spec.block_size - 1:
            raise SpecError(f"{self.format()}: depth {self.depth} exceeds the "
                            f"{spec.block_size - 1} tokens a block of {spec.block_size} "
                            f"drafts ({options.draft_checkpoint})")

    def check_config(self, config, options: Options) -> None:
        from specjax.heads import dflash as heads

        try:
            heads.check_target(heads.read_spec(options.draft_checkpoint), config,
                               options.draft_checkpoint)
        except heads.CheckpointError as e:
            raise SpecError(str(e)) from None

    def scratch(self, options: Options) -> int | None:
        """The nodes and the root (``Speculative.scratch``). Bare ``dflash`` drafts its
        drafter's whole block: ``block_size`` from the checkpoint's config (the random
        build's ``RANDOM_BLOCK`` without one; None where the config is unreadable)."""
        if self.depth is not None:
            return (self.depth if self.topk == 1 else self.total) + 1
        if not options.draft_checkpoint:
            return RANDOM_BLOCK
        from specjax.heads import dflash as heads

        try:
            return heads.read_spec(options.draft_checkpoint).block_size
        except heads.CheckpointError:
            return None  # ``check`` names the problem

    def _drafter(self, lm, spec):
        from specjax.drafters.dflash import DFlashDrafter

        total = None if self.topk == 1 else self.total
        return DFlashDrafter(lm.model, spec, depth=self.depth, topk=self.topk,
                             total_tokens=total)

    def build(self, lm, options: Options) -> Built:
        from specjax.heads import dflash as heads

        spec, params = heads.load(options.draft_checkpoint, lm.model.config)
        drafter = self._drafter(lm, spec)
        drafter.check_params(params)
        return speculative(self, lm, options, drafter, _cast(params, lm))

    def random(self, lm, options: Options, key) -> Built:
        """A random drafter: a block just past the spec's depth (16 without sizes), two
        layers on a shallow target and five (z-lab's) on one of 24 layers or more."""
        from specjax.drafters import dflash

        cfg = lm.model.config
        spec = dflash.DFlashSpec.of(cfg, num_layers=5 if cfg.num_layers >= 24 else 2,
                                    block_size=RANDOM_BLOCK if self.depth is None
                                    else self.depth + 1)
        # weights at 0.2: drafts that vary with the context (at 0.05 a toy accepts ~nothing)
        params = dflash.init_params(spec, key, lm.model.compute_dtype, scale=0.2)
        return speculative(self, lm, options, self._drafter(lm, spec), params)
