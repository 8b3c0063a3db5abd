"""The draft heads' building blocks (``specjax.drafters.blocks``) compute exactly what the
Llama port's layer computed for the EAGLE head, so heads trained on it (the shipped ones)
give the same outputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.drafters import blocks, eagle
from specjax.models import gemma, llama, t5
import toys

TOY, V = toys.LLAMA, toys.V


def _layer_inputs(cfg, seed=0, t=5, s=12, dtype=jnp.float32):
    """A random layer (the head's own tree names), stream, one-layer cache and masks."""
    spec = blocks.LayerSpec.of(cfg)
    keys = jax.random.split(jax.random.key(seed), 8)
    shapes = blocks.layer_shapes(spec)
    lp = {n: (jax.random.normal(k, sh) * 0.3 + (1.0 if n.endswith("norm") else 0.0)).astype(dtype)
          for (n, sh), k in zip(shapes.items(), jax.random.split(keys[0], len(shapes)))}
    x = jax.random.normal(keys[1], (2, t, cfg.hidden_size)).astype(dtype)
    k = (jax.random.normal(keys[2], (2, cfg.num_kv_heads, cfg.head_dim, s)) * 0.5).astype(dtype)
    v = (jax.random.normal(keys[3], (2, cfg.num_kv_heads, s, cfg.head_dim)) * 0.5).astype(dtype)
    length = jnp.asarray([3, 6], jnp.int32)
    mask = jax.random.bernoulli(keys[4], 0.5, (2, t, t)) | jnp.eye(t, dtype=bool)[None]
    visible = jax.random.bernoulli(keys[5], 0.6, (2, t, s))
    pos = length[:, None] + jnp.arange(t)[None]
    return spec, lp, x, k, v, length, mask, pos, visible


def _split(cfg, lp):
    """The same layer with ``qkv`` and ``gate_up`` split (the sharded layout)."""
    nq, nk, hd, f = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    q, k, v = jnp.split(lp["qkv"], [nq * hd, (nq + nk) * hd])
    gate, up = jnp.split(lp["gate_up"], [f])
    rest = {n: w for n, w in lp.items() if n not in ("qkv", "gate_up")}
    return {**rest, "q": q, "k": k, "v": v, "gate": gate, "up": up}


LAYER_CFGS = {
    "llama": TOY,
    "llama3-rope": toys.LLAMA3_ROPE,
}


@pytest.mark.parametrize("name", ["llama", "llama3-rope", "gemma", "t5"])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_head_layer_equals_the_llama_layer_bit_for_bit(name, split, dtype):
    """``blocks.decoder_layer`` computes exactly what ``llama.layer`` did for the head (the
    shipped heads were trained on it), for every target family's configuration."""
    cfg = LAYER_CFGS.get(name) or {
        "gemma": gemma.GemmaConfig(vocab_size=V, hidden_size=32, intermediate_size=64,
                                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                                   layer_types=("sliding", "full")),
        "t5": t5.T5Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=2,
                          num_encoder_layers=1, num_heads=4, head_dim=8)}[name]
    spec, lp, x, k, v, length, mask, pos, visible = _layer_inputs(cfg, dtype=dtype)
    if split:
        lp = _split(cfg, lp)
    for vis in (None, visible):
        want = llama.layer(cfg, lp, x, k, v, length, mask, pos, vis)
        got = blocks.decoder_layer(spec, lp, x, k, v, length, mask, pos, vis)
        for w, g in zip(want, got):
            assert g.dtype == w.dtype and g.shape == w.shape
            np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def test_head_primitives_equal_the_llama_ports():
    """RMS norm (both axes) and the LM-head product, bit for bit."""
    x = jax.random.normal(jax.random.key(0), (3, 5, 16))
    w = jax.random.normal(jax.random.key(1), (16,))
    for axis in (0, -1):
        ww = w[:3] if axis == 0 else w
        np.testing.assert_array_equal(blocks.rms_norm(x, ww, 1e-5, axis),
                                      llama.rms_norm(x, ww, 1e-5, axis))
    head = jax.random.normal(jax.random.key(2), (40, 16))
    np.testing.assert_array_equal(blocks.head_logits(head, x), llama.head_logits(head, x))


def test_a_head_built_on_blocks_gives_the_shipped_heads_outputs():
    """The head as it is built now computes what the Llama layer computes, on trained
    weights: the shipped SmolLM2 head's when installed (a head without the layer's
    attention-input norm, as it ships, is given a unit norm, so the Llama layer can
    compute it), else a random head's."""
    cfg = TOY
    head = eagle.init_head(cfg, jax.random.key(7))
    from specjax.heads import kinds, shipped_head

    path = shipped_head("eagle", "smollm2-135m")
    if path is not None:
        from specjax.models import SMOLLM2_135M

        cfg = SMOLLM2_135M
        head, _ = kinds.load_eagle(path, cfg)
        head = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), head)
        head["layer"].setdefault("attn_norm", jnp.ones((cfg.hidden_size,), jnp.float32))
    b, t, d = 1, 6, cfg.hidden_size
    emb = jax.random.normal(jax.random.key(8), (b, t, d))
    prev = jax.random.normal(jax.random.key(9), (b, t, d))
    pos = jnp.arange(t)[None]
    zk = jnp.zeros((b, cfg.num_kv_heads, cfg.head_dim, t))
    zv = jnp.zeros((b, cfg.num_kv_heads, t, cfg.head_dim))
    mask = jnp.tril(jnp.ones((t, t), bool))[None]
    module = eagle.nnx.merge(eagle.head_graphdef(cfg), head)
    got = module(emb, prev, pos, zk, zv, jnp.zeros((b,), jnp.int32), mask)
    x = jnp.einsum("bte,ed->btd", jnp.concatenate([emb, prev], -1), head["fc"]) + head["fc_b"]
    want = llama.layer(cfg, head["layer"], x, zk, zv, jnp.zeros((b,), jnp.int32), mask, pos)
    for w, g in zip(want, got):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
