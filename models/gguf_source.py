"""A GGUF file as loading reads it: opened with one ``WeightLoadError`` for a file that is
not GGUF (``open_gguf``), its ``{arch}.*`` metadata read with types checked (``GGUFFields``,
which each family's GGUF config parser reads through), and its tensors dequantized one at a
time (``GGUFSource``). The bytes themselves are read by ``gguf_file``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import NoReturn

import numpy as np

from specjax.models.base import RopeScaling
from specjax.models.gguf_file import GGUFFile, read_gguf
from specjax.models.hf_config import ABSENT, is_int, is_number
from specjax.models.streaming import TensorSource, WeightLoadError


class GGUFFields:
    """Typed reads of ``{arch}.*`` metadata keys of a GGUF file: a missing key without a
    default, or a value of the wrong type or range, is one ``WeightLoadError`` naming the
    file and the key (never a ``TypeError`` or ``ZeroDivisionError`` further on)."""

    def __init__(self, reader: GGUFFile, arch: str):
        self.reader, self.arch = reader, arch

    def fail(self, key: str, what: str) -> NoReturn:
        raise WeightLoadError(f"{self.reader.path or 'GGUF file'}: metadata key "
                              f"'{self.arch}.{key}' {what}")

    def raw(self, key: str, default=ABSENT):
        v = self.reader.get(f"{self.arch}.{key}", default)
        if v is ABSENT:
            self.fail(key, "is missing")
        return v

    def integer(self, key: str, default=ABSENT, minimum: int = 1) -> int:
        v = self.raw(key, default)
        if isinstance(v, np.integer):
            v = int(v)
        if not is_int(v) or v < minimum:
            self.fail(key, f"must be an integer >= {minimum}, got {v!r}")
        return v

    def number(self, key: str, default=ABSENT) -> float:
        v = self.raw(key, default)
        if isinstance(v, (np.integer, np.floating)):
            v = v.item()
        if not is_number(v) or not math.isfinite(v) or v <= 0:
            self.fail(key, f"must be a finite number > 0, got {v!r}")
        return float(v)

    def rope_scaling(self) -> RopeScaling:
        kind = self.raw("rope.scaling.type", None)
        if kind == "linear":
            return RopeScaling("linear", factor=self.number("rope.scaling.factor"))
        if kind not in (None, "none"):
            self.fail("rope.scaling.type", f"is {kind!r}, which is not supported (linear only)")
        return RopeScaling()


def open_gguf(path: str | Path) -> GGUFFile:
    """The GGUF file at ``path``, its header read (``FileNotFoundError`` where there is
    none; ``WeightLoadError`` naming it where it is not readable GGUF)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        return read_gguf(path)
    except (ValueError, OSError) as e:  # GGUFFormatError is a ValueError
        raise WeightLoadError(f"{path}: not a readable GGUF file ({e})") from e


class GGUFSource(TensorSource):
    """The tensors of a read ``GGUFFile``, each dequantized to float32 when read. ``rows``
    of a matrix dequantize only those rows' bytes (ggml blocks never cross a row, so the
    values equal those rows of the whole tensor)."""

    def __init__(self, reader: GGUFFile):
        self.by_name = {t.name: t for t in reader.tensors}
        self.shapes = {t.name: t.shape for t in reader.tensors}

    def read(self, name, rows=None):
        import gguf

        t, shape = self.by_name[name], self.shapes[name]
        if rows is not None and len(shape) >= 2:  # t.data's first axis is the rows
            a, b = rows[0], min(rows[1], shape[0])
            w = np.asarray(gguf.quants.dequantize(t.data[a:b], t.qtype), np.float32)
            return w.reshape((b - a,) + tuple(shape[1:]))
        w = np.asarray(gguf.quants.dequantize(t.data, t.qtype), np.float32).reshape(shape)
        return w if rows is None else w[rows[0]:rows[1]]
