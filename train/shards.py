"""Self-distilled token shards: the target's own answers as token ids, small enough to commit.

A store is a directory holding ``manifest.json`` and numbered ``shard_*.npz`` files. Each
shard holds one decode batch: the token ids of every sequence (prompt then answer) as
``uint16`` (``uint32`` for vocabularies over 65536), their lengths and prompt lengths, and
the ids of the prompts they answer. Features are never stored: a replay recomputes them
with one prefill of the tokens (``specjax.train.onpolicy.prefill_features``).

The manifest names the target by a hash of its configuration and weights
(``target_hash``), the sampling settings, and every shard with its prompt ids and SHA-256. A
store refuses a different target or other settings (``ShardError``), so tokens of one model
never train a head for another. Shards and the manifest are written to temporary names
and renamed, shard first: a kill leaves either the old store or the new one.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path
from typing import Sequence

import jax
import numpy as np

FORMAT = 1


class ShardError(ValueError):
    """A store that does not belong to this target or these settings, or a damaged shard."""


def target_hash(config, params) -> str:
    """SHA-256 (hex, first 16 digits) of a model's configuration and every weight's bytes,
    in a fixed order: equal for the same model however it was loaded, different after any
    change to a weight."""
    h = hashlib.sha256(repr(config).encode())
    for path, leaf in sorted(jax.tree_util.tree_leaves_with_path(params),
                             key=lambda pl: jax.tree_util.keystr(pl[0])):
        a = np.ascontiguousarray(np.asarray(leaf))
        h.update(jax.tree_util.keystr(path).encode())
        h.update(str(a.dtype).encode() + str(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()[:16]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name("tmp_" + path.name)
    tmp.write_bytes(data)
    tmp.replace(path)


class ShardStore:
    """The shards of one target under ``root`` (created if missing).

    ``header`` (the target's name and hash, sampling settings, how prompts are chosen) is
    written on creation and must match on every later open."""

    def __init__(self, root: str | Path, header: dict, vocab_size: int):
        self.root = Path(root)
        self.dtype = np.uint16 if vocab_size <= 1 << 16 else np.uint32
        header = json.loads(json.dumps({"format": FORMAT, **header}))
        path = self.root / "manifest.json"
        if path.exists():
            self.manifest = json.loads(path.read_text())
            self._check(header)
        else:
            self.root.mkdir(parents=True, exist_ok=True)
            self.manifest = {**header, "token_dtype": np.dtype(self.dtype).name, "shards": []}
            self._save()

    @classmethod
    def open(cls, root: str | Path, thash: str, vocab_size: int) -> "ShardStore":
        """An existing store, whatever its settings, if target ``thash`` wrote it
        (``ShardError`` otherwise, ``FileNotFoundError`` without a manifest)."""
        path = Path(root) / "manifest.json"
        if not path.exists():
            raise FileNotFoundError(f"{root} holds no shard store (no manifest.json): write one "
                                    "with `specjax train onpolicy`")
        m = json.loads(path.read_text())
        header = {k: v for k, v in m.items() if k not in ("shards", "token_dtype", "val")}
        return cls(root, {**header, "target": {**m["target"], "hash": thash}}, vocab_size)

    def _check(self, header: dict) -> None:
        old, new = self.manifest.get("target", {}), header.get("target", {})
        if old.get("hash") != new.get("hash"):
            raise ShardError(
                f"{self.root} holds tokens of target {old.get('name')!r} (hash "
                f"{old.get('hash')}), not of {new.get('name')!r} (hash {new.get('hash')}): "
                f"self-distilled data only trains heads for the model that wrote it; use "
                f"another --shards directory")
        diff = {k: (self.manifest.get(k), v) for k, v in header.items()
                if k != "target" and self.manifest.get(k) != v}
        if diff:
            raise ShardError(f"{self.root} was written with other settings (field: (saved, "
                             f"requested)) {diff}; use another --shards directory")

    def _save(self) -> None:
        _write_atomic(self.root / "manifest.json",
                      json.dumps(self.manifest, indent=1).encode())

    def __len__(self) -> int:
        return len(self.manifest["shards"])

    def tokens(self) -> int:
        return sum(s["tokens"] for s in self.manifest["shards"])

    def append(self, prompt_ids: Sequence[str], examples: Sequence[tuple[np.ndarray, int]],
               name: str | None = None) -> dict:
        """Writes ``examples`` (``(tokens, prompt_len)``, answering ``prompt_ids``) as the next
        shard, or as the named extra shard ``name`` (kept apart from the numbered ones, for
        a held-out set); returns its manifest entry."""
        if len(prompt_ids) != len(examples):
            raise ValueError(f"{len(prompt_ids)} prompt ids for {len(examples)} examples")
        fname = f"{name}.npz" if name else f"shard_{len(self):05d}.npz"
        toks = np.concatenate([np.asarray(t) for t, _ in examples])
        if toks.min() < 0 or toks.max() > np.iinfo(self.dtype).max:
            raise ValueError(f"token ids outside {np.dtype(self.dtype).name}")
        buf = io.BytesIO()
        np.savez_compressed(buf, tokens=toks.astype(self.dtype),
                            lengths=np.asarray([len(t) for t, _ in examples], np.int32),
                            prompt_lens=np.asarray([p for _, p in examples], np.int32))
        _write_atomic(self.root / fname, buf.getvalue())
        entry = {"file": fname, "sha256": _sha(self.root / fname), "prompt_ids": list(prompt_ids),
                 "tokens": int(toks.size),
                 "answer_tokens": int(sum(len(t) - p for t, p in examples))}
        if name:
            self.manifest[name] = entry
        else:
            self.manifest["shards"].append(entry)
        self._save()
        return entry

    def read(self, which: int | str) -> list[tuple[np.ndarray, int]]:
        """The examples ``(tokens int32, prompt_len)`` of shard ``which`` (its number, or the
        name given to ``append``), checked against the manifest's SHA-256."""
        entry = self.manifest[which] if isinstance(which, str) else self.manifest["shards"][which]
        path = self.root / entry["file"]
        if not path.exists() or _sha(path) != entry["sha256"]:
            raise ShardError(f"{path} is missing or does not match its SHA-256 in "
                             f"{self.root / 'manifest.json'}: the store is damaged")
        z = np.load(path)
        ends = np.cumsum(z["lengths"])
        return [(z["tokens"][e - n:e].astype(np.int32), int(pl))
                for e, n, pl in zip(ends, z["lengths"], z["prompt_lens"])]

    def has(self, name: str) -> bool:
        return name in self.manifest


__all__ = ["ShardError", "ShardStore", "target_hash"]
