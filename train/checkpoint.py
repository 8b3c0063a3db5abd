"""Orbax checkpoints for draft heads: training state with resume, and exported heads.

A run directory holds ``run.json`` (what is being trained: a mismatch is refused) and an
Orbax ``CheckpointManager`` tree of ``{params, opt_state, step}``. An exported head is a
directory with ``head.json`` (kind, target, metadata) and the parameters as an Orbax
checkpoint in ``params/``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: corrupt, or made for something else."""


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.asarray(x).dtype), tree)


def check_run(run_dir: Path, meta: dict) -> None:
    """Writes ``run.json``, or refuses a run directory made for a different configuration."""
    run_dir.mkdir(parents=True, exist_ok=True)
    meta = json.loads(json.dumps(meta))  # tuples compare as the lists they are saved as
    f = run_dir / "run.json"
    if f.exists():
        old = json.loads(f.read_text())
        diff = {k: (old.get(k), v) for k, v in meta.items() if old.get(k) != v}
        if diff:
            raise CheckpointError(f"{run_dir} holds a run with a different configuration "
                                  f"(field: (saved, requested)) {diff}; use another directory")
    else:
        f.write_text(json.dumps(meta, indent=2, sort_keys=True))


def manager(run_dir: Path, keep: int = 2) -> ocp.CheckpointManager:
    opts = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
    return ocp.CheckpointManager((run_dir / "ckpt").absolute(), options=opts)


@contextlib.contextmanager
def quiet_absl():
    """Silences Orbax's own log lines while it reads a checkpoint; failures surface as one
    ``CheckpointError`` instead."""
    log = logging.getLogger("absl")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


def restore_latest(mngr: ocp.CheckpointManager, like: Any) -> tuple[int, Any] | None:
    """The latest ``(step, state)`` shaped like ``like``, or None for a fresh run."""
    with quiet_absl():
        step = mngr.latest_step()
        if step is None:
            return None
        try:
            state = mngr.restore(step, args=ocp.args.StandardRestore(_abstract(like)))
        except Exception as e:  # orbax raises many types for corrupt or mismatched trees
            raise CheckpointError(
                f"cannot restore step {step} from {mngr.directory}: it is corrupt or was saved "
                f"for another head ({type(e).__name__}: {str(e)[:200]}); remove "
                f"{Path(mngr.directory) / str(step)} to resume from the checkpoint before it"
            ) from e
    return step, state


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
