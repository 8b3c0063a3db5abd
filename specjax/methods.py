"""The method registry: every decoding method is one spec class, registered here, that owns
its text form, its checks, how it builds, its random-weight build for the device check, its
head directory option and its CLI help line.

Text forms (``parse`` / ``MethodSpec.format``; ``parse(m.format()) == m``):

* ``ar``: plain autoregressive decoding;
* ``sd-ngram[:depth]``, ``sd-early-exit:L``: speculative decoding with prompt lookup or
  the target's first ``L`` layers;
* ``eagle2[:depth,topk,total][:conf,norerank,fullvocab,vocab=N]``: EAGLE-2's head and
  dynamic tree (an exported head: ``Options.draft_checkpoint``, default the shipped one);
  a published EAGLE-1/2 head directory (``specjax.drafters.published``) works too;
* ``eagle3[:depth,topk,total][:conf,norerank]``: a published EAGLE-3 head
  (``Options.draft_checkpoint``) over the target's fused hidden states;
* ``redrafter[:W,L][:nodedup]``: ReDrafter's beams as one tree
  (``Options.redrafter_checkpoint``);
* ``hsd[:SPEC]``: a hierarchy (``specjax.hsd.HierarchySpec``; bare ``hsd`` is tuned from
  ``Options.calibration``);
* ``hf``, ``hf-pld``: the transformers peers a benchmark compares against (not decoders).

Where dispatch happens: on the spec's own class. ``parse`` and ``split`` pick the
registered class whose prefix matches the text (the longest one), ``check(spec, options)``
calls ``spec.check``, ``build(spec, lm, options)`` calls ``spec.build``, and the device
check calls ``spec.random``. ``forms()`` (``FORMS``), the CLI's ``--method`` help and
completion flags, ``specjax bench`` and the demo read the registered classes
(``registered()``). Adding a method is one ``Method`` subclass decorated with ``register``
(see ``Method``); ``unregister`` removes one.

``build`` returns a ``Built``: the decoder, its parameters and the spec as run, callable
like ``specjax.decode``.

Nothing is silently wrong: a spec no builder can run (an EAGLE tree with fewer nodes than
levels, an n-gram level above an exit) is a ``SpecError`` when constructed or parsed;
``check(spec, options)`` checks the head directories and calibration a spec reads before
any model loads (``build`` runs it first); a ``vocab=N`` runs exactly ``N`` tokens or is
refused; an argument of the wrong type is a one-line ``TypeError`` naming it.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any, ClassVar, Sequence

from specjax.hsd.spec import HierarchySpec


class SpecError(ValueError):
    """A method spec, or an option it needs, is wrong: a one-line usage error."""


def _type_error(where: str, name: str, want: str, got) -> TypeError:
    """``where: name must be want, got T``: a Python caller passed the wrong kind of thing."""
    return TypeError(f"{where}: {name} must be {want}, got {type(got).__name__}")


def _sizes(text: str, n: int, what: str, spec: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(","))
    except ValueError:
        out = ()
    if len(out) != n or min(out) < 1:
        raise SpecError(f"bad sizes {text!r} in {spec!r}: want {what}, each >= 1")
    return out


def _sections(text: str, name: str, form: str) -> tuple[str, list[str]]:
    """``name[:sizes][:opt,...]`` -> ``(sizes, opts)``; ``SpecError`` naming ``form``."""
    parts = text.split(":")
    if parts[0] != name or len(parts) > 3:
        raise SpecError(f"bad spec {text!r}: use {form}")
    return (parts[1] if len(parts) > 1 else ""), (parts[2].split(",") if len(parts) > 2 else [])


def _joined(name: str, sizes, opts: list[str]) -> str:
    """The text form ``_sections`` reads back, without empty trailing sections."""
    parts = [name, ",".join(map(str, sizes)) if sizes else "", ",".join(opts)]
    while parts[-1] == "":
        parts.pop()
    return ":".join(parts)


# ----------------------------------------------------------------------------- registry


@dataclasses.dataclass(frozen=True)
class CliOption:
    """A CLI flag that completes a bare ``--method`` name: ``--method bare`` reads
    ``flag`` (default ``default``) and ``Method.complete`` turns its value into a text form."""

    bare: str  # e.g. "sd"
    flag: str  # e.g. "--drafter"
    default: str
    help: str

    @property
    def dest(self) -> str:
        """The argparse attribute of ``flag``."""
        return self.flag.lstrip("-").replace("-", "_")


class Method:
    """What a registered method spec provides. A subclass is a frozen dataclass that sets
    ``kind``, ``prefixes`` (its names: ``p`` matches ``p`` and ``p:...``; one ending in
    ``-`` matches any text it starts), ``forms`` and ``usage`` (its CLI help line), and
    defines ``parse``, ``format`` and ``build``. The defaults here: no check before the
    model loads, no head directory (``checkpoint``: the ``Options`` field naming one), no
    completion flag (``cli``), a decoder (``decodes``; False: a benchmark peer), and
    ``random`` building as ``build`` does."""

    kind: ClassVar[str]
    prefixes: ClassVar[tuple[str, ...]]
    forms: ClassVar[tuple[str, ...]]
    usage: ClassVar[str]
    example: ClassVar[str | None] = None  # a full spec the CLI's help shows
    cli: ClassVar[CliOption | None] = None
    checkpoint: ClassVar[str | None] = None
    ships_heads: ClassVar[bool] = False  # True: ``shipped`` names heads shipped per model
    decodes: ClassVar[bool] = True

    @classmethod
    def parse(cls, text: str) -> Method:
        """The spec of ``text``, one of this class's forms; ``SpecError`` otherwise."""
        raise NotImplementedError

    def format(self) -> str:
        """The text form ``parse`` reads back to this spec."""
        raise NotImplementedError

    @classmethod
    def complete(cls, value: str) -> str:
        """The text form of ``--method cli.bare`` with ``cli.flag`` set to ``value``."""
        return value

    @classmethod
    def shipped(cls, model: str) -> Path | None:
        """The head this method reads by default for registry model ``model`` (None: none
        ships, or it reads none)."""
        return None

    def check(self, options: Options) -> None:
        """Raises ``SpecError`` (``FileNotFoundError`` where no head ships) for what the
        build would read besides the model; nothing by default."""

    def build(self, lm, options: Options) -> Built:
        """The decoder and its parameters on ``lm`` (``check`` has passed)."""
        raise NotImplementedError

    def random(self, lm, options: Options, key) -> Built:
        """As ``build``, but with random heads from ``key`` (the device check: no trained
        head fits a random target); by default ``build(self, lm, options)``."""
        return build(self, lm, options)


_REGISTRY: list[type] = []


def _prefix_hits(prefix: str, text: str) -> bool:
    """Whether ``text`` names a method of ``prefix`` (see ``Method.prefixes``)."""
    if prefix.endswith("-"):
        return text.startswith(prefix) or text == prefix[:-1]
    return text == prefix or text.startswith(prefix + ":")


def register(cls: type) -> type:
    """Adds the ``Method`` subclass ``cls`` to the registry (after the ones before it) and
    returns it, as a class decorator. ``TypeError`` if it is not a ``Method`` subclass,
    ``ValueError`` if a prefix is taken by another registered class."""
    if not (isinstance(cls, type) and issubclass(cls, Method)):
        raise TypeError(f"methods.register: {cls!r} is not a methods.Method subclass")
    taken = {p: c for c in _REGISTRY for p in c.prefixes}
    clash = [p for p in cls.prefixes if p in taken and taken[p] is not cls]
    if clash:
        raise ValueError(f"methods.register: {cls.__name__}'s prefix {clash[0]!r} is "
                         f"{taken[clash[0]].__name__}'s")
    if cls not in _REGISTRY:
        _REGISTRY.append(cls)
    return cls


def unregister(cls: type) -> None:
    """Removes ``cls`` from the registry (nothing if it is not there)."""
    if cls in _REGISTRY:
        _REGISTRY.remove(cls)


def registered() -> tuple[type, ...]:
    """The registered method classes, in registration order."""
    return tuple(_REGISTRY)


def forms() -> tuple[str, ...]:
    """Every registered class's text forms, in registration order (``FORMS``)."""
    return tuple(f for cls in _REGISTRY for f in cls.forms)


def __getattr__(name: str):
    """``FORMS``: ``forms()``, read when asked, so it includes later registrations."""
    if name == "FORMS":
        return forms()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _class_of(text: str) -> type | None:
    """The registered class whose longest prefix names ``text``, or None."""
    hits = [(len(p), i, cls) for i, cls in enumerate(_REGISTRY) for p in cls.prefixes
            if _prefix_hits(p, text)]
    return max(hits, key=lambda h: (h[0], -h[1]))[2] if hits else None


# ----------------------------------------------------------------------------- methods


@register
@dataclasses.dataclass(frozen=True)
class AR(Method):
    """``ar``: one token per target forward."""

    kind: ClassVar[str] = "ar"
    prefixes: ClassVar[tuple[str, ...]] = ("ar",)
    forms: ClassVar[tuple[str, ...]] = ("ar",)
    usage: ClassVar[str] = "ar (one token per forward)"

    @classmethod
    def parse(cls, text: str) -> AR:
        if text != "ar":
            raise SpecError(f"bad method {text!r}: 'ar' takes no options")
        return cls()

    def format(self) -> str:
        return "ar"

    def build(self, lm, options: Options) -> Built:
        from specjax.core.decoding import AR as ARDecoder

        return Built(self, ARDecoder(lm.model, mesh=lm.mesh), lm.params, "ar")


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

    def build(self, lm, options: Options) -> Built:
        from specjax.drafters import EarlyExitDrafter, NGramDrafter

        depth = options.draft_len or self.depth
        kw = {} if depth is None else {"depth": depth}
        if self.drafter == "ngram":
            drafter = NGramDrafter(**kw)
        else:
            n = lm.model.config.num_layers
            if not 1 <= self.layer < n:
                raise SpecError(f"{self.format()}: the exit layer must lie in [1, {n - 1}]")
            drafter = EarlyExitDrafter(lm.model, self.layer, **(
                {} if options.draft_len is None else {"depth": options.draft_len}))
        return speculative(self, lm, options, drafter, None)


def _cast(tree, lm):
    """``tree``'s arrays in ``lm``'s compute dtype."""
    import jax
    import jax.numpy as jnp

    return jax.tree.map(lambda x: jnp.asarray(x, lm.model.compute_dtype), tree)


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
        from specjax.drafters import eagle

        return eagle.shipped_head(model)

    def check(self, options: Options) -> None:
        """A ``draft_checkpoint`` holds a head of this kind (exported or published);
        without one, a head ships for ``options.model_name``."""
        if options.draft_checkpoint:
            _head_dir(options.draft_checkpoint, "--draft-checkpoint", self.head_kind,
                      published=True)
        else:
            self._check_default(options)

    def _check_default(self, options: Options) -> None:
        if self.shipped(options.model_name) is None:
            raise FileNotFoundError(f"no EAGLE head ships for {options.model_name!r}; train "
                                    "one with `specjax train eagle` and pass "
                                    "--draft-checkpoint DIR")

    def build(self, lm, options: Options) -> Built:
        from specjax import head_io
        from specjax.drafters import eagle, published

        if options.draft_checkpoint and published.is_published(options.draft_checkpoint):
            return _build_published(self, lm, options)
        path = options.draft_checkpoint or self.shipped(options.model_name)  # check: set
        head, meta = head_io.load_eagle(path, lm.model.config)
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
        from specjax import head_io
        from specjax.drafters import eagle3, published

        path = options.draft_checkpoint  # check: an eagle3 head's directory
        if published.is_published(path):
            return _build_published(self, lm, options)
        head, meta = head_io.load_eagle3(path, lm.model.config)
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
        from specjax.drafters import redrafter

        return redrafter.shipped_head(model)

    def check(self, options: Options) -> None:
        """A ``redrafter_checkpoint`` holds an exported ReDrafter head."""
        if options.redrafter_checkpoint:
            _head_dir(options.redrafter_checkpoint, "--redrafter-checkpoint", "redrafter")

    def build(self, lm, options: Options) -> Built:
        from specjax import head_io
        from specjax.drafters import redrafter as rd

        path = options.redrafter_checkpoint or self.shipped(options.model_name)
        if path is None:
            raise FileNotFoundError(f"no ReDrafter head ships for {options.model_name!r}; "
                                    "train one: " + rd.RECIPE.format(model=options.model_name))
        head, meta = head_io.load_redrafter(path, lm.model.config.hidden_size,
                                            target=options.model_name or "the target")
        dparams = rd.draft_params(_cast(head, lm), head_io.redrafter_vocab(meta))
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


@register
@dataclasses.dataclass(frozen=True)
class HSD(Method):
    """``hsd:SPEC`` (a ``HierarchySpec``), or ``hsd`` alone: tuned from a calibration."""

    hierarchy: HierarchySpec | None = None

    kind: ClassVar[str] = "hsd"
    prefixes: ClassVar[tuple[str, ...]] = ("hsd",)
    forms: ClassVar[tuple[str, ...]] = ("hsd[:SPEC]",)
    usage: ClassVar[str] = "hsd[:SPEC] (hsd with --hierarchy)"
    example: ClassVar[str | None] = "hsd:ngram:4,target"
    cli: ClassVar[CliOption | None] = CliOption(
        "hsd", "--hierarchy", "auto", "for hsd: auto (tuned from --calibration) or a spec "
        "such as ngram:4,12:3,target")

    def __post_init__(self):
        """``SpecError`` for a hierarchy no target can run (``Hierarchy.check``'s rules but
        the exit layers' range, which needs the target: n-gram only at the bottom, at
        least T[0] n-gram tokens, exit layers increasing)."""
        import types

        if self.hierarchy is None:
            return
        h, _ = self.hierarchy.build({}, None)
        deep = max(self.hierarchy.exit_layers(), default=0) + 1  # any layer is in range
        try:
            h.check(types.SimpleNamespace(config=types.SimpleNamespace(num_layers=deep)))
        except ValueError as e:
            raise SpecError(f"hsd:{self.hierarchy.format()}: {e}") from None

    @classmethod
    def parse(cls, text: str) -> HSD:
        name, _, spec = text.partition(":")
        if name != "hsd":
            raise SpecError(f"bad method {text!r}: use hsd or hsd:SPEC")
        if not spec or spec == "auto":
            return cls()
        try:
            return cls(HierarchySpec.parse(spec))
        except ValueError as e:
            raise SpecError(str(e)) from None

    @classmethod
    def complete(cls, value: str) -> str:
        return "hsd" if value == "auto" else f"hsd:{value}"

    def format(self) -> str:
        return "hsd" if self.hierarchy is None else f"hsd:{self.hierarchy.format()}"

    def check(self, options: Options) -> None:
        """``exit_heads`` holds exported exit heads; bare ``hsd``'s calibration is
        readable and measured for ``options.model_name``."""
        if options.exit_heads:
            _head_dir(options.exit_heads, "--exit-heads", "exit-heads")
        if self.hierarchy is None:
            _calibration(options)

    def build(self, lm, options: Options) -> Built:
        from specjax.drafters.exit_heads import exit_head
        from specjax.hsd.loop import HSD as HSDDecoder

        note = None
        if self.hierarchy is None:
            hierarchy, heads, note = _tuned(lm, options)
        else:
            heads, layers, _ = exit_heads(lm, options)
            hierarchy = self.hierarchy
            try:
                hierarchy.sigma(layers)  # every exit layer has a head (or is a plain exit)
            except ValueError as e:
                raise SpecError(str(e)) from None
        h, hp = hierarchy.build(heads, exit_head)
        h.check(lm.model)
        dec = HSDDecoder(lm.model, h, mesh=lm.mesh, widths=options.widths)
        dec.level_widths()  # a bad width policy fails here
        return Built(HSD(hierarchy), dec, (lm.params, hp), f"hsd:{hierarchy.format()}", note)


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


MethodSpec = AR | SD | Eagle | Eagle3 | Redrafter | HSD | Peer  # the built-in methods


def parse(text: str) -> MethodSpec:
    """The spec of one method's text form (the registered class whose longest prefix names
    it parses it); ``SpecError`` naming the forms (or the rule a spec breaks) otherwise,
    ``TypeError`` for a ``text`` that is not a ``str``."""
    if not isinstance(text, str):
        raise _type_error("methods.parse", "text", "a method's text form (str)", text)
    text = text.strip()
    cls = _class_of(text)
    if cls is None:
        raise SpecError(f"unknown method {text!r}; available: {', '.join(forms())}")
    return cls.parse(text)


def split(text: str) -> list[str]:
    """``"ar,eagle2:4,4,8:conf,vocab=4096,hf"`` -> ``["ar", "eagle2:4,4,8:conf,vocab=4096",
    "hf"]``: a comma starts a new method only where a registered method's name follows."""
    if not isinstance(text, str):
        raise _type_error("methods.split", "text", "comma-separated methods (str)", text)
    names = sorted({p for cls in _REGISTRY for p in cls.prefixes}, key=len, reverse=True)
    alts = "|".join(re.escape(p) + ("" if p.endswith("-") else r"\b") for p in names)
    parts = re.split(rf",(?=\s*(?:{alts}))", text)
    return [m.strip() for m in parts if m.strip()]


# ----------------------------------------------------------------------------- building


@dataclasses.dataclass(frozen=True)
class Options:
    """What building a method reads besides its spec: the model's registry name (which
    picks shipped heads), the verification-width policy, head directories, and HSD's exit
    layers and tuning settings."""

    model_name: str = ""  # "" in build: the loaded model's own registry name (``lm.name``)
    draft_len: int | None = None  # sd-*: draft tokens per round (None: the spec's own)
    widths: Any = None  # specjax.core.widths policy, name or widths (None: Auto)
    draft_checkpoint: str | None = None  # an exported EAGLE head (None: the shipped one)
    redrafter_checkpoint: str | None = None
    exit_heads: str | None = None  # exported exit heads (None: the shipped ones)
    layers: tuple[int, ...] = (4, 8, 12, 16, 20, 24)  # plain exits where no heads exist
    calibration: str | None = None  # `specjax calibrate` JSON, for bare hsd
    t_max: int = 8
    max_levels: int = 4
    horizontal: tuple[int, ...] = (0,)


@dataclasses.dataclass(frozen=True)
class Built:
    """A method ready to decode: ``decoder`` and its ``params`` for ``specjax.decode``;
    ``name`` is the spec as run (bare ``hsd``: the tuned hierarchy) and ``note`` says
    anything a user should know about the choice."""

    spec: MethodSpec
    decoder: Any
    params: Any
    name: str
    note: str | None = None

    def __call__(self, prompts: Sequence[Sequence[int]], **kw):
        """``specjax.decode(self.decoder, self.params, prompts, **kw)``."""
        from specjax.core.decoder import decode

        return decode(self.decoder, self.params, prompts, **kw)


def as_spec(spec: MethodSpec | str, where: str) -> MethodSpec:
    """``spec``, or the spec its text parses to; ``TypeError`` naming ``where`` for
    anything else."""
    if isinstance(spec, str):
        return parse(spec)
    if not isinstance(spec, registered()):
        raise _type_error(where, "spec", "a method spec (methods.parse) or its text", spec)
    return spec


def _check_lm(lm, where: str) -> None:
    """``TypeError`` unless ``lm`` looks like a ``specjax.models.load`` result."""
    if not (hasattr(lm, "model") and hasattr(lm, "params") and hasattr(lm.model, "config")):
        raise _type_error(where, "lm", "a loaded specjax model (specjax.models.load: Llama, "
                                       "Gemma, T5... with .model and .params)", lm)


def _check_options(options, where: str) -> None:
    if not isinstance(options, Options):
        raise _type_error(where, "options", "a methods.Options", options)


def build(spec: MethodSpec | str, lm, options: Options = Options()) -> Built:
    """``spec`` (or its text) on ``lm`` (a ``specjax.models.load`` result): the decoder and
    its parameters, heads loaded and checked. Raises ``TypeError`` for an argument of the
    wrong type, ``SpecError`` for a bad spec or option (``check``'s, then the model's: a
    draft vocabulary or exit layer it lacks), ``FileNotFoundError`` where no head ships,
    before anything compiles. Runs ``check`` and then the spec's own ``build``."""
    spec = as_spec(spec, "methods.build")
    _check_lm(lm, "methods.build")
    _check_options(options, "methods.build")
    if not options.model_name and isinstance(getattr(lm, "name", None), str):
        options = dataclasses.replace(options, model_name=lm.name)  # picks its shipped heads
    check(spec, options)
    return spec.build(lm, options)


def check(spec: MethodSpec | str, options: Options = Options()) -> MethodSpec:
    """What ``build`` needs besides the model, checked without loading it (the CLI calls
    this first): the head directory the spec reads exists and holds a head of its kind,
    an ``eagle2`` without one has a head shipped for ``options.model_name``, and bare
    ``hsd``'s calibration is readable and measured for ``options.model_name``. Raises
    ``SpecError`` saying what is wrong with the given path (``FileNotFoundError`` where no
    head ships); returns the spec. Each spec's class checks its own (``Method.check``)."""
    spec = as_spec(spec, "methods.check")
    _check_options(options, "methods.check")
    spec.check(options)
    return spec


def _head_dir(path, flag: str, kind: str, published: bool = False) -> None:
    """``SpecError`` naming ``flag`` and ``path`` unless ``path`` is a directory holding
    an exported head of ``kind`` (``head.json``) or, with ``published``, a published
    EAGLE head (``config.json`` and a weights file)."""
    from specjax import export
    from specjax.drafters.published import WEIGHT_FILES

    p = Path(str(path))
    want = (f"an exported {kind} head (head.json)" + (" or a published EAGLE head "
            f"(config.json and {' or '.join(WEIGHT_FILES)})" if published else ""))
    if not p.exists():
        raise SpecError(f"{flag} {path} does not exist")
    if not p.is_dir():
        raise SpecError(f"{flag} {path} is a file; give the directory of {want}")
    if (p / export.HEAD_JSON).is_file():
        got = export.read_kind(p)  # None (unreadable): loading names the corruption
        method = {"eagle": "eagle2", "eagle3": "eagle3"}
        if got not in (None, kind):
            raise SpecError(f"{flag} {path} holds an exported {got!r} head, not {kind!r}" + (
                f": use --method {method[got]}" if got in method and kind in method else ""))
    elif published and (p / "config.json").is_file():
        if not any((p / f).is_file() for f in WEIGHT_FILES):
            raise SpecError(f"{flag} {path} has config.json but no weights: want "
                            f"{' or '.join(WEIGHT_FILES)} beside it")
    else:
        what = "is empty" if not any(p.iterdir()) else (
            "has no head.json" + (" and no config.json" if published else ""))
        raise SpecError(f"{flag} {path} {what}: want {want}")


def speculative(spec, lm, opts: Options, drafter, dparams) -> Built:
    """A ``Speculative`` decoder of ``drafter`` (checked against ``lm``) as ``spec``."""
    from specjax.core.speculative import Speculative

    spec = as_spec(spec, "methods.speculative")
    _check_lm(lm, "methods.speculative")
    _check_options(opts, "methods.speculative")
    drafter.check(lm.model)
    dec = Speculative(lm.model, drafter, opts.widths, mesh=lm.mesh)
    return Built(spec, dec, (lm.params, dparams), spec.format())


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
    from specjax.drafters import published

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


def load_drafter(spec: MethodSpec | str, lm, model_name: str = "", checkpoint_dir=None):
    """``(drafter, dparams)`` of an ``eagle2`` or ``redrafter`` spec: its exported head
    (default: the one shipped for ``model_name``) loaded onto ``lm``'s devices, checked
    against ``lm`` (hidden size, vocabulary) and cast to its compute dtype. Raises as
    ``build`` does."""
    spec = as_spec(spec, "methods.load_drafter")
    _check_lm(lm, "methods.load_drafter")
    field = type(spec).checkpoint
    if field is None:
        raise SpecError(f"{spec.format()} has no trained head to load")
    path = None if checkpoint_dir is None else str(checkpoint_dir)
    built = build(spec, lm, Options(model_name=model_name, **{field: path}))
    return built.decoder.drafter, built.params[1]


def exit_heads(lm, opts: Options, layers: Sequence[int] | None = None):
    """``(heads, layers, source)``: trained exit heads from ``opts.exit_heads`` (default:
    the ones shipped for the model, named by directory, never by a machine path), else
    plain early exits at ``layers`` (default ``opts.layers``)."""
    from specjax import head_io
    from specjax.drafters import exit_heads as eh

    _check_lm(lm, "methods.exit_heads")
    _check_options(opts, "methods.exit_heads")
    path = opts.exit_heads or eh.shipped_heads(opts.model_name)
    if path is not None:
        heads, _ = head_io.load_exit_heads(path, lm.model, lm.model.compute_dtype)
        return heads, sorted(heads), str(opts.exit_heads or Path(str(path)).name)
    return {}, list(opts.layers if layers is None else layers), None


def read_calibration(path: str) -> dict:
    """A calibration JSON; a missing or corrupt file is named in a one-line
    ``SpecError``, a ``path`` that is not a path in a ``TypeError``."""
    if not isinstance(path, (str, Path)):
        raise _type_error("methods.read_calibration", "path", "a file path", path)
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise SpecError(f"{path} is not a calibration JSON file ({e})") from None
    except OSError as e:
        raise SpecError(f"cannot read calibration {path}: {e.strerror}") from None


def _calibration(opts: Options) -> dict:
    """``opts.calibration`` read; ``SpecError`` unless given, a JSON object, and measured
    for ``opts.model_name``."""
    if not opts.calibration:
        raise SpecError("hsd without a hierarchy (auto) needs a calibration: --calibration "
                        "FILE (from `specjax calibrate`)")
    calib = read_calibration(opts.calibration)
    if not isinstance(calib, dict) or not isinstance(calib.get("layers"), list):
        raise SpecError(f"{opts.calibration} is not a calibration JSON file (no 'layers')")
    if calib.get("model") != opts.model_name:
        raise SpecError(f"{opts.calibration} was measured for {calib.get('model')!r}, not "
                        f"{opts.model_name!r}; run `specjax calibrate` for this model")
    return calib


def _tuned(lm, opts: Options):
    """The hierarchy predicted fastest by ``opts.calibration``: ``(spec, heads, note)``."""
    from specjax.hsd import calibrate

    calib = _calibration(opts)
    heads, layers, _ = exit_heads(lm, opts, calib["layers"])
    if layers != list(calib["layers"]):
        raise SpecError(f"{opts.calibration} was measured for exit layers {calib['layers']}, "
                        f"but the exit heads have {layers}")
    lat, sigma, T, horizontal, table = calibrate.tune(calib, opts.t_max, opts.max_levels,
                                                      horizontal=opts.horizontal)
    note = None
    if len(sigma) == 1:  # the target alone is predicted fastest: run the best hierarchy
        row = min(table, key=lambda r: r["latency_ms"])
        sigma, T, horizontal = row["sigma"], row["T"], row["horizontal"]
        note = (f"the target alone is predicted faster ({lat:.1f} ms/token) than any "
                f"hierarchy (best {row['latency_ms']:.1f}); running that best one")
    spec = HierarchySpec.from_sigma(sigma, T, layers, draft_temperatures(calib, len(sigma)),
                                    horizontal)
    return spec, heads, note


def draft_temperatures(calib: dict, n_levels: int) -> tuple | None:
    """The draft levels' own temperature a calibration was measured at (None: the
    target's), for ``HierarchySpec.from_sigma``, which applies it to exit levels only."""
    t = calib.get("draft_temperature")
    return None if t is None else tuple([t] * (n_levels - 1) + [None])


__all__ = ["AR", "SD", "Eagle", "Eagle3", "Redrafter", "HSD", "Peer", "MethodSpec", "Method",
           "CliOption", "Options", "Built", "SpecError", "register", "unregister",
           "registered", "forms", "parse", "split", "as_spec", "check", "build", "speculative",
           "load_drafter", "exit_heads", "read_calibration", "draft_temperatures",
           "FORMS"]  # noqa: F822 -- FORMS is the module's __getattr__
