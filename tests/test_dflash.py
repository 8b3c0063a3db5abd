"""DFlash: the port against z-lab's own code, the hub layout, trees over blocks, training.

The reference fixtures in tests/data/dflash_ref were written by z-lab/dflash's
``dflash/model.py`` (commit 44947fb; torch on CPU, float32, eager attention) with
``scripts/dflash_reference.py`` in its own environment (``scripts/dflash_ref_env.sh``): a
tiny random Qwen3 target, a random ``DFlashDraftModel`` in the hub layout, the draft logits
of single block forwards, and greedy ``dflash_generate`` runs round by round.
``test_fixtures_regenerate_bit_identical`` reruns that script where the environment exists.
Greedy equality with ``ar`` and the sampling law of ``dflash`` (chain and tree) are in
tests/test_conformance.py, as for every method.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
import toys
from specjax import methods
from specjax.core.decoding import hidden_features
from specjax.drafters import dflash
from specjax.heads import dflash as heads
from specjax.models.kv_cache import KVCache

ROOT = Path(__file__).resolve().parents[1]
REF = ROOT / "tests" / "data" / "dflash_ref"


@pytest.fixture(scope="module")
def ref():
    from specjax.models import load

    lm = load(str(REF / "target"))
    spec, params = heads.load(REF / "drafter", lm.model.config)
    meta = json.loads((REF / "reference.json").read_text())
    arrays = dict(np.load(REF / "reference.npz"))
    return lm, spec, jax.tree.map(jnp.asarray, params), meta, arrays


def _block_logits(lm, spec, params, context, block):
    """specjax's drafter on one block after ``context`` (the inference path: the context's
    K/V in the drafter cache at their positions, the block at ``len(context) ..``)."""
    model, tp = lm.model, lm.params
    t = len(context)
    toks = jnp.asarray([context], jnp.int32)
    pos = jnp.arange(t)[None]
    layers = tuple(l + 1 for l in spec.target_layers)
    _, hid, _ = model.forward(tp, toks, pos, model.init_cache(1, t), return_layers=layers,
                              compute_logits=False)
    feats = hidden_features(hid, layers)
    kv = dflash.context_kv(spec, params, feats, pos)
    bpos = t + jnp.arange(spec.block_size)[None]
    h = dflash.block_hidden(spec, params, model.embed(tp, jnp.asarray([block], jnp.int32)), bpos,
                            kv, jnp.asarray([t], jnp.int32))
    return np.asarray(dflash.draft_logits(model, tp, h)[0]), np.asarray(feats[0])


def test_context_features_are_the_references(ref):
    lm, spec, params, meta, arrays = ref
    case = meta["forward_cases"][meta["features_case"]]
    _, feats = _block_logits(lm, spec, params, case["context"], case["block"])
    want = arrays[f"case{meta['features_case']}_context_features"]
    np.testing.assert_allclose(feats, want, rtol=0, atol=1e-4)


def test_draft_logits_equal_the_reference_code(ref):
    """For every context, specjax's logits at all block slots are z-lab's to <= 1e-4, and
    its draft tokens (slots 1..B-1) are the reference's."""
    lm, spec, params, meta, arrays = ref
    assert len(meta["forward_cases"]) >= 3
    for i, case in enumerate(meta["forward_cases"]):
        got, _ = _block_logits(lm, spec, params, case["context"], case["block"])
        want = arrays[f"case{i}_logits"]
        assert np.std(want) > 0.1  # not a degenerate reference
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4, err_msg=f"case {i}")
        assert got[1:].argmax(-1).tolist() == case["draft_tokens"]


@pytest.mark.parametrize("wrong", ["k_and_v_swapped", "context_normed", "layer_ids_unshifted"])
def test_a_wrong_mapping_fails_the_same_test(ref, wrong):
    """The parity test has the power to see a wrong port: each mistake moves the logits by
    far more than its 1e-4."""
    lm, spec, params, meta, arrays = ref
    case, want = meta["forward_cases"][2], arrays["case2_logits"]
    if wrong == "k_and_v_swapped":
        bad = {**params, "layers": [{**lp, "k": lp["v"], "v": lp["k"]} for lp in params["layers"]]}
        got, _ = _block_logits(lm, spec, bad, case["context"], case["block"])
    elif wrong == "context_normed":  # the context through input_layernorm too
        bad = {**params, "hidden_norm": params["hidden_norm"] * params["layers"][0]["attn_norm"]}
        got, _ = _block_logits(lm, spec, bad, case["context"], case["block"])
    else:  # hidden_states[lid] instead of [lid + 1]: the streams entering the layers
        import dataclasses

        shifted = dataclasses.replace(spec, target_layers=tuple(l - 1 for l in spec.target_layers))
        got, _ = _block_logits(lm, shifted, params, case["context"], case["block"])
    assert np.max(np.abs(got - want)) > 1e-2, wrong


def test_greedy_runs_equal_the_reference_round_by_round(ref):
    """``dflash`` decodes each reference prompt to z-lab's output (which is the target's
    greedy output) in the same number of rounds."""
    lm, spec, params, meta, _ = ref
    drafter = dflash.DFlashDrafter(lm.model, spec)
    for run in meta["spec_runs"]:
        out = specjax.speculative_generate(lm.model, lm.params, drafter, params, [run["prompt"]],
                                           max_new_tokens=run["max_new_tokens"])
        assert out.to_lists()[0] == run["output"] == run["greedy"]
        want = sum(a - 1 for a in run["acceptance_lengths"])
        assert int(np.asarray(out.accepted).sum()) <= want  # the last round may be cut
        assert int(np.asarray(out.target_forwards)[0]) == len(run["acceptance_lengths"])  # rounds (the prefill is not one)


def test_fixtures_regenerate_bit_identical(tmp_path):
    """z-lab's code, rerun in its own environment, writes the committed fixtures again."""
    py = ROOT / ".venv-dflash" / "bin" / "python"
    if not py.exists():
        pytest.skip("the reference environment is absent: bash scripts/dflash_ref_env.sh "
                    "builds .venv-dflash (torch, transformers 4.57.1, z-lab/dflash 44947fb)")
    subprocess.run([str(py), str(ROOT / "scripts" / "dflash_reference.py"), "--out",
                    str(tmp_path)], check=True, capture_output=True, timeout=600)
    for f in ("reference.npz", "drafter/model.safetensors", "target/model.safetensors"):
        assert (tmp_path / f).read_bytes() == (REF / f).read_bytes(), f


# ----------------------------------------------------------------------------- the layout

def test_save_writes_the_hub_layout_back(ref, tmp_path):
    lm, spec, params, _, _ = ref
    out = heads.save(spec, params, tmp_path / "d", lm.model.config, dtype="float32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dflash_config"] == {"mask_token_id": 511, "target_layer_ids": [1, 3]}
    assert cfg["block_size"] == 4 and cfg["num_target_layers"] == 6
    spec2, params2 = heads.load(out, lm.model.config)
    assert spec2 == spec
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
        np.testing.assert_array_equal(np.asarray(a), b)
    from safetensors import safe_open

    with safe_open(out / "model.safetensors", "np") as st, \
            safe_open(REF / "drafter" / "model.safetensors", "np") as z:
        assert sorted(st.keys()) == sorted(z.keys())  # z-lab's names exactly


def _edit(tmp_path, config=None, drop=None, rename=None):
    d = tmp_path / "edited"
    shutil.copytree(REF / "drafter", d)
    if config:
        cfg = json.loads((d / "config.json").read_text())
        config(cfg)
        (d / "config.json").write_text(json.dumps(cfg))
    if drop or rename:
        from safetensors.numpy import load_file, save_file

        t = load_file(d / "model.safetensors")
        if drop:
            del t[drop]
        if rename:
            t[rename[1]] = t.pop(rename[0])
        save_file(t, d / "model.safetensors")
    return d


CASES = {
    "no mask id": (dict(config=lambda c: c["dflash_config"].pop("mask_token_id")),
                   "mask_token_id"),
    "mask id past the vocabulary": (dict(config=lambda c: c["dflash_config"].update(
        mask_token_id=600)), "mask_token_id"),
    "a layer past num_target_layers": (dict(config=lambda c: c["dflash_config"].update(
        target_layer_ids=[1, 6])), "target_layer_ids"),
    "made for another depth": (dict(config=lambda c: c.update(num_target_layers=8)),
                               "num_target_layers"),
    "another width": (dict(config=lambda c: c.update(hidden_size=128)), "hidden_size"),
    "sliding window": (dict(config=lambda c: c.update(layer_types=["sliding_attention"] * 2)),
                       "layer_types"),
    "biases": (dict(config=lambda c: c.update(attention_bias=True)), "attention_bias"),
    "missing tensor": (dict(drop="layers.1.self_attn.k_norm.weight"), "k_norm"),
    "misnamed tensor": (dict(rename=("fc.weight", "model.fc.weight")), "model.fc.weight"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_bad_drafter_is_refused_in_one_line(ref, tmp_path, case):
    lm = ref[0]
    kw, fragment = CASES[case]
    d = _edit(tmp_path, **kw)
    with pytest.raises(heads.CheckpointError) as e:
        heads.load(d, lm.model.config)
    toys.one_line(e, fragment)


def test_the_method_checks_its_drafter_before_the_model_loads(tmp_path):
    with pytest.raises(methods.SpecError) as e:
        methods.check("dflash", methods.Options())
    toys.one_line(e, "--draft-checkpoint")
    with pytest.raises(methods.SpecError) as e:
        methods.check("dflash:5", methods.Options(draft_checkpoint=str(REF / "drafter")))
    toys.one_line(e, "depth 5", "block of 4")
    with pytest.raises(methods.SpecError) as e:
        methods.check("dflash", methods.Options(draft_checkpoint=str(tmp_path)))
    toys.one_line(e, "config.json")
    for bad in ("dflash:0", "dflash:3,2", "dflash:3,2,100", "dflash:3:conf", "dflash:x"):
        with pytest.raises(methods.SpecError):
            methods.parse(bad)
    assert methods.parse("dflash:3,2,5").format() == "dflash:3,2,5"


def test_tree_holds_each_slots_topk(ref):
    """With ``topk`` > 1 the tree's nodes are parents-first, each one of its block slot's
    top-k tokens, the best first token among them; it decodes as ``ar`` and accepts at
    least what the chain accepts on the reference prompt."""
    lm, spec, params, meta, _ = ref
    prompt = meta["spec_runs"][0]["prompt"]
    chain = methods.build("dflash", lm, methods.Options(draft_checkpoint=str(REF / "drafter")))
    tree = methods.build("dflash:3,3,9", lm,
                         methods.Options(draft_checkpoint=str(REF / "drafter")))
    a = chain([prompt], max_new_tokens=32)
    b = tree([prompt], max_new_tokens=32)
    assert a.to_lists() == b.to_lists() == [meta["spec_runs"][0]["output"]]
    assert int(np.asarray(b.accepted).sum()) >= int(np.asarray(a.accepted).sum())
    d = tree.decoder.drafter
    ctx_tokens = jnp.asarray([prompt + [0] * 8], jnp.int32)
    t = len(prompt)
    layers = d.feature_layers
    _, hid, _ = lm.model.forward(lm.params, ctx_tokens[:, :t], jnp.arange(t)[None],
                                 lm.model.init_cache(1, t), return_layers=layers,
                                 compute_logits=False)
    kv = dflash.context_kv(spec, params, hidden_features(hid, layers), jnp.arange(t)[None])
    cache = KVCache(k=tuple(k for k, _ in kv), v=tuple(v for _, v in kv),
                    length=jnp.asarray([t - 1]))
    root, rp = ctx_tokens[:, t - 1], jnp.asarray([t - 1])
    logits = d.block_logits(params, lm.params, cache, root, rp)
    from specjax.core.drafter import Context
    from specjax.core import sampling

    ctx = Context(tokens=ctx_tokens, length=jnp.asarray([t]), prompt_len=jnp.asarray([t - 1]),
                  cache=None, params=lm.params)
    draft, _, _ = d.propose(params, dflash.DFlashState(cache=cache), ctx, jax.random.key(0),
                            sampling.Greedy())
    par, toks = np.asarray(draft.parents[0]), np.asarray(draft.tokens[0])
    assert len(par) == 9 and all(p < i for i, p in enumerate(par))  # parents first
    depth = []
    for p in par:
        depth.append(1 if p < 0 else depth[p] + 1)
    lq = np.asarray(logits[0])
    for i, d_ in enumerate(depth):  # every node is one of its slot's top-3 tokens
        assert toks[i] in np.argsort(-lq[d_ - 1])[:3], (i, d_)
    assert lq[0].argmax() in toks[np.asarray(depth) == 1]
    assert max(depth) >= 2  # a tree over the block, not only its first slot


# ----------------------------------------------------------------------------- training

def test_training_blocks_equal_the_inference_forward():
    """All anchors' blocks in one training forward give, block by block, the logits the
    drafter computes when it drafts after that anchor."""
    from specjax.train import dflash as td

    model, tp = toys.llama(seed=1)
    cfg = td.DFlashConfig(layers=2, block_size=4, anchors=6)
    spec = cfg.spec(model.config)
    p = dflash.init_params(spec, jax.random.key(0), scale=0.2)
    b, t = 2, 16
    toks = jax.random.randint(jax.random.key(1), (b, t), 0, 12)
    layers = tuple(l + 1 for l in spec.target_layers)
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    _, hid, _ = model.forward(tp, toks, pos, model.init_cache(b, t), return_layers=layers,
                              compute_logits=False)
    feats = hidden_features(hid, layers)
    trained = jnp.ones((b, t)).at[:, :4].set(0)
    anchors, keep = td.anchor_positions(jnp.pad(trained[:, 1:], ((0, 0), (0, 1))) > 0, 6,
                                        jax.random.key(2))
    assert bool(jnp.all(keep)) and int(anchors.min()) >= 3  # token a + 1 is trained
    bt, bp, vis, mask = td.block_batch(spec, toks, anchors, keep)
    kv = dflash.context_kv(spec, p, feats, pos)
    h = dflash.block_hidden(spec, p, model.embed(tp, bt), bp, kv, None, vis, mask)
    d = dflash.DFlashDrafter(model, spec)
    for n in range(anchors.shape[1]):
        a = anchors[:, n]
        cache = KVCache(k=tuple(k for k, _ in kv), v=tuple(v for _, v in kv), length=a)
        got = d.block_logits(p, tp, cache, jnp.take_along_axis(toks, a[:, None], 1)[:, 0], a)
        want = dflash.draft_logits(model, tp, h[:, n * 4 + 1:n * 4 + 4])
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4)


def test_training_lowers_the_loss_and_resumes_exactly(tmp_path):
    """A few steps on the toy's own greedy answers lower the loss; a run stopped after a
    checkpoint and resumed ends at the parameters of one that never stopped."""
    from specjax.train import dflash as td

    model, tp = toys.llama(seed=1)
    lm = toys.ToyLM(model, tp, eos_ids=())
    prompts = [[1, 5, 2, 7], [3, 3, 1], [7, 2], [4, 1, 1, 5, 6]] * 2
    outs = specjax.generate(model, tp, prompts, max_new_tokens=24).to_lists()
    cfg = td.DFlashConfig(layers=1, block_size=4, anchors=8, epochs=6, batch_tokens=128,
                          lr=3e-3, warmup=2, save_every=4)
    spec = cfg.spec(model.config)
    layers = tuple(l + 1 for l in spec.target_layers)
    from specjax.train import onpolicy

    ex = onpolicy.prefill_features(lm, [(np.asarray(p + o, np.int32), len(p))
                                        for p, o in zip(prompts, outs)], layers)
    ex = [(t, pl, f.astype(np.float16)) for t, pl, f in ex]
    logs = []
    full, _ = td.train(lm, ex, cfg, tmp_path / "a", log=logs.append)
    losses = [r["loss"] for r in logs if "loss" in r]
    assert np.mean(losses[-4:]) < np.mean(losses[:4]) - 0.1, losses
    td.train(lm, ex, cfg, tmp_path / "b", stop_after=5)
    resumed, _ = td.train(lm, ex, cfg, tmp_path / "b")
    assert int(resumed["step"]) == int(full["step"]) == len(td.plan(ex, cfg))
    for a, b in zip(jax.tree.leaves(full["params"]), jax.tree.leaves(resumed["params"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)


def test_config_refuses_bad_settings():
    from specjax.train.dflash import DFlashConfig

    for bad in (dict(block_size=1), dict(anchors=0), dict(gamma=0.0), dict(layers=0)):
        with pytest.raises(ValueError) as e:
            DFlashConfig(**bad)
        toys.one_line(e, next(iter(bad)).split("_")[0])
