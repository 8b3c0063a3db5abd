"""The method registry's machinery: ``Method`` (what a registered spec class provides),
``register``, ``parse``/``split`` by prefix, ``Options``, ``Built``, ``build``/``check`` and the
pieces every built-in method shares (``speculative``, ``load_drafter``, head-directory checks).
The methods themselves live one per module beside this one (see the package docstring)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, ClassVar, Sequence


class SpecError(ValueError):
    """A method spec, or an option it needs, is wrong: a one-line usage error."""


class WidthsError(SpecError):
    """The verification widths (``Options.widths``) are wrong for the spec."""


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


def _field_default(cls, field: str) -> int:
    """The default of dataclass ``cls``'s ``field`` (a drafter's size, for ``scratch``)."""
    return next(f.default for f in dataclasses.fields(cls) if f.name == field)


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
    completion flag (``cli``), a decoder (``decodes``; False: a benchmark peer), no
    ``tiny``/``device``/``demo`` specs, and ``random`` building as ``build`` does. A
    decoding method without ``tiny`` specs fails the conformance test."""

    kind: ClassVar[str]
    prefixes: ClassVar[tuple[str, ...]]
    forms: ClassVar[tuple[str, ...]]
    usage: ClassVar[str]
    example: ClassVar[str | None] = None  # a full spec the CLI's help shows
    cli: ClassVar[CliOption | None] = None
    checkpoint: ClassVar[str | None] = None
    ships_heads: ClassVar[bool] = False  # True: ``shipped`` names heads shipped per model
    decodes: ClassVar[bool] = True
    # the model family it drafts for (a ``families.Family`` name; None: any): the tests and
    # sweeps run its tiny specs on a toy of that family, and ``check_config`` refuses others
    family: ClassVar[str | None] = None
    # specs the project runs the method as, without options: ``tiny`` on the tests' 3-layer,
    # 12-token toy (conformance, and the per-family sweeps), ``device`` in the device check
    # (random heads), ``demo`` as the demo's candidates (where its head ships)
    tiny: ClassVar[tuple[str, ...]] = ()
    device: ClassVar[tuple[str, ...]] = ()
    demo: ClassVar[tuple[str, ...]] = ()

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

    def check_config(self, config, options: Options) -> None:
        """Raises ``SpecError`` for what the model's ``config`` alone shows the build would
        refuse (an exit layer past its layers, heads at other layers), before any weight is
        read; nothing by default. ``check`` has passed."""

    def check_widths(self, widths: tuple[int, ...], options: Options) -> None:
        """Raises ``WidthsError`` for fixed verification widths (ascending, each >= 1) that
        the build would refuse. By default ``Speculative``'s rule: they lie in
        ``[1, scratch]`` and include ``scratch`` (the root and every draft node); nothing
        where ``scratch`` is unknown or 0 (a method that verifies nothing)."""
        n = self.scratch(options)
        if n and widths[-1] != n:
            raise WidthsError(f"{self.format()}: verification widths {','.join(map(str, widths))} "
                            f"must lie in [1, {n}] and include {n} (the root and all "
                            f"{n - 1} draft nodes)")

    def scratch(self, options: Options) -> int | None:
        """The cache slots one round of the built decoder may write past a row's prompt and
        budget (its ``Decoder.scratch``), from the spec alone, so a prompt that cannot fit
        the context is refused before the weights load; None where only the build knows
        (the default)."""
        return None

    def build(self, lm, options: Options) -> Built:
        """The decoder and its parameters on ``lm`` (``check`` has passed)."""
        raise NotImplementedError

    def random(self, lm, options: Options, key) -> Built:
        """As ``build``, but with random heads from ``key`` (the device check: no trained
        head fits a random target); by default ``build(self, lm, options)``."""
        return build(self, lm, options)


class DraftSizes:
    """What a spec shares that drafts ``depth`` tokens as a chain (``topk`` 1) or as a tree
    of ``total`` nodes from the ``topk`` best tokens per level (``dflash``, ``mtp``): the
    size checks, the text form ``kind[:depth[,topk,total]]`` and its parse. Mixed in before
    ``Method`` by a frozen dataclass with fields ``depth``, ``topk`` and ``total``; its
    defaults format as the bare ``kind``."""

    def __post_init__(self):
        """``SpecError`` unless the sizes can draft: each >= 1, and a tree's
        ``depth <= total <= topk + (depth - 1) * topk^2``."""
        from specjax.drafters.eagle import pool_size

        if self.depth is not None and self.depth < 1 or self.topk < 1:
            raise SpecError(f"{self.format()}: depth and topk must be >= 1")
        if self.topk == 1:
            if self.total not in (None, self.depth):
                raise SpecError(f"{self.format()}: a chain (topk 1) drafts depth nodes")
            return
        if self.depth is None or self.total is None:
            raise SpecError(f"{self.format()}: a tree needs depth,topk,total")
        if not self.depth <= self.total <= pool_size(self.depth, self.topk):
            raise SpecError(f"{self.format()}: total ({self.total}) must lie in [depth "
                            f"{self.depth}, {pool_size(self.depth, self.topk)}] (topk + "
                            "(depth - 1) * topk^2)")

    @classmethod
    def parse(cls, text: str):
        sizes, opts = _sections(text, cls.kind, cls.forms[0])
        if opts:
            raise SpecError(f"bad spec {text!r}: {cls.kind} takes no options; use "
                            f"{cls.forms[0]}")
        if not sizes:
            return cls()
        try:
            n = tuple(int(x) for x in sizes.split(","))
        except ValueError:
            n = ()
        if len(n) not in (1, 3) or min(n) < 1:
            raise SpecError(f"bad sizes {sizes!r} in {text!r}: want depth or depth,topk,total, "
                            "each >= 1")
        return cls(n[0]) if len(n) == 1 else cls(*n)

    def format(self) -> str:
        sizes = () if self == type(self)() else (
            (self.depth,) if self.topk == 1 else (self.depth, self.topk, self.total))
        return _joined(self.kind, sizes, [])


#: any registered method spec (the registry is open: ``register`` adds classes)
MethodSpec = Method

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


def _cast(tree, lm):
    """``tree``'s arrays in ``lm``'s compute dtype."""
    import jax
    import jax.numpy as jnp

    return jax.tree.map(lambda x: jnp.asarray(x, lm.model.compute_dtype), tree)


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


def _check_widths(spec: Method, options: Options) -> None:
    """``options.widths`` readable as a width policy, and fixed widths that ``spec``'s
    build accepts (``Method.check_widths``); ``WidthsError`` otherwise."""
    from specjax.core import widths as width_policy

    try:
        policy = width_policy.as_policy(options.widths)
    except (ValueError, TypeError) as e:
        raise WidthsError(str(e)) from None
    if isinstance(policy, width_policy.Fixed):
        spec.check_widths(policy.widths(None), options)


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
    check(spec, options, lm.model.config)
    return spec.build(lm, options)


def check(spec: MethodSpec | str, options: Options = Options(), config=None) -> MethodSpec:
    """What ``build`` needs besides the model, checked without loading it (the CLI calls
    this first): the head directory the spec reads exists and holds a head of its kind
    (a published EAGLE head's kind read from its tensor names), an ``eagle2`` or
    ``redrafter`` without one has a head shipped for ``options.model_name``, and bare
    ``hsd``'s calibration is readable and measured for ``options.model_name``, and fixed
    verification widths fit the spec's draft (``Method.check_widths``). With the
    model's ``config`` (``specjax.models.registry.config``: no weight is read), also what
    it shows (``Method.check_config``): ``sd-early-exit:L`` and HSD's exit layers within
    the model's layers and present among its exit heads. Raises ``SpecError`` saying what
    is wrong (``FileNotFoundError`` where no head ships); returns the spec. Each spec's
    class checks its own (``Method.check``, ``Method.check_config``)."""
    spec = as_spec(spec, "methods.check")
    _check_options(options, "methods.check")
    spec.check(options)
    _check_widths(spec, options)
    if config is not None:
        if not hasattr(config, "num_layers"):
            raise _type_error("methods.check", "config", "a model config (num_layers, ...)",
                              config)
        spec.check_config(config, options)
    return spec


def speculative(spec, lm, opts: Options, drafter, dparams) -> Built:
    """A ``Speculative`` decoder of ``drafter`` (checked against ``lm``) as ``spec``."""
    from specjax.core.speculative import Speculative

    spec = as_spec(spec, "methods.speculative")
    _check_lm(lm, "methods.speculative")
    _check_options(opts, "methods.speculative")
    drafter.check(lm.model)
    dec = Speculative(lm.model, drafter, opts.widths, mesh=lm.mesh)
    return Built(spec, dec, (lm.params, dparams), spec.format())


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
