"""Draft-head training on toy models: distilled features are the target's, the loss goes
down, resume after a kill reaches the same parameters, and bad checkpoints fail clearly."""

from __future__ import annotations

import dataclasses
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import toys
from specjax.drafters import eagle
from toys import assert_within_a_bf16_step
from specjax.train import checkpoint, distill
from specjax.train import eagle as train_eagle

TOY = toys.LLAMA_TRAIN
V = TOY.vocab_size


@pytest.fixture(scope="module")
def lm():
    return toys.toy_lm(TOY, 4)


@pytest.fixture(scope="module")
def corpus(lm):
    return toys.answered_prompts(lm, 0)


def test_distilled_features_are_the_targets_hidden_states(lm, corpus):
    for tok, pl, f in corpus[:5]:
        logits, hid, _ = toys.forward(lm.model, lm.params, jnp.asarray(tok)[None])
        want = np.asarray(hid[TOY.num_layers][0, :-1], np.float32)
        assert_within_a_bf16_step(f[:-1], want)
        # the answer is the target's greedy rollout, teacher-forced
        np.testing.assert_array_equal(np.argmax(logits[0, pl - 1:-1], -1), tok[pl:])


CFG = train_eagle.TrainConfig(steps=30, batch_tokens=256, max_len=64, lr=1e-2, warmup=3,
                              save_every=5, seed=1)


def test_loss_decreases(lm, corpus, tmp_path):
    logs = []
    train_eagle.train(lm.model, lm.params, corpus, CFG, tmp_path / "run", log=logs.append)
    first = np.mean([r["loss"] for r in logs[:5]])
    last = np.mean([r["loss"] for r in logs[-5:]])
    assert last < 0.8 * first, f"loss {first:.3f} -> {last:.3f}"
    assert logs[-1]["acc"] > logs[0]["acc"]


def test_a_two_layer_head_trains_from_a_one_layer_head(lm, corpus, tmp_path):
    """``head_layers=2`` warm-started from a one-layer head: the added layer starts as the
    identity (the first step's loss equals the one-layer run's) and then trains; a run of
    one layer refuses a two-layer start."""
    one = eagle.init_head(TOY, jax.random.key(7))
    cfg = dataclasses.replace(CFG, steps=6)
    logs1, logs2 = [], []
    train_eagle.train(lm.model, lm.params, corpus, cfg, tmp_path / "one", init=one,
                      log=logs1.append)
    st = train_eagle.train(lm.model, lm.params, corpus, dataclasses.replace(cfg, head_layers=2),
                           tmp_path / "two", init=one, log=logs2.append)
    assert logs2[0]["loss"] == pytest.approx(logs1[0]["loss"], rel=1e-5)
    assert logs2[-1]["loss"] != pytest.approx(logs1[-1]["loss"], rel=1e-5)
    assert eagle.num_layers(st["params"]) == 2
    assert float(jnp.abs(st["params"]["extra_layers"][0]["down"]).max()) > 0
    with pytest.raises(ValueError, match="has 2 layers"):
        train_eagle.train(lm.model, lm.params, corpus, cfg, tmp_path / "three",
                          init=st["params"])


def test_held_out_examples_are_scored_and_never_trained_on(lm, corpus, tmp_path):
    cfg = dataclasses.replace(CFG, val_examples=6, steps=10)
    tr, val = train_eagle.split(corpus, cfg)
    assert len(val) == 6 and len(tr) == len(corpus) - 6
    assert {id(e) for e in tr}.isdisjoint({id(e) for e in val})
    assert [len(e[0]) for e in train_eagle.split(corpus, cfg)[1]] == [len(e[0]) for e in val]
    plan = train_eagle.batch_plan(tr, cfg)
    assert sum(len(b) for b in plan) == len(tr)  # batches draw from the training part only
    logs = []
    train_eagle.train(lm.model, lm.params, corpus, cfg, tmp_path / "run", log=logs.append)
    scored = [r for r in logs if "val_acc" in r]
    assert [r["step"] for r in scored] == [5, 10]
    want = sum(int(np.sum(train_eagle.batch_at(val, train_eagle.batch_plan(val, cfg), k, cfg)[3]))
               for k in range(len(train_eagle.batch_plan(val, cfg))))
    assert scored[-1]["val_tokens"] == want > 0
    assert 0.0 <= scored[-1]["val_acc"] <= 1.0 and np.isfinite(scored[-1]["val_loss"])
    with pytest.raises(ValueError, match="val_examples"):
        train_eagle.split(corpus, dataclasses.replace(CFG, val_examples=len(corpus)))


def test_resume_after_kill_gives_the_same_parameters(lm, corpus, tmp_path):
    whole = train_eagle.train(lm.model, lm.params, corpus, CFG, tmp_path / "a")
    train_eagle.train(lm.model, lm.params, corpus, CFG, tmp_path / "b", stop_after=13)
    shutil.rmtree(tmp_path / "b" / "ckpt" / "13")  # killed after step 13, before saving it
    resumed = train_eagle.train(lm.model, lm.params, corpus, CFG, tmp_path / "b")
    assert int(resumed["step"]) == 30
    for a, b in zip(jax.tree.leaves(whole["params"]), jax.tree.leaves(resumed["params"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bad_checkpoints_fail_clearly(lm, corpus, tmp_path):
    run = tmp_path / "run"
    train_eagle.train(lm.model, lm.params, corpus, CFG, run, stop_after=5)
    other = dataclasses.replace(CFG, lr=CFG.lr / 2)
    with pytest.raises(checkpoint.CheckpointError, match="different configuration"):
        train_eagle.train(lm.model, lm.params, corpus, other, run)
    for f in (run / "ckpt" / "5").rglob("*"):
        if f.is_file() and f.stat().st_size > 0:
            f.write_bytes(b"\0garbage")
    with pytest.raises(checkpoint.CheckpointError, match="corrupt"):
        train_eagle.train(lm.model, lm.params, corpus, CFG, run)

    head = eagle.init_head(TOY, jax.random.key(0))
    out = checkpoint.export_head(head, tmp_path / "head", {"kind": "eagle"})
    back, _ = checkpoint.load_head(out, "eagle", like=head)
    assert jax.tree.map(lambda x: x.dtype, back)["fc"] == jnp.bfloat16
    big = eagle.init_head(dataclasses.replace(TOY, hidden_size=48), jax.random.key(0))
    with pytest.raises(checkpoint.CheckpointError, match="another model"):
        checkpoint.load_head(out, "eagle", like=big)
    with pytest.raises(checkpoint.CheckpointError, match="not an exported head"):
        checkpoint.load_head(tmp_path, "eagle")


def test_prompt_selection_drops_spec_bench_overlap(tmp_path):
    d = tmp_path / "prompts"
    (d / "t0").mkdir(parents=True)
    text = " ".join(f"word{i}" for i in range(30))
    (d / "gsm8k_train.jsonl").write_text('{"question": "q1 ' + text + '"}\n{"question": "q2"}\n')
    (d / "self_instruct_seed.jsonl").write_text('{"instruction": "do it", "instances": []}\n')
    (d / "t0" / "task.jsonl").write_text('{"prompt": "summarize this"}\n')
    picked, info = distill.select_prompts(d, 10, exclude=["intro " + text])
    assert sorted(picked) == ["do it", "q2", "summarize this"]
    assert info["dropped_overlapping_spec_bench"] == 1


def test_cli_train_eagle_logs_resumes_and_exports(lm, corpus, tmp_path, monkeypatch):
    """``specjax train eagle`` end to end: one log line per step, the loss weights it was
    given recorded in the export, and a second call resumes instead of starting over."""
    import json

    from specjax import cli

    monkeypatch.setattr("specjax.models.load", lambda *a, **k: lm)
    monkeypatch.setattr(distill, "load_shards", lambda d: corpus)
    run, out = tmp_path / "run", tmp_path / "head"
    argv = ["train", "eagle", "--data", str(tmp_path), "--run", str(run), "--batch-tokens", "256",
            "--max-len", "64", "--save-every", "3", "--w-ce", "1.0", "--noise", "0.05",
            "--steps", "6", "--export", str(out)]
    assert cli.main(argv) == 0
    shutil.rmtree(run / "ckpt" / "6")  # as if killed after step 6, before saving it
    assert cli.main(argv) == 0
    steps = [json.loads(r)["step"] for r in (run / "log.jsonl").read_text().splitlines()]
    # the killed run's rows after its checkpoint (steps 4-6) were dropped, then rewritten
    assert steps == [1, 2, 3, 4, 5, 6], steps
    meta = json.loads((out / "head.json").read_text())
    assert meta["steps_done"] == 6
    assert (meta["train"]["w_ce"], meta["train"]["noise"]) == (1.0, 0.05)
    head, _ = checkpoint.load_head(out, "eagle", like=eagle.init_head(TOY, jax.random.key(0)))
    assert head["fc"].dtype == jnp.bfloat16
    # a head warm-started from another keeps that head's vocabulary order, whatever the
    # corpus's frequencies (here the reverse of its own export's)
    meta["vocab_ids"] = meta["vocab_ids"][::-1]
    from specjax.heads import exported

    exported.write_meta(out, meta)  # head.json edited on purpose: its head_sha256 rewritten
    warm = ["train", "eagle", "--data", str(tmp_path), "--run", str(tmp_path / "run2"),
            "--batch-tokens", "256", "--max-len", "64", "--steps", "1", "--init", str(out),
            "--export", str(tmp_path / "warm")]
    assert cli.main(warm) == 0
    got = json.loads((tmp_path / "warm" / "head.json").read_text())
    assert got["vocab_ids"] == meta["vocab_ids"]


def test_cli_corrupt_checkpoint_is_one_line(lm, corpus, tmp_path, monkeypatch, capsys, caplog):
    from specjax import cli

    monkeypatch.setattr("specjax.models.load", lambda *a, **k: lm)
    monkeypatch.setattr(distill, "load_shards", lambda d: corpus)
    run = tmp_path / "run"
    argv = ["train", "eagle", "--data", str(tmp_path), "--run", str(run), "--batch-tokens", "256",
            "--max-len", "64", "--save-every", "2", "--steps", "2"]
    assert cli.main(argv) == 0
    for f in (run / "ckpt" / "2").rglob("*"):
        if f.is_file() and f.stat().st_size > 0:
            f.write_bytes(b"\0garbage")
    capsys.readouterr()
    assert cli.main(argv) == 1
    err = [l for l in capsys.readouterr().err.splitlines() if "specjax: error" in l]
    assert len(err) == 1 and "corrupt" in err[0] and f"remove {run / 'ckpt' / '2'}" in err[0]
    assert not [r for r in caplog.records if r.name == "absl" and r.levelno >= 40]
