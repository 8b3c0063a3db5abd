"""specjax.generate: batching, EOS, bucketing, errors (token for token against transformers'
``generate``: tests/test_models.py, beside the logit parity, so one worker loads the
transformers model once)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import toys
import specjax
from specjax.core import decoder, sampling
from specjax.models.llama import Llama, init_params

PROMPTS = [
    ("The capital of France is", False),
    ("def fibonacci(n):", False),
    ("Give me three tips for staying focused while studying.", True),
]

TOY = toys.LLAMA_2


@pytest.fixture(scope="module")
def toy():
    return Llama(TOY), init_params(TOY, jax.random.key(0))


@pytest.mark.slow
def test_batch_rows_equal_single_rows_with_early_eos(smollm):
    """Rows of different lengths, one stopping early at EOS, match the same rows run alone."""
    prompts = [smollm.encode(t, chat=c) for t, c in PROMPTS]
    kw = dict(max_new_tokens=24, cache_size=128)
    free = specjax.generate(smollm.model, smollm.params, prompts[1:2], **kw).to_lists()[0]
    stop = free[5]  # a token row 1 emits early: declare it EOS so that row ends at step <= 6
    eos = (stop,)
    batch = specjax.generate(smollm.model, smollm.params, prompts, eos_ids=eos, **kw).to_lists()
    singles = [specjax.generate(smollm.model, smollm.params, [p], eos_ids=eos, **kw).to_lists()[0]
               for p in prompts]
    assert batch == singles
    assert len(batch[1]) <= 6 and batch[1][-1] == stop
    assert len({len(r) for r in batch}) > 1, "rows should end at different lengths"
    assert batch[1] == free[: len(batch[1])]


def test_greedy_equals_teacher_forced_argmax_toy(toy):
    model, params = toy
    prompts = [[1, 2, 3, 4, 5], [7, 8]]
    out = specjax.generate(model, params, prompts, max_new_tokens=12).to_lists()
    for p, gen in zip(prompts, out):
        logits, _, _ = toys.forward(model, params, jnp.asarray([p + gen]), 64)
        pred = np.asarray(jnp.argmax(logits[0], -1))
        assert pred[len(p) - 1: -1].tolist() == gen


def test_no_recompile_for_new_prompt_length_or_budget(toy):
    model, params = toy
    specjax.generate(model, params, [[1, 2, 3]], max_new_tokens=10, cache_size=128)
    n_exes = len(decoder._RUN._exes)
    again = specjax.generate(model, params, [[5, 6, 7, 8, 9, 10, 11]], max_new_tokens=13,
                             cache_size=128)
    assert again.compile_s == 0.0 and len(decoder._RUN._exes) == n_exes
    assert int(again.lengths[0]) == 13


def test_prompt_too_long_fails_before_running(toy):
    model, params = toy
    n_exes = len(decoder._RUN._exes)
    with pytest.raises(ValueError, match=r"row 1: prompt of 120 tokens \+ 20 new tokens = 140 "
                                         r"does not fit the cache of 128"):
        specjax.generate(model, params, [[1] * 10, [1] * 120], max_new_tokens=20, cache_size=128)
    ctx = TOY.max_position_embeddings
    with pytest.raises(ValueError, match=f"exceeds the model's context of {ctx}"):
        specjax.generate(model, params, [[1] * (ctx - 12)], max_new_tokens=20)
    assert len(decoder._RUN._exes) == n_exes, "nothing may compile before the check"


def test_bad_arguments_fail_clearly(toy):
    model, params = toy
    with pytest.raises(ValueError, match="explicit PRNG key"):
        specjax.generate(model, params, [[1, 2]], max_new_tokens=4, sampler=specjax.Sample())
    with pytest.raises(ValueError, match=rf"token ids must lie in \[0, {TOY.vocab_size}\)"):
        specjax.generate(model, params, [[1, 99]], max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        specjax.generate(model, params, [[1, 2]], max_new_tokens=0)
    with pytest.raises(ValueError, match="multiple of the prefill chunk"):
        specjax.generate(model, params, [[1, 2]], max_new_tokens=4, cache_size=100)


def test_sampling_is_keyed_and_reproducible(toy):
    model, params = toy
    s = specjax.Sample(temperature=1.0)
    a = specjax.generate(model, params, [[1, 2, 3]], max_new_tokens=16, sampler=s,
                         key=jax.random.key(1)).to_lists()
    b = specjax.generate(model, params, [[1, 2, 3]], max_new_tokens=16, sampler=s,
                         key=jax.random.key(1)).to_lists()
    c = specjax.generate(model, params, [[1, 2, 3]], max_new_tokens=16, sampler=s,
                         key=jax.random.key(2)).to_lists()
    assert a == b and a != c


def _np_truncated(logits, temp, top_k, top_p):
    """Reference: softmax(logits/temp) restricted to top-k, then to the top-p nucleus."""
    x = logits / temp
    order = np.argsort(-x, kind="stable")
    keep = np.zeros_like(x, bool)
    keep[order[: top_k if top_k > 0 else len(x)]] = True
    p = np.where(keep, np.exp(x - x.max()), 0)
    p /= p.sum()
    mass = 0.0
    nucleus = np.zeros_like(keep)
    for i in order:
        if not keep[i] or mass >= top_p:
            continue
        nucleus[i] = True
        mass += p[i]
    q = np.where(nucleus, np.exp(x - x.max()), 0)
    return q / q.sum()


@pytest.mark.parametrize("temp,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8),
                                              (1.0, 8, 0.6)])
def test_probs_match_reference_truncation(temp, top_k, top_p):
    logits = np.random.default_rng(0).normal(size=(3, 32)).astype(np.float32) * 2
    got = np.asarray(sampling.probs(jnp.asarray(logits), specjax.Sample(temp, top_k, top_p)))
    for row, g in zip(logits, got):
        np.testing.assert_allclose(g, _np_truncated(row, temp, top_k, top_p), atol=1e-6)


def test_sample_follows_probs_chi_square():
    """200k draws from sample() match probs() (chi-square, p > 1e-4); a 1% shift would fail."""
    from scipy import stats

    logits = jnp.asarray(np.random.default_rng(1).normal(size=(1, 12)), jnp.float32)
    s = specjax.Sample(temperature=0.9, top_k=8, top_p=0.95)
    p = np.asarray(sampling.probs(logits, s))[0]
    n = 200_000
    keys = jax.random.split(jax.random.key(0), n)
    draws = jax.vmap(lambda k: sampling.sample(k, logits, s)[0])(keys)
    counts = np.bincount(np.asarray(draws), minlength=12)
    assert counts[p == 0].sum() == 0, "sampled a token outside top-k/top-p"
    support = p > 0
    _, pval = stats.chisquare(counts[support], n * p[support])
    assert pval > 1e-4, (counts, n * p)


@pytest.mark.slow
def test_cli_generate_json(smollm, monkeypatch, capsys):
    from specjax import cli

    monkeypatch.setattr("specjax.models.load", lambda *a, **k: smollm)
    assert cli.main(["generate", "--prompt", "What is 2+2?", "--chat", "--max-new-tokens", "8",
                     "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["method"] == "ar" and 1 <= len(res["token_ids"]) <= 8
    assert res["tokens_per_s"] > 0 and res["compile_s"] >= 0
    assert res["text"] == smollm.tokenizer.decode(res["token_ids"], skip_special_tokens=True)
