"""``sd-ngram[:depth]``, ``sd-early-exit:L``: speculative decoding with a drafter
without trained weights (prompt lookup, or the target's first layers)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from specjax.methods.registry import (Built, CliOption, Method, Options, SpecError,
                                       _field_default, register, speculative)


@register
@dataclasses.dataclass(frozen=True)
class SD(Method):
    """``sd-ngram[:depth]`` or ``sd-early-exit:L``: a drafter without trained weights."""

    drafter: str = "ngram"  # "ngram" | "early-exit"
    depth: int | None = None  # n-gram: tokens proposed per round (None: the default)
    layer: int | None = None  # early exit: layers run

    kind: ClassVar[str] = "sd"
    prefixes: ClassVar[tuple[str, ...]] = ("sd-",)
    forms: ClassVar[tuple[str, ...]] = ("sd-ngram[:depth]", "sd-early-exit:L")
    usage: ClassVar[str] = "sd-ngram[:depth] | sd-early-exit:L (sd with --drafter)"
    example: ClassVar[str | None] = "sd-ngram:7"
    tiny: ClassVar[tuple[str, ...]] = ("sd-ngram:4", "sd-early-exit:1")
    device: ClassVar[tuple[str, ...]] = ("sd-ngram:7",)
    demo: ClassVar[tuple[str, ...]] = ("sd-ngram:3", "sd-ngram:7")
    cli: ClassVar[CliOption | None] = CliOption(
        "sd", "--drafter", "ngram", "for sd: ngram[:depth] | early-exit:L")

    def __post_init__(self):
        """``SpecError`` unless the fields make one of the two forms."""
        ok = (self.drafter == "ngram" and self.layer is None and (self.depth or 1) >= 1
              or self.drafter == "early-exit" and self.depth is None
              and isinstance(self.layer, int) and self.layer >= 1)
        if not ok:
            raise SpecError(f"bad sd spec {self}: use sd-ngram[:depth] or sd-early-exit:L "
                            "(depth, L >= 1)")

    @classmethod
    def parse(cls, text: str) -> SD:
        name, _, arg = text.removeprefix("sd-").partition(":")
        if name == "ngram" and (not arg or arg.isdigit()) and arg != "0":
            return cls("ngram", int(arg) if arg else None)
        if name == "early-exit" and arg.isdigit() and arg != "0":
            return cls("early-exit", layer=int(arg))
        raise SpecError(f"bad method {text!r}: use sd-ngram[:depth] or sd-early-exit:L")

    @classmethod
    def complete(cls, value: str) -> str:
        return "sd-" + value

    def format(self) -> str:
        if self.drafter == "ngram":
            return "sd-ngram" + (f":{self.depth}" if self.depth else "")
        return f"sd-early-exit:{self.layer}"

    def check_config(self, config, options: Options) -> None:
        """An early exit's layer lies below the model's top layer."""
        n = config.num_layers
        if self.drafter == "early-exit" and not 1 <= self.layer < n:
            raise SpecError(f"{self.format()}: the exit layer must lie in [1, {n - 1}]; the "
                            f"model has {n} layers")

    def scratch(self, options: Options) -> int:
        """The chain's tokens and its root (``Speculative.scratch``)."""
        from specjax.drafters import EarlyExitDrafter, NGramDrafter

        if self.drafter == "ngram":
            depth = options.draft_len or self.depth or _field_default(NGramDrafter, "depth")
            return depth + 1
        depth = options.draft_len or _field_default(EarlyExitDrafter, "depth")
        return depth * _field_default(EarlyExitDrafter, "width") + 1

    def build(self, lm, options: Options) -> Built:
        from specjax.drafters import EarlyExitDrafter, NGramDrafter

        depth = options.draft_len or self.depth
        kw = {} if depth is None else {"depth": depth}
        if self.drafter == "ngram":
            drafter = NGramDrafter(**kw)
        else:
            self.check_config(lm.model.config, options)
            drafter = EarlyExitDrafter(lm.model, self.layer, **(
                {} if options.draft_len is None else {"depth": options.draft_len}))
        return speculative(self, lm, options, drafter, None)
