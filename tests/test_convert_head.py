"""Heads specjax exported, written in SafeAILab/EAGLE's published layouts
(``published.save`` and ``specjax convert-head``): the files' forward, run by the
independent PyTorch reference of ``tests/published.py``, equals specjax's forward of the
original head; converting what ``published.load`` reads back writes the same bytes; a
converted head decodes as ``ar``; heads the layouts cannot express are refused in one
line."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import toys
from published import d2t_target_ids, torch_eagle1_logits, torch_eagle3_logits
from specjax import cli, methods
from specjax.core.decoding import generate
from specjax.drafters import blocks, eagle, eagle3
from specjax.heads import exported, kinds, published, shipped_head
from specjax.heads.published import NoPublishedLayout
from specjax.models.base import RopeScaling

TARGET = toys.LLAMA_6  # V 64, hidden 32, 4 heads of 8, 2 K/V heads, 6 layers
V, H, DV, B, T = TARGET.vocab_size, TARGET.hidden_size, 24, 2, 7


def _jitter(tree, key, scale=0.1):
    """Every leaf moved off its init value (norms away from 1, biases away from 0), so a
    tensor written under the wrong name changes the forward."""
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(treedef, [x + scale * jax.random.normal(k, x.shape)
                                        for x, k in zip(leaves, keys)])


def eagle1_head(cfg=TARGET, seed=0, layers=1) -> dict:
    """A random EAGLE-1/2 head of the published shape: ``eagle.init_head``'s tree without
    the layer's ``attn_norm`` (EAGLE-1/2's layer 0 has no input norm), and ``layers - 1``
    more whole decoder layers (``num_hidden_layers``)."""
    hp = eagle.init_head(cfg, jax.random.key(seed), layers=layers)
    del hp["layer"]["attn_norm"]
    return jax.tree.map(np.asarray, _jitter(hp, jax.random.key(seed + 1)))


def eagle3_head(cfg=TARGET, seed=0, dv=DV) -> tuple[dict, np.ndarray]:
    """A random EAGLE-3 head and its draft vocabulary (distinct target ids, not sorted, so
    ``d2t``'s offsets are not all equal)."""
    hp = _jitter(eagle3.init_head(cfg, jax.random.key(seed), dv), jax.random.key(seed + 1))
    ids = np.random.default_rng(seed).permutation(cfg.vocab_size)[:dv]
    return jax.tree.map(np.asarray, hp), ids


def _read(d):
    """The converted directory as the reference reads it: torch state dict and config."""
    return load_file(str(d / "model.safetensors")), json.loads((d / "config.json").read_text())


def _inputs(seed: int, width: int):
    g = torch.Generator().manual_seed(seed)
    embed, head = torch.randn(V, H, generator=g) * 0.5, torch.randn(V, H, generator=g) * 0.5
    return embed, head, torch.randint(0, V, (B, T), generator=g), torch.randn(B, T, width,
                                                                             generator=g)


def _run(fn, spec, hp, emb, x):
    """A head's ``apply_head`` over a causal sequence from an empty cache, float32."""
    k, v = blocks.empty_kv(spec, B, T, jnp.float32, 1 + len(hp.get("extra_layers", ())))
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    hp = jax.tree.map(jnp.asarray, hp)
    out, _, _ = fn(spec, hp, jnp.asarray(emb), jnp.asarray(x), pos, k, v,
                   jnp.zeros((B,), jnp.int32), blocks.causal(B, T))
    return out


# --- 1. the converted files' reference forward equals specjax's forward of the head --------

# linear RoPE scaling with another base, written as EAGLE's heads read it ({"type": "linear"})
LINEAR = dataclasses.replace(TARGET, rope_theta=500000.0, rope_scaling=RopeScaling("linear", 4.0))


@pytest.mark.parametrize("target,layers", [(TARGET, 1), (LINEAR, 1), (TARGET, 2)],
                         ids=["default-rope", "linear-rope", "two-layers"])
def test_converted_eagle1_head_equals_the_pytorch_reference(tmp_path, target, layers):
    hp = eagle1_head(target, layers=layers)
    # for SpecForge/SGLang: SafeAILab/EAGLE's code ignores rope_theta under linear scaling
    published.save("eagle", hp, tmp_path, target, dtype="float32", for_sglang=target is LINEAR)
    sd, cfg = _read(tmp_path)
    assert cfg["torch_dtype"] == "float32" and "layers.0.input_layernorm.weight" not in sd
    assert cfg["num_hidden_layers"] == layers
    assert ("layers.1.input_layernorm.weight" in sd) == (layers == 2)
    if target is LINEAR:
        assert cfg["rope_scaling"] == {"type": "linear", "factor": 4.0}
    embed, lm_head, tokens, feats = _inputs(1, H)
    spec = blocks.LayerSpec.of(target)
    out = _run(eagle.apply_head, spec, hp, embed[tokens].numpy(), feats.numpy())
    ours = np.asarray(out @ jnp.asarray(lm_head.numpy()).T)
    ref = torch_eagle1_logits(sd, cfg, embed, lm_head, tokens, feats).numpy()
    assert np.abs(ours - ref).max() < 1e-4, np.abs(ours - ref).max()
    bad = torch_eagle1_logits(sd, cfg, embed, lm_head, tokens, feats, wrong="swap_concat")
    assert np.abs(ours - bad.numpy()).max() > 1e-2  # the comparison can tell


def test_converted_eagle3_head_equals_the_pytorch_reference(tmp_path):
    hp, ids = eagle3_head()
    published.save("eagle3", hp, tmp_path, TARGET, vocab_ids=ids,
                   layers=eagle3.fused_layers(TARGET.num_layers), dtype="float32")
    sd, cfg = _read(tmp_path)
    assert cfg["draft_vocab_size"] == DV and sd["d2t"].dtype == torch.int64
    assert sd["t2d"].dtype == torch.bool and int(sd["t2d"].sum()) == DV
    np.testing.assert_array_equal(d2t_target_ids(sd["d2t"], torch.arange(DV)).numpy(), ids)
    embed, _, tokens, fused = _inputs(2, 3 * H)
    spec = eagle3.layer_spec(TARGET)
    out = _run(eagle3.apply_head, spec, hp, embed[tokens].numpy(), fused.numpy())
    ours = np.asarray(eagle3.draft_logits(spec, jax.tree.map(jnp.asarray, hp), out))
    ref, ref_x = torch_eagle3_logits(sd, cfg, embed, tokens, fused)
    assert np.abs(ours - ref.numpy()).max() < 1e-4, np.abs(ours - ref.numpy()).max()
    # a later draft step: the head's own output in place of the fused states (fc skipped)
    out2 = _run(eagle3.apply_head, spec, hp, embed[tokens].numpy(), ref_x.numpy())
    ours2 = np.asarray(eagle3.draft_logits(spec, jax.tree.map(jnp.asarray, hp), out2))
    assert np.abs(ours2 - torch_eagle3_logits(sd, cfg, embed, tokens, ref_x)[0].numpy()).max() < 1e-4


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_bfloat16_files_hold_the_head_rounded_to_bfloat16(tmp_path, kind):
    """The default dtype (bfloat16, as SafeAILab/EAGLE publishes) stores each weight rounded
    once to bfloat16: ``load`` reads back exactly the float32 head cast to bfloat16."""
    hp, ids = (eagle1_head(), None) if kind == "eagle" else eagle3_head()
    published.save(kind, hp, tmp_path, TARGET, vocab_ids=ids)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    head = published.load(tmp_path, TARGET)
    rounded = jax.tree.map(lambda x: x.astype(ml_dtypes.bfloat16).astype(np.float32), hp)
    jax.tree.map(np.testing.assert_array_equal, head.params, rounded)
    if kind == "eagle3":
        np.testing.assert_array_equal(head.vocab_ids, ids)


# --- 2. convert -> load -> convert writes the same bytes ------------------------------------

@pytest.mark.parametrize("kind,dtype,layers", [("eagle", "bfloat16", 1), ("eagle3", "bfloat16", 1),
                                               ("eagle3", "float32", 1), ("eagle", "bfloat16", 2)])
def test_convert_load_convert_is_byte_stable(tmp_path, kind, dtype, layers):
    hp, ids = (eagle1_head(layers=layers), None) if kind == "eagle" else eagle3_head()
    a, b = tmp_path / "a", tmp_path / "b"
    published.save(kind, hp, a, TARGET, vocab_ids=ids, dtype=dtype)
    head = published.load(a, TARGET)
    published.save(head.kind, head.params, b, TARGET, spec=head.spec, vocab_ids=head.vocab_ids,
                   layers=head.layers, dtype=dtype)
    for name in published.SAVED_FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    published.save(kind, hp, a, TARGET, vocab_ids=ids, dtype=dtype)  # over a conversion
    assert sorted(p.name for p in a.iterdir()) == sorted(published.SAVED_FILES)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()


# --- 3. a converted head decodes as ar through --draft-checkpoint ---------------------------

@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """A random 6-layer Llama saved as an HF directory (what ``--model DIR`` reads)."""
    root = tmp_path_factory.mktemp("convert")
    return toys.loaded_llama(root / "toy", layers=6), root / "toy"


def assert_decodes_as_ar(lm, spec: str, head_dir) -> None:
    """``spec`` with ``--draft-checkpoint head_dir`` decodes two prompts exactly as ``ar``,
    drafting some tokens."""
    built = methods.build(spec, lm, methods.Options(draft_checkpoint=str(head_dir)))
    prompts, budgets = [[5, 9, 17, 3, 44], [7] * 11], [20, 13]
    ar = generate(lm.model, lm.params, prompts, max_new_tokens=budgets).to_lists()
    out = built(prompts, max_new_tokens=budgets)
    assert out.to_lists() == ar
    assert out.drafted.sum() > 0


@pytest.mark.parametrize("spec,layers", [("eagle2:3,3,8", 1), ("eagle3:3,3,8", 1),
                                         ("eagle2:3,3,8", 2)])
def test_a_converted_head_decodes_as_ar(toy, tmp_path, spec, layers):
    lm, _ = toy
    cfg = lm.model.config
    if spec.startswith("eagle3"):
        hp, ids = eagle3_head(cfg, seed=3, dv=48)
        published.save("eagle3", hp, tmp_path, cfg, vocab_ids=ids)
    else:
        published.save("eagle", eagle1_head(cfg, seed=3, layers=layers), tmp_path, cfg)
    assert_decodes_as_ar(lm, spec, tmp_path)


# --- refusals: a head no published layout expresses -----------------------------------------

def test_heads_without_a_published_layout_are_refused(tmp_path):
    hp = eagle1_head()
    with_norm = {**hp, "layer": {**hp["layer"], "attn_norm": np.ones((H,), np.float32)}}
    cases = [
        (lambda: published.save("eagle", with_norm, tmp_path / "a", TARGET),
         "no input_layernorm"),
        (lambda: published.save("eagle", hp, tmp_path / "b", TARGET, draft_vocab=8),
         "reduced vocabulary of 8"),
        (lambda: published.save("eagle3", eagle3_head()[0], tmp_path / "c", TARGET,
                                layers=(1, 2, 3)), "fuses layers [2, 3, 3]"),
        (lambda: published.save("eagle3", {**eagle3_head()[0], "extra": np.ones(3)},
                                tmp_path / "d", TARGET), "['extra'] have no tensor"),
        (lambda: published.save("eagle", hp, tmp_path / "e", toys.GEMMA), "Gemma"),
        (lambda: published.save("redrafter", hp, tmp_path / "f", TARGET), "'redrafter'"),
        (lambda: published.save("eagle", eagle1_head(toys.LLAMA3_ROPE), tmp_path / "g",
                                toys.LLAMA3_ROPE), "llama3 scaling"),
    ]
    for call, msg in cases:
        with pytest.raises(NoPublishedLayout) as e:
            call()
        assert msg in str(e.value) and len(str(e.value).splitlines()) == 1, str(e.value)
    assert not any(tmp_path.iterdir())  # nothing written for a refused head
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a previous conversion"):
        published.save("eagle", hp, tmp_path / "x", TARGET)


def test_the_attn_norm_refusal_names_no_attn_norm(tmp_path):
    """The refusal of a head with ``attn_norm`` says how to train one that exports to the
    EAGLE-1/2 layout (``--no-attn-norm``), not that every head specjax trains has one."""
    hp = eagle1_head()
    with_norm = {**hp, "layer": {**hp["layer"], "attn_norm": np.ones((H,), np.float32)}}
    with pytest.raises(NoPublishedLayout) as e:
        published.save("eagle", with_norm, tmp_path / "a", TARGET)
    msg = str(e.value)
    assert "--no-attn-norm" in msg and "every head" not in msg, msg
    assert "by default" in msg and len(msg.splitlines()) == 1, msg


# linear RoPE scaling with EAGLE's own base, 10000: EAGLE's code runs it as written
LINEAR_10K = dataclasses.replace(LINEAR, rope_theta=10000.0)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_linear_rope_with_another_base_is_refused_unless_for_sglang(tmp_path, kind):
    """SafeAILab/EAGLE builds linear-scaled RoPE with base 10000 whatever ``rope_theta``
    says: such a head is refused in one line naming ``--for-sglang``, nothing written;
    with ``for_sglang`` it is written with its ``rope_theta``; base 10000 needs no flag."""
    def head(cfg):
        return (eagle1_head(cfg), None) if kind == "eagle" else eagle3_head(cfg)

    hp, ids = head(LINEAR)
    with pytest.raises(NoPublishedLayout) as e:
        published.save(kind, hp, tmp_path / "a", LINEAR, vocab_ids=ids)
    msg = str(e.value)
    assert "--for-sglang" in msg and "rope_theta 500000" in msg and "base 10000" in msg, msg
    assert "SpecForge" in msg and len(msg.splitlines()) == 1, msg
    assert not any(tmp_path.iterdir())
    published.save(kind, hp, tmp_path / "b", LINEAR, vocab_ids=ids, for_sglang=True)
    cfg = json.loads((tmp_path / "b" / "config.json").read_text())
    assert cfg["rope_theta"] == 500000.0
    assert cfg["rope_scaling"] == {"type": "linear", "factor": 4.0}
    assert published.load(tmp_path / "b", LINEAR).spec.rope_theta == 500000.0
    hp, ids = head(LINEAR_10K)
    published.save(kind, hp, tmp_path / "c", LINEAR_10K, vocab_ids=ids)
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    assert cfg["rope_theta"] == 10000.0 and cfg["rope_scaling"]["type"] == "linear"


def _target_logits(spec, hp, vocab_ids, emb, fused):
    """Draft logits over the target's vocabulary: draft id i's logit at target id
    ``vocab_ids[i]`` (every target id covered: a full-size draft vocabulary)."""
    hp = jax.tree.map(jnp.asarray, hp)
    out = np.asarray(eagle3.draft_logits(spec, hp, _run(eagle3.apply_head, spec, hp, emb,
                                                        fused)))
    full = np.full(out.shape[:-1] + (V,), np.nan, np.float32)
    full[..., np.asarray(vocab_ids)] = out
    return full


def test_a_full_size_permuted_vocabulary_is_written_in_identity_order(tmp_path):
    """A draft vocabulary as large as the target's, in another order: SafeAILab/EAGLE drops
    ``d2t`` at that size and reads ``lm_head`` row j as target id j, so the rows are
    written permuted into identity order (``d2t`` zeros, ``t2d`` all true, which SpecForge's
    loader needs); read back, the draft logits over the target's vocabulary are identical,
    and the reference forward of the file, read as EAGLE reads it, equals them."""
    hp, ids = eagle3_head(dv=V)
    assert not np.array_equal(ids, np.arange(V))  # a permutation, not the identity
    published.save("eagle3", hp, tmp_path, TARGET, vocab_ids=ids, dtype="float32")
    sd, cfg = _read(tmp_path)
    assert cfg["draft_vocab_size"] == V == cfg["vocab_size"]
    assert not sd["d2t"].any() and bool(sd["t2d"].all())  # the identity map
    lm = sd["lm_head.weight"].numpy()
    np.testing.assert_array_equal(lm[ids], hp["lm_head"])  # row ids[i] is draft id i's
    head = published.load(tmp_path, TARGET)
    np.testing.assert_array_equal(head.vocab_ids, np.arange(V))
    embed, _, tokens, fused = _inputs(3, 3 * H)
    spec = eagle3.layer_spec(TARGET)
    want = _target_logits(spec, hp, ids, embed[tokens].numpy(), fused.numpy())
    got = _target_logits(head.spec, head.params, head.vocab_ids, embed[tokens].numpy(),
                         fused.numpy())
    assert not np.isnan(want).any()
    np.testing.assert_array_equal(got, want)
    eagle_reads, _ = torch_eagle3_logits(sd, cfg, embed, tokens, fused)  # row j: target id j
    assert np.abs(eagle_reads.numpy() - want).max() < 1e-4
    # the files convert back to the same bytes (identity order stays)
    published.save("eagle3", head.params, tmp_path / "again", TARGET, spec=head.spec,
                   vocab_ids=head.vocab_ids, layers=head.layers, dtype="float32")
    assert ((tmp_path / "again" / "model.safetensors").read_bytes()
            == (tmp_path / "model.safetensors").read_bytes())


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_rms_norm_eps_is_written_as_its_shortest_float32_decimal(tmp_path, kind):
    """A target whose eps is a float32 value (a GGUF's 1e-5 reads as
    9.999999747378752e-06) writes ``"rms_norm_eps": 1e-05``, which rounds to the same
    float32; an eps that is no float32 value (1e-6 from an HF config) is written as is."""
    f32 = dataclasses.replace(TARGET, rms_norm_eps=float(np.float32(1e-5)))
    assert f32.rms_norm_eps == 9.999999747378752e-06
    for cfg_, want, d in ((f32, 1e-05, "a"), (dataclasses.replace(TARGET, rms_norm_eps=1e-6),
                                               1e-06, "b")):
        hp, ids = (eagle1_head(cfg_), None) if kind == "eagle" else eagle3_head(cfg_)
        published.save(kind, hp, tmp_path / d, cfg_, vocab_ids=ids)
        text = (tmp_path / d / "config.json").read_text()
        assert json.loads(text)["rms_norm_eps"] == want
        assert f'"rms_norm_eps": {want!r}' in text, text
        assert np.float32(want) == np.float32(cfg_.rms_norm_eps)


def test_embedding_note_names_the_embedding_the_head_expects():
    """Without ``embed`` the written head expects the target's embedding; with one, its own
    (and SpecForge's default replacement by the target's is named)."""
    hp, _ = eagle3_head()
    assert "expects the target's embedding" in published.embedding_note(hp)
    own = published.embedding_note({**hp, "embed": np.zeros((V, H), np.float32)})
    assert "its own embedding" in own and "SpecForge" in own


# --- 4. the command -------------------------------------------------------------------------

_LAST_OUT = [""]  # the last _cli call's stdout


def _cli(argv, capsys):
    try:
        code = cli.main(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    out = capsys.readouterr()
    _LAST_OUT[0] = out.out
    return code, out.err.strip()


def test_cli_converts_exported_heads(toy, tmp_path, capsys):
    lm, model_dir = toy
    cfg = lm.model.config
    hp3, ids = eagle3_head(cfg, seed=5, dv=40)
    kinds.save_eagle3(hp3, tmp_path / "h3", vocab_ids=ids,
                      layers=eagle3.fused_layers(cfg.num_layers))
    kinds.save_eagle(eagle1_head(cfg, seed=5), tmp_path / "h1")
    for kind, src in (("eagle3", "h3"), ("eagle", "h1")):
        out = tmp_path / f"out-{kind}"
        for _ in range(2):  # the second run writes over the first conversion
            code, err = _cli(["convert-head", str(tmp_path / src), str(out), "--to", kind,
                              "--model", str(model_dir)], capsys)
            assert code == 0, err
        assert "embedding: the head carries no embed_tokens.weight" in _LAST_OUT[0]
        head = published.load(out, cfg)
        params, _ = export_params(tmp_path / src, kind)
        jax.tree.map(np.testing.assert_array_equal, head.params, params)  # bf16 both ways
        if kind == "eagle3":
            np.testing.assert_array_equal(head.vocab_ids, ids)


def export_params(path, kind):
    """The exported head's parameters as float32 numpy."""
    from specjax.heads import exported

    params, meta = exported.load_head(path, kind)
    return jax.tree.map(lambda x: np.asarray(x, np.float32), params), meta


def test_cli_refusals_are_one_line(toy, tmp_path, capsys):
    lm, model_dir = toy
    cfg = lm.model.config
    hp3, ids = eagle3_head(cfg, seed=5, dv=40)
    kinds.save_eagle3(hp3, tmp_path / "h3", vocab_ids=ids,
                      layers=eagle3.fused_layers(cfg.num_layers))
    kinds.save_eagle(eagle1_head(cfg), tmp_path / "h1", vocab_ids=np.arange(8),
                     draft_vocab=8)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    m = ["--model", str(model_dir)]
    probes = [
        (["convert-head", str(tmp_path / "h3"), str(tmp_path / "o1"), "--to", "eagle", *m], 2,
         "holds an exported 'eagle3' head, not 'eagle': use --to eagle3"),
        (["convert-head", str(tmp_path / "missing"), str(tmp_path / "o2"), "--to", "eagle3",
          *m], 2, "missing does not exist"),
        (["convert-head", str(tmp_path / "h3"), str(tmp_path / "full"), "--to", "eagle3", *m],
         2, "is not empty and not a previous conversion"),
        (["convert-head", str(tmp_path / "h1"), str(tmp_path / "o3"), "--to", "eagle", *m], 1,
         "reduced vocabulary of 8"),
        (["convert-head", str(tmp_path / "h3"), str(tmp_path / "o4"), "--to", "eagle4", *m], 2,
         "invalid choice: 'eagle4'"),
    ]
    for argv, want, msg in probes:
        code, err = _cli(argv, capsys)
        assert code == want and len(err.splitlines()) == 1 and msg in err, (argv, code, err)
    assert (tmp_path / "full" / "notes.txt").read_text() == "mine"
    assert not any((tmp_path / o).exists() for o in ("o1", "o2", "o3", "o4"))


def test_cli_refuses_linear_rope_with_another_base_unless_for_sglang(toy, tmp_path, capsys):
    """``convert-head`` against a target with linear RoPE scaling and rope_theta 500000
    (an HF directory holding only its config.json): refused in one line naming
    ``--for-sglang``, nothing written; with ``--for-sglang`` written with that base."""
    lm, model_dir = toy
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.update(rope_theta=500000.0, rope_scaling={"type": "linear", "factor": 2.0})
    (tmp_path / "linear").mkdir()
    (tmp_path / "linear" / "config.json").write_text(json.dumps(cfg))
    kinds.save_eagle(eagle1_head(lm.model.config, seed=5), tmp_path / "h1")
    argv = ["convert-head", str(tmp_path / "h1"), str(tmp_path / "o"), "--to", "eagle",
            "--model", str(tmp_path / "linear")]
    code, err = _cli(argv, capsys)
    assert code == 1 and len(err.splitlines()) == 1 and "--for-sglang" in err, err
    assert not (tmp_path / "o").exists()
    code, err = _cli([*argv, "--for-sglang"], capsys)
    assert code == 0, err
    written = json.loads((tmp_path / "o" / "config.json").read_text())
    assert written["rope_theta"] == 500000.0 and written["rope_scaling"]["factor"] == 2.0


def test_the_shipped_heads_convert_to_the_published_layout_or_say_why_not(tmp_path, capsys):
    """Whatever layout a shipped EAGLE head has, ``convert-head`` handles it in one step:
    a head without the attention-input norm (``head.json``: ``attn_norm: false``) is
    written in EAGLE-1/2's layout and read back to the parameters specjax decodes with,
    bit for bit (bfloat16 both); a head with the norm, or of a non-Llama target, is
    refused in one line naming why, and nothing is written. Read against the registry's
    configurations, no weights loaded."""
    from specjax.commands.convert import target_config

    for model in ("smollm2-135m", "gemma3-270m"):
        head = shipped_head("eagle", model)
        if head is None:
            continue
        out = tmp_path / model
        code, err = _cli(["convert-head", str(head), str(out), "--to", "eagle"], capsys)
        meta = exported.read_meta(head, "eagle")
        cfg = target_config(model)
        if kinds.eagle_attn_norm(meta) or "Llama" not in type(cfg).__name__:
            assert code == 1 and len(err.splitlines()) == 1, err
            assert "attn_norm" in err or "target is a" in err, err
            assert not out.exists()
            continue
        assert code == 0, err
        back = published.load(out, cfg).params
        ours, _ = kinds.load_eagle(head, cfg)
        jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, back),
                     jax.tree.map(np.asarray, ours))


# --- train onpolicy --export-format eagle3 --------------------------------------------------

def test_an_exported_eagle3_head_is_also_written_in_the_published_layout(tmp_path):
    """What ``train onpolicy --export DIR --export-format eagle3`` does after its export:
    ``DIR-eagle3`` holds the same head (bfloat16 both) in the published layout."""
    from specjax.train import glue

    hp, ids = eagle3_head()
    kinds.save_eagle3(hp, tmp_path / "h", vocab_ids=ids,
                      layers=eagle3.fused_layers(TARGET.num_layers))
    out = glue.export_published(tmp_path / "h", TARGET)
    assert out == tmp_path / "h-eagle3" == glue.published_dir(tmp_path / "h", "eagle3")
    head = published.load(out, TARGET)
    params, _ = export_params(tmp_path / "h", "eagle3")
    jax.tree.map(np.testing.assert_array_equal, head.params, params)
    np.testing.assert_array_equal(head.vocab_ids, ids)


def test_train_onpolicy_export_format_is_checked_before_any_work(tmp_path, capsys):
    base = ["train", "onpolicy", "--prompts", str(tmp_path / "p"), "--shards",
            str(tmp_path / "s"), "--run", str(tmp_path / "r")]
    (tmp_path / "e-eagle3").mkdir()
    (tmp_path / "e-eagle3" / "notes.txt").write_text("mine")
    probes = [
        ([*base, "--kind", "eagle3", "--export-format", "eagle3"], "needs --export DIR"),
        ([*base, "--export", str(tmp_path / "e"), "--export-format", "eagle3"],
         "needs --kind eagle3"),
        ([*base, "--kind", "eagle3", "--export", str(tmp_path / "e"), "--export-format",
          "eagle3"], "not a previous conversion"),
        ([*base, "--kind", "eagle", "--export-format", "eagle2"], "invalid choice: 'eagle2'"),
    ]
    for argv, msg in probes:
        code, err = _cli(argv, capsys)
        assert code == 2 and len(err.splitlines()) == 1 and msg in err, (argv, code, err)


# --- train eagle / onpolicy --no-attn-norm --export-format eagle ----------------------------

@pytest.fixture(scope="module")
def trained_eagle1(toy, tmp_path_factory):
    """``specjax train eagle --no-attn-norm --export DIR --export-format eagle``, 4 steps on
    the toy's own answers to 4 prompts: ``(DIR, DIR-eagle)``."""
    from specjax.train import distill

    lm, _ = toy
    root = tmp_path_factory.mktemp("train-eagle1")
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, 128, size=n)) for n in (5, 9, 14, 20)]
    corpus = distill.answer_batch(lm, prompts, max_new_tokens=12)
    argv = ["train", "eagle", "--data", str(root), "--run", str(root / "run"), "--steps", "4",
            "--batch-tokens", "256", "--max-len", "64", "--save-every", "4", "--lr", "1e-2",
            "--warmup", "1", "--no-attn-norm", "--export", str(root / "head"),
            "--export-format", "eagle"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("specjax.models.load", lambda *a, **k: lm)
        mp.setattr(distill, "load_shards", lambda d: corpus)
        assert cli.main(argv) == 0
    return root / "head", root / "head-eagle"


def test_a_head_trained_without_attn_norm_exports_in_the_eagle1_layout(toy, trained_eagle1,
                                                                        tmp_path, capsys):
    """The head ``train eagle --no-attn-norm`` trained (head.json says so) is written as
    EAGLE-1/2 files whose PyTorch reference forward, on their float32 conversion, equals
    specjax's forward of the exported head; with an input norm the reference differs."""
    lm, model_dir = toy
    cfg = lm.model.config
    head_dir, pub = trained_eagle1
    meta = json.loads((head_dir / "head.json").read_text())
    assert meta["attn_norm"] is False and meta["train"]["attn_norm"] is False
    assert meta["steps_done"] == 4
    hp, _ = kinds.load_eagle(head_dir, cfg)
    hp = jax.tree.map(lambda x: np.asarray(x, np.float32), hp)
    assert "attn_norm" not in hp["layer"]
    fresh = eagle.init_head(cfg, jax.random.key(0), attn_norm=False)
    assert np.abs(hp["fc"] - np.asarray(fresh["fc"])).max() > 1e-3  # it trained
    sd16, cfg16 = _read(pub)
    assert cfg16["torch_dtype"] == "bfloat16" and "layers.0.input_layernorm.weight" not in sd16
    f32 = tmp_path / "f32"  # the float32 export: convert-head of the same head
    code, err = _cli(["convert-head", str(head_dir), str(f32), "--to", "eagle", "--dtype",
                      "float32", "--model", str(model_dir)], capsys)
    assert code == 0, err
    sd, pcfg = _read(f32)
    assert sorted(sd) == sorted(sd16)
    for k in sd:  # the bfloat16 export holds the float32 one's values
        assert torch.equal(sd[k], sd16[k].float()), k
    g = torch.Generator().manual_seed(7)
    v, h = cfg.vocab_size, cfg.hidden_size
    embed, lm_head = torch.randn(v, h, generator=g) * 0.5, torch.randn(v, h, generator=g) * 0.5
    tokens, feats = torch.randint(0, v, (B, T), generator=g), torch.randn(B, T, h, generator=g)
    out = _run(eagle.apply_head, blocks.LayerSpec.of(cfg), hp, embed[tokens].numpy(),
               feats.numpy())
    ours = np.asarray(out @ jnp.asarray(lm_head.numpy()).T)
    ref = torch_eagle1_logits(sd, pcfg, embed, lm_head, tokens, feats).numpy()
    assert np.abs(ours - ref).max() < 1e-4, np.abs(ours - ref).max()
    normed = torch_eagle1_logits(sd, pcfg, embed, lm_head, tokens, feats, wrong="input_norm")
    assert np.abs(ours - normed.numpy()).max() > 1e-2  # the comparison sees an input norm


@pytest.mark.parametrize("which", ["published", "specjax"])
def test_a_head_trained_without_attn_norm_decodes_as_ar(toy, trained_eagle1, which):
    """Both the published copy (``DIR-eagle``) and the specjax export (``head.json`` says
    it has no ``attn_norm``) load through ``--draft-checkpoint`` and decode as ``ar``."""
    lm, _ = toy
    head_dir, pub = trained_eagle1
    assert_decodes_as_ar(lm, "eagle2:3,3,8", pub if which == "published" else head_dir)


def test_without_no_attn_norm_a_warm_start_keeps_its_layout(toy, trained_eagle1, tmp_path):
    """Without ``--no-attn-norm`` (``attn_norm`` None) ``train eagle``/``onpolicy`` take the
    layout of the EAGLE-2 head ``--init`` names (``shipped``: the model's shipped head), read
    from ``head.json``; a random head, an EAGLE-3 run and an unreadable directory have the
    norm, and the flag, when given, is kept."""
    from argparse import Namespace

    from specjax.commands.train import _resolve_attn_norm

    head_dir, _ = trained_eagle1
    normed = kinds.save_eagle(eagle.init_head(toy[0].model.config, jax.random.key(1)),
                              tmp_path / "normed")
    cases = [(str(head_dir), "eagle", None, False), (str(normed), "eagle", None, True),
             ("none", "eagle", None, True), (str(head_dir), "eagle3", None, True),
             (str(tmp_path / "missing"), "eagle", None, True),
             (str(normed), "eagle", False, False)]
    shipped = shipped_head("eagle", "smollm2-135m")
    if shipped is not None:
        cases.append(("shipped", "eagle", None,
                      kinds.eagle_attn_norm(exported.read_meta(shipped, "eagle"))))
    for init, kind, flag, want in cases:
        args = Namespace(attn_norm=flag, init=init, kind=kind, model="smollm2-135m")
        _resolve_attn_norm(args)
        assert args.attn_norm is want, (init, kind, flag)
    args = Namespace(attn_norm=None, init=str(head_dir), model="smollm2-135m")  # train eagle
    _resolve_attn_norm(args)
    assert args.attn_norm is False


def test_export_format_eagle_and_no_attn_norm_are_checked_before_any_work(
        toy, trained_eagle1, tmp_path, capsys):
    """``--export-format eagle`` and ``--no-attn-norm`` refused in one usage line (exit 2)
    before anything is read or written: the published layout needs a head without
    ``attn_norm``, of kind ``eagle``, over the whole vocabulary; a warm start must have
    the layout the run trains."""
    _, model_dir = toy
    head_dir, _ = trained_eagle1
    normed = kinds.save_eagle(eagle.init_head(toy[0].model.config, jax.random.key(1)),
                              tmp_path / "normed")
    e = str(tmp_path / "e")
    te = ["train", "eagle", "--data", str(tmp_path / "d"), "--run", str(tmp_path / "r")]
    to = ["train", "onpolicy", "--prompts", str(tmp_path / "p"), "--shards",
          str(tmp_path / "s"), "--run", str(tmp_path / "r")]
    probes = [
        ([*te, "--export", e, "--export-format", "eagle"], "needs --no-attn-norm"),
        ([*te, "--no-attn-norm", "--export-format", "eagle"], "needs --export DIR"),
        ([*te, "--no-attn-norm", "--export", e, "--export-format", "eagle", "--draft-vocab",
          "8"], "needs --draft-vocab 0, got 8"),
        ([*te, "--export", e, "--export-format", "eagle3"], "invalid choice: 'eagle3'"),
        ([*te, "--no-attn-norm", "--init", str(normed)], "normalizes its attention input"),
        ([*to, "--kind", "eagle", "--init", "none", "--export", e, "--export-format",
          "eagle"], "needs --no-attn-norm"),
        ([*to, "--kind", "eagle", "--init", str(normed), "--export", e, "--export-format",
          "eagle"], "needs --no-attn-norm"),
        ([*to, "--kind", "eagle3", "--no-attn-norm", "--export", e, "--export-format",
          "eagle"], "--export-format eagle needs --kind eagle"),
        ([*to, "--kind", "eagle3", "--no-attn-norm"], "--no-attn-norm needs --kind eagle"),
        ([*to, "--kind", "eagle3", "--head-layers", "2"], "--head-layers needs --kind eagle"),
        ([*to, "--kind", "eagle", "--head-layers", "0"], "--head-layers must be >= 1"),
        ([*to, "--kind", "eagle", "--w-ce", "-1"], "--w-ce must be >= 0"),
        ([*to, "--kind", "eagle", "--max-prompt-tokens", "0"],
         "--max-prompt-tokens must be >= 1"),
        ([*to, "--kind", "eagle", "--no-attn-norm", "--init", str(normed)],
         "normalizes its attention input"),
        ([*to, "--kind", "eagle", "--fold-attn-norm", "--init", str(normed)],
         "add --no-attn-norm"),
        ([*to, "--kind", "eagle", "--no-attn-norm", "--fold-attn-norm", "--init", "none"],
         "--init none gives none to fold"),
        ([*to, "--kind", "eagle", "--no-attn-norm", "--fold-attn-norm", "--init",
          str(head_dir)], "gives none to fold"),
        ([*to, "--kind", "eagle", "--no-attn-norm", "--fold-attn-norm", "--init",
          str(normed)], "holds none yet"),
    ]
    for model in ("smollm2-135m", "gemma3-270m"):  # the default --init shipped, if normed
        shipped = shipped_head("eagle", model)
        if shipped is not None and kinds.eagle_attn_norm(exported.read_meta(shipped, "eagle")):
            probes.append(([*to, "--model", model, "--no-attn-norm"],
                           "--init shipped: the shipped head"))
    for argv, msg in probes:
        code, err = _cli(argv, capsys)
        assert code == 2 and len(err.splitlines()) == 1 and msg in err, (argv, code, err)
    assert not any((tmp_path / n).exists() for n in ("e", "e-eagle", "r", "s"))
