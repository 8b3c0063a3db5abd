"""SpecForge's EAGLE-3 layout (sgl-project/SpecForge ``LlamaForCausalLMEagle3``, written by
``tests/published.py``'s ``write_specforge_eagle3_head`` from SpecForge's source): such a head
loads and drafts the logits of an independent PyTorch forward of SpecForge's model; a head
``published.save`` exports carries exactly SpecForge's tensor names and shapes but
``embed_tokens.weight`` (SpecForge's SGLang export drops it too), and the config keys
SpecForge reads; a SpecForge head read into specjax converts back to SpecForge's whole
layout, bit for bit."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import toys
from published import (SPECFORGE_CONFIG_KEYS, d2t_target_ids, specforge_eagle3_expected_shapes,
                        specforge_serving_names, torch_specforge_eagle3_logits,
                        write_specforge_eagle3_head)
from specjax.drafters import blocks, eagle3
from specjax.heads import published

TARGET = toys.LLAMA_6  # V 64, hidden 32, 4 heads of 8, 2 K/V heads, 6 layers
V, H, DV, B, T = TARGET.vocab_size, TARGET.hidden_size, 24, 2, 7

# (head hidden, target_hidden_size in the config, explicit head_dim): a head as wide as its
# target (no target_hidden_size, as SpecForge's own configs), one twice as wide with its own
# embedding and target_hidden_size, and one whose head_dim is not hidden // heads
CASES = {"same-width": (H, None, None), "wider-head": (2 * H, H, None),
         "head-dim": (2 * H, H, 8)}


def _read(d):
    """A written directory as SpecForge's loader sees it: torch state dict and config."""
    return load_file(str(d / "model.safetensors")), json.loads((d / "config.json").read_text())


def _run(spec, hp, emb, x):
    """``eagle3.apply_head`` over a causal sequence from an empty cache, float32."""
    k, v = blocks.empty_kv(spec, B, T, jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    out, _, _ = eagle3.apply_head(spec, hp, jnp.asarray(emb), jnp.asarray(x), pos, k, v,
                                  jnp.zeros((B,), jnp.int32), blocks.causal(B, T))
    return out


def _write(path, case, seed=0):
    hidden, target_hidden, head_dim = CASES[case]
    return write_specforge_eagle3_head(path, hidden=hidden, heads=4, kv_heads=2,
                                       intermediate=2 * hidden, vocab=V, draft_vocab=DV,
                                       target_hidden=target_hidden, head_dim=head_dim,
                                       seed=seed)


@pytest.mark.parametrize("case", list(CASES))
def test_specforge_head_equals_the_pytorch_reference(tmp_path, case):
    """bfloat16 files, as SpecForge saves them: specjax reads each bfloat16 weight exactly
    into float32, the reference computes in float32 from the same values, so the forwards
    agree to float32 rounding (1e-4), not bfloat16's."""
    sd, cfg = _write(tmp_path, case)
    on_disk, _ = _read(tmp_path)
    want = specforge_eagle3_expected_shapes(cfg)
    assert {k: tuple(v.shape) for k, v in on_disk.items()} == want  # SpecForge's own layout
    assert on_disk["lm_head.weight"].dtype == torch.bfloat16 and cfg["dtype"] == "bfloat16"
    head = published.load(tmp_path, TARGET)
    assert head.kind == "eagle3" and head.layers == eagle3.fused_layers(TARGET.num_layers)
    assert "embed" in head.params and head.spec.head_dim == cfg["head_dim"]
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, V, (B, T), generator=g)
    fused = torch.randn(B, T, 3 * H, generator=g)
    hp = jax.tree.map(jnp.asarray, head.params)
    out = _run(head.spec, hp, sd["embed_tokens.weight"][tokens].numpy(), fused.numpy())
    ours = np.asarray(eagle3.draft_logits(head.spec, hp, out))
    ref, _ = torch_specforge_eagle3_logits(sd, cfg, tokens, fused)
    assert np.abs(ours - ref.numpy()).max() < 1e-4, np.abs(ours - ref.numpy()).max()
    bad, _ = torch_specforge_eagle3_logits(sd, cfg, tokens, fused, norm_output=False)
    assert np.abs(ours - bad.numpy()).max() > 1e-2  # the comparison can tell
    np.testing.assert_array_equal(head.vocab_ids,
                                  d2t_target_ids(sd["d2t"], torch.arange(DV)).numpy())


def test_exported_head_has_specforges_names_but_the_embedding(tmp_path):
    """``published.save`` (what ``convert-head --to eagle3`` and ``--export-format eagle3``
    write) of a head as wide as its target: SpecForge's state dict for that config.json less
    ``embed_tokens.weight`` exactly, which is also exactly what SpecForge's SGLang export
    writes; SpecForge's buffers' dtypes; every config key SpecForge needs."""
    hp = eagle3.init_head(TARGET, jax.random.key(0), DV)
    ids = np.random.default_rng(0).permutation(V)[:DV]
    published.save("eagle3", jax.tree.map(np.asarray, hp), tmp_path, TARGET, vocab_ids=ids,
                   layers=eagle3.fused_layers(TARGET.num_layers))
    sd, cfg = _read(tmp_path)
    full = specforge_eagle3_expected_shapes(cfg)
    got = {k: tuple(v.shape) for k, v in sd.items()}
    assert set(full) - set(got) == {"embed_tokens.weight"} and set(got) <= set(full)
    assert got == {k: s for k, s in full.items() if k != "embed_tokens.weight"}
    assert set(got) == specforge_serving_names(cfg)
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool
    assert {v.dtype for k, v in sd.items() if k not in ("d2t", "t2d")} == {torch.bfloat16}
    assert [k for k in SPECFORGE_CONFIG_KEYS if k not in cfg] == []
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["draft_vocab_size"] == DV and cfg["vocab_size"] == V
    # EAGLE's fused layers: SpecForge's default aux ids, so no eagle_config is needed
    assert "eagle_config" not in cfg and "fc_norm" not in cfg
    np.testing.assert_array_equal(d2t_target_ids(sd["d2t"], torch.arange(DV)).numpy(), ids)


@pytest.mark.parametrize("case", ["same-width", "wider-head"])
def test_specforge_head_converts_back_to_its_whole_layout(tmp_path, case):
    """A SpecForge head read by ``published.load`` and written by ``published.save`` has
    SpecForge's whole state dict (its own embedding included) with the same bfloat16 values
    and buffers, and the config values SpecForge builds the model from."""
    sd, cfg = _write(tmp_path / "sf", case, seed=2)
    head = published.load(tmp_path / "sf", TARGET)
    published.save("eagle3", head.params, tmp_path / "out", TARGET, spec=head.spec,
                   vocab_ids=head.vocab_ids, layers=head.layers)
    out, out_cfg = _read(tmp_path / "out")
    src, _ = _read(tmp_path / "sf")
    assert set(out) == set(specforge_eagle3_expected_shapes(cfg)) == set(src)
    for k in src:
        assert out[k].dtype == src[k].dtype and torch.equal(out[k], src[k]), k
    # max_position_embeddings is the target's (only the size of SpecForge's RoPE cache,
    # which grows on demand); every other key SpecForge builds the model from is the head's
    for k in set(SPECFORGE_CONFIG_KEYS) - {"max_position_embeddings"}:
        assert out_cfg[k] == cfg[k], k
    assert out_cfg["max_position_embeddings"] == TARGET.max_position_embeddings
    assert out_cfg["rope_theta"] == cfg["rope_theta"]
    assert out_cfg.get("target_hidden_size", out_cfg["hidden_size"]) == H
