"""Training across processes: ``specjax train eagle --mesh data=2,model=2`` run as 2 JAX
processes of 2 simulated CPU devices each (``specjax.distributed.launch``, gloo
collectives) is one data- and model-parallel run: its losses and parameters equal the
one-process run on the same global batches, its Orbax checkpoints restore in one process
and one process's checkpoints resume in two, and the run's own files are written once.

Tolerance: losses and parameters equal the one-device run to 1e-5, absolute, with no
relative slack (rtol 0), as tests/test_sharding.py states for one process of simulated
devices: the sharded reductions (gradients summed over ``data``, the Megatron
all-reduces over ``model``) round differently in float32, nothing else differs. Measured
on this toy after 3 steps: under 1e-6 (losses and parameters).

The processes run ``tests/mp_train_cli.py`` (the CLI with the toy target of
tests/test_train.py in place of ``specjax.models.load``); the one-process reference runs
here, unsharded (tests/test_sharding.py proves one process on a mesh equals it).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import mp_train_cli
from specjax import distributed
from specjax.train import checkpoint, distill, glue, loop
from specjax.train import eagle as train_eagle

TOL = 1e-5  # absolute, rtol 0: float32 rounding of the sharded reductions (see above)
STEPS = 3
HERE = Path(__file__).resolve().parent


def _argv(data: Path, run: Path, steps: int = STEPS, save_every: int = 1, export=None):
    """``specjax train eagle`` on the toy: 3 steps of 2-6 rows, no input noise (its shape
    would follow the padding rows a ``data`` axis adds), 4 held-out examples scored at
    every checkpoint."""
    argv = ["train", "eagle", "--model", "toy", "--data", str(data), "--run", str(run),
            "--batch-tokens", "256", "--max-len", "64", "--steps", str(steps),
            "--save-every", str(save_every), "--noise", "0", "--lr", "1e-2", "--warmup", "1",
            "--val-examples", "4"]
    return argv + (["--export", str(export)] if export else [])


def _config(argv) -> train_eagle.TrainConfig:
    """The ``TrainConfig`` the CLI builds from ``argv``."""
    from specjax import cli

    return glue.from_args(train_eagle.TrainConfig, cli.build_parser().parse_args(argv))


def _meta(data: Path) -> dict:
    """What ``specjax train eagle`` records in ``run.json`` besides the config."""
    return {"model": "toy", "data": data.name, "init": None}


def _launch(tmp: Path, *commands, processes: int = 2, timeout: float = 300):
    """``commands`` (CLI argument lists) run one after another in each of ``processes``
    processes of one run, on ``--mesh data=2,model=2``; every process must exit 0."""
    argv = [sys.executable, str(HERE / "mp_train_cli.py")]
    for i, c in enumerate(commands):
        argv += (["--then"] if i else []) + [
            *c, "--mesh", "data=2,model=2", "--coordinator", "{coordinator}",
            "--num-processes", "{num_processes}", "--process-id", "{process_id}"]
    results = distributed.launch(argv, processes, devices=4 // processes, timeout=timeout,
                                 log_dir=tmp / "logs")
    for r in results:
        assert r.returncode == 0, f"process {r.process_id}: exit {r.returncode}\n" \
                                  f"{r.output[-5000:]}"
    return results


def _log(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()]


def _restore(run: Path, like: dict) -> dict:
    """The latest checkpoint of ``run``, restored here (one process, one device)."""
    mngr = checkpoint.manager(run)
    try:
        got = checkpoint.restore_latest(mngr, like)
    finally:
        mngr.close()
    assert got is not None, f"no checkpoint in {run}"
    return got[1]


def _max_diff(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x, np.float32) - np.asarray(y, np.float32))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def _close(ref, got) -> None:
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                                                         rtol=0, atol=TOL), ref, got)


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """``(lm, corpus, data dir)``: tests/test_train.py's toy and a distilled corpus of 24
    examples, written as a corpus directory the processes read."""
    lm = mp_train_cli.toy_lm()
    v = lm.model.config.vocab_size
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(1, v, size=n)) for n in rng.integers(3, 20, size=24)]
    corpus = distill.answer_batch(lm, prompts, max_new_tokens=24)
    data = tmp_path_factory.mktemp("corpus")
    distill.save_shard(data / "shard_00000.npz", corpus)
    return lm, distill.load_shards(data), data


def _train_here(toy, run: Path, argv, **kw) -> dict:
    """``train_eagle.train`` in this process (one device, no mesh), as the CLI runs it."""
    lm, corpus, data = toy
    return train_eagle.train(lm.model, lm.params, corpus, _config(argv), run,
                             meta=_meta(data), **kw)


def _fresh(toy, argv) -> dict:
    """A state of the run's shape (the restore target)."""
    lm, _, _ = toy
    cfg = _config(argv)
    params = train_eagle.eagle.init_head(lm.model.config, jax.random.key(cfg.seed))
    opt = train_eagle.optimizer(cfg)
    return {"params": params, "opt_state": opt.init(params),
            "step": jax.numpy.asarray(0, jax.numpy.int32)}


def test_two_processes_train_eagle_as_one(toy, tmp_path):
    """3 steps on 2 processes x 2 devices (``data=2,model=2``) from scratch, and, in the same
    processes, a run resumed from a one-process checkpoint (step 2, with a half-written
    step-3 directory beside it): losses, held-out scores and parameters equal the
    one-process run's to ``TOL``; the 2-process checkpoint restores in one process and a
    one-process run resumes from it to the same parameters; ``log.jsonl`` holds one row per
    step (process 0 alone writes) and the export is written once."""
    lm, corpus, data = toy
    ref_run, mp_run, from_one, from_two = (tmp_path / n for n in ("ref", "mp", "one", "two"))
    ref = _train_here(toy, ref_run, _argv(data, ref_run), log=loop.RunLog(ref_run))
    assert int(ref["step"]) == STEPS
    logs = _log(ref_run)
    # a one-process run "killed" after step 2: its checkpoint 2, and a step-3 directory
    # Orbax never finished (what a kill during the save leaves)
    shutil.copytree(ref_run, from_one)
    shutil.rmtree(from_one / "ckpt" / str(STEPS))
    (from_one / "ckpt" / f"{STEPS}.orbax-checkpoint-tmp-1").mkdir()
    (from_one / "ckpt" / f"{STEPS}.orbax-checkpoint-tmp-1" / "junk").write_text("half")

    _launch(tmp_path, _argv(data, mp_run, export=tmp_path / "head"),
            _argv(data, from_one, export=tmp_path / "head_one"))

    # losses and held-out scores, one row per step and per checkpoint: written once
    got = _log(mp_run)
    assert [r["step"] for r in got] == [r["step"] for r in logs] == [1, 1, 2, 2, 3, 3]
    for a, b in zip(logs, got):
        for k in ("loss", "ce", "reg", "val_loss"):
            if k in a:
                assert abs(a[k] - b[k]) <= TOL, (k, a, b)
    # the 2-process checkpoint, restored in one process: the one-process parameters
    like = _fresh(toy, _argv(data, mp_run))
    two = _restore(mp_run, like)
    assert int(two["step"]) == STEPS
    _close(ref["params"], two["params"])
    _close(ref["opt_state"], two["opt_state"])
    print(f"2 processes vs 1: max |d loss| "
          f"{max(abs(a['loss'] - b['loss']) for a, b in zip(logs, got) if 'loss' in a):.2e}, "
          f"max |d param| {_max_diff(ref['params'], two['params']):.2e}")
    head, _ = checkpoint.load_head(tmp_path / "head", "eagle", like=like["params"])
    _close(jax.tree.map(lambda x: np.asarray(x, np.float32), head),
           jax.tree.map(lambda x: np.asarray(np.asarray(x, head["fc"].dtype), np.float32),
                        two["params"]))
    assert not list((tmp_path / "head").glob("tmp*"))
    # one process's checkpoint resumed by two: the half-written step-3 directory ignored
    resumed = _restore(from_one, like)
    _close(ref["params"], resumed["params"])
    assert [r["step"] for r in _log(from_one)] == [1, 1, 2, 2, 3, 3]
    assert (tmp_path / "head_one" / "head.json").is_file()
    # the 2-process run "killed" after step 2, resumed in one process
    shutil.copytree(mp_run, from_two)
    shutil.rmtree(from_two / "ckpt" / str(STEPS))
    again = _train_here(toy, from_two, _argv(data, from_two))
    _close(ref["params"], again["params"])
    assert _max_diff(ref["params"], _fresh(toy, _argv(data, mp_run))["params"]) > 1e-3
