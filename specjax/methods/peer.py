"""``hf``, ``hf-pld``, ``hf-mtp``: transformers' own decoding, the peers a benchmark runs
beside ours."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from specjax.methods.registry import Built, Method, Options, SpecError, register


@register
@dataclasses.dataclass(frozen=True)
class Peer(Method):
    """``hf``, ``hf-pld`` or ``hf-mtp[:depth]``: transformers' own decoding, which a
    benchmark runs beside ours (``specjax.bench.peer_method``): ``generate``, its prompt
    lookup, and its assisted generation with the Gemma 4 assistant that
    ``--draft-checkpoint`` names (``depth`` drafts per round, default 4, as ``mtp``)."""

    name: str = "hf"
    depth: int | None = None  # hf-mtp's drafts per round

    kind: ClassVar[str] = "peer"
    prefixes: ClassVar[tuple[str, ...]] = ("hf-pld", "hf-mtp", "hf")
    forms: ClassVar[tuple[str, ...]] = ("hf", "hf-pld", "hf-mtp[:depth]")
    usage: ClassVar[str] = ("hf | hf-pld | hf-mtp[:depth] (transformers' generate, prompt "
                            "lookup, Gemma 4 assistant; bench only)")
    checkpoint: ClassVar[str | None] = "draft_checkpoint"  # hf-mtp's assistant
    decodes: ClassVar[bool] = False

    @classmethod
    def parse(cls, text: str) -> Peer:
        if text in ("hf", "hf-pld"):
            return cls(text)
        name, _, depth = text.partition(":")
        if name == "hf-mtp":
            if not depth:
                return cls("hf-mtp", 4)
            if depth.isdigit() and int(depth) >= 1:
                return cls("hf-mtp", int(depth))
        raise SpecError(f"bad method {text!r}; use hf, hf-pld or hf-mtp[:depth]")

    def format(self) -> str:
        return self.name if self.depth in (None, 4) else f"{self.name}:{self.depth}"

    def check(self, options: Options) -> None:
        """``hf-mtp`` reads a Gemma 4 assistant (``mtp``'s check); the others nothing."""
        if self.name == "hf-mtp":
            import importlib.util

            from specjax.methods.mtp import MTP

            MTP(self.depth).check(options)
            if importlib.util.find_spec("transformers.models.gemma4_assistant") is None:
                raise SpecError("hf-mtp runs transformers' Gemma4AssistantForCausalLM: "
                                "install transformers >= 5.7")

    def build(self, lm, options: Options) -> Built:
        raise SpecError(f"{self.format()} is a peer for benchmarks, not a specjax decoder")
