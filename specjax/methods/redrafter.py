"""``redrafter[:W,L][:nodedup]``: ReDrafter's beams merged into one tree."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import ClassVar

from specjax.methods.registry import (Built, CliOption, Method, Options, SpecError, _cast,
                                       _field_default, _joined, _sections, _sizes,
                                       register, speculative)


@register
@dataclasses.dataclass(frozen=True)
class Redrafter(Method):
    """``redrafter[:W,L][:nodedup]``: ``W`` beams of ``L`` drafted tokens."""

    sizes: tuple[int, int] | None = None
    dedup: bool = True

    kind: ClassVar[str] = "redrafter"
    prefixes: ClassVar[tuple[str, ...]] = ("redrafter",)
    forms: ClassVar[tuple[str, ...]] = ("redrafter[:W,L][:nodedup]",)
    usage: ClassVar[str] = "redrafter[:W,L][:nodedup] (redrafter with --redrafter)"
    example: ClassVar[str | None] = "redrafter:2,3"
    tiny: ClassVar[tuple[str, ...]] = ("redrafter:3,3", "redrafter:3,3:nodedup")
    device: ClassVar[tuple[str, ...]] = ("redrafter:1,3", "redrafter:4,4")
    demo: ClassVar[tuple[str, ...]] = ("redrafter:1,3",)  # where a ReDrafter head ships
    cli: ClassVar[CliOption | None] = CliOption(
        "redrafter", "--redrafter", "redrafter",
        "ReDrafter spec: redrafter[:W,L][:nodedup] (W beams of L tokens)")
    checkpoint: ClassVar[str | None] = "redrafter_checkpoint"
    ships_heads: ClassVar[bool] = True

    def __post_init__(self):
        """``SpecError`` unless the sizes are ``W,L``, each >= 1."""
        if self.sizes is not None and (len(self.sizes) != 2 or min(self.sizes) < 1):
            raise SpecError(f"bad sizes {self.sizes} in redrafter: want W,L, each >= 1")

    @classmethod
    def parse(cls, text: str) -> Redrafter:
        sizes, opts = _sections(text, "redrafter", "redrafter[:W,L][:nodedup]")
        if any(o != "nodedup" for o in opts):
            raise SpecError(f"unknown ReDrafter option in {text!r}: nodedup")
        return cls(_sizes(sizes, 2, "W,L", text) if sizes else None, not opts)

    def drafter_kwargs(self) -> dict:
        """``RedrafterDrafter``'s settings (the sizes only where given)."""
        sizes = {} if self.sizes is None else dict(zip(("width", "length"), self.sizes))
        return {"dedup": self.dedup, **sizes}

    def format(self) -> str:
        return _joined("redrafter", self.sizes, [] if self.dedup else ["nodedup"])

    @classmethod
    def shipped(cls, model: str) -> Path | None:
        from specjax.heads import shipped_head

        return shipped_head("redrafter", model)

    def check(self, options: Options) -> None:
        """A ``redrafter_checkpoint`` holds an exported ReDrafter head; without one, a head
        ships for ``options.model_name``."""
        from specjax.heads import head_dir_error
        from specjax.heads.shipped import REDRAFTER_RECIPE

        if options.redrafter_checkpoint:
            if err := head_dir_error(options.redrafter_checkpoint, "--redrafter-checkpoint",
                                     "redrafter"):
                raise SpecError(err)
        elif self.shipped(options.model_name) is None:
            raise FileNotFoundError(f"no ReDrafter head ships for {options.model_name!r}; train "
                                    "one: " + REDRAFTER_RECIPE.format(model=options.model_name))

    def scratch(self, options: Options) -> int:
        """The beams' nodes and the root (``Speculative.scratch``)."""
        from specjax.drafters.redrafter import RedrafterDrafter

        w, n = self.sizes or (_field_default(RedrafterDrafter, "width"),
                              _field_default(RedrafterDrafter, "length"))
        return w * n + 1

    def build(self, lm, options: Options) -> Built:
        from specjax.drafters import redrafter as rd
        from specjax.heads import kinds

        self.check(options)  # a head is given or ships
        path = options.redrafter_checkpoint or self.shipped(options.model_name)
        head, meta = kinds.load_redrafter(path, lm.model.config.hidden_size,
                                          target=options.model_name or "the target")
        dparams = rd.draft_params(_cast(head, lm), kinds.redrafter_vocab(meta))
        drafter = rd.RedrafterDrafter(lm.model, **self.drafter_kwargs())
        drafter.check_params(dparams)
        return speculative(self, lm, options, drafter, dparams)

    def random(self, lm, options: Options, key) -> Built:
        """A random head over the first ``min(8192, vocab)`` ids."""
        import numpy as np

        from specjax.drafters import redrafter as rd

        cfg = lm.model.config
        dv = min(8192, cfg.vocab_size)
        head = _cast(rd.init_head(cfg.hidden_size, dv, key), lm)
        d = rd.RedrafterDrafter(lm.model, **self.drafter_kwargs())
        dp = rd.draft_params(head, np.arange(dv, dtype=np.int32))
        return speculative(self, lm, options, d, dp)
