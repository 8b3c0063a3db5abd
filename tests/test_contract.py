"""The model contract: Llama, Gemma and T5's decoder implement every member of it, and
nothing outside ``specjax.models`` reads parameters by name or pulls the training package
into inference."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import toys
from specjax.core import encdec
from specjax.models import T5, Gemma, Llama, Model, ModelConfig, RopeScaling
from specjax.models import gemma, llama, t5

ROOT = Path(__file__).resolve().parents[1]
TINY_L = toys.LLAMA
TINY_G = gemma.GemmaConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=8,
                           layer_types=("sliding", "full"), sliding_window=4)
TINY_T = t5.T5Config(vocab_size=16, hidden_size=32, intermediate_size=64, num_layers=2,
                     num_encoder_layers=1, num_heads=4, head_dim=8)


def _llama():
    return Llama(TINY_L), llama.init_params(TINY_L, jax.random.key(0)), None


def _gemma():
    return Gemma(TINY_G), gemma.init_params(TINY_G, jax.random.key(0)), None


def _t5():
    """T5's decoder, its weights bound to two encoded sources of different lengths."""
    model = T5(TINY_T)
    params, _ = encdec.bind_sources(model, t5.init_params(TINY_T, jax.random.key(0)),
                                    [[3, 4, 5, 6], [7, 8]], source_size=4)
    return model, params, [[3, 4, 5, 6], [7, 8, -1, -1]]


CONFIG_MEMBERS = {"vocab_size": int, "hidden_size": int, "num_layers": int,
                  "max_position_embeddings": int, "num_heads": int, "num_kv_heads": int,
                  "head_dim": int, "intermediate_size": int, "rms_norm_eps": float,
                  "rope_theta": float, "rope_scaling": RopeScaling}


def _check_config(cfg) -> None:
    """Every ``ModelConfig`` member is there with its type, and the sizes agree."""
    assert isinstance(cfg, ModelConfig)
    assert set(CONFIG_MEMBERS) == set(ModelConfig.__annotations__)
    for name, kind in CONFIG_MEMBERS.items():
        value = getattr(cfg, name)
        assert isinstance(value, kind) and not isinstance(value, bool), (name, value)
    assert cfg.num_heads % cfg.num_kv_heads == 0 and 0 < cfg.rms_norm_eps < 1e-3
    assert cfg.rope_theta > 0 and cfg.rope_scaling.inv_freq(cfg.head_dim, cfg.rope_theta
                                                            ).shape == (cfg.head_dim // 2,)


@pytest.mark.parametrize("make", [_llama, _gemma, _t5], ids=["llama", "gemma", "t5"])
def test_every_family_implements_the_contract(make):
    """Calls every member of ``Model`` on Llama, Gemma and T5's decoder and checks what
    comes back: shapes, dtypes, and that the pieces compose (``logits`` = ``output_head``
    of ``final_norm``; a forward's logits = ``logits`` of its last hidden state)."""
    model, params, source = make()
    cfg = model.config
    assert isinstance(model, Model)
    _check_config(cfg)
    v, d, n, f32 = cfg.vocab_size, cfg.hidden_size, cfg.num_layers, jnp.float32
    assert model.param_dtype(params) == f32 == model.compute_dtype
    toks = jnp.asarray([[1, 2, 3], [4, 5, 6]])
    pos = jnp.broadcast_to(jnp.arange(3), (2, 3))

    cache = model.init_cache(2, 8)
    assert len(cache.k) == len(cache.v) == n and cache.capacity == 8
    assert cache.k[0].shape == (2, cfg.num_kv_heads, cfg.head_dim, 8)
    assert cache.v[0].shape == (2, cfg.num_kv_heads, 8, cfg.head_dim)
    assert cache.k[0].dtype == f32 and cache.length.tolist() == [0, 0]
    assert model.init_cache(2, 8, jnp.bfloat16).v[-1].dtype == jnp.bfloat16

    emb = model.embed(params, toks)
    assert emb.shape == (2, 3, d) and emb.dtype == f32
    normed = model.final_norm(params, emb)
    assert normed.shape == (2, 3, d) and normed.dtype == f32
    head = model.output_head(params)
    assert head.shape == (v, d) and head.dtype == f32
    lg = model.logits(params, emb)
    assert lg.shape == (2, 3, v) and lg.dtype == f32
    np.testing.assert_allclose(lg, normed @ head.T, rtol=1e-4, atol=1e-4)
    sub = model.logits(params, emb, head=head[:5])
    assert sub.shape == (2, 3, 5) and sub.dtype == f32
    np.testing.assert_allclose(sub, lg[..., :5], rtol=1e-5, atol=1e-5)

    logits, hidden, out = model.forward(params, toks, pos, cache, return_layers=(0, 1))
    assert logits.shape == (2, 3, v) and logits.dtype == f32
    assert sorted(hidden) == [0, 1, n] and all(h.shape == (2, 3, d) for h in hidden.values())
    np.testing.assert_allclose(hidden[0], emb, rtol=1e-6)
    np.testing.assert_allclose(logits, model.logits(params, hidden[n]), rtol=1e-5, atol=1e-5)
    assert out.length.tolist() == [0, 0]  # the caller advances or commits
    assert float(jnp.abs(out.k[0][:, :, :, :3]).sum()) > 0
    assert float(jnp.abs(out.k[0][:, :, :, 3:]).sum()) == 0

    causal = jnp.broadcast_to(jnp.tril(jnp.ones((3, 3), bool)), (2, 3, 3))
    masked, _, _ = model.forward(params, toks, pos, cache, causal)
    np.testing.assert_allclose(masked, logits, rtol=1e-5, atol=1e-5)
    alone = jnp.broadcast_to(jnp.eye(3, dtype=bool), (2, 3, 3))  # each token sees itself only
    lone, _, _ = model.forward(params, toks, pos, cache, alone)
    np.testing.assert_allclose(lone[:, 0], logits[:, 0], rtol=1e-5, atol=1e-5)
    assert not np.allclose(lone[:, 2], logits[:, 2], atol=1e-4)

    ex, hid, _ = model.forward(params, toks, pos, cache, exit_layer=1, compute_logits=False)
    assert ex is None and sorted(hid) == [1]
    np.testing.assert_allclose(hid[1], hidden[1], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError):
        model.forward(params, toks, pos, cache, exit_layer=n + 1)

    src = model.source_tokens(params)
    assert model.is_encoder_decoder is (source is not None)
    if source is None:
        assert src is None
    else:
        assert src.dtype == jnp.int32 and src.tolist() == source


@pytest.mark.parametrize("make", [_llama, _gemma, _t5], ids=["llama", "gemma", "t5"])
def test_a_forward_without_cache_equals_one_into_an_empty_cache(make, monkeypatch):
    """A cache of capacity 0 (the feature pass's teacher-forced forward) attends to the new
    tokens alone, causally, in query blocks: its logits and hidden states equal a forward
    into an empty cache of capacity T, with the blocks uneven (``QUERY_BLOCK`` 2, T 5), the
    causal mask implied, and a narrower mask (each token alone) still obeyed."""
    from specjax.models import ops

    monkeypatch.setattr(ops, "QUERY_BLOCK", 2)
    model, params, _ = make()
    toks = jnp.asarray([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])
    pos = jnp.broadcast_to(jnp.arange(5), (2, 5))
    full, hid, _ = model.forward(params, toks, pos, model.init_cache(2, 5), return_layers=(1,))
    none, hid0, out = model.forward(params, toks, pos, model.init_cache(2, 0), return_layers=(1,))
    assert out.capacity == 0
    np.testing.assert_allclose(none, full, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(hid0[1], hid[1], rtol=1e-5, atol=1e-5)
    alone = jnp.broadcast_to(jnp.eye(5, dtype=bool), (2, 5, 5))
    a_full, _, _ = model.forward(params, toks, pos, model.init_cache(2, 5), alone)
    a_none, _, _ = model.forward(params, toks, pos, model.init_cache(2, 0), alone)
    np.testing.assert_allclose(a_none, a_full, rtol=1e-5, atol=1e-5)
    assert not np.allclose(a_none[:, 4], none[:, 4], atol=1e-4)


def test_no_module_outside_models_reads_parameters_by_name():
    pattern = re.compile(r"""params\[["'](embed|final_norm|lm_head|layers)["']\]""")
    hits = [f"{f.relative_to(ROOT)}:{i}" for d in ("specjax", "train")
            for f in sorted((ROOT / d).rglob("*.py"))
            for i, line in enumerate(f.read_text().splitlines(), 1) if pattern.search(line)]
    assert hits == [], hits


def test_inference_never_imports_the_training_package():
    code = ("import sys, specjax, specjax.drafters.eagle, specjax.drafters.exit_heads, "
            "specjax.drafters.redrafter, specjax.core.beams, specjax.hsd, "
            "specjax.core.speculative, specjax.hsd.calibrate, specjax.demo, specjax.bench; "
            "print(sorted(m for m in sys.modules if m.startswith('specjax.train')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout
