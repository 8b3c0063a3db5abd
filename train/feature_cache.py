"""Replayed shards' features on disk: what a prefill of a stored shard gives, computed once
per target and read back memory-mapped.

A run replays its store with one prefill of every round it holds, and its epochs prefill
the whole store again; on a CPU that is most of an epoch's time, and every run pays it
anew. A ``FeatureCache`` keeps each shard's features as one float32 ``.npy`` file
(``[tokens, F]``: the shard's sequences one after another, each with its last row zero,
as ``onpolicy.prefill_features`` returns them), named by the store's target hash, the
layers read and the shard's SHA-256. Another target, other layers or a rewritten shard
therefore never read stale features. A file is written under a temporary name and
renamed, so a kill leaves no half-written one; beside it a JSON file (``<name>.json``,
written after the ``.npy`` is in place) records its shape and its bytes' SHA-256. On read,
a file of the wrong shape, type or size, or whose bytes do not match the SHA-256 (checked
once per process and file), is refused in one line naming it; ``check`` compares every
file's size with its JSON before a target loads. A ``.npy`` without its JSON (a kill
between the two writes, or a cache written before the JSONs existed) is not trusted: its
features are computed and written again. The arrays read back are the computed ones bit
for bit, so a run with the cache trains to the parameters of one without it.

Size: ``4 x F`` bytes a token (SmolLM2-135M, EAGLE-2: F = 576, 2.3 KB a token, 3.1 GB for
1.35 M tokens). Read back memory-mapped, the features of a whole store need not fit in
host memory during the epochs.

In a multi-process run every process asks for the same shards; they read the cache only
when every one of them finds the file (one agreed answer: the features come from a
collective prefill, which all or none must run), and process 0 alone writes it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Sequence

import jax
import numpy as np

from specjax.heads.exported import file_sha256

from specjax.train.shards import ShardStore

Rows = list  # [(tokens int32 [n], prompt_len)]: a shard's examples (``ShardStore.read``)
Example = tuple  # (tokens int32 [n], prompt_len, feats float32 [n, F])


class FeatureCacheError(ValueError):
    """A cached features file that is damaged: its shape, type or size does not fit its
    shard or its JSON, or its bytes do not match the SHA-256 recorded there."""


_DELETE = "delete it and the features are computed again"


class FeatureCache:
    """Features of stored shards under ``root`` (created when first written)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self._verified: dict[Path, tuple[int, int]] = {}  # path: (size, mtime_ns) hashed

    def check(self, target_hash: str | None = None) -> int:
        """``FeatureCacheError`` naming the first features file (of the target
        ``target_hash``, or of any) whose JSON is unreadable or whose size is not the one
        its JSON records: a truncated file, found before a target loads (its SHA-256 is
        checked when it is read). The number of files checked. Files without a JSON are
        skipped (they are computed again)."""
        root = self.root / target_hash if target_hash else self.root
        n = 0
        for meta in sorted(root.rglob("*.json")) if root.is_dir() else ():
            path = meta.with_suffix(".npy")
            if path.is_file() and not path.name.startswith("tmp_"):
                _check_size(path, _read_meta(meta))
                n += 1
        return n

    def path(self, store: ShardStore, which: int | str, layers: Sequence[int]) -> Path:
        """Where shard ``which`` of ``store`` keeps its features of ``layers``."""
        tag = "-".join(str(int(x)) for x in layers)
        return (self.root / store.manifest["target"]["hash"] / f"layers-{tag}"
                / f"{store.sha256(which)}.npy")

    def examples(self, store: ShardStore, which: int | str, layers: Sequence[int],
                 compute: Callable[[Rows], list[Example]]) -> list[Example]:
        """Shard ``which``'s examples with their features: read from the cache, or
        ``compute(rows)`` and written to it. Each example's features are ``[n, F]``
        float32 (memory-mapped when read). ``FeatureCacheError`` for a cached file that is
        not ``[tokens, F]`` float32 for this shard, or not the size or the SHA-256 its
        JSON records."""
        rows = store.read(which)
        path = self.path(store, which, layers)
        meta = _meta_path(path)
        if not _everywhere(path.is_file() and meta.is_file()):
            out = compute(rows)
            if jax.process_index() == 0:
                _save(path, np.concatenate([np.asarray(f, np.float32) for _, _, f in out]))
            return out
        record = _read_meta(meta)
        dtype, shape = _npy_header(path)
        n = sum(len(t) for t, _ in rows)
        if dtype != np.float32 or len(shape) != 2 or shape[0] != n:
            raise FeatureCacheError(f"{path} holds {dtype} {shape}, not float32 "
                                    f"[{n}, F] for its shard: it is damaged; {_DELETE}")
        _check_size(path, record)
        self._check_sha(path, record)
        flat = np.load(path, mmap_mode="r")
        ends = np.cumsum([len(t) for t, _ in rows])
        return [(t, pl, flat[e - len(t):e]) for (t, pl), e in zip(rows, ends)]

    def _check_sha(self, path: Path, record: dict) -> None:
        """``FeatureCacheError`` unless ``path``'s bytes match ``record``'s SHA-256 (hashed
        once per process while the file's size and time stay those seen)."""
        st = path.stat()
        if self._verified.get(path) == (st.st_size, st.st_mtime_ns):
            return
        if file_sha256(path) != record["sha256"]:
            raise FeatureCacheError(f"{path} does not match the SHA-256 in {_meta_path(path).name}"
                                    f": it is damaged; {_DELETE}")
        self._verified[path] = (st.st_size, st.st_mtime_ns)


def _everywhere(found: bool) -> bool:
    """Whether ``found`` holds on every process of the run (an all-gather; ``found`` as is
    in a one-process run)."""
    if jax.process_count() == 1:
        return found
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.asarray(found))))


def _meta_path(path: Path) -> Path:
    return path.with_suffix(".json")


def _read_meta(meta: Path) -> dict:
    """A features file's JSON: ``{"shape": [tokens, F], "sha256": ..., "bytes": ...}``;
    ``FeatureCacheError`` naming it when it is not that."""
    try:
        record = json.loads(meta.read_text())
        ok = (isinstance(record, dict) and isinstance(record.get("sha256"), str)
              and isinstance(record.get("bytes"), int))
    except (ValueError, UnicodeDecodeError):
        ok = False
    if not ok:
        raise FeatureCacheError(f"{meta} is not a features file's record (JSON with its "
                                f"sha256 and bytes): it is damaged; delete it and "
                                f"{meta.with_suffix('.npy').name}, and the features are "
                                "computed again")
    return record


def _npy_header(path: Path) -> tuple[np.dtype, tuple[int, ...]]:
    """The dtype and shape a ``.npy`` file's header records; ``FeatureCacheError`` naming
    it when the header is unreadable."""
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                    else np.lib.format.read_array_header_2_0)
            shape, _, dtype = read(f)
    except Exception as e:  # noqa: BLE001 -- np.lib.format's parse fails many ways
        raise FeatureCacheError(f"{path} is not a readable .npy file ({e}): it is damaged; "
                                f"{_DELETE}") from None
    return np.dtype(dtype), tuple(shape)


def _check_size(path: Path, record: dict) -> None:
    size = path.stat().st_size
    if size != record["bytes"]:
        raise FeatureCacheError(f"{path} holds {size} bytes, {_meta_path(path).name} records "
                                f"{record['bytes']}: it is truncated or damaged; {_DELETE}")


def _save(path: Path, array: np.ndarray) -> None:
    """``array`` as ``path`` (a temporary name, renamed), then its JSON the same way: a
    kill leaves no ``.npy`` with a JSON that does not describe it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = _meta_path(path)
    meta.unlink(missing_ok=True)  # a stale record never describes the new file
    tmp = path.with_name("tmp_" + path.name)
    with open(tmp, "wb") as f:
        np.save(f, array)
    record = {"shape": list(array.shape), "dtype": "float32", "bytes": tmp.stat().st_size,
              "sha256": file_sha256(tmp)}
    tmp.replace(path)
    tmp_meta = meta.with_name("tmp_" + meta.name)
    tmp_meta.write_text(json.dumps(record, indent=1))
    tmp_meta.replace(meta)


__all__ = ["FeatureCache", "FeatureCacheError"]
