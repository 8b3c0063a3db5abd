"""Orbax checkpoints of training runs, with resume.

A run directory holds ``run.json`` (what is being trained: a mismatch is refused) and an
Orbax ``CheckpointManager`` tree of ``{params, opt_state, step}``. Exported heads (what
inference loads) are written and read per kind by ``specjax.heads``, on
``specjax.heads.exported``' layout; its functions are re-exported here.

In a multi-process run (``specjax.distributed``) every process calls the same functions
with the same arguments: Orbax saves the global arrays together (each process writes the
shards it holds; process 0 commits the step once all have written, so an unfinished step
is never ``latest_step``), and the run's own files (``run.json``) are written by process 0
alone (:func:`is_main`), the others waiting at a :func:`barrier`. The run directory must
then be one shared filesystem path for every process.

Orbax keeps no checksums, so each step proves it is whole with a manifest,
``<step>/specjax_sha256.json``: the SHA-256 of every file in the step's directory, written
by process 0 once the save has committed (when the manager next waits for its writes: at
the next save, a ``wait_until_finished`` or ``close``). Before a restore every process
checks the latest step against its manifest; a damaged step (a file missing, added, or not
matching) is moved to ``ckpt-damaged/<step>`` beside ``ckpt/`` by process 0, with one
line saying so on stderr, and the run resumes from the step before it (or refuses in one
line when no whole step is left). A step without a manifest (saved before manifests
existed, or by a run killed between the commit and the manifest) is accepted as Orbax
wrote it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from specjax.heads.exported import (CheckpointError, export_head, file_sha256,  # noqa: F401
                                    load_head, read_meta)


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
    old = read_run(run_dir)
    if old is not None:
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


def read_run(run_dir: str | Path) -> dict | None:
    """``run_dir/run.json`` (None where there is none); ``CheckpointError`` naming it, and
    what to do, when it is not a JSON object."""
    f = Path(run_dir) / "run.json"
    if not f.is_file():
        return None
    try:
        got = json.loads(f.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        got = e
    if not isinstance(got, dict):
        what = (f"not readable JSON ({got})" if isinstance(got, Exception)
                else f"a JSON {type(got).__name__}, not an object")
        raise CheckpointError(f"{f} is {what}: the run's record is damaged; restore it, or "
                              "use another --run directory (or delete it, if the "
                              "checkpoints beside it are of this configuration)")
    return got


def _write_atomic(path: Path, text: str) -> None:
    """``path`` holding ``text``, written under a temporary name and renamed."""
    tmp = path.with_name(f"tmp_{path.name}")
    tmp.write_text(text)
    tmp.replace(path)


MANIFEST = "specjax_sha256.json"  # in each step's directory
_TMP_MANIFEST = "tmp_" + MANIFEST


def _step_files(step_dir: Path) -> dict[str, Path]:
    """Every file under ``step_dir`` but its manifest, by path relative to it."""
    return {p.relative_to(step_dir).as_posix(): p for p in sorted(step_dir.rglob("*"))
            if p.is_file() and p.name not in (MANIFEST, _TMP_MANIFEST)}


def write_manifest(step_dir: Path) -> None:
    """``step_dir/specjax_sha256.json``: the SHA-256 of every other file in the committed
    step ``step_dir`` (written under a temporary name and renamed)."""
    files = {k: file_sha256(p) for k, p in _step_files(step_dir).items()}
    tmp = step_dir / _TMP_MANIFEST
    tmp.write_text(json.dumps({"files": files}, indent=1, sort_keys=True))
    tmp.replace(step_dir / MANIFEST)


def check_manifest(step_dir: Path) -> str | None:
    """What is wrong with the step ``step_dir`` by its manifest (None: it is whole, or has
    no manifest)."""
    f = step_dir / MANIFEST
    if not f.is_file():
        return None
    try:
        want = json.loads(f.read_text())["files"]
        assert isinstance(want, dict) and all(isinstance(v, str) for v in want.values())
    except (ValueError, UnicodeDecodeError, KeyError, TypeError, AssertionError):
        return f"its manifest {MANIFEST} is not readable"
    have = _step_files(step_dir)
    for name in sorted(want.keys() | have.keys()):
        if name not in have:
            return f"{name} is missing"
        if name not in want:
            return f"{name} is not in its manifest"
        if file_sha256(have[name]) != want[name]:
            return f"{name} does not match its SHA-256 in {MANIFEST}"
    return None


class Manager(ocp.CheckpointManager):
    """An Orbax ``CheckpointManager`` whose saves each get a checksum manifest
    (:func:`write_manifest`) once committed: process 0 writes those of the steps this
    manager saved whenever it waits for its writes (which every save, ``close`` and
    :func:`finish` do)."""

    def __init__(self, *a, **kw):
        self._unproved: list[int] = []
        super().__init__(*a, **kw)

    def save(self, step, *a, **kw):
        saved = super().save(step, *a, **kw)
        if saved:
            self._unproved.append(int(step))
        return saved

    def wait_until_finished(self):
        super().wait_until_finished()
        todo, self._unproved = self._unproved, []
        if not is_main():
            return
        for step in todo:
            d = Path(self.directory) / str(step)
            if d.is_dir():  # else deleted already (max_to_keep)
                write_manifest(d)


def manager(run_dir: Path, keep: int = 2) -> ocp.CheckpointManager:
    opts = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
    return Manager((run_dir / "ckpt").absolute(), options=opts)


def _damaged_steps(root: Path, steps) -> list[tuple[int, str]]:
    """``(step, why)`` for the steps in ``root`` that their manifests show damaged, newest
    first, up to the first whole one; ``CheckpointError`` when none is whole."""
    damaged = []
    for step in sorted(steps, reverse=True):
        why = check_manifest(root / str(step))
        if why is None:
            return damaged
        damaged.append((step, why))
    if damaged:
        steps = "; ".join(f"step {s}: {why}" for s, why in damaged)
        dirs = " and ".join(str(root / str(s)) for s, _ in damaged)
        raise CheckpointError(f"every checkpoint in {root} is corrupt ({steps}); remove "
                              f"{dirs} to train from the start")
    return damaged


def check_steps(run_dir: str | Path) -> None:
    """Before any model loads: ``CheckpointError`` when ``run_dir/ckpt`` holds steps and
    every one is damaged by its manifest (the refusal :func:`restore_latest` would give
    after the loading). Reads the files only; a run with a whole step, or none, passes."""
    root = (Path(run_dir) / "ckpt").absolute()
    if root.is_dir():
        _damaged_steps(root, [int(d.name) for d in root.iterdir()
                              if d.is_dir() and d.name.isdigit()])


def _set_aside_damaged(mngr: ocp.CheckpointManager) -> None:
    """Checks the latest steps against their manifests, newest first, until one is whole
    (or has none); each damaged one is moved to ``ckpt-damaged/`` by process 0, saying so,
    and ``mngr`` reloaded. ``CheckpointError`` when no whole step is left."""
    root = Path(mngr.directory)
    damaged = _damaged_steps(root, mngr.all_steps())
    if not damaged:
        return
    barrier("checkpoint: checked")  # every process has read the damaged steps
    if is_main():
        aside = root.parent / "ckpt-damaged"
        aside.mkdir(exist_ok=True)
        for step, why in damaged:
            dest = aside / str(step)
            if dest.exists():
                shutil.rmtree(dest)
            (root / str(step)).rename(dest)
            print(f"specjax: warning: checkpoint step {step} in {root} is damaged ({why}); "
                  f"moved to {dest}, resuming from the step before it", file=sys.stderr,
                  flush=True)
    barrier("checkpoint: set aside")
    mngr.reload()


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
    """The latest whole ``(step, state)`` shaped like ``like``, or None for a fresh run.
    Steps that their manifests show damaged are set aside first (the run falls back to
    the step before, saying so)."""
    with quiet_absl():
        _set_aside_damaged(mngr)
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
