"""The resumable training loop every head uses: Orbax checkpoints, progress and a log.

``resume`` opens a run directory (refusing one made for another configuration) and restores
the latest checkpoint; ``run_steps`` trains to a step count, saving every ``save_every``
steps and at the end. Batches must be a function of the step alone (the callers derive them
from the seed and the step), so a run killed after a checkpoint resumes to the same
parameters as one that never stopped.

On a mesh (``on_mesh``; every trainer's ``mesh=``) the target is sharded as for decoding,
each batch's rows are split over ``data`` and the optimizer state is sharded ZeRO-1 style
(``zero_spec``: each moment over the whole mesh, or over ``data``, along its first axis that
divides); the head's parameters stay replicated. XLA's partitioner runs the same program,
so a sharded run reaches the one-device parameters up to float rounding
(``tests/test_sharding.py``). Checkpoints hold whole arrays and resume onto any mesh.

Multi-process (``specjax.distributed``: the mesh spans every process's devices): every
process runs the same trainer on the same inputs. Host values reach the mesh through
``specjax.sharding.place`` (each process makes only its own slices), values read back on
the host pass through :func:`host` first (an all-gather where they span processes), Orbax
saves and restores the global state with every process taking part, and the run's own
files (``log.jsonl``, ``run.json``) are written by process 0 alone. The result equals the
one-process run on the same mesh up to float rounding
(``tests/test_multiprocess_train.py``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from specjax import sharding
from specjax.sharding import DATA, MODEL
from specjax.train import checkpoint


def on_mesh(mesh, target, tparams, state: dict) -> tuple[Any, dict]:
    """Training on ``mesh``: the target's weights split as for decoding
    (``specjax.sharding.shard_params``) and the training state placed by :func:`state_specs`
    (the optimizer state split ZeRO-1 style, the rest replicated); batches split over
    ``data`` (:func:`batch_on`), XLA sums the gradients over it. Unchanged without a
    mesh."""
    if mesh is None:
        return tparams, state
    return sharding.shard_params(target.config, tparams, mesh), shard_state(mesh, state)


def zero_spec(shape: tuple[int, ...], mesh) -> P:
    """Where one optimizer-state leaf of ``shape`` lives (ZeRO-1): its first axis that the
    whole mesh (``data x model`` devices) divides is split over both axes; else its first
    axis that ``data`` divides, over ``data``; else (scalars, odd sizes) it is replicated.
    A function of the shape alone, so the same inside and outside ``jit``."""
    d, m = sharding.axis_size(mesh, DATA), sharding.axis_size(mesh, MODEL)
    split = tuple(a for a, n in ((DATA, d), (MODEL, m)) if n > 1)
    choices = [(split[0] if len(split) == 1 else split, d * m)] if split else []
    if d > 1 and m > 1:
        choices.append((DATA, d))
    for axes, n in choices:
        for i, size in enumerate(shape):
            if size % n == 0:
                return P(*(None,) * i, axes)
    return P()


def state_specs(mesh, state: dict) -> dict:
    """A ``PartitionSpec`` per leaf of a training state ``{params, opt_state, step, ...}``:
    ``opt_state``'s leaves (Adam's moments) by :func:`zero_spec`, everything else
    replicated (the head's parameters are read whole by every ``data`` replica; its
    update is computed on the moments' shards and gathered)."""
    return {k: jax.tree.map(lambda x: zero_spec(np.shape(x), mesh), v) if k == "opt_state"
            else jax.tree.map(lambda x: P(), v) for k, v in state.items()}


def shard_state(mesh, state: dict) -> dict:
    """``state`` placed on ``mesh`` by :func:`state_specs`; unchanged without a mesh."""
    if mesh is None:
        return state
    return jax.tree.map(lambda x, s: sharding.place(x, NamedSharding(mesh, s)), state,
                        state_specs(mesh, state))


def constrain_state(mesh, state: dict) -> dict:
    """Inside a jitted step: the new state pinned to :func:`state_specs`, so every step
    returns the layout it was given (one compile, the moments never gathered). Unchanged
    without a mesh."""
    if mesh is None:
        return state
    return jax.tree.map(
        lambda x, s: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, s)), state,
        state_specs(mesh, state))


def batch_on(mesh, batch: tuple) -> tuple:
    """A batch (arrays with rows first, the loss mask among them) with its rows split over
    the ``data`` axis, padded with zero rows to a multiple of it; a zero row's mask is zero,
    so it adds nothing to a masked mean. Unchanged without a mesh."""
    if mesh is None:
        return batch
    pad = (-batch[0].shape[0]) % int(mesh.shape[sharding.DATA])
    if pad:
        batch = tuple(np.concatenate([x, np.zeros((pad,) + x.shape[1:], x.dtype)])
                      for x in batch)
    return tuple(sharding.rows(mesh, np.asarray(x)) for x in batch)


def replicated(mesh, x):
    """``x`` (a host array, or None) copied to every device of ``mesh``
    (``sharding.replicated``: each process places its own copies); without a mesh, a
    ``jax.Array`` on the default device."""
    if x is None:
        return None
    return jax.numpy.asarray(x) if mesh is None else sharding.replicated(mesh, np.asarray(x))


def host(tree):
    """``tree`` with every array as numpy, readable on every process: arrays spanning
    processes are gathered first (``sharding.gather``, a collective: every process must
    call it, with the same tree)."""
    return jax.tree.map(np.asarray, sharding.gather(tree))


def resume(run_dir: str | Path, meta: dict, fresh: dict, mesh=None) -> tuple[dict, Any]:
    """``(state, manager)``: the latest checkpoint in ``run_dir``, or ``fresh`` (a dict with
    ``params``, ``opt_state`` and ``step``) if there is none. With ``mesh``, the state is
    placed by :func:`shard_state` (restored straight onto those shardings: each process
    reads only its own slices), whatever mesh or process count saved it."""
    run = Path(run_dir)
    fresh = shard_state(mesh, fresh)
    checkpoint.check_run(run, meta)
    with checkpoint.quiet_absl():  # a corrupt checkpoint is reported once, by restore_latest
        mngr = checkpoint.manager(run)
    try:
        got = checkpoint.restore_latest(mngr, fresh)
    except BaseException:
        mngr.close()
        raise
    return (fresh if got is None else got[1]), mngr


class RunLog:
    """``run_dir/log.jsonl``, one JSON row per call. ``rewind(step)`` drops the rows a killed
    run wrote after its last checkpoint (rows whose ``key``, the step by default, lies past
    it), so a resumed log matches the checkpoint it continues from. Only process 0 of a
    multi-process run writes (``checkpoint.is_main``); elsewhere both are no-ops."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / "log.jsonl"
        self.main = checkpoint.is_main()
        if self.main:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def __call__(self, row: dict) -> None:
        if not self.main:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")

    def rewind(self, step: int, key: str = "step") -> None:
        if not self.main or not self.path.exists():
            return
        rows = []
        for line in self.path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by the kill
                continue
            if row.get(key, 0) <= step:
                rows.append(line)
        tmp = self.path.with_name("log.jsonl.tmp")
        tmp.write_text("".join(r + "\n" for r in rows))
        tmp.replace(self.path)


def run_steps(state: dict, step: Callable[[dict, int], tuple[dict, dict]], mngr, *,
              steps: int, save_every: int, stop_after: int | None = None, progress=None,
              log: Callable[[dict], Any] | None = None,
              on_save: Callable[[dict], dict] | None = None) -> dict:
    """Runs ``state, metrics = step(state, s)`` from the state's step up to ``steps``
    (or ``stop_after`` more), checkpointing; ``on_save(state)`` adds validation metrics to
    the log at every checkpoint (called on every process: it may run collectives). The manager is closed on return and on any error, after
    its pending writes finish (``checkpoint.closing``): the last checkpoint saved is
    complete on disk."""
    start = int(state["step"])
    end = steps if stop_after is None else min(steps, start + stop_after)
    if isinstance(log, RunLog):
        log.rewind(start)
    if progress is not None:
        progress.update(start)
    t0, seen = time.perf_counter(), 0.0
    with checkpoint.closing(mngr):
        for s in range(start, end):
            state, m = step(state, s)
            m = sharding.gather(m) if log is not None or progress is not None else m
            if log is not None:
                log({"step": s + 1, **{k: float(v) for k, v in m.items()},
                     "seconds": round(time.perf_counter() - t0, 1)})
            if progress is not None:
                progress.update(1)
                post = {k: f"{float(v):.3f}" for k, v in m.items() if k in ("loss", "acc")}
                if "tokens" in m:  # the step's loss-covered tokens: training tokens/s
                    seen += float(m["tokens"])
                    post["tok/s"] = f"{seen / (time.perf_counter() - t0):.0f}"
                progress.set_postfix(post)
            if (s + 1) % save_every == 0 or s + 1 == end:
                mngr.save(s + 1, args=checkpoint.ocp.args.StandardSave(state), force=True)
                if on_save is not None and log is not None:  # log: a no-op off process 0
                    log({"step": s + 1, **on_save(state)})
    return state
