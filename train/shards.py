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

In a multi-process run every process opens the store and appends the same rounds, and
process 0 alone writes (each shard and the manifest once); the others wait for it and
read the manifest it wrote, so the store's directory must be one shared path.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path
from typing import Iterable, Sequence

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


def read_manifest(root: str | Path) -> dict | None:
    """The manifest of the store under ``root`` (None where it has none): a JSON object with
    a ``shards`` list of objects naming a ``file`` and its ``sha256``. Anything else is a
    one-line ``ShardError`` naming the file."""
    path = Path(root) / "manifest.json"
    if not path.is_file():
        return None
    try:
        m = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ShardError(f"{path} is not valid JSON ({e}): the store is damaged") from None
    entries = m.get("shards") if isinstance(m, dict) else None
    if not isinstance(entries, list) or not all(
            isinstance(e, dict) and {"file", "sha256"} <= e.keys() for e in entries):
        raise ShardError(f"{path} is not a shard manifest (expected an object whose 'shards' "
                         "lists each shard's file and sha256): the store is damaged")
    return m


def _entry(manifest: dict, root: Path, which: int | str) -> dict:
    """The manifest entry of shard ``which`` (a number, or a name given to ``append``)."""
    try:
        entry = manifest[which] if isinstance(which, str) else manifest["shards"][which]
    except (KeyError, IndexError):
        raise ShardError(f"{root / 'manifest.json'} lists no shard {which!r}") from None
    if not isinstance(entry, dict) or not {"file", "sha256"} <= entry.keys():
        raise ShardError(f"{root / 'manifest.json'}: shard {which!r} names no file and sha256")
    return entry


def verify(root: str | Path, entry: dict) -> Path:
    """The path of the shard ``entry`` describes; ``ShardError`` unless it exists and its
    bytes match the entry's SHA-256."""
    root = Path(root)
    path = root / entry["file"]
    if not path.is_file() or _sha(path) != entry["sha256"]:
        raise ShardError(f"{path} is missing or does not match its SHA-256 in "
                         f"{root / 'manifest.json'}: the store is damaged")
    return path


def check_store(root: str | Path, which: Iterable[int | str] | None = None,
                settings: dict | None = None, required: bool = False) -> None:
    """What needs no model, checked before one loads: the manifest is readable
    (``read_manifest``; ``required``: it exists, else ``FileNotFoundError``), it was written
    with ``settings`` (header fields besides the target, if given), and every shard of
    ``which`` (None: every numbered shard) the store holds (numbers past its end and names
    it lacks are skipped) exists with its recorded SHA-256. Raises ``ShardError`` naming
    the file otherwise."""
    m = read_manifest(root)
    if m is None:
        if required:
            raise FileNotFoundError(f"{root} holds no shard store (no manifest.json): write "
                                    "one with `specjax train onpolicy`")
        return
    if settings is not None:
        _check_settings(Path(root), m, settings)
    for w in range(len(m["shards"])) if which is None else which:
        if (w in m) if isinstance(w, str) else (0 <= w < len(m["shards"])):
            verify(root, _entry(m, Path(root), w))


def _check_settings(root: Path, manifest: dict, header: dict) -> None:
    """``ShardError`` unless ``manifest`` holds ``header``'s fields besides the target."""
    diff = {k: (manifest.get(k), v) for k, v in json.loads(json.dumps(header)).items()
            if k != "target" and manifest.get(k) != v}
    if diff:
        raise ShardError(f"{root} was written with other settings (field: (saved, "
                         f"requested)) {diff}; use another --shards directory")


def _main() -> bool:
    """Whether this process writes the store (process 0; always, in one process)."""
    return jax.process_index() == 0


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
        manifest = read_manifest(self.root)
        if manifest is not None:
            self.manifest = manifest
            self._check(header)
        else:
            if _main():
                self.root.mkdir(parents=True, exist_ok=True)
            self.manifest = {**header, "token_dtype": np.dtype(self.dtype).name, "shards": []}
            self._save()

    @classmethod
    def open(cls, root: str | Path, target: dict, vocab_size: int) -> "ShardStore":
        """An existing store, whatever its settings, if the target ``target`` (``{"name",
        "hash"}``, as ``store_header`` records it) wrote it: ``ShardError`` naming the store's
        target and this one otherwise, ``FileNotFoundError`` without a manifest."""
        check_store(root, (), required=True)
        m = read_manifest(root)
        header = {k: v for k, v in m.items() if k not in ("shards", "token_dtype", "val")}
        return cls(root, {**header, "target": target}, vocab_size)

    def _check(self, header: dict) -> None:
        old, new = self.manifest.get("target"), header.get("target", {})
        old = old if isinstance(old, dict) else {}
        if old.get("hash") != new.get("hash"):
            raise ShardError(
                f"{self.root} holds tokens of target {old.get('name')!r} (hash "
                f"{old.get('hash')}), not of {new.get('name')!r} (hash {new.get('hash')}): "
                f"self-distilled data only trains heads for the model that wrote it; use "
                f"another --shards directory")
        _check_settings(self.root, self.manifest, header)

    def _save(self) -> None:
        """Writes the manifest (process 0 only)."""
        if _main():
            _write_atomic(self.root / "manifest.json",
                          json.dumps(self.manifest, indent=1).encode())

    def _sync(self) -> None:
        """In a multi-process run: waits until process 0 has written, then every other
        process reads the manifest it wrote (its shards' SHA-256s: a shard's bytes differ
        from process to process, by the zip's timestamps)."""
        if jax.process_count() > 1:
            from specjax.train.checkpoint import barrier

            barrier(f"shard store {self.root}: {len(self)}")
            if not _main():
                self.manifest = read_manifest(self.root)

    def __len__(self) -> int:
        return len(self.manifest["shards"])

    def tokens(self) -> int:
        return sum(s["tokens"] for s in self.manifest["shards"])

    def answer_tokens(self) -> int:
        return sum(s["answer_tokens"] for s in self.manifest["shards"])

    def append(self, prompt_ids: Sequence[str], examples: Sequence[tuple[np.ndarray, int]],
               name: str | None = None) -> dict:
        """Writes ``examples`` (``(tokens, prompt_len)``, answering ``prompt_ids``) as the next
        shard, or as the named extra shard ``name`` (kept apart from the numbered ones, for
        a held-out set); returns its manifest entry. In a multi-process run every process
        calls it with the same examples and process 0 alone writes (:meth:`_sync`)."""
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
        if _main():
            _write_atomic(self.root / fname, buf.getvalue())
        entry = {"file": fname, "sha256": hashlib.sha256(buf.getvalue()).hexdigest(),
                 "prompt_ids": list(prompt_ids),
                 "tokens": int(toks.size),
                 "answer_tokens": int(sum(len(t) - p for t, p in examples))}
        if name:
            self.manifest[name] = entry
        else:
            self.manifest["shards"].append(entry)
        self._save()
        self._sync()
        return self.manifest[name] if name else self.manifest["shards"][-1]

    def read(self, which: int | str) -> list[tuple[np.ndarray, int]]:
        """The examples ``(tokens int32, prompt_len)`` of shard ``which`` (its number, or the
        name given to ``append``), checked against the manifest's SHA-256."""
        z = np.load(verify(self.root, _entry(self.manifest, self.root, which)))
        ends = np.cumsum(z["lengths"])
        return [(z["tokens"][e - n:e].astype(np.int32), int(pl))
                for e, n, pl in zip(ends, z["lengths"], z["prompt_lens"])]

    def has(self, name: str) -> bool:
        return name in self.manifest

    def sha256(self, which: int | str) -> str:
        """The SHA-256 the manifest records for shard ``which`` (its number or name)."""
        return _entry(self.manifest, self.root, which)["sha256"]


__all__ = ["ShardError", "ShardStore", "check_store", "read_manifest", "target_hash",
           "verify"]
