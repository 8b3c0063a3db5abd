"""Self-checks of tests/published.py: the random EAGLE heads it writes have exactly the
published tensor names, shapes and dtypes; both weight formats round-trip; the reference
forwards are causal, match a hand computation (and transformers' LlamaAttention where it is
installed), and the deliberately wrong variants are visibly different."""

from __future__ import annotations

import json
import math

import pytest
import torch

from published import (
    d2t_absolute,
    d2t_target_ids,
    eagle1_expected_shapes,
    eagle3_expected_shapes,
    torch_eagle1_logits,
    torch_eagle3_logits,
    write_eagle1_head,
    write_eagle3_head,
)

H, NQ, NKV, INTER, V, DV = 32, 4, 2, 48, 96, 40


def _load(path, weights):
    if weights == "pytorch_model.bin":
        return torch.load(path / weights, weights_only=True)
    from safetensors.torch import load_file

    return load_file(str(path / weights))


def _inputs(seed, B=2, T=5, width=H, vocab=V):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (B, T), generator=g)
    feats = torch.randn(B, T, width, generator=g)
    embed = torch.randn(vocab, H, generator=g) * 0.5
    lm_head = torch.randn(vocab, H, generator=g) * 0.2
    return tokens, feats, embed, lm_head


@pytest.mark.parametrize("weights", ["pytorch_model.bin", "model.safetensors"])
@pytest.mark.parametrize("style", ["vicuna", "llama3", "qwen2"])
def test_eagle1_layout_and_round_trip(tmp_path, style, weights):
    dtype = torch.bfloat16 if weights == "pytorch_model.bin" else torch.float32
    kv = NQ if style == "vicuna" else NKV
    sd, cfg = write_eagle1_head(tmp_path, hidden=H, heads=NQ, kv_heads=kv, intermediate=INTER,
                                vocab=V, style=style, weights=weights, dtype=dtype, seed=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["config.json", weights])
    on_disk = json.loads((tmp_path / "config.json").read_text())
    assert on_disk == cfg and on_disk["num_hidden_layers"] == 1
    assert on_disk["architectures"] == ["LlamaForCausalLM"] and on_disk["model_type"] == "llama"
    loaded = _load(tmp_path, weights)
    expected = eagle1_expected_shapes(cfg)
    assert set(loaded) == set(expected) == set(sd)
    for k, t in loaded.items():
        assert tuple(t.shape) == expected[k], k
        assert t.dtype == dtype, k
        assert torch.equal(t.float(), sd[k]), k
    assert not any("input_layernorm" in k or "norm.weight" == k or "lm_head" in k
                   or "embed" in k for k in loaded)
    if style == "vicuna":
        assert "bias" not in cfg and "fc.bias" in loaded
        assert "num_key_value_heads" not in cfg and "rope_theta" not in cfg
    if style == "llama3":
        assert cfg["bias"] is False and "fc.bias" not in loaded
        assert cfg["rope_theta"] == 500000.0
        assert loaded["layers.0.self_attn.k_proj.weight"].shape[0] == NKV * (H // NQ)
    if style == "qwen2":
        assert cfg["qkv_bias"] is True and "fc.bias" in loaded
        assert {"layers.0.self_attn.q_proj.bias", "layers.0.self_attn.k_proj.bias",
                "layers.0.self_attn.v_proj.bias"} <= set(loaded)
        assert "layers.0.self_attn.o_proj.bias" not in loaded
    else:
        assert not any(k.endswith("_proj.bias") for k in loaded)
    # meaningful scale: weights neither tiny nor huge, norms near one
    assert 0.04 < float(sd["fc.weight"].std()) < 0.25
    w = sd["layers.0.post_attention_layernorm.weight"]
    assert (w - 1).abs().max() < 0.6 and (w - 1).abs().max() > 0.01


@pytest.mark.parametrize("weights", ["pytorch_model.bin", "model.safetensors"])
@pytest.mark.parametrize("own_embedding,target_hidden", [(False, None), (True, 24)])
def test_eagle3_layout_and_round_trip(tmp_path, weights, own_embedding, target_hidden):
    sd, cfg = write_eagle3_head(tmp_path, hidden=H, heads=NQ, kv_heads=NKV, intermediate=INTER,
                                vocab=V, draft_vocab=DV, target_hidden=target_hidden,
                                own_embedding=own_embedding, weights=weights, seed=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["config.json", weights])
    assert json.loads((tmp_path / "config.json").read_text()) == cfg
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == DV
    assert "rope_theta" not in cfg
    assert ("target_hidden_size" in cfg) == (target_hidden is not None)
    loaded = _load(tmp_path, weights)
    expected = eagle3_expected_shapes(cfg, own_embedding)
    assert set(loaded) == set(expected) == set(sd)
    for k, t in loaded.items():
        assert tuple(t.shape) == expected[k], k
        want = {"d2t": torch.int64, "t2d": torch.bool}.get(k, torch.bfloat16)
        assert t.dtype == want, k
        assert torch.equal(t.float() if t.is_floating_point() else t, sd[k]), k
    assert "fc.bias" not in loaded
    assert loaded["fc.weight"].shape == (H, 3 * (target_hidden or H))
    # d2t offsets and t2d agree
    d2t, t2d = loaded["d2t"], loaded["t2d"]
    assert int(t2d.sum()) == DV
    ids = d2t_target_ids(d2t, torch.arange(DV))
    assert bool(t2d[ids].all())
    assert torch.equal(ids, torch.nonzero(t2d).flatten())  # sorted, one per draft id
    assert bool((ids[1:] > ids[:-1]).all()) and int(ids.max()) < V
    assert not torch.equal(d2t_absolute(d2t, torch.arange(DV)), ids)


def test_eagle1_one_token_equals_hand_computation(tmp_path):
    sd, cfg = write_eagle1_head(tmp_path, hidden=H, heads=NQ, kv_heads=NKV, intermediate=INTER,
                                vocab=V, style="qwen2", dtype=torch.float32, seed=3)
    tokens, feats, embed, lm_head = _inputs(3, B=1, T=1)
    got = torch_eagle1_logits(sd, cfg, embed, lm_head, tokens, feats)[0, 0]
    # one token: softmax over one key is 1 and RoPE does not touch v, so the attention
    # output of query head j is v of kv head j // (NQ // NKV).
    hd, p, eps = H // NQ, "layers.0.", cfg["rms_norm_eps"]
    e, f = embed[tokens[0, 0]], feats[0, 0]
    x = sd["fc.weight"] @ torch.cat([e, f]) + sd["fc.bias"]
    v = sd[p + "self_attn.v_proj.weight"] @ x + sd[p + "self_attn.v_proj.bias"]
    heads = [v[(j // (NQ // NKV)) * hd:(j // (NQ // NKV) + 1) * hd] for j in range(NQ)]
    x = x + sd[p + "self_attn.o_proj.weight"] @ torch.cat(heads)
    n = x / torch.sqrt((x * x).mean() + eps) * sd[p + "post_attention_layernorm.weight"]
    gate = sd[p + "mlp.gate_proj.weight"] @ n
    up = sd[p + "mlp.up_proj.weight"] @ n
    x = x + sd[p + "mlp.down_proj.weight"] @ (gate * torch.sigmoid(gate) * up)
    want = lm_head @ x
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    assert float(want.abs().mean()) > 0.1  # not near zero


def test_references_are_causal_and_position_dependent(tmp_path):
    sd, cfg = write_eagle1_head(tmp_path, hidden=H, heads=NQ, kv_heads=NKV, intermediate=INTER,
                                vocab=V, style="llama3", dtype=torch.float32, seed=4)
    tokens, feats, embed, lm_head = _inputs(4, T=6)
    full = torch_eagle1_logits(sd, cfg, embed, lm_head, tokens, feats)
    part = torch_eagle1_logits(sd, cfg, embed, lm_head, tokens[:, :3], feats[:, :3])
    assert torch.allclose(full[:, :3], part, atol=1e-5)
    # RoPE is relative: a uniform shift changes nothing, a gap changes later positions
    shifted = torch_eagle1_logits(sd, cfg, embed, lm_head, tokens, feats,
                                  positions=torch.arange(6) + 7)
    assert torch.allclose(shifted, full, atol=1e-4)
    gapped = torch_eagle1_logits(sd, cfg, embed, lm_head, tokens, feats,
                                 positions=torch.tensor([0, 1, 2, 5, 6, 9]))
    assert torch.allclose(gapped[:, :3], full[:, :3], atol=1e-5)
    assert (gapped[:, 3:] - full[:, 3:]).abs().max() > 1e-3
    other = dict(cfg, rope_theta=10000.0)
    assert (torch_eagle1_logits(sd, other, embed, lm_head, tokens, feats)
            - full).abs().max() > 1e-3


@pytest.mark.parametrize("wrong", ["swap_concat", "input_norm"])
def test_eagle1_wrong_variants_differ(tmp_path, wrong):
    sd, cfg = write_eagle1_head(tmp_path, hidden=H, heads=NQ, kv_heads=NKV, intermediate=INTER,
                                vocab=V, style="vicuna", seed=5)
    tokens, feats, embed, lm_head = _inputs(5)
    right = torch_eagle1_logits(sd, cfg, embed, lm_head, tokens, feats)
    bad = torch_eagle1_logits(sd, cfg, embed, lm_head, tokens, feats, wrong=wrong)
    assert right.shape == (2, 5, V) and right.dtype == torch.float32
    assert (right - bad).abs().max() > 1e-3


def test_eagle3_reference(tmp_path):
    sd, cfg = write_eagle3_head(tmp_path, hidden=H, heads=NQ, kv_heads=NKV, intermediate=INTER,
                                vocab=V, draft_vocab=DV, target_hidden=24, own_embedding=True,
                                seed=6)
    tokens, fused, embed, _ = _inputs(6, width=3 * 24)
    logits, x = torch_eagle3_logits(sd, cfg, embed, tokens, fused)
    assert logits.shape == (2, 5, DV) and x.shape == (2, 5, H) and logits.dtype == torch.float32
    assert float(logits.abs().mean()) > 0.1
    bad, _ = torch_eagle3_logits(sd, cfg, embed, tokens, fused, wrong="swap_concat")
    assert (logits - bad).abs().max() > 1e-3
    # the head's own embedding wins over the target's
    same, _ = torch_eagle3_logits(sd, cfg, embed * 3 + 1, tokens, fused)
    assert torch.equal(same, logits)
    # a later draft step: the h-wide pre-norm output goes in with fc skipped
    step2, x2 = torch_eagle3_logits(sd, cfg, embed, tokens, x)
    assert step2.shape == (2, 5, DV) and (x2 - x).abs().max() > 1e-3
    # without its own embedding the target's is used
    no_emb = {k: v for k, v in sd.items() if k != "embed_tokens.weight"}
    other, _ = torch_eagle3_logits(no_emb, cfg, embed, tokens, fused)
    assert (other - logits).abs().max() > 1e-3


def test_attention_matches_transformers(tmp_path):
    """The reference's RoPE/GQA/causal attention equals transformers' LlamaAttention."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    import published

    sd, cfg = write_eagle1_head(tmp_path, hidden=H, heads=NQ, kv_heads=NKV, intermediate=INTER,
                                vocab=V, style="llama3", dtype=torch.float32, seed=7)
    hf_cfg = LlamaConfig(hidden_size=H, num_attention_heads=NQ, num_key_value_heads=NKV,
                         intermediate_size=INTER, vocab_size=V, rope_theta=cfg["rope_theta"],
                         max_position_embeddings=64, attention_bias=False)
    hf_cfg._attn_implementation = "eager"
    attn = LlamaAttention(hf_cfg, layer_idx=0).eval()
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        getattr(attn, name).weight.data = sd[f"layers.0.self_attn.{name}.weight"].clone()
    T = 7
    x = torch.randn(2, T, H, generator=torch.Generator().manual_seed(7))
    pos = torch.arange(T)[None]
    cos, sin = LlamaRotaryEmbedding(hf_cfg)(x, pos)
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        want = attn(x, position_embeddings=(cos, sin), attention_mask=mask)[0]
    got = published._attention(x, sd, "layers.0.self_attn.", cfg, torch.arange(T))
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)
    assert math.isfinite(float(got.abs().max()))
