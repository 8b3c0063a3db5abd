"""Replayed shards' features on disk: what a prefill of a stored shard gives, computed once
per target and read back memory-mapped.

A run replays its store with one prefill of every round it holds, and its epochs prefill
the whole store again; on a CPU that is most of an epoch's time, and every run pays it
anew. A ``FeatureCache`` keeps each shard's features as one float32 ``.npy`` file
(``[tokens, F]``: the shard's sequences one after another, each with its last row zero,
as ``onpolicy.prefill_features`` returns them), named by the store's target hash, the
layers read and the shard's SHA-256. Another target, other layers or a rewritten shard
therefore never read stale features. A file is written under a temporary name and
renamed, so a kill leaves no half-written one; a file of the wrong shape or type is
refused in one line naming it. The arrays read back are the computed ones bit for bit, so
a run with the cache trains to the parameters of one without it.

Size: ``4 x F`` bytes a token (SmolLM2-135M, EAGLE-2: F = 576, 2.3 KB a token, 3.1 GB for
1.35 M tokens). Read back memory-mapped, the features of a whole store need not fit in
host memory during the epochs.

In a multi-process run every process asks for the same shards; they read the cache only
when every one of them finds the file (one agreed answer: the features come from a
collective prefill, which all or none must run), and process 0 alone writes it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

import jax
import numpy as np

from specjax.train.shards import ShardStore

Rows = list  # [(tokens int32 [n], prompt_len)]: a shard's examples (``ShardStore.read``)
Example = tuple  # (tokens int32 [n], prompt_len, feats float32 [n, F])


class FeatureCacheError(ValueError):
    """A cached features file whose shape or type does not fit its shard."""


class FeatureCache:
    """Features of stored shards under ``root`` (created when first written)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

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
        not ``[tokens, F]`` float32 for this shard."""
        rows = store.read(which)
        path = self.path(store, which, layers)
        if not _everywhere(path.is_file()):
            out = compute(rows)
            if jax.process_index() == 0:
                _save(path, np.concatenate([np.asarray(f, np.float32) for _, _, f in out]))
            return out
        flat = np.load(path, mmap_mode="r")
        n = sum(len(t) for t, _ in rows)
        if flat.dtype != np.float32 or flat.ndim != 2 or flat.shape[0] != n:
            raise FeatureCacheError(f"{path} holds {flat.dtype} {flat.shape}, not float32 "
                                    f"[{n}, F] for its shard: it is damaged; delete it and "
                                    "the features are computed again")
        ends = np.cumsum([len(t) for t, _ in rows])
        return [(t, pl, flat[e - len(t):e]) for (t, pl), e in zip(rows, ends)]


def _everywhere(found: bool) -> bool:
    """Whether ``found`` holds on every process of the run (an all-gather; ``found`` as is
    in a one-process run)."""
    if jax.process_count() == 1:
        return found
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.asarray(found))))


def _save(path: Path, array: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name("tmp_" + path.name)
    with open(tmp, "wb") as f:
        np.save(f, array)
    tmp.replace(path)


__all__ = ["FeatureCache", "FeatureCacheError"]
