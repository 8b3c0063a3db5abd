"""``ar``: plain autoregressive decoding."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from specjax.methods.registry import Built, Method, Options, SpecError, register


@register
@dataclasses.dataclass(frozen=True)
class AR(Method):
    """``ar``: one token per target forward."""

    kind: ClassVar[str] = "ar"
    prefixes: ClassVar[tuple[str, ...]] = ("ar",)
    forms: ClassVar[tuple[str, ...]] = ("ar",)
    usage: ClassVar[str] = "ar (one token per forward)"
    tiny: ClassVar[tuple[str, ...]] = ("ar",)
    device: ClassVar[tuple[str, ...]] = ("ar",)

    @classmethod
    def parse(cls, text: str) -> AR:
        if text != "ar":
            raise SpecError(f"bad method {text!r}: 'ar' takes no options")
        return cls()

    def format(self) -> str:
        return "ar"

    def scratch(self, options: Options) -> int:
        return 0  # one token per step: nothing is written past the budget

    def build(self, lm, options: Options) -> Built:
        from specjax.core.decoding import AR as ARDecoder

        return Built(self, ARDecoder(lm.model, mesh=lm.mesh), lm.params, "ar")
