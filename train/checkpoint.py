"""Orbax checkpoints of training runs, with resume.

A run directory holds ``run.json`` (what is being trained: a mismatch is refused) and an
Orbax ``CheckpointManager`` tree of ``{params, opt_state, step}``. Exported heads (what
inference loads) are written and read per kind by ``specjax.head_io``, on
``specjax.export``'s layout; export's functions are re-exported here.

In a multi-process run (``specjax.distributed``) every process calls the same functions
with the same arguments: Orbax saves the global arrays together (each process writes the
shards it holds; process 0 commits the step once all have written, so an unfinished step
is never ``latest_step``), and the run's own files (``run.json``) are written by process 0
alone (:func:`is_main`), the others waiting at a :func:`barrier`. The run directory must
then be one shared filesystem path for every process.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from specjax.export import CheckpointError, export_head, load_head, read_meta  # noqa: F401


def _abstract(tree):
    """The restore target of ``tree``: each leaf's shape, dtype and sharding (a ``jax.Array``'s
    own, else the default device's). Orbax needs the sharding: without it, it falls back to
    the one recorded at save time, and a run saved on another device (``cpu:0`` read on a
    GPU) fails with a topology mismatch."""
    def leaf(x):
        a = x if isinstance(x, jax.Array) else jnp.asarray(x)
        return jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=a.sharding)

    return jax.tree.map(leaf, tree)


def is_main() -> bool:
    """Whether this process writes a run's own files (process 0; always, in one process)."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Waits until every process of a multi-process run reaches the barrier ``name``
    (``multihost_utils.sync_global_devices``); returns at once in a one-process run."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"specjax:{name}")


def check_run(run_dir: Path, meta: dict) -> None:
    """Writes ``run.json``, or refuses a run directory made for a different configuration:
    a field that differs, or that one side records and the other does not (a config field
    recorded only away from its default, such as ``eagle.run_fields``' ``head_layers``).
    Every process compares before any writes; process 0 alone writes, and every process
    returns once it has (:func:`barrier`)."""
    meta = json.loads(json.dumps(meta))  # tuples compare as the lists they are saved as
    f = run_dir / "run.json"
    if f.exists():
        old = json.loads(f.read_text())
        diff = {k: (old.get(k), meta.get(k)) for k in sorted(meta.keys() | old.keys())
                if old.get(k) != meta.get(k)}
        if diff:
            raise CheckpointError(f"{run_dir} holds a run with a different configuration "
                                  f"(field: (saved, requested)) {diff}; use another directory")
    barrier("check_run: compared")  # nobody reads run.json while process 0 writes it
    if is_main():
        run_dir.mkdir(parents=True, exist_ok=True)
        if not f.exists():
            _write_atomic(f, json.dumps(meta, indent=2, sort_keys=True))
    barrier("check_run: written")


def _write_atomic(path: Path, text: str) -> None:
    """``path`` holding ``text``, written under a temporary name and renamed."""
    tmp = path.with_name(f"tmp_{path.name}")
    tmp.write_text(text)
    tmp.replace(path)


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


def latest_step(run_dir: str | Path) -> int:
    """The step of the latest complete checkpoint in ``run_dir`` (0 for none), read without
    creating anything; unfinished ``*.orbax-checkpoint-tmp`` directories do not count."""
    ckpt = Path(run_dir) / "ckpt"
    return max(ocp.utils.checkpoint_steps(ckpt), default=0) if ckpt.is_dir() else 0


def finish(mngr: ocp.CheckpointManager) -> None:
    """Waits for ``mngr``'s pending writes, so every checkpoint it saved is complete on
    disk, then closes it."""
    mngr.wait_until_finished()
    mngr.close()


@contextlib.contextmanager
def closing(mngr: ocp.CheckpointManager):
    """``finish(mngr)`` when the block ends, on success or on any error: the last save
    before an error is complete on disk and no write is left in flight. An error while
    finishing does not hide the block's own error."""
    try:
        yield mngr
    except BaseException:
        with contextlib.suppress(Exception):
            finish(mngr)
        raise
    finish(mngr)
