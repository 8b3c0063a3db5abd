"""A GGUF (llama.cpp) file's metadata and tensor table, read in one pass.

``gguf.GGUFReader`` builds a numpy view for every element of every metadata array; a
262k-token vocabulary (Gemma 3) then takes about 10 s to open, and loading opened the file
twice. This reader walks the header with ``struct`` over one memory map instead (well under
a second for the same file) and keeps each tensor's bytes as a view into that map, so no
weight is read before it is asked for. Dequantization stays ``gguf.quants``'.

The format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (versions 2 and 3,
little-endian). The header is checked as ggml's ``gguf.cpp`` checks it, each failure one
``GGUFFormatError`` naming the tensor or key: at most 4 dimensions (checked before they are
read), an element count within int64, rows of whole blocks, a power-of-2
``general.alignment``, each tensor's data where the one before it ends (aligned), and no
bytes after the last tensor's padding; so a flipped type, offset or dimension is refused
rather than read as other weights.
"""

from __future__ import annotations

import dataclasses
import math
import struct
from pathlib import Path
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
#: GGML's bounds (``ggml.h``): dimensions of a tensor, and the elements of one (int64)
_MAX_DIMS, _MAX_ELEMENTS = 4, (1 << 63) - 1
# the stored element types of unquantized tensors; every other type is kept as raw bytes
_PLAIN = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32,
          27: np.int64, 28: np.float64}


class GGUFFormatError(ValueError):
    """The bytes are not a GGUF file this reader understands (bad magic, an unsupported
    version or byte order, a truncated header or tensor data)."""


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file: ``shape`` in numpy (row-major) order, ``qtype`` its
    ``gguf.GGMLQuantizationType``, ``data`` its stored bytes as ``gguf.GGUFReader`` gives
    them (typed for unquantized tensors, ``uint8`` blocks otherwise): a view, not a copy."""

    name: str
    shape: tuple[int, ...]
    qtype: Any
    data: np.ndarray


@dataclasses.dataclass(frozen=True)
class GGUFFile:
    """``metadata``: each key's value (a number, str, or list; numeric arrays as numpy
    arrays). ``tensors``: in file order, names unique."""

    metadata: dict[str, Any]
    tensors: tuple[GGUFTensor, ...]
    path: str = ""  # the file read, for messages

    def get(self, key: str, default=None):
        return self.metadata.get(key, default)


class _Cursor:
    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def take(self, fmt: str):
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.take("<Q")
        if self.pos + n > len(self.buf):
            raise GGUFFormatError(f"a string of {n} bytes runs past the end of the file")
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, kind: int):
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise GGUFFormatError(f"unknown metadata value type {kind}")
        item, n = self.take("<I"), self.take("<Q")
        if item in _SCALARS:
            dt = np.dtype(_SCALARS[item])
            end = self.pos + n * dt.itemsize
            if end > len(self.buf):
                raise GGUFFormatError(f"an array of {n} values runs past the end of the file")
            out = np.frombuffer(self.buf, dt, n, self.pos).copy()
            self.pos = end
            return out
        return [self.value(item) for _ in range(n)]


def read_gguf(path: str | Path) -> GGUFFile:
    """The metadata and tensor table of the GGUF file at ``path``; ``GGUFFormatError`` for
    anything that is not a whole GGUF file (a tensor's bytes past the end included)."""
    import gguf

    mm = np.memmap(path, np.uint8, mode="r")
    buf = memoryview(mm)
    try:
        c = _Cursor(buf)
        if bytes(buf[:4]) != _MAGIC:
            raise GGUFFormatError("no GGUF magic at the start of the file")
        c.pos = 4
        version = c.take("<I")
        if version not in (2, 3):
            raise GGUFFormatError(f"GGUF version {version} (or big-endian) is not supported; "
                                  f"versions 2 and 3, little-endian, are")
        n_tensors, n_kv = c.take("<Q"), c.take("<Q")
        metadata = {}
        for _ in range(n_kv):
            key = c.string()
            metadata[key] = c.value(c.take("<I"))
        infos = []
        for _ in range(n_tensors):
            name, ndim = c.string(), c.take("<I")
            if ndim > _MAX_DIMS:  # checked before reading them: 2^32-1 would read the file
                raise GGUFFormatError(f"tensor {name!r} has {ndim} dimensions; GGML allows "
                                      f"at most {_MAX_DIMS}")
            dims = [c.take("<Q") for _ in range(ndim)]
            infos.append((name, tuple(reversed(dims)), c.take("<I"), c.take("<Q")))
    except struct.error as e:
        raise GGUFFormatError(f"the header ends early ({e})") from e
    align = _alignment(metadata)
    start = -(-c.pos // align) * align
    tensors, seen, expected = [], set(), 0
    for name, shape, qtype, offset in infos:
        if name in seen:
            raise GGUFFormatError(f"tensor {name!r} appears twice")
        seen.add(name)
        try:
            qtype = gguf.GGMLQuantizationType(qtype)
        except ValueError:
            raise GGUFFormatError(f"tensor {name!r} has unknown type {qtype}") from None
        nbytes = _nbytes(name, shape, qtype)
        if offset != expected:  # as ggml's gguf.cpp: tensors follow each other, aligned
            raise GGUFFormatError(f"tensor {name!r} has data offset {offset}, expected "
                                  f"{expected} (the tensors before it end there)")
        expected += -(-nbytes // align) * align
        tensors.append(GGUFTensor(name, shape, qtype, _tensor_data(mm, start + offset,
                                                                 shape, qtype, name, nbytes)))
    if tensors and mm.shape[0] > start + expected:  # writers pad the last tensor, no more
        raise GGUFFormatError(f"{mm.shape[0] - start - expected} bytes after the last tensor "
                              f"({tensors[-1].name!r}) belong to no tensor")
    return GGUFFile(metadata, tuple(tensors), str(path))


def _alignment(metadata: dict) -> int:
    """``general.alignment`` (32 when absent): as ggml requires, a uint32 power of 2."""
    align = metadata.get("general.alignment", 32)
    if (not isinstance(align, int) or isinstance(align, bool) or align <= 0
            or align & (align - 1)):
        raise GGUFFormatError(f"metadata key 'general.alignment' is {align!r}; it must be a "
                              "power of 2 (32 when absent)")
    return align


def _nbytes(name: str, shape: tuple[int, ...], qtype) -> int:
    """The stored size of tensor ``name``; ``GGUFFormatError`` naming it where GGML would
    refuse its dimensions (an element count past int64, rows not whole blocks)."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n = math.prod(shape)  # Python ints: no overflow to wrap around
    if n > _MAX_ELEMENTS:
        raise GGUFFormatError(f"tensor {name!r} has dimensions {list(shape)}, whose product "
                              "overflows int64")
    if shape and shape[-1] % block:
        raise GGUFFormatError(f"tensor {name!r} has rows of {shape[-1]} values, not a whole "
                              f"number of {qtype.name}'s {block}-value blocks")
    return n * size // block


def _tensor_data(mm: np.ndarray, at: int, shape: tuple[int, ...], qtype, name: str,
                 nbytes: int):
    """The view of one tensor's ``nbytes`` bytes, shaped as ``gguf.GGUFReader`` shapes it."""
    import gguf

    if at + nbytes > mm.shape[0]:
        raise GGUFFormatError(f"tensor {name!r} ends at byte {at + nbytes}, past the end of "
                              f"the file ({mm.shape[0]} bytes): a truncated file")
    raw = mm[at:at + nbytes]
    if int(qtype) in _PLAIN:
        return raw.view(_PLAIN[int(qtype)]).reshape(shape)
    return raw.reshape(gguf.quant_shape_to_byte_shape(shape, qtype))
