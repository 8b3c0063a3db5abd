"""Gemma: Gemma-3-270M on its real weights against transformers on the same GGUF, and small
random Gemma 2 / Gemma 3 models that transformers builds and saves (soft-capping, sliding
windows, QK-norm), including speculative decoding across the window's edge."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import hsd, methods
from specjax.models import load_hf_dir
from specjax.drafters import eagle
from specjax.models.gemma import FULL, SLIDING, Gemma, init_params
from specjax.models.kv_cache import causal_mask

WINDOW = 8  # small random models: prompts and generations run well past the window


def _fwd(model, params, tokens, cache=None, start=0):
    tokens = jnp.asarray(tokens, jnp.int32)
    b, t = tokens.shape
    cache = model.init_cache(b, 64, params["embed"].dtype) if cache is None else cache
    pos = jnp.broadcast_to(start + jnp.arange(t), (b, t))
    return _jitted_forward(model)(params, tokens, pos, cache, causal_mask(b, t))


@functools.lru_cache(maxsize=None)
def _jitted_forward(model):
    """One jitted forward per model, so a shape seen before is not traced again."""
    return jax.jit(model.forward)


def _save_tiny(path, kind: str, seed: int = 0):
    """A random transformers Gemma 2 or Gemma 3 text model, saved as safetensors, with
    sharp attention (weights larger than HF's init)."""
    import torch
    import transformers

    torch.set_num_threads(2)
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=128, sliding_window=WINDOW, rms_norm_eps=1e-6,
                  query_pre_attn_scalar=24, attn_implementation="eager")
    if kind == "gemma2":  # soft-capping small enough to bite
        cfg = transformers.Gemma2Config(**common, attn_logit_softcapping=2.0,
                                        final_logit_softcapping=3.0)
    else:
        cfg = transformers.Gemma3TextConfig(
            **common, layer_types=["sliding_attention", "full_attention"] * 2,
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default",
                                                   "rope_theta": 1e4}})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.3 * torch.randn_like(p) if p.ndim == 1 else 0.25 * torch.randn_like(p))
    model.save_pretrained(str(path))
    return model


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = _save_tiny(path, request.param)
    cfg, params = load_hf_dir(path)
    return request.param, hf, Gemma(cfg), params


def test_tiny_config_reads_the_family_features(tiny):
    kind, _, model, _ = tiny
    c = model.config
    assert c.sliding_window == WINDOW and c.query_pre_attn_scalar == 24
    if kind == "gemma2":
        assert (c.attn_logit_softcapping, c.final_logit_softcapping) == (2.0, 3.0)
        assert not c.qk_norm and c.layer_types == (SLIDING, FULL) * 2
    else:
        assert c.qk_norm and c.attn_logit_softcapping is None
        assert (c.rope_theta, c.rope_local_theta) == (1e6, 1e4)


def test_tiny_logits_match_transformers_past_the_window(tiny):
    import torch

    kind, hf, model, params = tiny
    tokens = np.random.default_rng(1).integers(0, 96, (2, 30)).astype(np.int32)
    with torch.no_grad():
        ref = hf(torch.from_numpy(tokens).long()).logits.numpy()
    ours, _, _ = _fwd(model, params, tokens)
    d = float(np.max(np.abs(np.asarray(ours) - ref)))
    assert d < 1e-4, f"{kind}: logits differ from transformers by {d:.2e}"
    # the features are exercised: dropping the window (or the caps) changes the logits
    wide = Gemma(dataclasses.replace(model.config, sliding_window=1000))
    assert float(np.max(np.abs(np.asarray(_fwd(wide, params, tokens)[0]) - ref))) > 1e-2
    if kind == "gemma2":
        nocap = Gemma(dataclasses.replace(model.config, attn_logit_softcapping=None,
                                          final_logit_softcapping=None))
        assert float(np.max(np.abs(np.asarray(_fwd(nocap, params, tokens)[0]) - ref))) > 1e-2


def test_tiny_cached_steps_equal_full_forward(tiny):
    _, _, model, params = tiny
    tokens = np.random.default_rng(2).integers(0, 96, (1, 24)).astype(np.int32)
    full, _, _ = _fwd(model, params, tokens)
    cache = model.init_cache(1, 64, params["embed"].dtype)
    steps = []
    chunks = [(0, 10)] + [(i, i + 1) for i in range(10, 24)]  # a prefill, then one at a time
    for lo, hi in chunks:
        out, _, cache = _fwd(model, params, tokens[:, lo:hi], cache, start=lo)
        cache = cache.advance(hi - lo)
        steps.append(np.asarray(out))
    np.testing.assert_allclose(np.concatenate(steps, 1), np.asarray(full), atol=1e-4)


def test_tiny_greedy_decoding_equals_transformers(tiny):
    import torch

    kind, hf, model, params = tiny
    prompt = np.random.default_rng(3).integers(0, 96, 12).tolist()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, 12:].tolist()
    out = specjax.generate(model, params, [prompt], max_new_tokens=20, eos_ids=())
    assert out.to_lists()[0] == ref, kind


def test_tiny_speculation_across_the_window_edge_equals_ar(tiny):
    """Tree verification and commit with prompts and outputs longer than the window: every
    drafter's greedy output equals ``generate`` on a ragged batch of 4 (batch 1 against
    batch 4 is checked for every drafter on Llama toys and on Gemma-3-270M). Gemma 2 runs a
    chain and a tree; Gemma 3 also the early-exit and model drafters, and three-level HSD."""
    kind, _, model, params = tiny
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 96, n).tolist() for n in (5, 9, 14, 21)]
    prompts[2] = (prompts[2][:4] * 4)[:14]  # repetitive: n-gram drafts get accepted
    ar = specjax.generate(model, params, prompts, max_new_tokens=24, eos_ids=()).to_lists()
    small = Gemma(dataclasses.replace(model.config, num_layers=2, layer_types=(SLIDING, FULL)))
    small_params = init_params(small.config, jax.random.key(5))
    head = eagle.draft_params(eagle.init_head(model.config, jax.random.key(6)), model, params,
                              vocab_ids=list(range(0, 96, 2)))  # a reduced draft vocabulary
    drafters = [(specjax.NGramDrafter(depth=5), None),
                (specjax.EarlyExitDrafter(model, 2, depth=3), None),
                (specjax.ModelDrafter(small, depth=3, width=2), small_params),
                (eagle.EagleDrafter(model, depth=3, topk=2, total_tokens=5), head)]
    if kind == "gemma2":  # the drafters that read the target's own windowed layers: Gemma 3
        drafters = [drafters[0], drafters[3]]
    for drafter, dparams in drafters:
        out = specjax.speculative_generate(model, params, drafter, dparams, prompts,
                                           max_new_tokens=24, eos_ids=())
        assert out.to_lists() == ar, type(drafter).__name__
    if kind == "gemma3":  # HSD: an n-gram bottom, an exit of the windowed layers, the target
        h = hsd.Hierarchy((hsd.NGram(specjax.NGramDrafter(depth=4)), hsd.Exit(2), hsd.Exit()),
                          (3, 2))
        out = hsd.hsd_generate(model, params, h, prompts, max_new_tokens=24, eos_ids=())
        assert out.to_lists() == ar, "hsd"


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    import json

    from specjax.models import WeightLoadError

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    with pytest.raises(WeightLoadError, match="model_type 'mamba' is not supported"):
        load_hf_dir(tmp_path)


@pytest.mark.parametrize("how", ["missing", "misshaped"])
def test_gemma_dir_with_a_bad_tensor_is_a_clear_error(tmp_path, how):
    from safetensors.numpy import load_file, save_file

    from specjax.models import WeightLoadError

    _save_tiny(tmp_path, "gemma3")
    (f,) = tmp_path.glob("*.safetensors")
    tensors = load_file(str(f))
    name = "model.layers.1.self_attn.q_norm.weight"
    if how == "missing":
        del tensors[name]
    else:
        tensors[name] = np.zeros((tensors[name].shape[0] + 1,), tensors[name].dtype)
    save_file(tensors, str(f))
    with pytest.raises(WeightLoadError, match="q_norm" if how == "misshaped" else "missing"):
        load_hf_dir(tmp_path)


def test_a_window_larger_than_the_cache_is_full_attention(tmp_path):
    """Windows are masks over a full cache (docs/design.md), so a window at least as long as
    the cache is not an error: it attends like a global layer. A window < 1 is refused."""
    _save_tiny(tmp_path, "gemma3")
    cfg, params = load_hf_dir(tmp_path)
    cfg = dataclasses.replace(cfg, rope_local_theta=cfg.rope_theta)
    toks = np.random.default_rng(5).integers(0, cfg.vocab_size, (2, 40))
    wide = _fwd(Gemma(dataclasses.replace(cfg, sliding_window=1000)), params, toks)[0]
    full = _fwd(Gemma(dataclasses.replace(cfg, layer_types=(FULL,) * cfg.num_layers)), params,
                toks)[0]
    narrow = _fwd(Gemma(cfg), params, toks)[0]
    np.testing.assert_allclose(wide, full, rtol=1e-5, atol=1e-5)
    assert float(jnp.max(jnp.abs(narrow - full))) > 1e-2  # the window of 8 does matter
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        dataclasses.replace(cfg, sliding_window=0)


# --------------------------------------------------------------------------- Gemma-3-270M

@pytest.fixture(scope="module")
def gemma3():
    return specjax.models.load("gemma3-270m")


@pytest.fixture(scope="module")
def hf_gemma3(gemma3, hf_from_gguf):
    return hf_from_gguf(gemma3.source)


@pytest.fixture(scope="module")
def gemma3_prompts(gemma3):
    long = " ".join(f"Item {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i * 7 % 31}."
                    for i in range(60))
    texts = ["The capital of France is", "def fibonacci(n):\n    ", long + " The blue box"]
    ids = [gemma3.encode(t) for t in texts]
    assert len(ids[2]) > 600  # longer than the 512-token window of the local layers
    return ids


@pytest.fixture(scope="module")
def gemma3_ar(gemma3, gemma3_prompts, ar_reference):
    """``(prompts, ar)``: the three prompts and a counting one, with their greedy ``generate``
    outputs of 16 tokens, decoded once for this file (``ar_reference``)."""
    prompts = gemma3_prompts + [gemma3.encode("1, 2, 3, 4, 5, 6, 7, 8,")]
    return prompts, ar_reference("gemma3-270m", gemma3, prompts, 16)


@pytest.mark.slow
def test_gemma3_270m_logits_match_transformers(gemma3, hf_gemma3, gemma3_prompts):
    assert gemma3.eos_ids == (1, 106) and not gemma3.has_chat_template
    # the short prompts in one forward, right-padded (under the causal mask a row's first
    # len(ids) logits do not see its padding), the long one alone: two compiles, not three
    groups = [[ids for ids in gemma3_prompts if len(ids) < 64],
              [ids for ids in gemma3_prompts if len(ids) >= 64]]
    assert all(groups)
    for group in groups:
        n, k = max(len(ids) for ids in group), len(group)
        rows = jnp.asarray([ids + [0] * (n - len(ids)) for ids in group], jnp.int32)
        logits, _, _ = jax.jit(gemma3.model.forward)(
            gemma3.params, rows, jnp.broadcast_to(jnp.arange(n), (k, n)),
            gemma3.model.init_cache(k, 1024), causal_mask(k, n))
        _check_against_hf(hf_gemma3, group, np.asarray(logits))


def _check_against_hf(hf, prompts, logits):
    """Each prompt's logits (a row of ``logits``, right-padded) against transformers'."""
    import torch

    for ids, ours in zip(prompts, logits):
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].numpy()
        d = float(np.max(np.abs(ours[: len(ids)] - ref)))
        # float32 rounding over 18 layers: measured 4e-5 (6 tokens) to 1.1e-3 (754 tokens),
        # on logits of magnitude 20-40
        assert d < 5e-3, f"{len(ids)}-token prompt: max |logit diff| {d:.2e}"


@pytest.mark.slow
@pytest.mark.extended  # opt-in (the suite's time): the logits test above runs by default,
# and greedy decoding equals transformers' past the window on the Gemma toys
def test_gemma3_270m_greedy_equals_transformers(gemma3, hf_gemma3, gemma3_ar):
    """Greedy ``generate``'s first 12 tokens (a greedy run's prefix is the shorter run: the
    shared 16-token reference) equal transformers' 12."""
    import torch

    prompts, ar = gemma3_ar
    for ids, got in zip(prompts[:3], ar):
        got = got[:12]
        with torch.no_grad():
            ref = hf_gemma3.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                                     eos_token_id=list(gemma3.eos_ids), pad_token_id=0)
        assert got == ref[0, len(ids):].tolist()


@pytest.mark.slow
def test_gemma3_270m_chat_without_template_is_a_clear_error(gemma3):
    with pytest.raises(ValueError, match="no chat template"):
        gemma3.encode("hi", chat=True)


@pytest.mark.slow
def test_gemma3_270m_every_method_equals_ar(gemma3, gemma3_ar):
    """The shipped EAGLE-2 head reproduces ``generate`` on the real weights at batch 4
    (ragged, one prompt past the 512-token window): the Gemma family's real-weight check
    (SmolLM2's: tests/test_real_smollm2.py). The drafters that need no trained head (n-gram,
    early exit, a draft model) run across the window edge on the Gemma 3 toy
    (test_tiny_speculation_across_the_window_edge_equals_ar), and so does HSD."""
    m, p = gemma3.model, gemma3.params
    prompts, ar = gemma3_ar  # generate(), once per session
    drafter, dparams = methods.load_drafter("eagle2", gemma3, "gemma3-270m")  # shipped head
    out = specjax.speculative_generate(m, p, drafter, dparams, prompts, max_new_tokens=16,
                                       eos_ids=gemma3.eos_ids)
    assert out.to_lists() == ar
    # the trained head's drafts land: more than 1.5 tokens per target forward on the first
    # prompt
    assert len(ar[0]) / int(np.asarray(out.target_forwards)[0]) > 1.5


def test_draft_heads_score_through_the_models_own_logits(tiny):
    """A draft head that predicts the target's normed feature scores it as the target
    does (``unembed``): Gemma 2's final soft-cap reaches EAGLE's and DFlash's draft logits
    and EAGLE's training targets (before, they multiplied by the LM head alone)."""
    from specjax.drafters import dflash

    kind, _, model, params = tiny
    h = jax.random.normal(jax.random.key(1), (2, 3, model.config.hidden_size))
    want = model.logits(params, h)
    f = model.final_norm(params, h)
    drafter = eagle.EagleDrafter(model, depth=2, topk=2, total_tokens=3)
    np.testing.assert_allclose(drafter._logq({}, params, f), jax.nn.log_softmax(want, -1),
                               rtol=0, atol=1e-5)
    np.testing.assert_allclose(dflash.draft_logits(model, params, f), want, rtol=0, atol=1e-5)
    rows = eagle.output_embedding(model, params)[::2]
    np.testing.assert_allclose(model.unembed(params, f, rows), want[..., ::2], rtol=0, atol=1e-5)
    if kind == "gemma2":  # the cap bites: the bare product differs
        bare = jnp.einsum("btd,vd->btv", f, eagle.output_embedding(model, params))
        assert float(jnp.max(jnp.abs(want))) < 3.0 < float(jnp.max(jnp.abs(bare)))
