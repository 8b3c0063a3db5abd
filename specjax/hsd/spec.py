"""A hierarchy as typed values, parsed from and formatted to its one text form.

``"ngram:4,12@0.5:3,target+h10"`` reads: level 0 is the n-gram drafter collecting ``T = 4``
tokens, level 1 the exit at layer 12 drafting at its own temperature 0.5 and collecting
``T = 3``, then the target; ``+h10`` is the horizontal heuristic
(``Hierarchy.horizontal``). ``HierarchySpec.parse`` is the only parser of this form and
``format`` writes it back (``parse(s.format()) == s``); calibration's candidate indices
(``specjax.hsd.calibrate.names``) convert with ``sigma`` / ``from_sigma``.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from specjax.hsd import loop as hsd


@dataclasses.dataclass(frozen=True)
class LevelSpec:
    """One draft level: ``layer`` None is the n-gram drafter, else the exit at ``layer``
    (with its own draft ``temperature``, None: the target's); it collects ``T`` tokens."""

    T: int
    layer: int | None = None
    temperature: float | None = None

    def format(self) -> str:
        name = "ngram" if self.layer is None else str(self.layer)
        temp = "" if self.temperature is None else f"@{self.temperature:g}"
        return f"{name}{temp}:{self.T}"

    @classmethod
    def parse(cls, text: str, spec: str) -> "LevelSpec":
        name, colon, t = text.partition(":")
        name, at, temp = name.partition("@")
        bad = ValueError(f"bad level {text!r} in {spec!r}: use ngram:T or L:T (L an exit "
                         "layer, optionally L@t:T with its own draft temperature t >= 0), "
                         "T >= 1")
        if not colon or not t.isdigit() or int(t) < 1 or not (name == "ngram" or name.isdigit()):
            raise bad
        if at and name == "ngram":
            raise ValueError(f"bad level {text!r} in {spec!r}: only exit levels take a "
                             "temperature")
        try:
            temperature = float(temp) if at else None
        except ValueError:
            raise bad from None
        if temperature is not None and not 0 <= temperature < float("inf"):
            raise bad
        return cls(int(t), None if name == "ngram" else int(name), temperature)


@dataclasses.dataclass(frozen=True)
class HierarchySpec:
    """Draft levels cheapest first (the target is implied on top) and the horizontal
    heuristic's size."""

    levels: tuple[LevelSpec, ...]
    horizontal: int = 0

    @classmethod
    def parse(cls, spec: str) -> "HierarchySpec":
        """Raises ``ValueError`` naming the bad part of ``spec``."""
        base, plus, h = spec.strip().rpartition("+h")
        if not plus:
            base, h = spec.strip(), "0"
        elif not h.isdigit():
            raise ValueError(f"bad horizontal suffix in {spec!r}: use e.g. '...,target+h10'")
        parts = [p.strip() for p in base.split(",") if p.strip()]
        if len(parts) < 2 or parts[-1] != "target":
            raise ValueError(f"bad hierarchy {spec!r}: want e.g. 'ngram:4,12:3,target'")
        return cls(tuple(LevelSpec.parse(p, spec) for p in parts[:-1]), int(h))

    def format(self) -> str:
        out = ",".join([lv.format() for lv in self.levels] + ["target"])
        return out + (f"+h{self.horizontal}" if self.horizontal else "")

    @property
    def T(self) -> tuple[int, ...]:
        return tuple(lv.T for lv in self.levels)

    @property
    def temperatures(self) -> tuple[float | None, ...]:
        """Each level's own draft temperature, the target's (None) last."""
        return tuple(lv.temperature for lv in self.levels) + (None,)

    def exit_layers(self) -> tuple[int, ...]:
        return tuple(lv.layer for lv in self.levels if lv.layer is not None)

    def sigma(self, layers: Sequence[int]) -> tuple[int, ...]:
        """Candidate indices (``calibrate.names(layers)``: ngram, each exit, target)."""
        missing = [l for l in self.exit_layers() if l not in layers]
        if missing:
            raise ValueError(f"hierarchy {self.format()!r} uses exit layers {missing}, but "
                             f"the exit heads have {list(layers)}")
        idx = [0 if lv.layer is None else 1 + list(layers).index(lv.layer)
               for lv in self.levels]
        return tuple(idx) + (len(layers) + 1,)

    @classmethod
    def from_sigma(cls, sigma: Sequence[int], T: Sequence[int], layers: Sequence[int],
                   temperatures: Sequence[float | None] | None = None,
                   horizontal: int = 0) -> "HierarchySpec":
        """The spec of candidate indices ``sigma`` (the last, the target, implied)."""
        temps = list(temperatures or []) + [None] * len(sigma)
        levels = tuple(LevelSpec(int(t), None if i == 0 else int(layers[i - 1]),
                                 None if i == 0 else temps[k])
                       for k, (i, t) in enumerate(zip(sigma[:-1], T)))
        return cls(levels, int(horizontal))

    def build(self, heads: dict, head_fn) -> tuple[hsd.Hierarchy, tuple]:
        """``(Hierarchy, hparams)``: exit levels score with ``head_fn`` and ``heads[layer]``
        (None where no trained head is given)."""
        levels, hp = [], []
        for lv in self.levels:
            if lv.layer is None:
                levels.append(hsd.NGram())
                hp.append(None)
            else:
                levels.append(hsd.Exit(lv.layer, head_fn, lv.temperature))
                hp.append(heads.get(lv.layer))
        return (hsd.Hierarchy(tuple(levels) + (hsd.Exit(),), self.T, self.horizontal),
                tuple(hp) + (None,))


__all__ = ["HierarchySpec", "LevelSpec"]
