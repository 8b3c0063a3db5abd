"""ReDrafter: the head's recurrence against its teacher-forced form, the drafter's
losslessness (greedy and sampled) on toy models and on the real SmolLM2, its state after a
commit, and bad heads refused clearly."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
import toys
from specjax.core import sampling
from specjax.core.speculative import speculative_generate
from specjax import methods
from specjax.drafters import redrafter
from specjax.models.llama import Llama, init_params

V = toys.V
TOY = toys.LLAMA
PROMPT = [1, 5, 2, 7, 5]
REDUCED = [3, 1, 4, 0, 9, 2]


@pytest.fixture(scope="module")
def toy():
    model, tparams = toys.llama(seed=1)
    head = redrafter.init_head(TOY.hidden_size, V, jax.random.key(3))
    # non-zero blocks, so the residual path is exercised too
    head["blocks"] = {k: {"w": jax.random.normal(jax.random.key(10 + k), b["w"].shape) * 0.1,
                          "b": b["b"] + 0.01} for k, b in head["blocks"].items()}
    return model, tparams, redrafter.draft_params(head)


def test_greedy_reduced_vocabulary_redrafter_equals_ar_on_toy(toy):
    """A head over a reduced draft vocabulary with non-zero residual blocks (the registry's
    random head drafts over the whole vocabulary with zero blocks: that one, with and
    without dedup, at batch 1 and 4, is tests/test_conformance.py's)."""
    model, tparams, _ = toy
    head = redrafter.init_head(TOY.hidden_size, len(REDUCED), jax.random.key(5))
    head["blocks"] = {k: {"w": jax.random.normal(jax.random.key(20 + k), b["w"].shape) * 0.1,
                          "b": b["b"] + 0.01} for k, b in head["blocks"].items()}
    dp = redrafter.draft_params(head, REDUCED)
    drafter = redrafter.RedrafterDrafter(model, width=3, length=3)
    drafter.check_params(dp)
    prompts = [PROMPT, [3, 3, 1], PROMPT * 4, [7]]
    budgets = [20, 7, 33, 12]
    ar = specjax.generate(model, tparams, prompts, max_new_tokens=budgets).to_lists()
    out = speculative_generate(model, tparams, drafter, dp, prompts, max_new_tokens=budgets)
    assert out.to_lists() == ar
    assert out.to_lists()[:1] == speculative_generate(
        model, tparams, drafter, dp, prompts[:1], max_new_tokens=budgets[0]).to_lists()


def _informed(model, tparams, dp):
    """A head whose h-part is the target's own LM head: it drafts near the target's
    distribution, so drafts are often accepted and the accept path is tested too."""
    head = jax.tree.map(jnp.zeros_like, dp["head"])
    head["out"] = head["out"].at[:TOY.hidden_size].set(model.output_head(tparams).T)
    head["rnn_u"], head["rnn_w"] = dp["head"]["rnn_u"], dp["head"]["rnn_w"]
    return redrafter.draft_params(head)


# ReDrafter's sampling law (deduplicated and not): tests/test_conformance.py::
# test_sampled_output_follows_the_target[redrafter:3,3] and [redrafter:3,3:nodedup].


def test_beam_scores_equal_the_teacher_forced_head(toy):
    """Every beam's score is the sum of the teacher-forced head's log-probabilities along
    the beam (``unroll``, the training path), and the best beam starts with the head's
    argmax: inference and training compute the same head."""
    model, tparams, dp = toy
    drafter = redrafter.RedrafterDrafter(model, width=3, length=3)
    ctx = toys.start_context(model, tparams, PROMPT)
    state = jax.jit(lambda dp, ctx: drafter.init(dp, ctx, 16))(dp, ctx)
    draft = jax.jit(lambda dp, st, ctx: drafter.propose(dp, st, ctx, jax.random.key(0),
                                                        sampling.Greedy())[0])(dp, state, ctx)
    logq_of = jax.jit(lambda h, emb: jax.nn.log_softmax(redrafter.unroll(dp["head"], h, emb), -1))
    # rebuild the beams from the packed tree: follow parents from every leaf
    tok, par, valid = (np.asarray(x[0]) for x in (draft.tokens, draft.parents, draft.valid))
    depth = {}
    for j in range(len(tok)):
        depth[j] = 1 if par[j] < 0 else depth[par[j]] + 1
    leaves = [j for j in range(len(tok)) if valid[j] and depth[j] == 3]
    assert leaves, "no full-length beam in the tree"
    root = int(ctx.tokens[0, len(PROMPT)])
    h = state.h[0]
    for leaf in leaves:
        path, j = [], leaf
        while j >= 0:
            path.append(int(tok[j]))
            j = int(par[j])
        path = path[::-1]
        emb = model.embed(tparams, jnp.asarray([[root] + path[:-1]]))[0]
        logq = np.asarray(logq_of(h, emb))  # [L, V]
        score = float(sum(logq[i, t] for i, t in enumerate(path)))
        assert np.isfinite(score)
        if leaf == leaves[0]:
            assert path[0] == int(jnp.argmax(logq[0])), "best beam does not start at the argmax"
            best = score
        assert score <= best + 1e-5, "a later beam scores higher than the first"


def test_commit_keeps_the_feature_of_the_last_accepted_token(toy):
    """After real rounds, the drafter's feature is the target's feature at the token before
    the root, exactly what a fresh start on the whole context computes."""

    model, tparams, dp = toy
    dp = _informed(model, tparams, dp)
    drafter = redrafter.RedrafterDrafter(model, width=3, length=3)
    accepted = 0
    spec = specjax.Speculative(model, drafter, drafter.verify_widths, chunk=16)
    init, step = jax.jit(spec.init), jax.jit(spec.step)  # one compile for the three prompts
    fresh_init = jax.jit(lambda dp, ctx: drafter.init(dp, ctx, 16))
    for prompt in (PROMPT, PROMPT * 3, [3, 3, 1, 4]):
        ctx = toys.start_context(model, tparams, prompt)
        buf = ctx.tokens.at[0, len(prompt)].set(0)  # the prompt alone; init emits the root
        x = specjax.Batch(tokens=buf, lengths=jnp.asarray([len(prompt)]),
                          budgets=jnp.asarray([64]), eos=jnp.asarray([-1]),
                          key=jax.random.key(0), sampler=sampling.Greedy(),
                          capacity=ctx.tokens.shape[1], max_out=64)
        s = init((tparams, dp), x)
        for _ in range(2):
            s = step((tparams, dp), s)
        accepted += int(s.stats.accepted_at[0, 0])
        n = int(s.length[0])
        fresh = fresh_init(dp, toys.start_context(model, tparams, np.asarray(s.tokens[0, :n - 1]).tolist()))
        np.testing.assert_allclose(np.asarray(s.dstate.h), np.asarray(fresh.h), atol=2e-4,
                                   rtol=2e-4)
    assert accepted > 0, "no round accepted a draft token: the commit path went untested"


def test_bad_heads_and_sizes_are_refused(toy):
    model, tparams, dp = toy
    drafter = redrafter.RedrafterDrafter(model, width=3, length=3)
    wide = redrafter.draft_params(redrafter.init_head(64, V, jax.random.key(0)))
    with pytest.raises(ValueError, match="hidden size is 32"):
        drafter.check_params(wide)
    other_vocab = redrafter.draft_params(redrafter.init_head(32, V + 4, jax.random.key(0)))
    with pytest.raises(ValueError, match="drafts over 16 tokens"):
        drafter.check_params(other_vocab)
    with pytest.raises(ValueError, match="width"):
        redrafter.RedrafterDrafter(model, width=0, length=3).check(model)
    with pytest.raises(ValueError, match="length"):
        redrafter.RedrafterDrafter(model, width=2, length=0).check(model)
    small = redrafter.draft_params(redrafter.init_head(32, 2, jax.random.key(0)), [1, 2])
    with pytest.raises(ValueError, match="width"):
        drafter.check_params(small)  # 3 beams over a 2-token draft vocabulary
    with pytest.raises(ValueError, match="want W,L"):
        methods.parse("redrafter:3")
    assert methods.parse("redrafter:2,5:nodedup").drafter_kwargs() == {
        "width": 2, "length": 5, "dedup": False}


# Greedy redrafter equals ar on the real model (batch 4):
# tests/test_real_smollm2.py::test_speculative_greedy_equals_ar[redrafter].


# --- training -----------------------------------------------------------------------------

TRAIN_TOY = toys.LLAMA_TRAIN
TRAIN_V = TRAIN_TOY.vocab_size


@pytest.fixture(scope="module")
def lm():
    return toys.ToyLM(Llama(TRAIN_TOY), jax.tree.map(lambda x: x * 3.0,
                                                     init_params(TRAIN_TOY, jax.random.key(4))))


@pytest.fixture(scope="module")
def corpus(lm):
    from specjax.train import distill

    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(1, TRAIN_V, size=n)) for n in rng.integers(3, 20, size=24)]
    return distill.answer_batch(lm, prompts, max_new_tokens=24)


def _cfg(**kw):
    from specjax.train import redrafter as train_rd

    base = dict(steps=30, batch_tokens=256, max_len=64, lr=1e-2, warmup=3, save_every=5,
                seed=1, draft_vocab=12, unroll=3)
    return train_rd.TrainConfig(**{**base, **kw})


@pytest.mark.parametrize("loss", ["kd", "ce"])
def test_loss_decreases(lm, corpus, tmp_path, loss):
    from specjax.train import redrafter as train_rd

    logs = []
    _, ids = train_rd.train(lm.model, lm.params, corpus, _cfg(loss=loss), tmp_path / "run",
                            log=logs.append)
    assert ids is not None and len(ids) == 12
    first = np.mean([r["loss"] for r in logs[:5]])
    last = np.mean([r["loss"] for r in logs[-5:]])
    assert last < 0.8 * first, f"{loss}: loss {first:.3f} -> {last:.3f}"
    assert np.mean([r["acc1"] for r in logs[-5:]]) > np.mean([r["acc1"] for r in logs[:5]])


def test_resume_after_kill_gives_the_same_parameters(lm, corpus, tmp_path):
    import shutil

    from specjax.train import redrafter as train_rd

    cfg = _cfg(steps=12, save_every=4)
    whole, _ = train_rd.train(lm.model, lm.params, corpus, cfg, tmp_path / "a")
    train_rd.train(lm.model, lm.params, corpus, cfg, tmp_path / "b", stop_after=6)
    shutil.rmtree(tmp_path / "b" / "ckpt" / "6")  # killed after step 6, before saving it
    resumed, _ = train_rd.train(lm.model, lm.params, corpus, cfg, tmp_path / "b")
    assert int(resumed["step"]) == 12
    for a, b in zip(jax.tree.leaves(whole["params"]), jax.tree.leaves(resumed["params"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_fine_tuning_starts_from_the_head_and_keeps_its_vocabulary(lm, corpus, tmp_path):
    from specjax.train import redrafter as train_rd

    trained, ids = train_rd.train(lm.model, lm.params, corpus, _cfg(), tmp_path / "a")
    head = redrafter.exportable(jax.tree.map(lambda x: x.astype(jnp.bfloat16),
                                             trained["params"]))  # as exported
    fresh, tuned = [], []
    train_rd.train(lm.model, lm.params, corpus, _cfg(steps=1), tmp_path / "b", log=fresh.append)
    _, ids2 = train_rd.train(lm.model, lm.params, corpus, _cfg(steps=1, draft_vocab=6),
                             tmp_path / "c", log=tuned.append, init=(head, ids))
    np.testing.assert_array_equal(ids2, ids)
    assert tuned[0]["loss"] < 0.8 * fresh[0]["loss"], (tuned[0], fresh[0])
    with pytest.raises(ValueError, match="residual blocks"):
        train_rd.train(lm.model, lm.params, corpus, _cfg(blocks=1), tmp_path / "d",
                       init=(head, ids))
    with pytest.raises(ValueError, match="draft vocabulary 12"):
        train_rd.train(lm.model, lm.params, corpus, _cfg(), tmp_path / "e",
                       init=(head, ids[:6]))


def test_cli_train_redrafter_exports_a_head_that_decodes(lm, corpus, tmp_path, monkeypatch):
    """``specjax train redrafter`` end to end: log, export, and the exported head loads and
    decodes losslessly; a head for another width is refused with a clear message."""
    import json

    from specjax import cli
    from specjax.train import distill

    monkeypatch.setattr("specjax.models.load", lambda *a, **k: lm)
    monkeypatch.setattr(distill, "load_shards", lambda d: corpus)
    run, out = tmp_path / "run", tmp_path / "head"
    argv = ["train", "redrafter", "--data", str(tmp_path), "--run", str(run), "--batch-tokens",
            "256", "--max-len", "64", "--save-every", "3", "--steps", "6", "--draft-vocab", "12",
            "--export", str(out)]
    assert cli.main(argv) == 0
    steps = [json.loads(r)["step"] for r in (run / "log.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6], steps
    meta = json.loads((out / "head.json").read_text())
    assert meta["kind"] == "redrafter" and meta["draft_vocab"] == 12 == len(meta["vocab_ids"])
    assert "/work" not in (out / "head.json").read_text()
    drafter, dp = methods.load_drafter("redrafter:2,3", lm, "toy", out)
    assert dp["head"]["out"].dtype == jnp.float32  # cast to the target's dtype
    prompts, budgets = [[3, 4, 5], [7, 1]], [10, 6]
    ar = specjax.generate(lm.model, lm.params, prompts, max_new_tokens=budgets).to_lists()
    got = speculative_generate(lm.model, lm.params, drafter, dp, prompts, max_new_tokens=budgets)
    assert got.to_lists() == ar
    wide = dataclasses.replace(TRAIN_TOY, hidden_size=48, head_dim=12)
    other = type(lm)(Llama(wide), init_params(wide, jax.random.key(0)))
    with pytest.raises(ValueError, match="hidden size 32, but"):
        methods.load_drafter("redrafter", other, "toy", out)
    with pytest.raises(methods.SpecError, match="has no head.json: want an exported redrafter"):
        methods.load_drafter("redrafter", lm, "toy", tmp_path)
