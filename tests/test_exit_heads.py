"""Early-exit heads on a toy model: an untrained adapter is the plain exit, distillation
lowers the KL, resume after a kill reaches the same parameters, exported heads load back
(and fail clearly when they do not fit), and decoding with trained heads stays lossless."""

from __future__ import annotations

import dataclasses
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import toys
import specjax
from specjax.drafters import eagle, exit_heads
from specjax.drafters import EarlyExitDrafter
from specjax.heads import kinds
from specjax.models.llama import Llama
from specjax.train import checkpoint
from specjax.train import exit_heads as train_exits
from toys import assert_within_a_bf16_step

TOY = toys.LLAMA_DEEP
V = TOY.vocab_size
CFG = train_exits.ExitConfig(layers=(1, 2), rank=8, steps=40, batch_tokens=256, max_len=64,
                             lr=3e-2, warmup=4, save_every=10, kl_vocab=24, seed=2)


@pytest.fixture(scope="module")
def lm():
    return toys.toy_lm(TOY, 7)


@pytest.fixture(scope="module")
def corpus(lm):
    return toys.answered_prompts(lm, 1)


@pytest.fixture(scope="module")
def feats(lm, corpus):
    return train_exits.layer_features(lm.model, lm.params, corpus, CFG)


def test_untrained_adapter_is_the_plain_early_exit(lm):
    heads = exit_heads.init_heads(TOY, (1, 3), jax.random.key(0), rank=4)
    h = jax.random.normal(jax.random.key(1), (2, 5, TOY.hidden_size))
    np.testing.assert_array_equal(np.asarray(exit_heads.exit_head(lm.model, lm.params,
                                                                  heads["3"], h)),
                                  np.asarray(lm.model.logits(lm.params, h)))
    moved = jax.tree.map(lambda x: x + 0.1, heads["3"])
    assert not np.allclose(exit_heads.exit_head(lm.model, lm.params, moved, h),
                           lm.model.logits(lm.params, h))
    with pytest.raises(ValueError, match="exit layers"):
        exit_heads.init_heads(TOY, (0, 2), jax.random.key(0))
    with pytest.raises(ValueError, match="exit layers"):
        exit_heads.init_heads(TOY, (4,), jax.random.key(0))


def test_layer_features_are_the_targets_hidden_states(lm, corpus, feats):
    for (tok, _, _), f in list(zip(corpus, feats))[:4]:
        _, hid, _ = toys.forward(lm.model, lm.params, jnp.asarray(tok)[None],
                                 return_layers=(1, 2))
        assert f.shape == (len(tok), 3, TOY.hidden_size) and f.dtype == jnp.bfloat16
        for k, l in enumerate((1, 2)):
            assert_within_a_bf16_step(f[:, k], hid[l][0])
        final = eagle.features(lm.model, lm.params, hid[TOY.num_layers][0])
        assert_within_a_bf16_step(f[:, 2], final)


def test_distillation_lowers_the_kl_of_every_exit(lm, corpus, feats, tmp_path):
    logs = []
    train_exits.train(lm.model, lm.params, corpus, CFG, tmp_path / "run", feats=feats,
                      log=logs.append)
    first, last = logs[0], np.mean([r["loss"] for r in logs[-5:]])
    assert last < 0.7 * first["loss"], f"KL {first['loss']:.3f} -> {last:.3f}"
    for l in CFG.layers:
        assert np.mean([r[f"acc_{l}"] for r in logs[-5:]]) >= first[f"acc_{l}"]


def test_resume_after_kill_gives_the_same_parameters(lm, corpus, feats, tmp_path):
    whole = train_exits.train(lm.model, lm.params, corpus, CFG, tmp_path / "a", feats=feats)
    train_exits.train(lm.model, lm.params, corpus, CFG, tmp_path / "b", feats=feats,
                      stop_after=17)
    shutil.rmtree(tmp_path / "b" / "ckpt" / "17")  # killed after step 17, before saving it
    resumed = train_exits.train(lm.model, lm.params, corpus, CFG, tmp_path / "b", feats=feats)
    assert int(resumed["step"]) == CFG.steps
    for a, b in zip(jax.tree.leaves(whole["params"]), jax.tree.leaves(resumed["params"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(checkpoint.CheckpointError, match="different configuration"):
        train_exits.train(lm.model, lm.params, corpus, dataclasses.replace(CFG, rank=4),
                          tmp_path / "b", feats=feats)


def test_exported_heads_load_back_and_mismatches_fail(lm, tmp_path):
    heads = exit_heads.init_heads(TOY, (1, 2), jax.random.key(3), rank=8)
    heads = jax.tree.map(lambda x: x + 0.25, heads)
    out = checkpoint.export_head(heads, tmp_path / "h", {"kind": "exit-heads",
                                                         "layers": [1, 2], "rank": 8})
    back, meta = kinds.load_exit_heads(out, lm.model)
    assert sorted(back) == [1, 2] and meta["rank"] == 8
    np.testing.assert_allclose(back[2]["up"], heads["2"]["up"], rtol=1e-2)  # bfloat16
    with pytest.raises(checkpoint.CheckpointError, match="not 'exit-heads'"):
        checkpoint.export_head(heads, tmp_path / "e", {"kind": "eagle"})
        kinds.load_exit_heads(tmp_path / "e", lm.model)
    big = Llama(dataclasses.replace(TOY, hidden_size=48))
    with pytest.raises(checkpoint.CheckpointError, match="another model"):
        kinds.load_exit_heads(out, big)


def test_a_distilled_vocabulary_restricts_the_exit_to_it(lm, tmp_path):
    heads = jax.tree.map(lambda x: x + 0.1, exit_heads.init_heads(TOY, (2,), jax.random.key(4)))
    h = jax.random.normal(jax.random.key(5), (3, TOY.hidden_size))
    ids = jnp.asarray([7, 0, 19, 3], jnp.int32)
    full = np.asarray(exit_heads.exit_head(lm.model, lm.params, heads["2"], h))
    sub = np.asarray(exit_heads.exit_head(lm.model, lm.params, {**heads["2"], "vocab_ids": ids},
                                          h))
    np.testing.assert_allclose(sub[:, ids], full[:, ids], rtol=1e-5, atol=1e-5)
    rest = np.setdiff1d(np.arange(V), ids)
    assert np.all(sub[:, rest] == np.finfo(np.float32).min)
    assert set(sub.argmax(-1)) <= set(np.asarray(ids).tolist())
    meta = {"kind": "exit-heads", "layers": [2], "rank": 64}
    out = checkpoint.export_head(heads, tmp_path / "v", {**meta, "vocab_ids": [7, 0, 19, 3]})
    back, _ = kinds.load_exit_heads(out, lm.model)
    np.testing.assert_array_equal(back[2]["vocab_ids"], ids)
    bad = checkpoint.export_head(heads, tmp_path / "b", {**meta, "vocab_ids": [7, 7, V]})
    with pytest.raises(checkpoint.CheckpointError, match="vocab_ids"):
        kinds.load_exit_heads(bad, lm.model)


def test_decoding_with_a_trained_exit_head_equals_ar(lm, corpus, feats, tmp_path):
    state = train_exits.train(lm.model, lm.params, corpus, dataclasses.replace(CFG, steps=10),
                              tmp_path / "run", feats=feats)
    head = state["params"]["2"]
    assert float(jnp.abs(head["up"]).max()) > 0  # trained, not the plain exit
    prompts = [list(range(1, 9)), list(range(3, 6))]
    ar = specjax.generate(lm.model, lm.params, prompts, max_new_tokens=20)
    d = EarlyExitDrafter(lm.model, 2, depth=3, head=exit_heads.exit_head)
    sd = specjax.speculative_generate(lm.model, lm.params, d, head, prompts, max_new_tokens=20)
    assert sd.to_lists() == ar.to_lists()
