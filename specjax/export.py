"""Exported draft heads on disk: a directory with ``head.json`` (kind, target, shapes,
metadata) and the parameters as an Orbax checkpoint in ``params/``.

The inference side (``specjax.drafters.eagle``, ``specjax.drafters.exit_heads``) loads heads from here and
never imports the training package; training writes them with ``export_head``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: corrupt, or made for something else."""


def shipped_dir(rel: str | None):
    """The package-data directory ``rel`` of a shipped head when it holds ``head.json``,
    else None."""
    from importlib import resources

    if rel is None:
        return None
    p = resources.files("specjax").joinpath(rel)
    return p if p.joinpath("head.json").is_file() else None


def export_head(params: Any, out_dir: str | Path, meta: dict, dtype=jnp.bfloat16) -> Path:
    """Writes a head for inference: parameters cast to ``dtype`` and ``head.json``."""
    out = Path(out_dir).absolute()
    if out.exists():
        if any(out.iterdir()) and not (out / "head.json").exists():
            raise CheckpointError(f"{out} exists and is not an exported head; refusing to "
                                  f"overwrite it")
        shutil.rmtree(out)
    out.mkdir(parents=True)
    cast = jax.tree.map(lambda x: jnp.asarray(x, dtype) if jnp.issubdtype(
        jnp.asarray(x).dtype, jnp.floating) else jnp.asarray(x), params)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(out / "params", cast)
    done = out / "params" / "commit_success.txt"
    if done.exists():  # Orbax writes this machine's absolute path into it; keep heads portable
        done.write_text("Checkpoint commit was successful.\n")
    shapes = jax.tree.map(lambda x: list(np.shape(x)), cast)
    (out / "head.json").write_text(json.dumps(
        {**meta, "shapes": shapes, "dtypes": {"float": jnp.dtype(dtype).name}}, indent=1))
    return out


def read_meta(path: str | Path, kind: str) -> dict:
    """``head.json`` of an exported head of ``kind``; a clear error otherwise."""
    p = Path(path).absolute()
    meta_f = p / "head.json"
    if not meta_f.exists():
        raise CheckpointError(f"{p} is not an exported head (no head.json)")
    try:
        meta = json.loads(meta_f.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{meta_f} is corrupt: {e}") from e
    if meta.get("kind") != kind:
        raise CheckpointError(f"{p} holds a {meta.get('kind')!r} head, not {kind!r}")
    return meta


def load_head(path: str | Path, kind: str, like: Any | None = None) -> tuple[Any, dict]:
    """Parameters and metadata of an exported head of ``kind``; clear errors when the
    directory is not one, is corrupt, or does not match ``like``'s shapes."""
    p = Path(path).absolute()
    meta = read_meta(p, kind)
    if like is not None:
        want = jax.tree.map(lambda x: list(np.shape(x)), like)
        if want != meta.get("shapes"):
            raise CheckpointError(f"{p} was exported for another model: its shapes differ "
                                  f"from what this target needs")
    try:
        with ocp.StandardCheckpointer() as ckpt:
            if like is None:
                params = ckpt.restore(p / "params")
            else:  # restore onto this host's default device, in the saved dtypes
                saved = meta.get("dtypes") or {}
                target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
                    np.shape(x), jnp.dtype(saved.get("float", "bfloat16"))
                    if jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)
                    else jnp.asarray(x).dtype), like)
                params = ckpt.restore(p / "params", target)
    except Exception as e:
        raise CheckpointError(f"cannot read the parameters in {p / 'params'}: corrupt or "
                              f"incomplete ({type(e).__name__}: {str(e)[:300]})") from e
    return params, meta


__all__ = ["CheckpointError", "export_head", "read_meta", "load_head"]
