"""``hsd[:SPEC]``: a hierarchy of drafters (``specjax.hsd``); bare ``hsd`` is tuned from
a calibration. The exit heads a hierarchy reads, and the calibration file, are read here;
the tuning itself is ``specjax.hsd.calibrate``'s."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import ClassVar, Sequence

from specjax.hsd.spec import HierarchySpec
from specjax.methods.registry import (Built, CliOption, Method, Options, SpecError,
                                       WidthsError, _check_lm, _check_options, _type_error,
                                       register)


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
    tiny: ClassVar[tuple[str, ...]] = ("hsd:1:3,target", "hsd:ngram:3,1:2,target",
                                       "hsd:ngram:2,1:2,2:2,target+h2")
    device: ClassVar[tuple[str, ...]] = ("hsd",)  # the device check's ngram/exit/target
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
            from specjax.heads import head_dir_error

            if err := head_dir_error(options.exit_heads, "--exit-heads", "exit-heads"):
                raise SpecError(err)
        if self.hierarchy is None:
            _calibration(options)

    def check_config(self, config, options: Options) -> None:
        """Every exit layer the hierarchy uses (bare ``hsd``: the calibration's) lies below
        the model's top layer and is one of the exit heads' layers (without heads: of
        ``options.layers``), read from the heads' ``head.json`` alone."""
        n = config.num_layers
        if self.hierarchy is None:
            calib = _calibration(options)
            layers, source = _exit_layers(options, calib["layers"])
            _same_layers(options, calib, layers)
            used, what = list(layers), f"{options.calibration}'s exit layers"
        else:
            layers, source = _exit_layers(options)
            _sigma(self.hierarchy, layers, source, options)
            used, what = list(self.hierarchy.exit_layers()), f"{self.format()}'s exit layers"
        bad = [l for l in used if not (isinstance(l, int) and 1 <= l < n)]
        if bad:
            raise SpecError(f"{what} {bad} lie outside [1, {n - 1}]; the model has {n} layers")

    def check_widths(self, widths: tuple[int, ...], options: Options) -> None:
        """HSD's levels verify at different widths: fixed widths are refused (as
        ``specjax.hsd.loop.HSD`` refuses them), a policy name is taken."""
        raise WidthsError(f"{self.format()}: the levels verify at different widths, so "
                        "verification widths take a policy (auto, padded, per-width, merged), "
                        f"not fixed widths {','.join(map(str, widths))}")

    def scratch(self, options: Options) -> int | None:
        """Every level's buffer and bonus tokens (``specjax.hsd.loop.HSD.scratch``); None
        for bare ``hsd``, whose hierarchy is tuned when built."""
        from specjax.hsd.loop import HSD as HSDDecoder

        if self.hierarchy is None:
            return None
        h, _ = self.hierarchy.build({}, None)
        return HSDDecoder(None, h).scratch

    def build(self, lm, options: Options) -> Built:
        from specjax.drafters.exit_heads import exit_head
        from specjax.hsd.loop import HSD as HSDDecoder

        note = None
        if self.hierarchy is None:
            hierarchy, heads, note = _tuned(lm, options)
        else:
            heads, layers, source = exit_heads(lm, options)
            hierarchy = self.hierarchy
            # every exit layer has a head (or is a plain exit)
            _sigma(hierarchy, layers, source, options)
        h, hp = hierarchy.build(heads, exit_head)
        h.check(lm.model)
        dec = HSDDecoder(lm.model, h, mesh=lm.mesh, widths=options.widths)
        dec.level_widths()  # a bad width policy fails here
        return Built(HSD(hierarchy), dec, (lm.params, hp), f"hsd:{hierarchy.format()}", note)



def exit_heads(lm, opts: Options, layers: Sequence[int] | None = None):
    """``(heads, layers, source)``: trained exit heads from ``opts.exit_heads`` (default:
    the ones shipped for the model, named by directory, never by a machine path), else
    plain early exits at ``layers`` (default ``opts.layers``)."""
    from specjax.heads import kinds, shipped_head

    _check_lm(lm, "methods.exit_heads")
    _check_options(opts, "methods.exit_heads")
    path = opts.exit_heads or shipped_head("exit-heads", opts.model_name)
    if path is not None:
        heads, _ = kinds.load_exit_heads(path, lm.model, lm.model.compute_dtype)
        return heads, sorted(heads), str(opts.exit_heads or Path(str(path)).name)
    return {}, list(opts.layers if layers is None else layers), None


def _exit_layers(opts: Options, default: Sequence[int] | None = None):
    """``(layers, source)`` as ``exit_heads`` returns them, from the heads' ``head.json``
    alone (no weight read): the exit heads' layers and directory, else the plain exits
    ``default`` (None: ``opts.layers``) and None."""
    from specjax.heads import exported, shipped_head

    path = opts.exit_heads or shipped_head("exit-heads", opts.model_name)
    if path is None:
        return list(opts.layers if default is None else default), None
    meta = exported.read_meta(path, "exit-heads")
    try:
        layers = sorted(int(l) for l in meta["layers"])
    except (KeyError, TypeError, ValueError):
        raise exported.CheckpointError(f"{path}: head.json's 'layers' must be a list of ints, "
                                       f"got {meta.get('layers')!r}") from None
    return layers, str(opts.exit_heads or Path(str(path)).name)


def _sigma(hierarchy: HierarchySpec, layers, source: str | None, opts: Options):
    """``hierarchy.sigma(layers)``, or a ``SpecError`` saying what to pass: ``--layers``
    where the exits are plain (``source`` None), other heads where they are trained."""
    try:
        return hierarchy.sigma(layers)
    except ValueError:
        pass
    used = list(hierarchy.exit_layers())
    missing = [l for l in used if l not in layers]
    head = f"hsd:{hierarchy.format()} uses exit layers {missing}"
    if source is None:
        default = " (the default, SmolLM2-135M's)" if tuple(layers) == Options.layers else ""
        name = f" for {opts.model_name!r}" if opts.model_name else ""
        raise SpecError(f"{head}, but no exit heads are given or ship{name}, so the plain "
                        f"exits are --layers {','.join(map(str, layers))}{default}: pass "
                        f"--layers {','.join(map(str, sorted(set(used))))} (Options.layers), "
                        "or --exit-heads DIR")
    raise SpecError(f"{head}, but the exit heads in {source} are at layers {list(layers)}: "
                    "use those layers, or pass --exit-heads DIR with heads at "
                    f"{','.join(map(str, missing))}")


def _same_layers(opts: Options, calib: dict, layers) -> None:
    """The calibration was measured for the exit heads' layers."""
    if list(layers) != list(calib["layers"]):
        raise SpecError(f"{opts.calibration} was measured for exit layers {calib['layers']}, "
                        f"but the exit heads have {list(layers)}")


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
    _same_layers(opts, calib, layers)
    spec, note = calibrate.tuned_spec(calib, layers, opts.t_max, opts.max_levels,
                                      opts.horizontal)
    return spec, heads, note


def draft_temperatures(calib: dict, n_levels: int) -> tuple | None:
    """``specjax.hsd.calibrate.draft_temperatures`` (kept here for its callers)."""
    from specjax.hsd import calibrate

    return calibrate.draft_temperatures(calib, n_levels)
