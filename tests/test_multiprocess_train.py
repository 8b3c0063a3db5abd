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
    """The ``TrainConfig`` the CLI builds from ``argv`` (``--no-attn-norm`` absent: the
    layout of ``--init``, with the norm without one, as ``cmd_train`` resolves it)."""
    from specjax import cli
    from specjax.commands.train import _resolve_attn_norm

    args = cli.build_parser().parse_args(argv)
    _resolve_attn_norm(args)
    return glue.from_args(train_eagle.TrainConfig, args)


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


# ----------------------------------------------------------------------------- opt-in

def _restore_any(run: Path) -> dict:
    """The latest checkpoint of ``run``, whatever tree it holds, restored here onto one
    device (its shapes and dtypes read from the checkpoint's own metadata)."""
    import orbax.checkpoint as ocp

    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    path = (run / "ckpt" / str(checkpoint.latest_step(run)) / "default").absolute()
    ckptr = ocp.StandardCheckpointer()
    with checkpoint.quiet_absl():
        meta = ckptr.metadata(path)
        meta = getattr(meta, "item_metadata", meta)
        like = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one), meta)
        return ckptr.restore(path, like)


def _onpolicy_argv(tmp: Path, name: str, rounds: int, init: Path, export: bool = False):
    """``specjax train onpolicy`` on the toy: ``rounds`` rounds of 4 prompts, 4 held out,
    scored every round, replayed features cached."""
    d = tmp / name
    argv = ["train", "onpolicy", "--model", "toy", "--prompts", str(tmp / "prompts"),
            "--shards", str(d / "shards"), "--run", str(d / "run"), "--rounds", str(rounds),
            "--batch", "4", "--val-prompts", "4", "--max-new-tokens", "8", "--draft-vocab", "16",
            "--batch-tokens", "128", "--val-every", "1", "--init", str(init),
            "--feature-cache", str(d / "features")]
    return argv + (["--export", str(d / "head")] if export else [])


def _heads_argv(data: Path, tmp: Path, name: str):
    """``train redrafter`` and ``train exit-heads`` on the toy corpus: 3 steps each."""
    d = tmp / name
    common = ["--model", "toy", "--data", str(data), "--steps", "3", "--save-every", "1",
              "--batch-tokens", "256", "--max-len", "64"]
    return (["train", "redrafter", *common, "--run", str(d / "redrafter"), "--val-examples",
             "4", "--draft-vocab", "8", "--export", str(d / "redrafter-head")],
            ["train", "exit-heads", *common, "--run", str(d / "exits"), "--layers", "1",
             "--rank", "4", "--kl-vocab", "8", "--export", str(d / "exit-heads")])


@pytest.mark.extended
def test_two_processes_train_onpolicy_redrafter_and_exit_heads_as_one(toy, tmp_path):
    """``train onpolicy`` (2 rounds, then a third that replays the held-out shard from the
    feature cache), ``train redrafter`` and ``train exit-heads`` (3 steps each) on 2
    processes x 2 devices and on 1 process of 4 devices (``data=2,model=2`` both): the
    same shard store, token for token, parameters equal to ``TOL``, one log row per step
    or round, each store shard, cached feature file and export written once. About a
    minute and a half on 2 CPU cores."""
    from specjax.heads import kinds

    lm, _, data = toy
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "gsm8k_train.jsonl").write_text("".join(
        json.dumps({"question": "ab " * (i % 3 + 1) + f"n{i}"}) + "\n" for i in range(40)))
    init = kinds.save_eagle(train_eagle.eagle.init_head(lm.model.config, jax.random.key(1)),
                            tmp_path / "init", vocab_ids=np.arange(16))
    for name, n in (("two", 2), ("one", 1)):
        _launch(tmp_path / name, _onpolicy_argv(tmp_path, name, 2, init),
                _onpolicy_argv(tmp_path, name, 3, init, export=True),
                *_heads_argv(data, tmp_path, name), processes=n)
    one, two = tmp_path / "one", tmp_path / "two"
    m1, m2 = (json.loads((d / "shards" / "manifest.json").read_text()) for d in (one, two))
    assert [s["prompt_ids"] for s in m2["shards"]] == [s["prompt_ids"] for s in m1["shards"]]
    for f in ("val.npz", "shard_00000.npz", "shard_00001.npz", "shard_00002.npz"):
        a, b = (np.load(d / "shards" / f) for d in (one, two))
        np.testing.assert_array_equal(a["tokens"], b["tokens"])
    assert not list((two / "shards").glob("tmp_*"))
    assert len(list((two / "features").rglob("*.npy"))) == 1  # the held-out shard, once
    assert [r["round"] for r in _log(two / "run")] == [0, 1, 2, 3]
    assert [r["step"] for r in _log(two / "redrafter")] == [1, 1, 2, 2, 3, 3]
    assert [r["step"] for r in _log(two / "exits")] == [1, 2, 3]
    for run in ("run", "redrafter", "exits"):
        a, b = _restore_any(one / run), _restore_any(two / run)
        assert int(a["step"]) == int(b["step"]) > 0
        _close(a["params"], b["params"])
    for head in ("head", "redrafter-head", "exit-heads"):
        assert (two / head / "head.json").is_file(), head


@pytest.mark.extended
def test_a_run_killed_in_one_process_resumes_on_both(toy, tmp_path, monkeypatch):
    """Process 1 of a 6-step run killed (SIGKILL) once its part of checkpoint 4 is
    written: process 0 fails too, the run directory's latest complete checkpoint is one
    both processes finished, and the rerun resumes from it to the one-process parameters
    (to ``TOL``), its log one row per step."""
    lm, corpus, data = toy
    argv = lambda run: _argv(data, run, steps=6, save_every=2)  # noqa: E731
    ref = _train_here(toy, tmp_path / "ref", argv(tmp_path / "ref"))
    run = tmp_path / "run"
    monkeypatch.setenv("MP_TRAIN_KILL", "1:4")
    cmd = [sys.executable, str(HERE / "mp_train_cli.py"), *argv(run), "--mesh",
           "data=2,model=2", "--distributed-timeout", "20", "--coordinator", "{coordinator}",
           "--num-processes", "{num_processes}", "--process-id", "{process_id}"]
    killed = distributed.launch(cmd, 2, devices=2, timeout=240, log_dir=tmp_path / "logs")
    assert killed[1].returncode == -9, killed[1].output[-3000:]
    assert killed[0].returncode != 0, killed[0].output[-3000:]
    assert checkpoint.latest_step(run) in (2, 4)
    monkeypatch.delenv("MP_TRAIN_KILL")
    _launch(tmp_path, argv(run))
    got = _restore(run, _fresh(toy, argv(run)))
    assert int(got["step"]) == 6
    _close(ref["params"], got["params"])
    assert [r["step"] for r in _log(run) if "loss" in r] == [1, 2, 3, 4, 5, 6]
