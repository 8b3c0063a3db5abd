"""The bfloat16 path: parameters and caches in bfloat16, logits accumulated in float32, and
every method's greedy output equal to bfloat16 AR, token for token."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import specjax
from specjax.drafters import eagle, redrafter
from specjax.hsd import Exit, Hierarchy, NGram
from specjax.models import Llama, LlamaConfig
from specjax.models.llama import init_params

V = 64
TOY = LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512)
PROMPTS = [[1, 5, 2, 7, 5, 9], [3, 3, 1, 4], [7, 2, 7, 2, 7, 9, 11, 2], [5, 6]]
NEW = 24


@pytest.fixture(scope="module")
def toy():
    model = Llama(TOY)
    tp = jax.tree.map(lambda x: (x * 3.0).astype(jnp.bfloat16),
                      init_params(TOY, jax.random.key(1)))
    return model, tp


def test_bf16_parameters_cache_and_float32_logits(toy):
    model, tp = toy
    assert model.param_dtype(tp) == jnp.bfloat16
    cache = model.init_cache(1, 32, model.param_dtype(tp))
    assert cache.k[0].dtype == jnp.bfloat16
    logits, _, cache = model.forward(tp, jnp.asarray([[1, 2, 3]]), jnp.arange(3)[None], cache)
    assert logits.dtype == jnp.float32 and cache.v[0].dtype == jnp.bfloat16


def test_every_method_bf16_greedy_equals_bf16_ar(toy):
    model, tp = toy
    ar = specjax.generate(model, tp, PROMPTS, max_new_tokens=NEW).to_lists()
    ed = eagle.EagleDrafter(model, depth=3, topk=2, total_tokens=6)
    edp = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x,
                       eagle.draft_params(eagle.init_head(TOY, jax.random.key(2)), model, tp))
    rd = redrafter.RedrafterDrafter(model, width=2, length=3)
    rdp = redrafter.draft_params(redrafter.init_head(TOY.hidden_size, V, jax.random.key(3),
                                                     dtype=jnp.bfloat16))
    ng = specjax.NGramDrafter(depth=4, min_ngram=1)
    h = Hierarchy((NGram(ng), Exit(1), Exit(2), Exit()), T=(2, 2, 2))
    outs = {
        "sd-ngram": specjax.speculative_generate(model, tp, ng, None, PROMPTS, max_new_tokens=NEW),
        "sd-early-exit": specjax.speculative_generate(
            model, tp, specjax.EarlyExitDrafter(model, layer=1, depth=3), None, PROMPTS,
            max_new_tokens=NEW),
        "eagle2": specjax.speculative_generate(model, tp, ed, edp, PROMPTS, max_new_tokens=NEW),
        "redrafter": specjax.speculative_generate(model, tp, rd, rdp, PROMPTS, max_new_tokens=NEW),
        "hsd": specjax.hsd_generate(model, tp, h, PROMPTS, max_new_tokens=NEW),
    }
    for name, out in outs.items():
        assert out.to_lists() == ar, name
    assert sum(int(o.target_forwards.sum()) for k, o in outs.items() if k != "hsd") < \
        4 * len(PROMPTS) * NEW, "no method accepted anything: the comparison proves little"
