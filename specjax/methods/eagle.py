"""``eagle2`` and ``eagle3``: EAGLE-2's dynamic tree with an EAGLE head (exported by
specjax, shipped, or published), and the EAGLE-3 head over fused hidden states."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import ClassVar

from specjax.methods.registry import (Built, CliOption, Method, Options, SpecError, _cast,
                                       _field_default, _joined, _sections, _sizes,
                                       register, speculative)


@register
@dataclasses.dataclass(frozen=True)
class Eagle(Method):
    """``eagle2[:depth,topk,total][:opts]``; opts ``conf`` (expand by confidence),
    ``norerank``, ``vocab=N`` (draft vocabulary size; ``fullvocab``: the target's)."""

    sizes: tuple[int, int, int] | None = None  # depth, topk, total tokens (None: defaults)
    by_value: bool = True
    rerank: bool = True
    vocab: int | None = None  # None: the head's own default

    kind: ClassVar[str] = "eagle2"
    default_sizes: ClassVar[tuple[int, int, int] | None] = None  # None: EagleDrafter's
    head_kind: ClassVar[str] = "eagle"  # the kind an exported head's head.json names
    prefixes: ClassVar[tuple[str, ...]] = ("eagle2",)
    forms: ClassVar[tuple[str, ...]] = ("eagle2[:depth,topk,total][:opts]",)
    usage: ClassVar[str] = ("eagle2[:depth,topk,total][:conf,norerank,fullvocab,vocab=N] "
                            "(eagle2 with --eagle)")
    example: ClassVar[str | None] = "eagle2:3,4,7"
    # vocab=6: a reduced draft vocabulary
    tiny: ClassVar[tuple[str, ...]] = ("eagle2:3,2,5", "eagle2:3,2,5:vocab=6")
    device: ClassVar[tuple[str, ...]] = ("eagle2:3,4,7", "eagle2:2,2,3")
    demo: ClassVar[tuple[str, ...]] = ("eagle2:2,2,3", "eagle2:3,4,7", "eagle2:4,4,7")
    cli: ClassVar[CliOption | None] = CliOption(
        "eagle2", "--eagle", "eagle2",
        "EAGLE spec: eagle2[:depth,topk,total][:conf,norerank,fullvocab,vocab=N]")
    checkpoint: ClassVar[str | None] = "draft_checkpoint"
    ships_heads: ClassVar[bool] = True

    def __post_init__(self):
        """``SpecError`` unless the sizes can draft a tree: each >= 1 and
        ``depth <= total <= pool_size(depth, topk)`` (the nodes ``depth`` levels draft);
        ``vocab`` >= 0."""
        from specjax.drafters.eagle import pool_size

        if self.vocab is not None and self.vocab < 0:
            raise SpecError(f"{self.format()}: vocab must be >= 0 (0: fullvocab)")
        if self.sizes is None:
            return
        if len(self.sizes) != 3 or min(self.sizes) < 1:
            raise SpecError(f"bad sizes {self.sizes} in {self.kind}: want depth,topk,total, "
                            "each >= 1")
        depth, topk, total = self.sizes
        if total < depth:
            raise SpecError(f"{self.format()}: total ({total}) must be >= depth ({depth}), "
                            "as a tree of depth levels has at least one node per level")
        if total > pool_size(depth, topk):
            raise SpecError(f"{self.format()}: total ({total}) must be <= the "
                            f"{pool_size(depth, topk)} nodes that depth {depth} and topk "
                            f"{topk} draft (topk + (depth - 1) * topk^2)")

    @classmethod
    def parse(cls, text: str) -> Eagle:
        sizes, opts = _sections(text, cls.kind, f"{cls.kind}[:depth,topk,total][:opts]")
        out = cls(_sizes(sizes, 3, "depth,topk,total", text) if sizes else None)
        for opt in opts:
            if opt in ("conf", "norerank") or (opt == "fullvocab" and cls.kind == "eagle2"):
                field = {"conf": "by_value", "norerank": "rerank", "fullvocab": "vocab"}[opt]
                out = dataclasses.replace(out, **{field: 0 if opt == "fullvocab" else False})
            elif opt.startswith("vocab=") and opt[6:].isdigit() and cls.kind == "eagle2":
                out = dataclasses.replace(out, vocab=int(opt[6:]))
            else:
                raise SpecError(f"unknown EAGLE option {opt!r} for {cls.kind}: " + (
                    "conf, norerank, fullvocab, vocab=N" if cls.kind == "eagle2" else
                    "conf, norerank (the head's draft vocabulary is its own)"))
        return out

    def drafter_kwargs(self) -> dict:
        """``EagleDrafter``'s settings (the sizes only where given)."""
        sizes = self.sizes or self.default_sizes
        sizes = {} if sizes is None else dict(zip(("depth", "topk", "total_tokens"), sizes))
        return {"by_value": self.by_value, "rerank": self.rerank, **sizes}

    def format(self) -> str:
        opts = ([] if self.by_value else ["conf"]) + ([] if self.rerank else ["norerank"])
        if self.vocab is not None:
            opts.append("fullvocab" if self.vocab == 0 else f"vocab={self.vocab}")
        return _joined(self.kind, self.sizes, opts)

    @classmethod
    def shipped(cls, model: str) -> Path | None:
        from specjax.heads import shipped_head

        return shipped_head("eagle", model)

    def check(self, options: Options) -> None:
        """A ``draft_checkpoint`` holds a head of this kind (exported or published);
        without one, a head ships for ``options.model_name``."""
        if options.draft_checkpoint:
            from specjax.heads import head_dir_error

            if err := head_dir_error(options.draft_checkpoint, "--draft-checkpoint",
                                     self.head_kind, published=True):
                raise SpecError(err)
            self._check_published(options.draft_checkpoint)
        else:
            self._check_default(options)

    def _check_published(self, path) -> None:
        """A published head's kind (from its tensor names, no weight read) is this
        method's: EAGLE-1/2 for ``eagle2``, EAGLE-3 for ``eagle3``."""
        from specjax.heads import published

        if not published.is_published(path):
            return
        kind = _published_kind(Path(str(path)))
        want = {"eagle": "eagle2", "eagle3": "eagle3"}.get(kind)
        if want is not None and want != self.kind:
            raise SpecError(f"--draft-checkpoint {path} holds a published "
                            f"{'EAGLE-3' if kind == 'eagle3' else 'EAGLE-1/2'} head: use "
                            f"--method {want}")

    def scratch(self, options: Options) -> int:
        """The tree's nodes and its root (``Speculative.scratch``)."""
        from specjax.drafters.eagle import EagleDrafter

        sizes = self.sizes or self.default_sizes
        total = sizes[2] if sizes else _field_default(EagleDrafter, "total_tokens")
        return total + 1

    def _check_default(self, options: Options) -> None:
        if self.shipped(options.model_name) is None:
            raise FileNotFoundError(f"no EAGLE head ships for {options.model_name!r}; train "
                                    "one with `specjax train eagle` and pass "
                                    "--draft-checkpoint DIR")

    def build(self, lm, options: Options) -> Built:
        from specjax.drafters import eagle
        from specjax.heads import kinds, published

        if options.draft_checkpoint and published.is_published(options.draft_checkpoint):
            return _build_published(self, lm, options)
        path = options.draft_checkpoint or self.shipped(options.model_name)  # check: set
        head, meta = kinds.load_eagle(path, lm.model.config)
        dparams = eagle.draft_params(_cast(head, lm), lm.model, lm.params,
                                     _draft_vocab(self, meta, lm.model.config.vocab_size))
        drafter = eagle.EagleDrafter(lm.model, **self.drafter_kwargs())
        drafter.check_params(dparams)
        return speculative(self, lm, options, drafter, dparams)

    def random(self, lm, options: Options, key) -> Built:
        """A random head; ``vocab=N``: the first ``N`` ids."""
        import numpy as np

        from specjax.drafters import eagle

        head = _cast(eagle.init_head(lm.model.config, key), lm)
        sub = None if not self.vocab else np.arange(self.vocab)
        d = eagle.EagleDrafter(lm.model, **self.drafter_kwargs())
        dp = eagle.draft_params(head, lm.model, lm.params, sub)
        return speculative(self, lm, options, d, dp)



@register
@dataclasses.dataclass(frozen=True)
class Eagle3(Eagle):
    """``eagle3[:depth,topk,total][:conf,norerank]``: a published EAGLE-3 head
    (``Options.draft_checkpoint``) drafting the dynamic tree over the target's fused
    low, middle and high hidden states. Without sizes: EAGLE's own defaults, depth 7,
    top-k 10 and 60 tokens (sized for accelerators; a CPU wants far fewer)."""

    kind: ClassVar[str] = "eagle3"
    default_sizes: ClassVar[tuple[int, int, int] | None] = (7, 10, 60)
    head_kind: ClassVar[str] = "eagle3"
    prefixes: ClassVar[tuple[str, ...]] = ("eagle3",)
    forms: ClassVar[tuple[str, ...]] = ("eagle3[:depth,topk,total][:opts]",)
    usage: ClassVar[str] = "eagle3[:depth,topk,total][:conf,norerank] (--draft-checkpoint)"
    example: ClassVar[str | None] = "eagle3:7,10,60"
    tiny: ClassVar[tuple[str, ...]] = ("eagle3:3,2,5",)
    device: ClassVar[tuple[str, ...]] = ("eagle3:2,2,3",)
    demo: ClassVar[tuple[str, ...]] = ()  # no EAGLE-3 head ships
    cli: ClassVar[CliOption | None] = None
    ships_heads: ClassVar[bool] = False

    @classmethod
    def shipped(cls, model: str) -> Path | None:
        return None

    def _check_default(self, options: Options) -> None:
        raise SpecError("eagle3 drafts with an EAGLE-3 head: pass --draft-checkpoint DIR, a "
                        "published head (config.json and pytorch_model.bin or "
                        "model.safetensors) or one `specjax train onpolicy --kind eagle3` "
                        "exported")

    def build(self, lm, options: Options) -> Built:
        """Over a published head, or one ``specjax train onpolicy --kind eagle3`` exported."""
        from specjax.drafters import eagle3
        from specjax.heads import kinds, published

        path = options.draft_checkpoint  # check: an eagle3 head's directory
        if published.is_published(path):
            return _build_published(self, lm, options)
        head, meta = kinds.load_eagle3(path, lm.model.config)
        ids = meta["vocab_ids"]
        drafter = eagle3.Eagle3Drafter(lm.model, layers=tuple(meta["layers"]),
                                       **self.drafter_kwargs())
        dparams = eagle3.draft_params(_cast(head, lm), lm.model, ids)
        drafter.check_params(dparams)
        return speculative(self, lm, options, drafter, dparams)

    def random(self, lm, options: Options, key) -> Built:
        """A random head over the first ``min(32000, vocab)`` ids (as the published
        Llama-3.1 head's draft vocabulary)."""
        import numpy as np

        from specjax.drafters import eagle3

        dv = min(32000, lm.model.config.vocab_size)
        head = eagle3.init_head(lm.model.config, key, dv, lm.model.compute_dtype)
        d = eagle3.Eagle3Drafter(lm.model, **self.drafter_kwargs())
        dp = eagle3.draft_params(head, lm.model, np.arange(dv))
        return speculative(self, lm, options, d, dp)



def _published_kind(path: Path) -> str | None:
    """``"eagle3"`` or ``"eagle"`` (EAGLE-1/2) for the published head in ``path``, by the
    rule ``published.load`` applies (EAGLE-3 heads have ``midlayer.`` tensors or a
    ``d2t``), read from the tensor names alone: a safetensors header, or a PyTorch file
    opened memory-mapped. None where the names cannot be read so (loading names the
    problem)."""
    import json
    import struct

    from specjax.heads.published import WEIGHT_FILES

    f = next((path / n for n in WEIGHT_FILES if (path / n).is_file()), None)
    try:
        if f is None:
            return None
        if f.suffix == ".safetensors":
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                if n > min(f.stat().st_size, 1 << 28):
                    return None
                names = set(json.loads(fh.read(n))) - {"__metadata__"}
        else:
            import importlib.util

            if importlib.util.find_spec("torch") is None:
                return None
            import torch

            names = set(torch.load(f, map_location="cpu", weights_only=True, mmap=True))
    except Exception:  # noqa: BLE001 -- unreadable here: loading reports it in one line
        return None
    if "fc.weight" not in names:
        return None
    return "eagle3" if "d2t" in names or any(k.startswith("midlayer.") for k in names) \
        else "eagle"


def _draft_vocab(spec: Eagle, meta: dict, vocab: int):
    """The ids an exported EAGLE-2 head drafts over (None: all ``vocab``): the first
    ``spec.vocab`` (else the head's ``draft_vocab``) of its ``vocab_ids``, most frequent
    first. A ``vocab=N`` is exactly ``N`` tokens or a ``SpecError``: over the target's
    ``vocab``, or past the tokens the head ranks (``N == vocab`` is the whole vocabulary)."""
    ids = meta.get("vocab_ids")
    if spec.vocab is None:
        n = meta.get("draft_vocab", 0)
        return None if not n or ids is None else ids[:n]
    ranked = 0 if ids is None else len(ids)
    if spec.vocab > vocab:
        raise SpecError(f"{spec.format()}: vocab={spec.vocab} exceeds the target's "
                        f"vocabulary of {vocab} tokens")
    if spec.vocab in (0, vocab):
        return None
    if not ranked:
        raise SpecError(f"{spec.format()}: the head ranks no tokens by frequency (no "
                        f"vocab_ids) to keep {spec.vocab} of: use fullvocab (all {vocab})")
    if spec.vocab > ranked:
        raise SpecError(f"{spec.format()}: the head ranks only {ranked} tokens by frequency: "
                        f"use vocab=N with N <= {ranked}, or fullvocab (all {vocab})")
    return ids[:spec.vocab]


def _build_published(spec: Eagle, lm, opts: Options) -> Built:
    """An ``eagle2`` (EAGLE-1/2 head) or ``eagle3`` spec over a published head directory."""
    from specjax.heads import published

    head = published.load(opts.draft_checkpoint, lm.model.config)
    want = {"eagle": "eagle2", "eagle3": "eagle3"}[head.kind]
    if want != spec.kind:
        raise SpecError(f"{opts.draft_checkpoint} holds an "
                        f"{'EAGLE-3' if head.kind == 'eagle3' else 'EAGLE-1/2'} head: use "
                        f"--method {want}")
    if spec.vocab is not None:
        raise SpecError(f"{spec.format()}: a published head drafts over its own vocabulary; "
                        "vocab options apply to heads specjax exports")
    drafter, dparams = published.drafter_and_params(head, lm.model, lm.model.compute_dtype,
                                                    **spec.drafter_kwargs())
    drafter.check_params(dparams)
    return speculative(spec, lm, opts, drafter, dparams)
