"""``hf``, ``hf-pld``: transformers' own decoding, the peers a benchmark runs beside ours."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from specjax.methods.registry import Built, Method, Options, SpecError, register


@register
@dataclasses.dataclass(frozen=True)
class Peer(Method):
    """``hf`` or ``hf-pld``: transformers' own decoding, which a benchmark runs beside ours
    (``specjax.bench.peer_method``)."""

    name: str = "hf"

    kind: ClassVar[str] = "peer"
    prefixes: ClassVar[tuple[str, ...]] = ("hf-pld", "hf")
    forms: ClassVar[tuple[str, ...]] = ("hf", "hf-pld")
    usage: ClassVar[str] = "hf | hf-pld (transformers' generate and prompt lookup; bench only)"
    decodes: ClassVar[bool] = False

    @classmethod
    def parse(cls, text: str) -> Peer:
        if text not in ("hf", "hf-pld"):
            raise SpecError(f"bad method {text!r}")
        return cls(text)

    def format(self) -> str:
        return self.name

    def build(self, lm, options: Options) -> Built:
        raise SpecError(f"{self.format()} is a peer for benchmarks, not a specjax decoder")
