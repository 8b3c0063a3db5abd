"""Exported draft heads on disk: a directory with ``head.json`` (kind, target, shapes,
training metadata) and the parameters in ``params.safetensors``.

This module knows the file layout, not the kinds: ``specjax.heads.kinds`` has one save
and one load function per kind of head (what each writes into ``head.json`` and the
parameter template a directory is checked against), used by decoding (``specjax.methods``)
and by training (``specjax.train``) alike; the inference side never imports the training
package.

A head is placed on the devices in use when it loads (``load_head``): the file records
no device, so a head exported on a CPU loads on a GPU or TPU, on one device or on a mesh.
Heads exported before this format (an Orbax checkpoint in ``params/``) still load, onto
this host's devices whatever device they were saved from.

Integrity: ``head.json`` records ``params_sha256`` (the SHA-256 of ``params.safetensors``)
and ``head_sha256``, the SHA-256 of ``head.json``'s own content (its object without that
field, keys sorted, compact JSON: ``meta_sha256``), which holds ``params_sha256``: together
they cover every file of the head, so an edited ``head.json`` (``draft_vocab`` 16 -> 17) is
refused as a flipped byte in the parameters is. Heads exported before a field existed load
without that check (the shipped heads record ``params_sha256`` only). A deliberate edit is
written with ``write_meta``, which records the new ``head_sha256``.

Parameter names: a head's parameters are a pytree of dicts (string or int keys), lists and
tuples with array leaves; each leaf is stored under its path joined with ``/``, where a
string key stands for itself, an int key ``k`` is written ``#k``, a list index ``i`` is
``[i]`` and a tuple index ``(i)``: ``{"blocks": [{"w": a}], "layer": {"qkv": b}}`` is
stored as ``blocks/[0]/w`` and ``layer/qkv``. ``flatten`` and ``unflatten`` are exact
inverses on such trees.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

HEAD_JSON = "head.json"
PARAMS = "params.safetensors"
LEGACY_PARAMS = "params"  # the Orbax checkpoint of heads exported before safetensors
FORMAT = {"format": "specjax-head", "version": "1"}  # the safetensors header's metadata


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: corrupt, or made for something else."""


# ----------------------------------------------------------------------------- names

_INDEX = re.compile(r"^(#(-?\d+)|\[(\d+)\]|\((\d+)\))$")


def _segment(key) -> str:
    if isinstance(key, str):
        if not key or "/" in key or key[0] in "#[(":
            raise ValueError(f"parameter key {key!r} cannot be stored: keys must be non-empty, "
                             f"without '/', and not start with '#', '[' or '('")
        return key
    if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
        return f"#{int(key)}"
    raise ValueError(f"parameter key {key!r}: only str and int dict keys can be stored")


def flatten(tree: Any) -> dict[str, np.ndarray]:
    """``{name: host array}`` for every leaf of ``tree`` (dicts with str or int keys, lists,
    tuples; array-like leaves), named as the module docstring says. ``ValueError`` for
    what ``unflatten`` could not rebuild: other containers, None, empty containers."""
    out: dict[str, np.ndarray] = {}

    def walk(x, prefix: str):
        if isinstance(x, dict):
            items = [(_segment(k), v) for k, v in x.items()]
        elif isinstance(x, (list, tuple)):
            fmt = "[{}]" if isinstance(x, list) else "({})"
            items = [(fmt.format(i), v) for i, v in enumerate(x)]
        else:
            a = None if x is None else np.asarray(x)
            if a is None or a.dtype == object:
                raise ValueError(f"parameter {prefix or '<root>'!r} is {type(x).__name__}: "
                                 f"only dicts, lists, tuples and arrays can be stored")
            out[prefix] = a
            return
        if not items:
            raise ValueError(f"parameter {prefix or '<root>'!r} is an empty container")
        for seg, v in items:
            walk(v, f"{prefix}/{seg}" if prefix else seg)

    if not isinstance(tree, (dict, list, tuple)):
        raise ValueError("a head's parameters must be a dict, list or tuple of arrays")
    walk(tree, "")
    return out


def unflatten(flat: dict[str, Any]) -> Any:
    """The pytree that ``flatten`` turned into ``flat`` (leaves as given). ``ValueError``
    when the names are not such a tree's (mixed container kinds, gaps in list indices)."""
    root: dict = {}
    for name, leaf in flat.items():
        *parents, last = name.split("/")
        node = root
        for seg in parents:
            node = node.setdefault(seg, {})
            if not isinstance(node, dict):
                raise ValueError(f"parameter {name!r} lies under an array")
        if last in node:
            raise ValueError(f"parameter {name!r} is stored twice")
        node[last] = leaf
    return _rebuild(root, "")


def _rebuild(node, where: str):
    if not isinstance(node, dict):
        return node
    kinds = {_kind(s) for s in node}
    if len(kinds) != 1:
        raise ValueError(f"parameters under {where or '<root>'!r} mix dict keys and indices")
    kind = kinds.pop()
    items = {_key(s): _rebuild(v, f"{where}/{s}") for s, v in node.items()}
    if kind == "dict":
        return items
    if sorted(items) != list(range(len(items))):
        raise ValueError(f"parameters under {where or '<root>'!r} have gaps in their indices")
    seq = [items[i] for i in range(len(items))]
    return seq if kind == "list" else tuple(seq)


def _kind(seg: str) -> str:
    m = _INDEX.match(seg)
    if not m or m.group(2) is not None:
        return "dict"
    return "list" if m.group(3) is not None else "tuple"


def _key(seg: str):
    m = _INDEX.match(seg)
    return seg if not m else int(next(g for g in m.groups()[1:] if g is not None))


# ----------------------------------------------------------------------------- writing

def replaceable(out_dir: str | Path) -> bool:
    """Whether ``export_head`` may write ``out_dir``: it does not exist, or it is a
    directory holding nothing but an exported head's files (which it replaces)."""
    out = Path(out_dir)
    if not out.exists():
        return True
    ours = {HEAD_JSON, PARAMS, LEGACY_PARAMS, PARAMS + ".tmp"}
    return out.is_dir() and all(p.name in ours or p.name.startswith(f".{HEAD_JSON}.tmp-")
                                for p in out.iterdir())


def export_head(params: Any, out_dir: str | Path, meta: dict, dtype=jnp.bfloat16) -> Path:
    """Writes a head for inference into ``out_dir`` (replacing a head there): floating
    parameters cast to ``dtype`` (others as they are) in ``params.safetensors``, and
    ``meta`` with ``shapes``, ``dtypes``, ``params_sha256`` (the SHA-256 of
    ``params.safetensors``) and ``head_sha256`` (that of ``head.json``'s content:
    ``meta_sha256``) added in ``head.json``, both checked when the head is read. Returns
    the absolute directory. ``CheckpointError`` when ``out_dir`` holds something else.

    The head is written into a sibling temporary directory and then swapped in whole
    (``specjax._atomic.replace_dir``): a crash at any moment leaves the head that was there
    or the new one, and the next export names and removes what the crash left."""
    from specjax import _atomic

    out = Path(out_dir).absolute()
    _atomic.recover(out)  # a head a killed export moved aside is back before the check
    if not replaceable(out):
        raise CheckpointError(f"{out} exists and is not an exported head; refusing to "
                              f"overwrite it")
    cast = jax.tree.map(lambda x: np.asarray(jnp.asarray(x, dtype) if jnp.issubdtype(
        jnp.asarray(x).dtype, jnp.floating) else x), params)
    flat = flatten(cast)
    from safetensors.numpy import save_file

    shapes = jax.tree.map(lambda x: list(np.shape(x)), cast)
    try:
        with _atomic.replace_dir(out) as tmp:
            save_file(flat, tmp / PARAMS, metadata=FORMAT)
            _atomic.plain_mode(tmp / PARAMS)
            _sort_metadata(tmp / PARAMS)
            _write_meta_file(tmp / HEAD_JSON, {
                **meta, "shapes": shapes, "dtypes": {"float": jnp.dtype(dtype).name},
                SHA_KEY: file_sha256(tmp / PARAMS)})
    except _atomic.OutputError as e:
        raise CheckpointError(str(e)) from None
    return out


def _sort_metadata(f: Path) -> None:
    """Rewrites the safetensors header of ``f`` in place with its ``__metadata__`` keys
    sorted (the writer orders them at random), so the same parameters write the same
    bytes, and so the same ``params_sha256``. The header keeps its length."""
    import struct

    with open(f, "r+b") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        raw = fh.read(n)
        header = json.loads(raw)
        if isinstance(header.get("__metadata__"), dict):
            header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
        new = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        if len(new) <= n:  # as the writer's: compact JSON, padded with spaces
            fh.seek(8)
            fh.write(new + b" " * (n - len(new)))


SHA_KEY = "params_sha256"  # head.json: the SHA-256 of params.safetensors (hex)
HEAD_SHA_KEY = "head_sha256"  # head.json: the SHA-256 of its own content (``meta_sha256``)
_HEX = re.compile(r"^[0-9a-fA-F]{64}$")


def file_sha256(f: str | Path) -> str:
    """The SHA-256 of the file ``f``, as hex."""
    import hashlib

    h = hashlib.sha256()
    with open(f, "rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


# (path, device, inode, size, mtime, ctime) -> hex: a file checked before the target loads
# is not read again when it loads. Kept only for a file whose ctime (which every write and
# every utime sets to now) is older than _SETTLED_NS when hashed, so a later change of any
# kind gives another key.
_SHA_CACHE: dict[tuple, str] = {}
_SETTLED_NS = 2_000_000_000


def _identity(f: Path) -> tuple:
    st = os.stat(f)
    return (str(f.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def checked_sha256(f: str | Path) -> str:
    """``file_sha256(f)``, remembered for the file as it is now (a check before the target
    loads, then the load, read it once)."""
    import time

    f = Path(f)
    key = _identity(f)
    if key in _SHA_CACHE:
        return _SHA_CACHE[key]
    digest = file_sha256(f)
    if _identity(f) == key and time.time_ns() - key[5] > _SETTLED_NS:
        _SHA_CACHE[key] = digest
    return digest


def meta_sha256(meta: dict) -> str:
    """The SHA-256 ``head.json`` records of itself (``head_sha256``): that of ``meta``
    without the field, as compact JSON with sorted keys (so a change of any value, key or
    list order changes it; spacing and key order do not)."""
    import hashlib

    body = {k: v for k, v in meta.items() if k != HEAD_SHA_KEY}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _write_meta_file(f: Path, meta: dict) -> None:
    """``meta`` as ``head.json`` at ``f`` with its ``head_sha256`` (computed from the JSON
    as it reads back, so int keys and tuples count as they will be read)."""
    body = json.loads(json.dumps({k: v for k, v in meta.items() if k != HEAD_SHA_KEY}))
    f.write_text(json.dumps({**body, HEAD_SHA_KEY: meta_sha256(body)}, indent=1))


def write_meta(path: str | Path, meta: dict) -> Path:
    """Replaces the ``head.json`` of the exported head in ``path`` with ``meta`` and the
    ``head_sha256`` of its new content: how a deliberate edit of ``head.json`` is made (an
    edit by hand is refused when the head is read). ``params_sha256`` is kept as ``meta``
    gives it. Returns the file."""
    from specjax import _atomic

    f = Path(path).absolute() / HEAD_JSON
    if not f.is_file():
        raise CheckpointError(f"{f.parent} is not an exported head (no {HEAD_JSON})")
    tmp = _atomic.temp_path(f)
    try:
        _write_meta_file(tmp, meta)
        os.replace(tmp, f)
    finally:
        tmp.unlink(missing_ok=True)
    return f


def check_meta(meta_f: str | Path, meta: dict) -> None:
    """``CheckpointError`` (one line naming ``meta_f``) when ``head.json``'s ``meta``
    records a ``head_sha256`` its content no longer has (edited or damaged: heads exported
    before the field pass unchecked), or a ``vocab_ids`` that is not a list of distinct
    token ids (null passes: no vocabulary ranked)."""
    want = meta.get(HEAD_SHA_KEY)
    if want is not None:
        if not isinstance(want, str) or not _HEX.match(want):
            raise CheckpointError(f"{meta_f}: {HEAD_SHA_KEY} is {str(want)[:70]!r}, not a hex "
                                  f"SHA-256")
        if meta_sha256(meta) != want.lower():
            raise CheckpointError(
                f"{meta_f} was edited or is damaged: its content differs from the SHA-256 it "
                f"records ({HEAD_SHA_KEY}); export the head again (an edit on purpose is "
                f"written with specjax.heads.exported.write_meta)")
    ids = meta.get("vocab_ids")
    if ids is None:
        return
    if not isinstance(ids, list):
        raise CheckpointError(f"{meta_f}: vocab_ids is {str(ids)[:40]!r}, not a list of "
                              f"token ids")
    seen: dict[int, int] = {}
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise CheckpointError(f"{meta_f}: vocab_ids[{i}] is {t!r}, not a token id "
                                  f"(an integer >= 0)")
        if t in seen:
            raise CheckpointError(f"{meta_f}: vocab_ids holds token id {t} twice (at "
                                  f"{seen[t]} and {i}); a head drafts each id once")
        seen[t] = i


def check_sha256(head_dir: str | Path, meta: dict) -> None:
    """``CheckpointError`` (one line naming the file) when ``head.json``'s ``meta`` records
    a SHA-256 of ``params.safetensors`` that the file in ``head_dir`` no longer has; heads
    exported before the field was written pass unchecked."""
    want = meta.get(SHA_KEY)
    if want is None:
        return
    f = Path(head_dir).absolute() / PARAMS
    if not isinstance(want, str):
        raise CheckpointError(f"{f.parent / HEAD_JSON}: {SHA_KEY} is {want!r}, not a hex "
                              f"SHA-256")
    if f.is_file() and checked_sha256(f) != want.lower():
        raise CheckpointError(f"{f} is corrupt or truncated: its SHA-256 differs from the "
                              f"one {HEAD_JSON} records (export the head again)")


def check_files(path: str | Path, kind: str) -> dict:
    """``read_meta(path, kind)`` with ``params.safetensors`` checked against its SHA-256
    too: every file of the head, without reading the parameters (``head_dir_error`` runs
    it before the target loads). Returns the meta; ``CheckpointError`` (one line)."""
    meta = read_meta(path, kind)
    check_sha256(path, meta)
    return meta


# ----------------------------------------------------------------------------- reading

def read_kind(path: str | Path) -> str | None:
    """The ``kind`` an exported head's ``head.json`` names, or None (no readable one)."""
    try:
        meta = json.loads((Path(path) / HEAD_JSON).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return meta.get("kind") if isinstance(meta, dict) else None


def read_meta(path: str | Path, kind: str) -> dict:
    """``head.json`` of an exported head of ``kind``, checked (``check_meta``: its
    ``head_sha256``, its ``vocab_ids``); a one-line ``CheckpointError`` otherwise."""
    p = Path(path).absolute()
    meta_f = p / HEAD_JSON
    if not os.path.lexists(p):  # an export killed between its renames: its old head back
        from specjax import _atomic

        _atomic.recover(p)
    if not meta_f.exists():
        raise CheckpointError(f"{p} is not an exported head (no {HEAD_JSON})")
    try:
        meta = json.loads(meta_f.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{meta_f} is corrupt: {e}") from e
    if isinstance(meta, dict):
        check_meta(meta_f, meta)  # edited or damaged, or an unusable vocabulary
    if not isinstance(meta, dict) or meta.get("kind") != kind:
        got = meta.get("kind") if isinstance(meta, dict) else None
        raise CheckpointError(f"{p} holds a {got!r} head, not {kind!r}")
    return meta


def load_head(path: str | Path, kind: str, like: Any | None = None, *,
              mesh: Mesh | None = None, specs: Any | None = None) -> tuple[Any, dict]:
    """``(params, meta)`` of the exported head of ``kind`` in ``path``: the parameters in
    the dtypes they were saved in, with the tree structure they were saved with.

    Placement: without ``mesh`` every array is on JAX's default device (uncommitted, so
    it follows the arrays it is used with); with ``mesh`` each array is placed with
    ``NamedSharding(mesh, spec)``, ``spec`` taken from ``specs`` (a ``PartitionSpec``
    pytree shaped like the parameters, e.g. ``sharding.param_specs``' output) or ``P()``
    (replicated on every device of the mesh) when ``specs`` is None.

    ``CheckpointError`` when ``path`` is not a head of ``kind``, its files are corrupt or
    truncated (``head.json`` and ``params.safetensors`` are checked against the SHA-256s
    ``head.json`` records, where it records them: ``check_meta``, ``check_sha256``), or
    (given ``like``) its parameter names and shapes differ from ``like``'s."""
    p = Path(path).absolute()
    meta = read_meta(p, kind)
    if (p / PARAMS).is_file():
        check_sha256(p, meta)
        params = _read_safetensors(p / PARAMS)
    elif (p / LEGACY_PARAMS).is_dir():
        params = _read_orbax(p / LEGACY_PARAMS)
    else:
        raise CheckpointError(f"{p} has {HEAD_JSON} but no parameters ({PARAMS})")
    _check_shapes(p, params, like)
    return place(params, mesh, specs), meta


def place(params: Any, mesh: Mesh | None = None, specs: Any | None = None) -> Any:
    """Host arrays ``params`` on devices, as ``load_head`` documents."""
    if mesh is None:
        return jax.tree.map(jax.device_put, params)
    from specjax import sharding

    if specs is None:
        return jax.tree.map(lambda x: sharding.place(x, NamedSharding(mesh, P())), params)
    return jax.tree.map(lambda x, s: sharding.place(x, NamedSharding(mesh, s)), params, specs)


def _shapes(tree) -> dict[str, tuple[int, ...]]:
    return {k: tuple(np.shape(v)) for k, v in flatten(tree).items()}


def _check_shapes(p: Path, params: Any, like: Any | None) -> None:
    if like is None:
        return
    want, got = _shapes(like), _shapes(params)
    if want != got:
        diff = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
        raise CheckpointError(
            f"{p} was exported for another model: its shapes differ from what this target "
            f"needs (" + ", ".join(f"{k}: saved {got.get(k)}, needed {want.get(k)}"
                                   for k in diff[:4]) + ")")


def _read_safetensors(f: Path) -> Any:
    """The parameter tree in ``f`` as host arrays; ``CheckpointError`` when ``f`` is not a
    complete safetensors file of a head."""
    from safetensors import safe_open

    try:
        with safe_open(f, framework="np") as st:
            flat = {k: np.array(st.get_tensor(k)) for k in st.keys()}
        if not flat:
            raise ValueError("it holds no tensors")
        return unflatten(flat)
    except Exception as e:  # safetensors raises its own error type for corrupt headers
        raise CheckpointError(f"cannot read the parameters in {f}: corrupt or truncated "
                              f"({type(e).__name__}: {str(e)[:300]})") from e


def _read_orbax(d: Path) -> Any:
    """The parameters of a head exported as an Orbax checkpoint, as host arrays. Restored
    onto this host's CPU with an explicit sharding, so the device the head was saved from
    (recorded in ``_sharding``, e.g. ``cuda:0``) does not matter."""
    import orbax.checkpoint as ocp

    d = Path(d).absolute()  # Orbax needs an absolute path
    try:
        host = jax.devices("cpu")[0]
    except RuntimeError:  # JAX_PLATFORMS without cpu
        host = jax.devices()[0]
    cpu = jax.sharding.SingleDeviceSharding(host)
    try:
        with ocp.StandardCheckpointer() as ckpt:
            saved = ckpt.metadata(d).item_metadata.tree
            target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=cpu),
                                  saved)
            restored = ckpt.restore(d, target)
        return jax.tree.map(np.asarray, restored)
    except Exception as e:  # Orbax raises many types for corrupt or incomplete trees
        raise CheckpointError(f"cannot read the parameters in {d}: corrupt or incomplete "
                              f"({type(e).__name__}: {str(e)[:300]})") from e


__all__ = ["CheckpointError", "export_head", "replaceable", "file_sha256", "check_sha256",
           "checked_sha256", "meta_sha256", "check_meta", "check_files", "write_meta",
           "read_meta", "read_kind", "load_head", "place", "flatten", "unflatten",
           "HEAD_JSON", "PARAMS", "SHA_KEY", "HEAD_SHA_KEY"]
