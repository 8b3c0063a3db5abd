"""Llama-3.1, Qwen2/2.5 and Qwen3 targets loaded from HF directories, against transformers.

Each family is a random tiny transformers model saved as safetensors (``_save``), with its
biases and norm gains drawn away from their defaults so that every one of them matters. A
family's logits match transformers' to 1e-4 (float32), its greedy ``generate`` equals
transformers' greedy ``generate`` token for token, the fused and split (sharded) layouts and
``scan_layers`` compute the same logits, and each deliberately wrong variant (biases
dropped, Qwen3's head norms skipped, Llama 3 RoPE scaling ignored, a Qwen2 directory read as
Llama) fails. Stop ids come from the tokenizer, ``END_OF_TURN`` and
``generation_config.json``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import toys
import specjax
from specjax import sharding
from specjax.models import RopeScaling, WeightLoadError, load, load_hf_dir, loading, registry
from specjax.models.kv_cache import causal_mask
from specjax.models.llama import (Llama, init_params, layer_shapes, stack_layers)

V = 128
COMMON = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               # tiny, so that head_dim 16 has frequencies in all three llama3 bands
               "original_max_position_embeddings": 64}

#: family -> (transformers config class, model class, config kwargs)
FAMILIES = {
    "llama3.1": ("LlamaConfig", "LlamaForCausalLM",
                 dict(rms_norm_eps=1e-5, tie_word_embeddings=False,
                      rope_parameters=LLAMA3_ROPE)),
    "qwen2.5": ("Qwen2Config", "Qwen2ForCausalLM",
                dict(rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
                     rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              dict(head_dim=32, rms_norm_eps=1e-6, tie_word_embeddings=True,
                   use_sliding_window=False,
                   rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    # Llama's attention_bias: q, k, v and o biases (o_b), which no other toy has
    "llama-bias": ("LlamaConfig", "LlamaForCausalLM",
                   dict(rms_norm_eps=1e-5, tie_word_embeddings=True, attention_bias=True)),
}
PROMPTS = [[5, 17, 99, 3, 42], [7, 1, 64, 64, 23, 9, 100, 11, 2, 50, 31]]
NEW = 12


def _save(path, family: str, seed: int = 0):
    """A random transformers model of ``family`` saved at ``path``; returns it (eval mode).

    Matrices are 0.2 * N(0, 1) (sharp attention, so RoPE matters), norm gains 1 + 0.3 *
    N(0, 1) and biases 0.5 * N(0, 1): all far from transformers' init (zero biases, unit
    gains), so a bias or a norm that is dropped moves the logits."""
    import torch
    import transformers

    torch.set_num_threads(2)
    cfg_cls, model_cls, kw = FAMILIES[family]
    cfg = getattr(transformers, cfg_cls)(**COMMON, **kw)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(0.5 * torch.randn_like(p))
            elif p.ndim == 1:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    model.generation_config.eos_token_id = None  # greedy runs to its budget in both
    model.save_pretrained(str(path))
    return model


_LOADED: dict[str, types.SimpleNamespace] = {}


def _loaded(family: str, tmp_path_factory) -> types.SimpleNamespace:
    """(family, transformers model, config, params, directory), loaded by ``load_hf_dir``;
    built once per family."""
    if family not in _LOADED:
        path = tmp_path_factory.mktemp(family)
        hf = _save(path, family)
        cfg, params = load_hf_dir(path)
        _LOADED[family] = types.SimpleNamespace(family=family, hf=hf, cfg=cfg, params=params,
                                                path=path)
    return _LOADED[family]


@pytest.fixture(scope="module", params=list(FAMILIES))
def target(request, tmp_path_factory):
    return _loaded(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return _loaded("qwen2.5", tmp_path_factory)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return _loaded("qwen3", tmp_path_factory)


@functools.partial(jax.jit, static_argnames=("model",))
def _logits(model, params, tokens):
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    cache = model.init_cache(b, 64)
    return model.forward(params, tokens, positions, cache, causal_mask(b, t))[0]


TOKENS = np.random.default_rng(0).integers(0, V, (2, 40)).astype(np.int32)


def _hf_logits(hf, tokens=TOKENS):
    import torch

    with torch.no_grad():
        return hf(torch.from_numpy(tokens).long()).logits.numpy()


def _diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


@pytest.fixture(scope="module")
def reference(target):
    """transformers' logits of ``TOKENS`` and specjax's, for the module's target."""
    return _hf_logits(target.hf), _logits(Llama(target.cfg), target.params, TOKENS)


# ----------------------------------------------------------------------------- parity

def test_config_read_from_the_directory(target):
    cfg, fam = target.cfg, target.family
    assert cfg.num_heads == 4 and cfg.num_kv_heads == 2 and cfg.num_layers == 2
    want = {"llama3.1": dict(rope_theta=5e5, rms_norm_eps=1e-5, tie_embeddings=False,
                             attention_bias=False, o_bias=False, qk_norm=False, head_dim=16),
            "qwen2.5": dict(rope_theta=1e6, rms_norm_eps=1e-6, tie_embeddings=True,
                            attention_bias=True, o_bias=False, qk_norm=False, head_dim=16),
            "qwen3": dict(rope_theta=1e6, rms_norm_eps=1e-6, tie_embeddings=True,
                          attention_bias=False, o_bias=False, qk_norm=True, head_dim=32),
            "llama-bias": dict(rope_theta=1e4, rms_norm_eps=1e-5, tie_embeddings=True,
                               attention_bias=True, o_bias=True, qk_norm=False, head_dim=16)}
    assert {k: getattr(cfg, k) for k in want[fam]} == want[fam]
    if fam == "llama3.1":
        assert cfg.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 64)
    else:
        assert cfg.rope_scaling == RopeScaling()
    lp = target.params["layers"][0]
    nq, nk, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    assert ("qkv_b" in lp) == cfg.attention_bias and ("o_b" in lp) == cfg.o_bias
    assert ("q_norm" in lp) == ("k_norm" in lp) == cfg.qk_norm
    if cfg.attention_bias:  # fused in qkv's row order: q's biases, then k's, then v's
        assert lp["qkv_b"].shape == ((nq + 2 * nk) * hd,)
        v_bias = target.hf.model.layers[0].self_attn.v_proj.bias.detach().numpy()
        np.testing.assert_array_equal(np.asarray(lp["qkv_b"][(nq + nk) * hd:]), v_bias)
    if cfg.qk_norm:
        assert lp["q_norm"].shape == lp["k_norm"].shape == (hd,)
    assert ("lm_head" in target.params) == (not cfg.tie_embeddings)


def test_logits_match_transformers(target, reference):
    ref, ours = reference
    d = _diff(ours, ref)
    print(f"{target.family}: max |logit diff| vs transformers {d:.2e}")
    assert d < 1e-4, f"{target.family}: logits differ from transformers by {d:.3e}"


def test_greedy_generate_matches_transformers(target):
    """A batch of two prompts of different lengths, token for token against transformers'
    greedy generate run per prompt."""
    import torch

    out = specjax.generate(Llama(target.cfg), target.params, PROMPTS,
                           max_new_tokens=NEW).to_lists()
    for ids, ours in zip(PROMPTS, out):
        x = torch.tensor([ids])
        with torch.inference_mode():
            y = target.hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW,
                                   do_sample=False, pad_token_id=0)
        ref = y[0, len(ids):].tolist()
        assert len(ref) == NEW and ours == ref, f"{target.family} prompt {ids}: {ours} != {ref}"


def test_split_and_scanned_layouts_compute_the_same_logits(target, reference):
    """``sharding.split_layout`` (q/k/v and their biases split) and ``scan_layers`` over
    stacked weights (in both layouts) give the fused per-layer model's logits."""
    cfg, params = target.cfg, target.params
    _, fused = reference
    split = sharding.split_layout(cfg, params)
    lp = split["layers"][1]
    assert "qkv" not in lp and "qkv_b" not in lp
    if cfg.attention_bias:
        nq, nk, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        assert (lp["q_b"].shape, lp["k_b"].shape, lp["v_b"].shape) == ((nq * hd,), (nk * hd,),
                                                                       (nk * hd,))
        np.testing.assert_array_equal(
            np.concatenate([lp["q_b"], lp["k_b"], lp["v_b"]]), params["layers"][1]["qkv_b"])
    scanned = Llama(cfg, scan_layers=True)
    runs = {"split": _logits(Llama(cfg), split, TOKENS),
            "scan": _logits(scanned, stack_layers(params), TOKENS),
            "scan+split": _logits(scanned, sharding.split_layout(cfg, stack_layers(params)),
                                  TOKENS)}
    for name, logits in runs.items():
        np.testing.assert_allclose(np.asarray(logits), np.asarray(fused), atol=2e-5, rtol=0,
                                   err_msg=f"{target.family} {name}")


def test_sharding_specs_split_biases_by_heads():
    """q/k/v biases split with their heads over ``model`` (per layer and stacked); head
    norms and ``o_b`` are replicated."""
    cfg = toys.LLAMA_EXTRAS
    params = sharding.split_layout(cfg, init_params(cfg, jax.random.key(0)))
    fake = types.SimpleNamespace(shape={"data": 1, "model": 2})
    per_layer = sharding.param_specs(cfg, params, fake)["layers"][0]
    assert {n: per_layer[n] for n in ("q_b", "k_b", "v_b", "q_norm", "k_norm", "o_b")} == {
        "q_b": P("model"), "k_b": P("model"), "v_b": P("model"), "q_norm": P(),
        "k_norm": P(), "o_b": P()}
    stacked = sharding.param_specs(cfg, sharding.split_layout(cfg, stack_layers(params)), fake)
    assert stacked["layers"]["q_b"] == P(None, "model") and stacked["layers"]["q_norm"] == P()
    odd = types.SimpleNamespace(shape={"data": 1, "model": 4})  # 2 KV heads: not split
    specs = sharding.param_specs(cfg, params, odd)["layers"][0]
    assert specs["q_b"] == P("model") and specs["k_b"] == P() and specs["v_b"] == P()


def test_qwen2_decodes_on_a_mesh(qwen2):
    """``shard_params`` places the split layout (biases included) on a mesh, and greedy
    decoding there equals decoding without one (one family: the placement is generic)."""
    mesh = sharding.make_mesh(1, 1)
    placed = sharding.shard_params(qwen2.cfg, qwen2.params, mesh)
    assert "q_b" in placed["layers"][0] and "qkv_b" not in placed["layers"][0]
    model = Llama(qwen2.cfg)
    kw = dict(max_new_tokens=6)
    assert (specjax.generate(model, placed, PROMPTS, mesh=mesh, **kw).to_lists()
            == specjax.generate(model, qwen2.params, PROMPTS, **kw).to_lists())


# ----------------------------------------------------------------------------- wrong variants

def test_dropping_the_feature_moves_the_logits(target, reference):
    """The model without the family's feature (biases, head norms, RoPE scaling) is far
    from transformers: each feature is exercised by the parity above."""
    cfg, params = target.cfg, target.params
    ref, _ = reference
    strip = lambda *names: {**params, "layers": [
        {k: v for k, v in lp.items() if k not in names} for lp in params["layers"]]}
    variants = {
        "llama3.1": [(dataclasses.replace(cfg, rope_scaling=RopeScaling()), params)],
        "qwen2.5": [(dataclasses.replace(cfg, attention_bias=False), strip("qkv_b"))],
        "qwen3": [(dataclasses.replace(cfg, qk_norm=False), strip("q_norm", "k_norm"))],
        "llama-bias": [(dataclasses.replace(cfg, attention_bias=False), strip("qkv_b")),
                       (dataclasses.replace(cfg, o_bias=False), strip("o_b"))],
    }[target.family]
    for wrong_cfg, wrong_params in variants:
        d = _diff(_logits(Llama(wrong_cfg), wrong_params, TOKENS), ref)
        print(f"{target.family} without its feature: max |logit diff| {d:.2e}")
        assert d > 0.1, f"{target.family}: dropping a feature moved the logits by only {d:.2e}"


def test_config_and_weights_that_disagree_are_refused(target):
    """A config asking for biases or head norms that the weights lack (or the reverse)
    fails at trace time, not silently."""
    cfg, params = target.cfg, target.params
    if not (cfg.attention_bias or cfg.qk_norm):
        wrong = dataclasses.replace(cfg, qk_norm=True)
        with pytest.raises(ValueError, match="qk_norm=True"):
            _logits(Llama(wrong), params, TOKENS)
        return
    field = "attention_bias" if cfg.attention_bias else "qk_norm"
    with pytest.raises(ValueError, match=f"{field}=False"):
        _logits(Llama(dataclasses.replace(cfg, **{field: False})), params, TOKENS)
    drop = "qkv_b" if cfg.attention_bias else "k_norm"
    half = {**params, "layers": [{k: v for k, v in lp.items() if k != drop}
                                 for lp in params["layers"]]}
    with pytest.raises(ValueError, match=f"{field}=True"):
        _logits(Llama(cfg), half, TOKENS)


def _copy_dir(src, dst, edit_config=None, drop=()):
    """The HF directory ``src`` copied to ``dst`` with its config.json edited and the
    tensors in ``drop`` removed."""
    from safetensors.numpy import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    d = json.loads((src / "config.json").read_text())
    if edit_config:
        edit_config(d)
    (dst / "config.json").write_text(json.dumps(d))
    tensors = load_file(str(src / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if k not in drop}, str(dst / "model.safetensors"))
    return dst


def test_qwen2_directory_read_as_llama_meets_unexpected_biases(qwen2, tmp_path):
    bad = _copy_dir(qwen2.path, tmp_path / "as_llama", lambda d: d.update(model_type="llama"))
    with pytest.raises(WeightLoadError, match=r"unexpected tensor .*self_attn\.[qkv]_proj\.bias"):
        load_hf_dir(bad)


def test_qwen3_directory_missing_a_head_norm_names_it(qwen3, tmp_path):
    name = "model.layers.1.self_attn.k_norm.weight"
    bad = _copy_dir(qwen3.path, tmp_path / "no_k_norm", drop=(name,))
    with pytest.raises(WeightLoadError, match=re.escape(name)):
        load_hf_dir(bad)


# ----------------------------------------------------------------------------- configs

def test_llama3_scaling_changes_frequencies_in_all_bands():
    s = RopeScaling("llama3", 8.0, 1.0, 4.0, 64)
    plain = np.asarray(RopeScaling().inv_freq(16, 5e5))
    scaled = np.asarray(s.inv_freq(16, 5e5))
    kept = np.isclose(scaled, plain, rtol=1e-6, atol=0)
    divided = np.isclose(scaled, plain / 8, rtol=1e-6, atol=0)
    between = ~kept & ~divided
    assert kept.any() and divided.any() and between.any(), (plain, scaled)
    assert np.all((scaled[between] < plain[between]) & (scaled[between] > plain[between] / 8))


def test_transformers4_llama31_config_fields():
    """A transformers-4 config.json (``rope_scaling`` beside a top-level ``rope_theta``,
    as Llama-3.1 ships) reads as the transformers-5 ``rope_parameters`` form does."""
    base = dict(COMMON, model_type="llama", tie_word_embeddings=False, rms_norm_eps=1e-5)
    v5 = loading.hf_config(dict(base, rope_parameters=LLAMA3_ROPE))
    v4 = loading.hf_config(dict(base, rope_theta=500000.0, rope_scaling={
        k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}))
    assert v4 == v5 and v4.rope_theta == 5e5 and v4.rope_scaling.rope_type == "llama3"


def test_mistral_reads_as_a_llama_family_model(tmp_path):
    """Mistral is one more ``model_type`` of the Llama family (``loading.FAMILIES``): a
    random tiny transformers Mistral (v0.2 and later: ``sliding_window`` null) loads from
    its directory and gives transformers' logits; v0.1's window, shorter than the context,
    is refused in one line."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.MistralConfig(**COMMON, sliding_window=None, rms_norm_eps=1e-5,
                                     tie_word_embeddings=False, head_dim=16)
    hf = transformers.MistralForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if p.ndim == 1 else 0.2 * torch.randn_like(p))
    hf.save_pretrained(str(tmp_path))
    ours_cfg, params = load_hf_dir(tmp_path)
    assert loading.family(ours_cfg) == "Llama"
    d = _diff(_hf_logits(hf), _logits(Llama(ours_cfg), params, TOKENS))
    assert d < 1e-4, f"mistral: logits differ from transformers by {d:.3e}"
    with pytest.raises(WeightLoadError, match=r"mistral: a sliding window \(sliding_window=16"):
        loading.hf_config(dict(COMMON, model_type="mistral", sliding_window=16))


@pytest.mark.parametrize("edit, match", [
    (dict(model_type="qwen2", use_sliding_window=True, sliding_window=16), "sliding_window=16"),
    (dict(model_type="qwen3", use_sliding_window=True, sliding_window=32,
          layer_types=["full_attention", "sliding_attention"]), r"layers \[1\]"),
    (dict(model_type="qwen2", rope_scaling={"type": "yarn", "factor": 4.0}), "yarn"),
    (dict(model_type="llama", hidden_act="gelu"), "hidden_act"),
    (dict(model_type="llama", mlp_bias=True), "mlp_bias"),
])
def test_unsupported_features_are_refused(edit, match):
    with pytest.raises(WeightLoadError, match=match):
        loading.hf_config(dict(COMMON, max_window_layers=0, **edit))


def test_sliding_window_off_or_wide_enough_is_accepted():
    """Qwen checkpoints' ``use_sliding_window: false`` (whatever ``sliding_window`` says),
    and a window that covers the whole context, compute what full attention computes."""
    for edit in (dict(use_sliding_window=False, sliding_window=16),
                 dict(use_sliding_window=True, sliding_window=128, max_window_layers=0)):
        assert loading.hf_config(dict(COMMON, model_type="qwen2", **edit)).attention_bias


def test_random_params_carry_the_configured_extras():
    cfg = toys.LLAMA_EXTRAS
    shapes = layer_shapes(cfg)
    assert (shapes["qkv_b"], shapes["o_b"], shapes["q_norm"], shapes["k_norm"]) == (
        (256,), (64,), (32,), (32,))
    lp = init_params(cfg, jax.random.key(0))["layers"][1]
    assert {k: v.shape for k, v in lp.items()} == shapes
    assert abs(float(jnp.mean(lp["q_norm"])) - 1) < 0.1  # gains near 1, as the other norms
    assert "qkv_b" not in layer_shapes(dataclasses.replace(cfg, attention_bias=False))
    unfused = loading.unfused_shapes(cfg)
    assert (unfused["layers/q_b"], unfused["layers/k_b"], unfused["layers/k_norm"]) == (
        (128,), (64,), (32,))


# ----------------------------------------------------------------------------- stop ids

def _word_tokenizer(path, specials):
    """A word-level fast tokenizer saved at ``path`` whose vocabulary ends with
    ``specials`` (the first is its EOS); returns their ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(V - len(specials))}
    vocab.update({s: V - len(specials) + i for i, s in enumerate(specials)})
    tk = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=specials[0],
                            unk_token="w0").save_pretrained(str(path))
    return [vocab[s] for s in specials]


def test_stop_ids_from_tokenizer_end_of_turn_and_generation_config(tmp_path):
    assert {"<|eot_id|>", "<|im_end|>", "<end_of_turn>"} <= set(registry.END_OF_TURN)
    path = tmp_path / "qwen"
    _save(path, "qwen2.5")
    eos, eot, im_end = _word_tokenizer(path, ["<|endoftext|>", "<|eot_id|>", "<|im_end|>"])
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_end, 7, 7]}))
    assert registry.generation_eos_ids(path) == (im_end, 7)
    lm = load(str(path))
    # the tokenizer's EOS, its end-of-turn tokens in END_OF_TURN order, then the config's new ids
    assert lm.eos_ids == (eos, eot, im_end, 7)
    assert isinstance(lm.model, Llama) and lm.model.config.attention_bias
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert registry.generation_eos_ids(path) == (9,)
    assert load(str(path)).eos_ids == (eos, eot, im_end, 9)
    # without a tokenizer the caller gives prompts and stops as ids (tests/test_bench.py)
    assert load(str(path), tokenizer=False).eos_ids == ()
    (path / "generation_config.json").unlink()
    assert registry.generation_eos_ids(path) == () and load(str(path)).eos_ids == (eos, eot, im_end)
    shutil.rmtree(path)


_MESH_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np
from specjax import sharding
from specjax.models.llama import Llama, LlamaConfig, init_params
from specjax.models.kv_cache import causal_mask
assert len(jax.devices()) == 2
cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=32, attention_bias=True, o_bias=True,
                  qk_norm=True)
params = jax.tree.map(lambda x: 3 * x, init_params(cfg, jax.random.key(0)))
toks = jax.random.randint(jax.random.key(1), (2, 9), 0, 128)
pos = jnp.broadcast_to(jnp.arange(9), (2, 9))
model = Llama(cfg)
run = jax.jit(lambda p, c: model.forward(p, toks, pos, c, causal_mask(2, 9))[0])
want = run(params, model.init_cache(2, 16))
mesh = sharding.make_mesh(1, 2)
placed = sharding.shard_params(cfg, params, mesh)
assert placed["layers"][0]["k_b"].sharding.spec == jax.sharding.PartitionSpec("model")
cache = jax.device_put(model.init_cache(2, 16), jax.tree.map(
    lambda s: jax.sharding.NamedSharding(mesh, s), sharding.cache_spec(model.init_cache(2, 16), mesh)))
got = run(placed, cache)
d = float(jnp.max(jnp.abs(got - want)))
assert d < 1e-4 and float(jnp.max(jnp.abs(want))) > 1, d
print("OK", d)
"""


def test_biases_and_head_norms_sharded_over_two_devices():
    """On a ``model=2`` mesh (two simulated CPU devices, in a subprocess), a config with
    q/k/v/o biases and head norms computes the one-device logits: the biases split with
    their heads."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", _MESH_SCRIPT], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr
