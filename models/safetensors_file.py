"""Safetensors files read lazily: a file's tensor table from its header alone
(``safetensors_header``, checked as the ``safetensors`` package checks it), the files of an
HF directory that transformers reads (``hf_weight_table``), and their tensors one at a time
in the stored dtype (``SafetensorsSource``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from specjax.models.hf_config import read_config_json
from specjax.models.streaming import TensorSource, WeightLoadError

_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16,
              "BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn,
              "F8_E5M2": ml_dtypes.float8_e5m2, "I64": np.int64, "I32": np.int32,
              "I16": np.int16, "I8": np.int8, "U64": np.uint64, "U32": np.uint32,
              "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_, "C64": np.complex64}
#: the stored dtypes that weights may have: floating point, never integers, booleans or
#: complex numbers (which casting would turn into numbers no model was trained with)
FLOAT_DTYPES = frozenset(np.dtype(v) for k, v in _ST_DTYPES.items()
                         if k.startswith(("F", "BF")))


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    """Where one tensor lies in a safetensors file: absolute byte range ``[start, end)``."""

    file: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int
    end: int


def safetensors_header(f: Path) -> dict[str, StoredTensor]:
    """Every tensor of the safetensors file ``f`` (in header order), from its header alone
    (8-byte little-endian length, then JSON). ``WeightLoadError`` naming ``f`` for a file
    that is not complete safetensors: a bad header, an unknown dtype, or a byte range that
    does not match the shape or lies past the end of the file; and, as the ``safetensors``
    package refuses them, a name (or any key) given twice in the header, two tensors over
    the same bytes, bytes no tensor covers, or bytes after the last tensor."""
    size = f.stat().st_size
    try:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > min(size - 8, 100 << 20):
                raise ValueError(f"header length {n} exceeds the file")
            header = json.loads(fh.read(n), object_pairs_hook=_unique_keys)
        out = {}
        for name, e in header.items():
            if name == "__metadata__":
                continue
            if e["dtype"] not in _ST_DTYPES:
                raise ValueError(f"tensor {name!r} has dtype {e['dtype']}, which is not read")
            dtype, shape = np.dtype(_ST_DTYPES[e["dtype"]]), tuple(int(s) for s in e["shape"])
            a, b = (8 + n + int(o) for o in e["data_offsets"])
            if b - a != math.prod(shape) * dtype.itemsize or b > size or a < 8 + n:
                raise ValueError(f"tensor {name!r}: bytes {a}..{b} of a {size}-byte file do "
                                 f"not hold {e['dtype']} {list(shape)}")
            out[name] = StoredTensor(f, dtype, shape, a, b)
        _check_coverage(out, 8 + n, size)
        return out
    except (ValueError, KeyError, TypeError, AttributeError, struct.error) as e:
        raise WeightLoadError(f"{f}: not a readable safetensors file ({e})") from None


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object's pairs as a dict; ``ValueError`` for a key given twice (which
    ``json`` would otherwise resolve silently to the last value)."""
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"{k!r} is named twice in the header")
        out[k] = v
    return out


def _check_coverage(table: dict[str, StoredTensor], start: int, size: int) -> None:
    """``ValueError`` unless the tensors' byte ranges tile ``[start, size)`` exactly, as
    the ``safetensors`` package requires: no two over the same bytes (reported first: a
    tensor pointed at another's bytes also leaves its own uncovered), no bytes between two
    tensors, none after the last. Messages give data offsets (``data_offsets``' terms)."""
    ranges = sorted(table.items(), key=lambda kv: (kv[1].start, kv[1].end))
    for (p, a), (name, t) in zip(ranges, ranges[1:]):
        if t.start < a.end:
            raise ValueError(f"tensor {name!r} (data bytes {t.start - start}..{t.end - start}) "
                             f"overlaps tensor {p!r} ({a.start - start}..{a.end - start})")
    at, last = start, None
    for name, t in ranges:
        if t.start > at:
            where = f"after tensor {last!r}" if last else "before the first tensor"
            raise ValueError(f"data bytes {at - start}..{t.start - start} {where} belong to "
                             f"no tensor (next: tensor {name!r})")
        at, last = t.end, name
    if at != size:
        after = f"tensor {last!r}" if last else "the header"
        raise ValueError(f"data bytes {at - start}..{size - start} after {after} belong to "
                         "no tensor (data past the end of the header's tensors)")


class SafetensorsSource(TensorSource):
    """Tensors of safetensors files, read one at a time from their byte ranges, in the
    stored dtype (bfloat16 stays bfloat16). Plain reads, not a mapping, so a tensor no
    longer referenced leaves no file pages counted in the process."""

    def __init__(self, table: dict[str, StoredTensor]):
        self.table = table
        self.shapes = {k: t.shape for k, t in table.items()}

    def _read_bytes(self, t: StoredTensor, a: int, buf: np.ndarray) -> None:
        view = memoryview(buf.reshape(-1).view(np.uint8))
        with open(t.file, "rb", buffering=0) as fh:
            fh.seek(a)
            got = 0
            while got < len(view):
                k = fh.readinto(view[got:])
                if not k:
                    raise WeightLoadError(f"{t.file}: ends inside tensor data (truncated)")
                got += k

    def read(self, name, rows=None):
        t = self.table[name]
        if rows is None or not t.shape:
            out = np.empty(t.shape, t.dtype)
            self._read_bytes(t, t.start, out)
            return out
        a, b = rows[0], min(rows[1], t.shape[0])
        out = np.empty((b - a,) + t.shape[1:], t.dtype)
        self._read_bytes(t, self._row_offset(t, a), out)
        return out

    def _row_offset(self, t: StoredTensor, row: int) -> int:
        return t.start + row * math.prod(t.shape[1:]) * t.dtype.itemsize

    def read_into(self, name, out, rows=None):
        t = self.table[name]
        if out.dtype == t.dtype and out.flags.c_contiguous:
            self._read_bytes(t, t.start if rows is None or not t.shape
                             else self._row_offset(t, rows[0]), out)
        else:
            out[...] = self.read(name, rows)


def hf_weight_table(path: Path) -> dict[str, StoredTensor]:
    """The tensors of an HF directory, from the files transformers 5 reads, in its order
    (``modeling_utils._get_resolved_checkpoint_files``): the file ``config.json`` names in
    ``transformers_weights``; else ``model.safetensors``; else the files
    ``model.safetensors.index.json``'s ``weight_map`` names, each tensor from the file the
    map gives. Other ``*.safetensors`` files (a stray ``model_backup.safetensors``) are
    ignored. Without any of these, one other ``*.safetensors`` file is read as the weights;
    several are a ``WeightLoadError`` naming them, none a ``FileNotFoundError``.
    ``WeightLoadError`` for an index naming a missing file, or a tensor its file lacks, or
    a shard holding a tensor the map does not assign to it (so no name is in two files)."""
    named = _named_weights(path)
    if named is not None:
        if named.name.endswith(".index.json"):
            return _indexed_table(path, named)
        return safetensors_header(named)
    if (path / "model.safetensors").is_file():
        return safetensors_header(path / "model.safetensors")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return _indexed_table(path, index)
    files = sorted(p for p in path.glob("*.safetensors") if p.is_file())
    if not files:
        raise FileNotFoundError(f"{path}: no model.safetensors, model.safetensors.index.json "
                                "or other *.safetensors file")
    if len(files) > 1:
        raise WeightLoadError(f"{path}: no model.safetensors or model.safetensors.index.json, "
                              f"and several weight files {[f.name for f in files]}: which hold "
                              "the model is ambiguous (name it model.safetensors, or write "
                              "an index)")
    return safetensors_header(files[0])


def _named_weights(path: Path) -> Path | None:
    """The weights file ``config.json``'s ``transformers_weights`` names, if it names one,
    checked as transformers checks it: a ``.safetensors`` or ``.safetensors.index.json``
    file inside ``path`` (``WeightLoadError`` otherwise, or where it does not exist)."""
    if not (path / "config.json").is_file():
        return None
    f = read_config_json(path / "config.json")
    name = f.text("transformers_weights", None)
    if name is None:
        return None
    target = (path / name).resolve()
    if (not name.endswith((".safetensors", ".safetensors.index.json"))
            or path.resolve() not in target.parents):
        f.fail(f"'transformers_weights' must name a .safetensors or .safetensors.index.json "
               f"file inside {path}, got {name!r}")
    if not target.is_file():
        f.fail(f"'transformers_weights' names {name}, which does not exist")
    return target


def check_floating(name: str, dtype, where, error: type = WeightLoadError) -> None:
    """``error`` naming ``where`` and tensor ``name`` unless its stored ``dtype`` is floating
    point: integers, booleans and complex numbers (a quantized or corrupt checkpoint) are
    not weights that a cast to floats would recover."""
    dt = np.dtype(dtype)
    if dt not in FLOAT_DTYPES:
        raise error(f"{where}: tensor {name!r} is stored as {dt.name}; weights must be "
                    "floating point (quantized checkpoints are not supported)")


def _indexed_table(path: Path, index: Path) -> dict[str, StoredTensor]:
    """The tensors a sharded checkout's index names (see :func:`hf_weight_table`)."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        by_file: dict[str, list[str]] = {}
        for name, fname in weight_map.items():
            by_file.setdefault(str(fname), []).append(str(name))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise WeightLoadError(f"{index}: not a readable index ({e!r})") from None
    table: dict[str, StoredTensor] = {}
    for fname, names in by_file.items():
        f = path / fname
        if not f.is_file():
            raise WeightLoadError(f"{index}: weight_map names {fname}, which is missing from "
                                  f"{path} ({len(names)} tensors, e.g. {names[0]!r})")
        header = safetensors_header(f)
        absent = [n for n in names if n not in header]
        if absent:
            raise WeightLoadError(f"{index}: weight_map puts {absent[0]!r} in {fname}, which "
                                  f"does not hold it ({len(absent)} such tensors)")
        extra = [n for n in header if weight_map.get(n) != fname]
        if extra:
            raise WeightLoadError(f"{f}: holds {extra[0]!r}, which {index.name} does not "
                                  f"assign to it ({len(extra)} such tensors)")
        table.update({n: header[n] for n in names})
    return {n: table[n] for n in weight_map}

