"""Gemma 4: two tiny random text decoders that transformers builds and saves (``gemma4_text``),
one dense (per-layer embeddings, KV sharing, K as V, double-wide MLPs, a final soft-cap) and
one MoE, against transformers' own ``Gemma4ForCausalLM``; the text decoder of a multimodal
``gemma4`` directory; and the refusals of what the port does not read."""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from toys import one_line

import specjax
from specjax.models import WeightLoadError, load_hf_dir
from specjax.models.gemma4 import FULL, SLIDING, Gemma4
from specjax.models.gemma4_load import hf_gemma4_config
from specjax.models.kv_cache import causal_mask
from specjax.models.registry import config as dir_config

V = 64
WINDOW = 4  # prompts and generations run well past the sliding layers' window
TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
         "full_attention"]
EOS = 1  # the saved config's eos_token_id (pad_token_id is 0)


def _fwd(model, params, tokens, cache=None, start=0):
    tokens = jnp.asarray(tokens, jnp.int32)
    b, t = tokens.shape
    cache = model.init_cache(b, 64) if cache is None else cache
    pos = jnp.broadcast_to(start + jnp.arange(t), (b, t))
    return _jitted_forward(model)(params, tokens, pos, cache, causal_mask(b, t))


@functools.lru_cache(maxsize=None)
def _jitted_forward(model):
    """One jitted forward per model, so a shape seen before is not traced again."""
    return jax.jit(model.forward)


def _save_tiny(path, kind: str, seed: int = 0):
    """A random transformers Gemma 4 text model saved as safetensors, with weights far from
    transformers' init (norm gains, the router's scales and the ``layer_scalar`` buffers
    around 1, the rest normal at 0.5), so the logits are far from uniform."""
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    torch.set_num_threads(2)
    kw = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=5,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=16,
              layer_types=TYPES, sliding_window=WINDOW, final_logit_softcapping=30.0,
              attn_implementation="eager")
    if kind == "dense":
        kw.update(hidden_size_per_layer_input=8, vocab_size_per_layer_input=V,
                  num_kv_shared_layers=2, use_double_wide_mlp=True, attention_k_eq_v=True,
                  num_global_key_value_heads=1)
    else:
        kw.update(enable_moe_block=True, num_experts=4, top_k_experts=2,
                  moe_intermediate_size=16, hidden_size_per_layer_input=0)
    torch.manual_seed(seed)
    model = Gemma4ForCausalLM(Gemma4TextConfig(**kw)).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            gain = "norm" in n or "scale" in n
            p.copy_(torch.randn_like(p) * (0.3 if "norm" in n else 0.5) + (1.0 if gain else 0.0))
        for n, b in model.named_buffers():
            if "layer_scalar" in n:
                b.copy_(torch.rand_like(b) + 0.5)
    model.save_pretrained(str(path))
    return model


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """``{kind: (transformers model, saved directory)}`` for "dense" and "moe"."""
    out = {}
    for kind in ("dense", "moe"):
        path = tmp_path_factory.mktemp(f"gemma4-{kind}")
        out[kind] = (_save_tiny(path, kind), path)
    return out


@pytest.fixture(scope="module", params=["dense", "moe"])
def tiny(request, dirs):
    """``(kind, transformers model, Gemma4, params)``."""
    hf, path = dirs[request.param]
    lm = specjax.models.load(str(path))
    assert isinstance(lm.model, Gemma4)
    return request.param, hf, lm.model, lm.params


def _hf_greedy(hf, prompt, n):
    import torch

    ids = torch.tensor([prompt])
    with torch.no_grad():  # all-ones mask: else transformers takes token 0 for padding
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                          do_sample=False, eos_token_id=EOS, pad_token_id=0)
    return out[0, len(prompt):].tolist()


# --------------------------------------------------------------------------- the tiny models

def test_tiny_config_reads_the_family_features(tiny, dirs):
    """What the config says reaches ``Gemma4Config``: the dense model's last two layers read
    the keys and values of the last earlier layer of their type and keep no cache entry;
    every other layer's entry has its type's shape (full: 1 head of 16 with K as V;
    sliding: 2 of 8). The full layers' geometry reads the same from ``per_layer_config``
    (what ``save_pretrained`` writes) as from ``global_head_dim`` and
    ``num_global_key_value_heads`` (what transformers expands into it)."""
    kind, _, model, params = tiny
    c = model.config
    d = json.loads((dirs[kind][1] / "config.json").read_text())
    assert hf_gemma4_config(d) == c
    del d["per_layer_config"]
    d.update(global_head_dim=16, num_global_key_value_heads=1 if kind == "dense" else None)
    assert hf_gemma4_config(d) == c
    assert c.layer_types == (SLIDING, FULL, SLIDING, SLIDING, FULL)
    assert (c.sliding_window, c.final_logit_softcapping) == (WINDOW, 30.0)
    assert (c.rope_theta, c.rope_local_theta, c.partial_rotary_factor) == (1e6, 1e4, 0.25)
    cache = model.init_cache(2, 24)
    if kind == "dense":
        assert (c.num_kv_shared_layers, c.first_shared) == (2, 3)
        assert c.kv_from == (0, 1, 2, 2, 1)
        assert c.attention_k_eq_v and c.geometry(FULL) == (1, 16) and c.geometry(SLIDING) == (2, 8)
        assert c.hidden_size_per_layer_input == 8 and c.use_double_wide_mlp
        assert [c.mlp_width(i) for i in range(5)] == [48, 48, 48, 96, 96]
        assert c.num_experts == 0
        # no K/V weights on the sharing layers, no V on the K-as-V full layer
        assert "v" not in params["layers"][1] and "k" in params["layers"][1]
        assert not {"k", "v", "k_norm"} & (set(params["layers"][3]) | set(params["layers"][4]))
        shapes = [(2, 8), (1, 16), (2, 8)]  # one entry per layer that keeps keys and values
    else:
        assert c.kv_from == tuple(range(5)) and c.num_kv_shared_layers == 0
        assert (c.num_experts, c.top_k_experts, c.moe_intermediate_size) == (4, 2, 16)
        assert c.hidden_size_per_layer_input == 0 and "ple_embed" not in params
        assert c.geometry(FULL) == (2, 16)  # no K as V: the sliding layers' K/V head count
        shapes = [(2, 8), (2, 16), (2, 8), (2, 8), (2, 16)]
    assert len(cache.k) == len(cache.v) == len(shapes)
    assert [k.shape for k in cache.k] == [(2, nk, hd, 24) for nk, hd in shapes]
    assert [v.shape for v in cache.v] == [(2, nk, 24, hd) for nk, hd in shapes]


def test_tiny_logits_match_transformers_past_the_window(tiny):
    import torch

    kind, hf, model, params = tiny
    tokens = np.random.default_rng(1).integers(0, V, (2, 14)).astype(np.int32)
    with torch.no_grad():
        ref = hf(torch.from_numpy(tokens).long(),
                 attention_mask=torch.ones(tokens.shape, dtype=torch.long)).logits.numpy()
    assert float(np.max(np.abs(ref))) > 3.0  # far from uniform
    ours, _, _ = _fwd(model, params, tokens)
    d = float(np.max(np.abs(np.asarray(ours) - ref)))
    assert d < 1e-4, f"{kind}: logits differ from transformers by {d:.2e}"
    # the window matters: a 14-token prompt crosses the window of 4
    import dataclasses

    wide = Gemma4(dataclasses.replace(model.config, sliding_window=1000))
    assert float(np.max(np.abs(np.asarray(_fwd(wide, params, tokens)[0]) - ref))) > 1e-2


def test_tiny_cached_steps_equal_full_forward(tiny):
    """A prefill, then one token at a time (the MoE model's experts gathered per token, not
    run densely), equals one forward over the whole sequence."""
    _, _, model, params = tiny
    tokens = np.random.default_rng(2).integers(0, V, (1, 16)).astype(np.int32)
    full, _, _ = _fwd(model, params, tokens)
    cache = model.init_cache(1, 64)
    steps = []
    for lo, hi in [(0, 6)] + [(i, i + 1) for i in range(6, 16)]:
        out, _, cache = _fwd(model, params, tokens[:, lo:hi], cache, start=lo)
        cache = cache.advance(hi - lo)
        steps.append(np.asarray(out))
    # float32 rounding: measured up to 2.4e-5 apart on logits of magnitude 12, each path
    # within 2.2e-5 of transformers' float64 logits
    np.testing.assert_allclose(np.concatenate(steps, 1), np.asarray(full), rtol=0, atol=5e-5)


def test_tiny_greedy_decoding_equals_transformers(tiny):
    """``generate`` at batch 1 equals transformers' greedy ``generate`` token for token
    (prompts of 3 to 17 tokens, all but the first past the window), and the four prompts
    in one ragged batch give the same tokens."""
    kind, hf, model, params = tiny
    rng = np.random.default_rng(3)
    prompts = [rng.integers(2, V, n).tolist() for n in (3, 7, 12, 17)]
    prompts[1][2] = 0  # a pad id inside a prompt is an ordinary token
    one = [specjax.generate(model, params, [p], max_new_tokens=16,
                            eos_ids=(EOS,)).to_lists()[0] for p in prompts]
    for p, got in zip(prompts, one):
        assert got == _hf_greedy(hf, p, 16), (kind, len(p))
    assert sum(len(g) for g in one) > 40  # no early stop hides the comparison
    batch = specjax.generate(model, params, prompts, max_new_tokens=16, eos_ids=(EOS,))
    assert batch.to_lists() == one, kind


# --------------------------------------------------------------------------- multimodal

def test_multimodal_directory_loads_its_text_decoder(dirs, tmp_path):
    """A ``gemma4`` directory (a ``text_config``, a vision tower, text tensors under
    ``model.language_model.``) loads its text decoder with one warning line about the
    vision tower, and gives the ``gemma4_text`` directory's logits."""
    from safetensors.numpy import load_file, save_file

    _, src = dirs["dense"]
    text = json.loads((src / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"],
        "text_config": text, "vision_config": {"model_type": "gemma4_vision", "hidden_size": 16},
        "tie_word_embeddings": True}))
    tensors = {"model.language_model." + k[len("model."):]: v
               for k, v in load_file(str(src / "model.safetensors")).items()}
    tensors["model.vision_tower.x.weight"] = np.ones((4, 4), np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"))

    with pytest.warns(UserWarning, match="vision") as record:
        lm = specjax.models.load(str(tmp_path), tokenizer=False)
    vision = [w for w in record if "vision" in str(w.message)]
    assert len(vision) == 1 and "\n" not in str(vision[0].message)
    cfg, params = lm.model.config, lm.params
    want_cfg, want_params = load_hf_dir(src)
    assert cfg == want_cfg
    tokens = np.random.default_rng(5).integers(0, V, (1, 12)).astype(np.int32)
    model = Gemma4(cfg)
    np.testing.assert_array_equal(np.asarray(_fwd(model, params, tokens)[0]),
                                  np.asarray(_fwd(model, want_params, tokens)[0]))


# --------------------------------------------------------------------------- bad inputs

@pytest.mark.parametrize("how", ["misshaped", "missing", "unexpected", "integers"])
def test_a_bad_tensor_is_one_clear_line(dirs, tmp_path, how):
    from safetensors.numpy import load_file, save_file

    _, src = dirs["dense"]
    shutil.copy(src / "config.json", tmp_path / "config.json")
    tensors = load_file(str(src / "model.safetensors"))
    if how == "misshaped":
        name = "model.layers.1.self_attn.k_proj.weight"
        tensors[name] = np.zeros((17, 32), np.float32)
        fragments = (name, "(17, 32)", "(16, 32)")
    elif how == "missing":
        del tensors["model.layers.0.mlp.up_proj.weight"]
        fragments = ("missing", "model.layers.0.mlp.up_proj.weight")
    elif how == "integers":
        name = "model.layers.0.self_attn.q_norm.weight"
        tensors[name] = np.ones(tensors[name].shape, np.int32)
        fragments = (name, "int32", "floating point")
    else:  # a V projection on the K-as-V full layer
        name = "model.layers.1.self_attn.v_proj.weight"
        tensors[name] = np.zeros((16, 32), np.float32)
        fragments = ("unexpected", name)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightLoadError) as e:
        load_hf_dir(tmp_path)
    one_line(e, *fragments)


@pytest.mark.parametrize("how", ["activation", "rope_type", "sliding_override"])
def test_an_unsupported_config_is_one_clear_line(dirs, tmp_path, how):
    """Refused from ``config.json`` alone (no weights read): the directory's config through
    ``specjax.models.registry.config``, and the same dict through ``hf_gemma4_config``."""
    _, src = dirs["dense"]
    d = json.loads((src / "config.json").read_text())
    if how == "activation":
        d["hidden_activation"] = "silu"
        fragments = ("hidden_activation", "'silu'")
    elif how == "rope_type":
        d["rope_parameters"]["full_attention"] = {"rope_type": "yarn", "factor": 8.0,
                                                  "rope_theta": 1e6}
        fragments = ("rope_parameters.full_attention", "'yarn'")
    else:
        d["per_layer_config"]["0"] = {"head_dim": 16}
        fragments = ("per_layer_config.0", "sliding layer")
    (tmp_path / "config.json").write_text(json.dumps(d))  # no weights in the directory
    with pytest.raises(WeightLoadError) as e:
        dir_config(str(tmp_path))
    one_line(e, *fragments, "config.json")
    with pytest.raises(WeightLoadError) as e:
        hf_gemma4_config(d)
    one_line(e, *fragments)


@pytest.mark.parametrize("size", ["E2B", "E4B", "26B_A4B", "31B"])
def test_the_released_sizes_read_as_transformers_writes_them(size):
    """``GEMMA4_<size>`` is what the parser reads from transformers' own serialization of
    that size's text config (the published config.json's fields)."""
    from transformers import Gemma4TextConfig

    from specjax.models import gemma4

    want = getattr(gemma4, f"GEMMA4_{size}")
    full = [f"{'full' if t == 'full' else 'sliding'}_attention" for t in want.layer_types]
    kw = dict(vocab_size=want.vocab_size, hidden_size=want.hidden_size,
              intermediate_size=want.intermediate_size, num_hidden_layers=want.num_layers,
              num_attention_heads=want.num_heads, num_key_value_heads=want.num_kv_heads,
              head_dim=want.head_dim, global_head_dim=want.global_head_dim,
              num_global_key_value_heads=want.num_global_kv_heads,
              attention_k_eq_v=want.attention_k_eq_v, layer_types=full,
              sliding_window=want.sliding_window, final_logit_softcapping=30.0,
              hidden_size_per_layer_input=want.hidden_size_per_layer_input,
              vocab_size_per_layer_input=262144, num_kv_shared_layers=want.num_kv_shared_layers,
              use_double_wide_mlp=want.use_double_wide_mlp,
              enable_moe_block=bool(want.num_experts), num_experts=want.num_experts or None,
              top_k_experts=want.top_k_experts or None,
              moe_intermediate_size=want.moe_intermediate_size or None,
              max_position_embeddings=want.max_position_embeddings)
    got = hf_gemma4_config({**Gemma4TextConfig(**kw).to_dict(), "model_type": "gemma4_text"})
    if not want.hidden_size_per_layer_input:  # unused without per-layer embeddings
        got = dataclasses.replace(got, vocab_size_per_layer_input=0)
        want = dataclasses.replace(want, vocab_size_per_layer_input=0)
    assert got == want
