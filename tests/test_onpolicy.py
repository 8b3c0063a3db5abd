"""On-policy self-distillation and EAGLE-3's training-time test, on a 4-layer toy Llama:
the online loop's features are a prefill's, TTT at k=1 is the plain loss and at k>1 runs
the head on its own outputs exactly as drafting does, a killed run resumes to the same
parameters without touching the shard store, and a store refuses another target."""

from __future__ import annotations

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import methods
from specjax.core.decoding import generate
from specjax.drafters import blocks, eagle, eagle3
from specjax.heads import exported, kinds
from specjax.train import eagle as train_eagle
from specjax.train import glue, onpolicy, shards, ttt
from toys import loaded_llama

CFG = onpolicy.OnPolicyConfig(rounds=3, batch=4, max_new_tokens=10, val_prompts=4,
                              val_every=2, batch_tokens=128, lr=1e-2, warmup=2,
                              draft_vocab=48, loss=ttt.LossConfig(k=2))
POOL = [(f"toy#{i}", "word " * (i % 5 + 1) + f"number {i}") for i in range(40)]


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return loaded_llama(tmp_path_factory.mktemp("toy"), seed=3)


@pytest.fixture(scope="module")
def examples(lm):
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, 128, size=n)) for n in (5, 9, 17, 30)]
    return onpolicy.decode_round(lm, prompts, 12, ttt.EAGLE3.layers(lm.model.config))


def _store(lm, root, thash=None):
    th = thash or shards.target_hash(lm.model.config, lm.params)
    return shards.ShardStore(root, onpolicy.store_header(lm, CFG, "none", th),
                             lm.model.config.vocab_size)


def test_online_features_equal_a_separate_prefill(lm, examples):
    """Features kept while decoding (prefill for the prompt, one decode step per answer
    token) equal one prefill of the finished sequence to 1e-5 of their scale, for every
    layer EAGLE-3 and EAGLE-2 read; the answers are the target's greedy continuation."""
    layers = ttt.EAGLE3.layers(lm.model.config)
    again = onpolicy.prefill_features(lm, [(t, pl) for t, pl, _ in examples], layers)
    for (tok, pl, f), (_, _, g) in zip(examples, again):
        assert f.shape == (len(tok), len(layers) * lm.model.config.hidden_size)
        scale = np.abs(g).max()
        assert np.abs(f[:-1] - g[:-1]).max() <= 1e-5 * scale
        assert np.abs(f[pl:-1]).max() > 0  # answer positions were filled, not left zero
    ar = generate(lm.model, lm.params, [list(t[:pl]) for t, pl, _ in examples],
                  max_new_tokens=12).to_lists()
    assert ar == [list(t[pl:]) for t, pl, _ in examples]


def _batch(examples, d):
    idx = list(range(len(examples)))
    toks, feats, mask = onpolicy.batch_arrays([(t, p, f[:, -d:]) for t, p, f in examples], idx)
    full = onpolicy.batch_arrays(examples, idx)[1]
    return toks, feats, full, mask


def test_ttt_at_k1_is_the_plain_loss(lm, examples):
    target, tp = lm.model, lm.params
    d = target.config.hidden_size
    toks, last, full, mask = _batch(examples, d)
    key = jax.random.key(5)
    hp = eagle.init_head(target.config, jax.random.key(1))
    ids = jnp.arange(0, 96, dtype=jnp.int32)
    plain_cfg = train_eagle.TrainConfig(noise=0.1, w_reg=1.0, w_ce=0.1)
    plain, _ = train_eagle.loss_fn(hp, tp, toks, last, ttt.shift(last, -1), mask, key, ids,
                                   target=target, cfg=plain_cfg)
    got, m = ttt.loss_fn(hp, tp, toks, last, mask, key, ids, kind=ttt.EAGLE2, target=target,
                         cfg=ttt.LossConfig(k=1, noise=0.1))
    np.testing.assert_allclose(float(got), float(plain), rtol=1e-6)
    assert set(m) == {"loss", "loss0", "acc0"}
    # EAGLE-3 at k=1: the teacher-forced cross-entropy over the draft vocabulary
    h3 = eagle3.init_head(target.config, jax.random.key(2), 48)
    vids = jnp.arange(10, 58, dtype=jnp.int32)
    got3, _ = ttt.loss_fn(h3, tp, toks, full, mask, key, vids, kind=ttt.EAGLE3, target=target,
                          cfg=ttt.LossConfig(k=1, noise=0.0))
    spec = eagle3.layer_spec(target.config)
    # EAGLE's sequence: entry t pairs token t + 1 with the fused features of position t
    tin, fin = eagle.head_inputs(toks, full[..., :-d])
    b, t = tin.shape
    zk, zv = blocks.empty_kv(spec, b, t, jnp.float32)
    out, _, _ = eagle3.apply_head(spec, h3, target.embed(tp, tin), fin,
                                  jnp.broadcast_to(jnp.arange(t), (b, t)), zk, zv,
                                  jnp.zeros((b,), jnp.int32), blocks.causal(b, t))
    tl = jnp.einsum("btd,vd->btv", blocks.features(target, tp, full[:, 1:, -d:]),
                    target.output_head(tp)[vids])
    ce = -jnp.sum(jax.nn.softmax(tl) * jax.nn.log_softmax(eagle3.draft_logits(spec, h3, out)), -1)
    m = mask[:, 1:]
    np.testing.assert_allclose(float(got3), float(jnp.sum(ce * m) / m.sum()), rtol=1e-5)


@pytest.mark.parametrize("kind,layers", [(ttt.EAGLE2, 1), (ttt.EAGLE2, 2), (ttt.EAGLE3, 1)],
                         ids=["eagle", "eagle-2-layers", "eagle3"])
def test_ttt_steps_read_the_heads_own_outputs_as_drafting_does(lm, examples, kind, layers):
    """Step s of the unroll at entry p equals the head drafting s tokens after position p
    (the head's cache, its own output fed back); a teacher-forced step 1 (the target's
    feature in place of the head's output) does not."""
    target, tp = lm.model, lm.params
    d = target.config.hidden_size
    toks, _, full, _ = _batch(examples, d)
    if kind.name == "eagle":
        hp = eagle.init_head(target.config, jax.random.key(1), layers=layers)
        for lp in eagle.head_layers(hp):
            lp["o"] = lp["o"] * 10 if layers == 1 else jnp.full_like(lp["o"], 0.02)
        teacher = blocks.features(target, tp, full[..., -d:])
        prev0 = ttt.shift(teacher, -1)
        run = lambda *a: eagle.head_forward(target, hp, tp, *a)  # noqa: E731
    else:
        hp = eagle3.init_head(target.config, jax.random.key(2), 48)
        teacher, prev0 = None, ttt.shift(full[..., :-d], -1)
        spec = eagle3.layer_spec(target.config)
        run = lambda tk, *a: eagle3.apply_head(spec, hp, target.embed(tp, tk), *a)  # noqa: E731
    outs = ttt.unroll(kind, target, hp, tp, toks, prev0, 3)
    row, p = 3, 20
    spec = kind.spec(target.config)
    k, v = blocks.empty_kv(spec, 1, 64, jnp.float32, layers)
    pos = jnp.arange(p + 1)[None]
    out, k, v = run(toks[row:row + 1, :p + 1], prev0[row:row + 1, :p + 1], pos, k, v,
                    jnp.zeros((1,), jnp.int32), blocks.causal(1, p + 1))
    f = out[:, p:p + 1]
    np.testing.assert_allclose(outs[0][row, p], f[0, 0], atol=1e-5)
    one = jnp.ones((1, 1, 1), bool)
    for s in (1, 2):
        f_next, k, v = run(toks[row:row + 1, p + s:p + s + 1], f, jnp.asarray([[p + s]]), k, v,
                           jnp.asarray([p + s], jnp.int32), one)
        np.testing.assert_allclose(outs[s][row, p], f_next[0, 0], atol=1e-4, rtol=1e-4)
        f = f_next
    if teacher is not None:  # teacher forcing at step 1 gives another output
        tf = ttt.unroll(kind, target, hp, tp, toks, prev0, 1)[0]
        np.testing.assert_allclose(tf[row, p + 1], outs[0][row, p + 1], atol=1e-5)
        assert float(jnp.abs(outs[1][row, p] - tf[row, p + 1]).max()) > 1e-2


def _params(state):
    return jax.tree.map(np.asarray, state["params"])


def test_a_killed_run_resumes_to_the_same_parameters_and_store(lm, tmp_path):
    vids = np.arange(48, dtype=np.int32)
    cfg = dataclasses.replace(CFG, rounds=2, val_every=1)
    run = lambda name, **kw: onpolicy.train(  # noqa: E731
        lm, ttt.EAGLE3, cfg, tmp_path / name, _store(lm, tmp_path / f"s_{name}"), POOL, vids,
        **kw)
    whole = _params(run("whole"))
    manifest = (tmp_path / "s_whole" / "manifest.json").read_text()
    logs = []
    run("killed", stop_after=1, log=logs.append)
    resumed = _params(run("killed", log=logs.append))
    jax.tree.map(np.testing.assert_array_equal, resumed, whole)
    assert (tmp_path / "s_killed" / "manifest.json").read_text() == manifest
    assert [r["round"] for r in logs] == [0, 1, 2]  # round 0: the head before training
    assert all(len(r["val_top1"]) == 3 for r in logs)  # round 1: the killed call ended there
    # killed after round 2's shard was written, before its checkpoint: the round replays
    shutil.rmtree(tmp_path / "killed" / "ckpt" / "2")
    again = _params(run("killed", log=logs.append))
    assert logs[-1]["replayed"] and not logs[2]["replayed"]
    assert (tmp_path / "s_killed" / "manifest.json").read_text() == manifest
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), again, whole)


def test_a_later_run_replays_the_store_and_extends_it(lm, tmp_path):
    vids = np.arange(128, dtype=np.int32)
    cfg = dataclasses.replace(CFG, rounds=2, loss=ttt.LossConfig(k=1))
    store = _store(lm, tmp_path / "store")
    a = onpolicy.train(lm, ttt.EAGLE2, cfg, tmp_path / "a", store, POOL, vids)
    logs = []
    onpolicy.train(lm, ttt.EAGLE2, dataclasses.replace(cfg, rounds=3), tmp_path / "b",
                   _store(lm, tmp_path / "store"), POOL, vids, log=logs.append)
    assert [r["replayed"] for r in logs if r["round"]] == [True, True, False]
    m = json.loads((tmp_path / "store" / "manifest.json").read_text())
    assert len(m["shards"]) == 3 and m["val"]["prompt_ids"]
    # run "a"'s head, exported now, records the 2 rounds it trained on, not the store's 3,
    # and drafts over the vocabulary of the head it started from
    out = glue.export_onpolicy(a, ttt.EAGLE2, cfg, tmp_path / "head", model="toy",
                               target_cfg=lm.model.config,
                               start=glue.Start(None, None, "none", draft_vocab=48),
                               shards=tmp_path / "store", vocab_ids=vids)
    assert json.loads((out / "head.json").read_text())["draft_vocab"] == 48
    data = json.loads((out / "head.json").read_text())["data"]
    assert (data["rounds"], data["tokens"]) == (2, sum(s["tokens"] for s in m["shards"][:2]))
    ids = [i for s in m["shards"] for i in s["prompt_ids"]]
    assert len(set(ids)) == len(ids) and not set(ids) & set(m["val"]["prompt_ids"])
    z = np.load(tmp_path / "store" / m["shards"][0]["file"])
    assert z["tokens"].dtype == np.uint16
    # ReDrafter's corpus from the same store: every shard's sequences with the last layer
    corpus = onpolicy.store_corpus(lm, tmp_path / "store")
    assert len(corpus) == sum(len(s["prompt_ids"]) for s in m["shards"])
    assert [len(t) for t, _, _ in corpus[:4]] == [len(t) for t, _ in store.read(0)]
    assert corpus[0][2].shape == (len(corpus[0][0]), lm.model.config.hidden_size)
    # decoded with no head (``extend_store``, ``--decode-only``): the same shards, byte for
    # byte, so a training run replays them; a full store decodes nothing more
    cfg3 = dataclasses.replace(cfg, rounds=3)
    assert onpolicy.extend_store(lm, _store(lm, tmp_path / "d"), POOL, cfg) == ["val", 0, 1]
    assert onpolicy.extend_store(lm, _store(lm, tmp_path / "d"), POOL, cfg3) == [2]
    assert onpolicy.extend_store(lm, _store(lm, tmp_path / "d"), POOL, cfg3) == []
    assert json.loads((tmp_path / "d" / "manifest.json").read_text()) == m
    with pytest.raises(ValueError, match="the prompt data changed"):
        onpolicy.extend_store(lm, _store(lm, tmp_path / "d"), POOL[::-1], cfg3)


def test_a_two_layer_run_starts_from_a_one_layer_head_and_exports_both(lm, tmp_path):
    """``head_layers=2`` warm-started from a one-layer head: the added layer starts as the
    identity (the held-out scores before training equal the one-layer head's), it trains,
    and the export records and reloads both layers bit for bit; a head of more layers than
    the run's is refused."""
    vids = np.arange(128, dtype=np.int32)
    cfg = dataclasses.replace(CFG, rounds=1, loss=ttt.LossConfig(k=2))
    one = eagle.init_head(lm.model.config, jax.random.key(5))
    logs2 = []
    two = dataclasses.replace(cfg, head_layers=2)
    st = onpolicy.train(lm, ttt.EAGLE2, two, tmp_path / "two", _store(lm, tmp_path / "s"),
                        POOL, vids, init=one, log=logs2.append)
    val = onpolicy.prefill_features(lm, _store(lm, tmp_path / "s").read("val"),  # what it scored
                                    ttt.EAGLE2.layers(lm.model.config))
    score = onpolicy.validate(onpolicy.make_eval(ttt.EAGLE2, lm.model), one, lm.params, val,
                              jnp.asarray(vids), cfg.batch_tokens)
    assert logs2[0]["val_top1"] == score["val_top1"]
    extra = st["params"]["extra_layers"]
    assert len(extra) == 1 and float(jnp.abs(extra[0]["o"]).max()) > 0
    out = glue.export_onpolicy(st, ttt.EAGLE2, two, tmp_path / "head", model="toy",
                               target_cfg=lm.model.config, start=glue.Start(None, None, "none"),
                               shards=tmp_path / "s", vocab_ids=vids)
    assert json.loads((out / "head.json").read_text())["layers"] == 2
    back, _ = kinds.load_eagle(out, lm.model.config)
    as_bf16 = lambda t: jax.tree.map(lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16)), t)  # noqa: E731
    jax.tree.map(np.testing.assert_array_equal, as_bf16(back), as_bf16(st["params"]))
    three = eagle.init_head(lm.model.config, jax.random.key(5), layers=3)
    with pytest.raises(ValueError, match="has 3 layers"):
        onpolicy.init_params(ttt.EAGLE2, lm.model.config, two, three)


def test_a_store_refuses_another_target_and_damage(lm, tmp_path):
    th = shards.target_hash(lm.model.config, lm.params)
    other = jax.tree.map(lambda x: x, lm.params)
    leaf = jax.tree.leaves(other)[0]
    other = jax.tree.map(lambda x: x.at[(0,) * x.ndim].add(1e-3) if x is leaf else x, other)
    assert shards.target_hash(lm.model.config, other) != th
    assert shards.target_hash(lm.model.config, lm.params) == th
    store = _store(lm, tmp_path / "s")
    store.append(["a#0", "a#1"], [(np.arange(5), 2), (np.arange(7), 3)])
    with pytest.raises(shards.ShardError, match="holds tokens of target .* not of"):
        _store(lm, tmp_path / "s", thash="0" * 16)
    for change in ({"max_new_tokens": 99}, {"max_prompt_tokens": 1024}):
        with pytest.raises(shards.ShardError, match="other settings"):
            shards.ShardStore(tmp_path / "s", {**onpolicy.store_header(
                lm, dataclasses.replace(CFG, **change), "none", th)}, 128)
    with pytest.raises(ValueError, match="--max-prompt-tokens must be >= 1, got 0"):
        dataclasses.replace(CFG, max_prompt_tokens=0)
    assert [list(t) for t, _ in _store(lm, tmp_path / "s").read(0)] == [list(range(5)),
                                                                        list(range(7))]
    f = tmp_path / "s" / "shard_00000.npz"
    f.write_bytes(f.read_bytes()[:-3] + b"xyz")
    with pytest.raises(shards.ShardError, match="does not match its SHA-256"):
        _store(lm, tmp_path / "s").read(0)


def test_an_exported_eagle3_head_decodes_as_ar(lm, tmp_path):
    """A trained EAGLE-3 head (export kind ``eagle3``) loads through ``--method eagle3``."""
    vids = np.arange(20, 68, dtype=np.int32)
    state = onpolicy.train(lm, ttt.EAGLE3, dataclasses.replace(CFG, rounds=1), tmp_path / "r",
                           _store(lm, tmp_path / "s"), POOL, vids)
    layers = list(ttt.EAGLE3.layers(lm.model.config)[:-1])
    exported.export_head(state["params"], tmp_path / "head",
                         {"kind": "eagle3", "vocab_ids": vids.tolist(), "layers": layers},
                         dtype=jnp.float32)
    built = methods.build("eagle3:2,3,6", lm,
                          methods.Options(draft_checkpoint=str(tmp_path / "head")))
    prompts, budgets = [[5, 9, 17, 3, 44], [1, 2, 8]], [16, 11]
    ar = generate(lm.model, lm.params, prompts, max_new_tokens=budgets).to_lists()
    out = built(prompts, max_new_tokens=budgets)
    assert out.to_lists() == ar and out.drafted.sum() > 0


def test_a_bad_mesh_is_refused_before_anything_loads(tmp_path, capsys):
    """``train onpolicy --mesh``: a malformed mesh or one past the visible devices is one
    usage line before any input is read; one the target cannot be split over is refused
    from its configuration (``_vocab_check``), before any weight is read."""
    import argparse

    from specjax import cli, sharding
    from specjax.commands import train as train_cmd
    from specjax.commands.common import UsageError
    from toys import LLAMA

    base = ["train", "onpolicy", "--prompts", str(tmp_path / "p"), "--shards",
            str(tmp_path / "s"), "--run", str(tmp_path / "r")]
    n = jax.device_count()
    for mesh, msg in (("rows=2", "unknown mesh axis 'rows'"),
                      (f"data={2 * n}", f"needs {2 * n} devices, but {n} are visible")):
        assert cli.main([*base, "--mesh", mesh]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"--mesh {mesh}: " in err and msg in err, err
    assert not (tmp_path / "r").exists()
    for extra, msg in (([], "--run DIR is required"),
                       (["--decode-only", "--epochs", "2"], "trains nothing: drop --epochs"),
                       (["--decode-only", "--feature-cache", str(tmp_path / "c")],
                        "trains nothing: drop --feature-cache"),
                       ([*base[-2:], "--mix-shards", str(tmp_path / "m")],
                        "--mix-shards joins the epochs: give --epochs"),
                       ([*base[-2:], "--epochs", "1", "--mix-shards", str(tmp_path / "s")],
                        "is the --shards store itself"),
                       ([*base[-2:], "--epochs", "1", "--mix-shards", str(tmp_path / "m")],
                        "holds no shard store"),
                       ([*base[-2:], "--epochs", "1", "--mix-shards", f"{tmp_path / 'e'}:3"],
                        "--mix-shards " + f"{tmp_path / 'e'}:3: the store holds 0 rounds")):
        (tmp_path / "e").mkdir(exist_ok=True)
        (tmp_path / "e" / "manifest.json").write_text('{"shards": []}')
        assert cli.main([*base[:-2], *extra]) == 2
        assert msg in capsys.readouterr().err

    class Mesh3:  # the sizes alone: one device cannot hold a model=3 mesh
        shape = {sharding.DATA: 1, sharding.MODEL: 3}
    args = argparse.Namespace(draft_vocab=8, model="toy", mesh="model=3")
    with pytest.raises(UsageError, match="--mesh model=3: mesh model=3 does not divide the "
                                         "model's 4 query heads"):
        train_cmd._vocab_check(args, Mesh3())(None, LLAMA)


def test_epoch_batches_shuffle_across_rounds_and_depend_on_seed_and_epoch_alone():
    """An epoch's minibatches hold every example once, mix rounds within a minibatch, and
    come in an order drawn from the seed and the epoch number alone."""
    # three rounds of eight examples of one length: only the shuffle decides who goes together
    ex = [(np.arange(20), 5, None)] * 24
    rnd = [i // 8 for i in range(24)]
    e0 = onpolicy.epoch_batches(ex, 128, 0, 0)
    assert sorted(i for b in e0 for i in b) == list(range(24))
    assert all(len(b) == 2 for b in e0)  # minibatched as rounds are: 2 x 64 padded tokens
    assert any(len({rnd[i] for i in b}) > 1 for b in e0)
    assert onpolicy.epoch_batches(ex, 128, 0, 0) == e0  # a resumed run draws the same
    assert onpolicy.epoch_batches(ex, 128, 0, 1) != e0
    assert onpolicy.epoch_batches(ex, 128, 1, 0) != e0


class _Bar:
    """A progress bar's surface that ``onpolicy.train`` uses, recorded."""

    def __init__(self):
        self.n, self.post = 0, []

    def update(self, k: int) -> None:
        self.n += k

    def set_postfix(self, values: dict) -> None:
        self.post.append(dict(values))


def test_epochs_train_on_every_round_and_resume_exactly(lm, tmp_path, monkeypatch):
    """``epochs`` after the rounds: each epoch trains on every round's examples, mixed; a
    finished run given epochs trains them, a run stopped or killed during them resumes to
    the parameters of one that never stopped (and its log to the same epochs), and a run
    whose epochs began refuses more rounds before it decodes any."""
    from specjax.heads import CheckpointError
    from specjax.train.loop import RunLog

    vids = np.arange(48, dtype=np.int32)
    cfg = dataclasses.replace(CFG, rounds=2, val_every=1, epochs=2)
    seen = []
    real = onpolicy.epoch_batches

    def spy(ex, *a):
        plan = real(ex, *a)
        seen.append([[tuple(ex[i][0]) for i in idx] for idx in plan])
        return plan

    monkeypatch.setattr(onpolicy, "epoch_batches", spy)
    run = lambda name, c=cfg, **kw: onpolicy.train(  # noqa: E731
        lm, ttt.EAGLE3, c, tmp_path / name, _store(lm, tmp_path / f"s_{name}"), POOL, vids,
        **kw)
    logs = []
    whole = _params(run("whole", log=logs.append))
    assert [r.get("epoch") for r in logs] == [None, None, None, 1, 2]
    assert all(len(r["val_top1"]) == 3 for r in logs)
    store = _store(lm, tmp_path / "s_whole")
    rounds = [{tuple(t) for t, _ in store.read(r)} for r in range(2)]
    assert len(seen) == 2 and seen[0] != seen[1]
    for epoch in seen:  # every example of both rounds once, rounds interleaved
        flat = [t for b in epoch for t in b]
        assert sorted(flat) == sorted(rounds[0] | rounds[1])
        order = [int(t in rounds[1]) for t in flat]
        assert order != sorted(order) and order != sorted(order, reverse=True)

    log = RunLog(tmp_path / "grown")
    run("grown", dataclasses.replace(cfg, epochs=0), log=log)  # a finished run, no epochs
    bars = [_Bar(), _Bar()]
    run("grown", stop_after=1, log=log, progress=bars[0])  # given epochs: stopped after one
    assert [json.loads(r).get("epoch") for r in log.path.read_text().splitlines()][-1] == 1
    jax.tree.map(np.testing.assert_array_equal,
                 _params(run("grown", log=log, progress=bars[1])), whole)
    # the bar starts at what the run had done, and shows the prefill before the epochs
    assert [b.n for b in bars] == [2 + 1, 2 + 1 + 1]
    assert bars[0].post[:2] == [{"features of round": "1/2"}, {"features of round": "2/2"}]
    n = len(seen[0])  # and each epoch's steps, its last one shown before the epoch's row
    assert bars[0].post[2:] == [{"epoch": 1, "step": f"{n}/{n}"},
                                {"epoch": 1, "tokens_seen": logs[3]["tokens_seen"]}]
    # killed after epoch 2's training, before its checkpoint: the epoch trains again
    shutil.rmtree(tmp_path / "grown" / "ckpt" / "4")
    jax.tree.map(np.testing.assert_array_equal, _params(run("grown", log=log)), whole)
    rows = [json.loads(r) for r in log.path.read_text().splitlines()]
    assert [(r["round"], r.get("epoch")) for r in rows] == [(0, None), (1, None), (2, None),
                                                             (2, 1), (2, 2)]
    manifest = (tmp_path / "s_grown" / "manifest.json").read_text()
    with pytest.raises(CheckpointError, match="trained 2 rounds then 2 epochs .* --rounds 3"):
        run("grown", dataclasses.replace(cfg, rounds=3))
    assert (tmp_path / "s_grown" / "manifest.json").read_text() == manifest


def test_a_feature_cache_trains_the_same_head_and_refuses_a_damaged_file(lm, tmp_path):
    """Replayed shards' features read from a ``FeatureCache`` are the prefill's bit for bit:
    a run that writes the cache as it replays its rounds, then reads it for its epochs,
    trains to the parameters of a run without it. Files are keyed by target, layers and
    shard, a cached shard is read, never computed again, and a file of the wrong shape is
    refused in one line naming it."""
    from specjax.train.feature_cache import FeatureCache, FeatureCacheError

    vids = np.arange(48, dtype=np.int32)
    cfg = dataclasses.replace(CFG, rounds=2, val_every=2, epochs=1)
    onpolicy.extend_store(lm, _store(lm, tmp_path / "s"), POOL, cfg)  # every run replays
    cache = FeatureCache(tmp_path / "cache")
    run = lambda name, **kw: _params(onpolicy.train(  # noqa: E731
        lm, ttt.EAGLE3, cfg, tmp_path / name, _store(lm, tmp_path / "s"), POOL, vids, **kw))
    plain = run("plain")
    jax.tree.map(np.testing.assert_array_equal, run("writes", feature_cache=cache), plain)
    files = sorted(cache.root.rglob("*.npy"))
    store, layers = _store(lm, tmp_path / "s"), ttt.EAGLE3.layers(lm.model.config)
    assert sorted(cache.path(store, w, layers) for w in ("val", 0, 1)) == files

    def refuse(rows):
        raise AssertionError("the cache recomputed a cached shard")

    ref = onpolicy.prefill_features(lm, store.read(1), layers)
    got = cache.examples(store, 1, layers, refuse)
    assert [(list(t), pl) for t, pl, _ in got] == [(list(t), pl) for t, pl, _ in ref]
    for (_, _, f), (_, _, g) in zip(got, ref):
        np.testing.assert_array_equal(f, g)
    assert cache.path(store, 1, layers[-1:]) != cache.path(store, 1, layers)
    np.save(cache.path(store, 1, layers), np.zeros((3, 4), np.float32))
    with pytest.raises(FeatureCacheError, match=r"float32 \(3, 4\), not float32 .*damaged"):
        cache.examples(store, 1, layers, refuse)


def test_stores_mixed_into_the_epochs_train_with_the_rounds_and_are_recorded(
        lm, tmp_path, monkeypatch):
    """``mix``: every shard of another store of the target joins each epoch, shuffled with
    the run's rounds; the run records the stores, so resuming with others is refused, and
    mixing without epochs is refused."""
    from specjax.heads import CheckpointError

    vids = np.arange(48, dtype=np.int32)
    cfg = dataclasses.replace(CFG, rounds=2, val_every=2, epochs=1)
    other = [(f"other#{i}", "other words " * (i % 3 + 1) + str(i)) for i in range(30)]
    onpolicy.extend_store(lm, _store(lm, tmp_path / "b"), other, cfg)
    mixed = _store(lm, tmp_path / "b")
    seen = []
    real = onpolicy.epoch_batches

    def spy(ex, *a):
        seen.append({tuple(t) for t, _, _ in ex})
        return real(ex, *a)

    monkeypatch.setattr(onpolicy, "epoch_batches", spy)
    run = lambda name, c=cfg, mix=((mixed, 2),), **kw: onpolicy.train(  # noqa: E731
        lm, ttt.EAGLE3, c, tmp_path / name, _store(lm, tmp_path / "a"), POOL, vids, mix=mix,
        **kw)
    bar = _Bar()
    run("r", progress=bar)
    assert [p for p in bar.post if "features of mixed round" in p] == [
        {"features of mixed round": "1/2"}, {"features of mixed round": "2/2"}]
    own = _store(lm, tmp_path / "a")
    rounds = {tuple(t) for w in range(2) for t, _ in own.read(w)}
    extra = {tuple(t) for w in range(len(mixed)) for t, _ in mixed.read(w)}
    assert len(mixed) == 2 and extra and not extra & rounds
    assert seen == [rounds | extra]
    assert json.loads((tmp_path / "r" / "run.json").read_text())["mix"] == \
        onpolicy.mix_digest([(mixed, 2)])
    with pytest.raises(CheckpointError, match="different configuration.*'mix'"):
        run("r", dataclasses.replace(cfg, epochs=2), mix=((mixed, 1),))
    with pytest.raises(CheckpointError, match="different configuration.*'mix'"):
        run("r", dataclasses.replace(cfg, epochs=2), mix=())
    with pytest.raises(ValueError, match="need epochs"):
        run("s", dataclasses.replace(cfg, epochs=0))
    with pytest.raises(ValueError, match="holds 2 rounds: cannot mix 3"):
        run("s", mix=((mixed, 3),))


def test_answers_only_trains_on_answer_positions_and_the_run_records_it(lm, tmp_path):
    """``answers_only``: rounds and epochs count (and train on) the answers' positions
    only, so the head differs from a run on every position; the run records the setting,
    and a run directory of either setting refuses the other."""
    from specjax.heads import CheckpointError

    vids = np.arange(48, dtype=np.int32)
    cfg = dataclasses.replace(CFG, rounds=2, val_every=2, epochs=1)
    onpolicy.extend_store(lm, _store(lm, tmp_path / "s"), POOL, cfg)
    store = _store(lm, tmp_path / "s")
    answers = sum(len(t) - pl for w in range(2) for t, pl in store.read(w))
    every = sum(len(t) - 1 for w in range(2) for t, _ in store.read(w))
    logs = {"all": [], "ans": []}
    run = lambda name, c: onpolicy.train(  # noqa: E731
        lm, ttt.EAGLE3, c, tmp_path / name, _store(lm, tmp_path / "s"), POOL, vids,
        log=logs[name].append)
    plain = _params(run("all", cfg))
    ans = _params(run("ans", dataclasses.replace(cfg, answers_only=True)))
    assert [r["tokens_seen"] for r in logs["all"]][-1] == 2 * every
    assert [r["tokens_seen"] for r in logs["ans"]][-1] == 2 * answers < 2 * every
    assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(plain),
                                                        jax.tree.leaves(ans)))
    assert logs["ans"][0]["val_top1"] == logs["all"][0]["val_top1"]  # same start, same scoring
    assert json.loads((tmp_path / "ans" / "run.json").read_text())["answers_only"] is True
    assert "answers_only" not in json.loads((tmp_path / "all" / "run.json").read_text())
    with pytest.raises(CheckpointError, match="different configuration.*'answers_only'"):
        run("ans", cfg)
    with pytest.raises(CheckpointError, match="different configuration.*'answers_only'"):
        run("all", dataclasses.replace(cfg, answers_only=True))
