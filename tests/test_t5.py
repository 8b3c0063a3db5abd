"""T5: parity with transformers' PyTorch T5 on random weights in the public shapes, the
decoder's cache and tree bias, and every decoding method on an encoder-decoder target."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
import toys
from laws import pvalue
from specjax.core import sampling
from specjax.core.verify import Rejection
from specjax.drafters import EarlyExitDrafter, ModelDrafter, NGramDrafter
from specjax.drafters.base import Context
from specjax.drafters.eagle import EagleDrafter, init_head
from specjax.hsd import Hierarchy, hsd_generate
from specjax.hsd.loop import Exit, NGram
from specjax.models import T5, T5_SMALL, T5_V1_1_SMALL, loading
from specjax.models.llama import Llama, init_params as llama_init
from specjax.models.t5 import T5Config, init_params, relative_bucket
from specjax.models.t5_random import save_random

torch = pytest.importorskip("torch")
from transformers import T5ForConditionalGeneration  # noqa: E402
from transformers.models.t5.modeling_t5 import T5Attention  # noqa: E402

TOY = toys.T5
SOURCES = [[5, 9, 3, 17, 22, 9, 3, 40], [7, 7], [11, 30, 2, 8, 19, 4, 4, 50, 61, 12, 33],
           [3, 9, 60, 1]]


def _sharp(params, s=3.0):
    return jax.tree.map(lambda x: x * s if x.ndim == 2 else x, params)


@pytest.fixture(scope="module")
def toy():
    model = T5(TOY)
    return model, _sharp(init_params(TOY, jax.random.key(0))), init_params(TOY, jax.random.key(1))


# --- parity with transformers ------------------------------------------------------------


def test_relative_buckets_equal_transformers():
    rel = torch.arange(-600, 600)
    for bidir in (True, False):
        for nb, md in ((32, 128), (8, 20)):
            ref = T5Attention._relative_position_bucket(rel, bidirectional=bidir, num_buckets=nb,
                                                        max_distance=md).numpy()
            ours = relative_bucket(jnp.asarray(rel.numpy()), bidir, nb, md)
            np.testing.assert_array_equal(np.asarray(ours), ref)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    return {name: save_random(tmp_path_factory.mktemp(name), name, seed=1)
            for name in ("t5-small", "t5-v1_1-small")}


@pytest.mark.parametrize("name", ["t5-small", "t5-v1_1-small"])
def test_logits_equal_transformers_in_public_shapes(hf_dirs, name):
    path = hf_dirs[name]
    cfg, params = loading.load_hf_dir(path)
    public = {"t5-small": T5_SMALL, "t5-v1_1-small": T5_V1_1_SMALL}[name]
    assert dataclasses.replace(cfg, max_position_embeddings=2048, max_source_positions=2048) \
        == public
    ref = T5ForConditionalGeneration.from_pretrained(str(path)).eval()
    rng = np.random.default_rng(0)
    src = rng.integers(2, cfg.vocab_size, (2, 19))
    lens = np.array([19, 12])
    dec = rng.integers(2, cfg.vocab_size, (2, 7))
    dec[:, 0] = cfg.decoder_start_token_id
    am = (np.arange(19)[None] < lens[:, None]).astype(np.int64)
    with torch.no_grad():
        enc_ref = ref.encoder(input_ids=torch.tensor(src), attention_mask=torch.tensor(am))
        out = ref(encoder_outputs=enc_ref, attention_mask=torch.tensor(am),
                  decoder_input_ids=torch.tensor(dec))
    model = T5(cfg)
    hid = np.asarray(model.encoder_output(params, jnp.asarray(src), jnp.asarray(lens)))
    ref_hid = enc_ref.last_hidden_state.numpy()
    for row in range(2):
        n = lens[row]
        np.testing.assert_allclose(hid[row, :n], ref_hid[row, :n], atol=1e-4 * np.abs(ref_hid).max())
    enc = model.encode(params, jnp.asarray(src), jnp.asarray(lens))
    logits, _, _ = model.forward(model.bind(params, enc), jnp.asarray(dec),
                                 jnp.broadcast_to(jnp.arange(7), (2, 7)),
                                 model.init_cache(2, 16))
    ref_logits = out.logits.numpy()
    err = np.abs(np.asarray(logits) - ref_logits).max() / np.abs(ref_logits).max()
    assert err < 1e-4, f"{name}: max |logits - transformers| = {err:.2e} of the largest logit"
    assert (np.asarray(logits).argmax(-1) == ref_logits.argmax(-1)).all()


@pytest.mark.parametrize("name", ["t5-small", "t5-v1_1-small"])
def test_greedy_generate_equals_transformers(hf_dirs, name):
    path = hf_dirs[name]
    cfg, params = loading.load_hf_dir(path)
    ref = T5ForConditionalGeneration.from_pretrained(str(path)).eval()
    rng = np.random.default_rng(3)
    sources = [rng.integers(2, cfg.vocab_size, n).tolist() for n in (23, 9)]
    out = specjax.generate(T5(cfg), params, sources, max_new_tokens=16)
    for row, src in zip(out.to_lists(), sources):
        with torch.no_grad():
            hf = ref.generate(torch.tensor([src]), max_new_tokens=16, do_sample=False,
                              eos_token_id=None, min_length=0)
        assert row == hf[0, 1:].tolist()


def test_flan_t5_base_config_reads_as_its_shape(tmp_path):
    """The third public shape, from the config transformers writes (its weights are 1 GB:
    benchmarks/t5_bench.sh builds and runs them)."""
    from transformers import T5Config as HFConfig

    from specjax.models import FLAN_T5_BASE
    from specjax.models.t5_random import HF_SHAPES

    fields = dict(HF_SHAPES["flan-t5-base"])
    HFConfig(decoder_start_token_id=0, **fields).save_pretrained(str(tmp_path))
    cfg = loading.hf_dir_config(tmp_path)
    assert not cfg.scale_output  # v1.1 / Flan: no d_model ** -0.5 before the head
    # whether the head is tied is settled by the weights (a saved lm_head.weight or not)
    assert dataclasses.replace(cfg, max_position_embeddings=2048, max_source_positions=2048,
                               tie_embeddings=False) == FLAN_T5_BASE


# --- the decoder's cache and tree bias ----------------------------------------------------


def _bound(toy, sources=SOURCES):
    model, params, _ = toy
    return model, specjax.core.encdec.encode(model, params, sources)


def test_cached_steps_equal_a_full_forward(toy):
    model, bp = _bound(toy)
    fwd = jax.jit(model.forward)  # as decoding runs it (eager, each step takes seconds)
    dec = jnp.asarray(np.random.default_rng(1).integers(0, TOY.vocab_size, (4, 9)))
    full, _, _ = fwd(bp, dec, jnp.broadcast_to(jnp.arange(9), (4, 9)), model.init_cache(4, 16))
    cache, steps = model.init_cache(4, 16), []
    for t in range(9):
        lg, _, cache = fwd(bp, dec[:, t:t + 1], jnp.full((4, 1), t), cache)
        cache, _ = cache.advance(1), steps.append(lg[:, 0])
    np.testing.assert_allclose(np.stack(steps, 1), np.asarray(full), atol=1e-5)


def test_tree_siblings_get_the_bias_of_their_own_chains(toy):
    """Root r (position 3) with children a, b (siblings, both at position 4) and c under b.
    Each node's logits equal those of its chain run alone."""
    model, bp = _bound(toy, [SOURCES[0]])
    fwd = jax.jit(model.forward)  # as decoding runs it (eager is slow)
    prefix = jnp.asarray([[0, 12, 40]])
    cache = model.init_cache(1, 16)
    _, _, cache = fwd(bp, prefix, jnp.arange(3)[None], cache)
    cache = cache.advance(3)
    r, a, b, c = 7, 21, 33, 50
    tree_tokens = jnp.asarray([[r, a, b, c]])
    # parents r, a<-r, b<-r, c<-b: each node sees itself and its ancestors
    mask = jnp.asarray([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]], bool)
    pos = jnp.asarray([[3, 4, 4, 5]])
    tree_logits, _, _ = fwd(bp, tree_tokens, pos, cache, mask)
    for chain, nodes in (([r, a], [0, 1]), ([r, b, c], [0, 2, 3])):
        t = len(chain)
        lg, _, _ = fwd(bp, jnp.asarray([chain]), (3 + jnp.arange(t))[None], cache)
        np.testing.assert_allclose(np.asarray(tree_logits[0, jnp.asarray(nodes)]),
                                   np.asarray(lg[0]), atol=1e-5)


# --- every method equals ar ------------------------------------------------------------------


def _drafters(toy):
    model, params, other = toy
    small = T5Config(**{**dataclasses.asdict(TOY), "num_layers": 1, "num_encoder_layers": 1})
    return {
        "ngram": (NGramDrafter(depth=3, min_ngram=1), None),
        "early-exit": (EarlyExitDrafter(model, 1, depth=3), None),
        "t5-draft": (ModelDrafter(T5(small), depth=3, width=2), init_params(small,
                                                                            jax.random.key(5))),
        "eagle": (EagleDrafter(model, depth=3, topk=2, total_tokens=6),
                  {"head": init_head(TOY, jax.random.key(6))}),
    }


def test_every_method_equals_ar(toy):
    """Every drafter and a three-level hierarchy reproduce ``generate`` on a ragged batch of
    4 sources (batch 1 against batch 4 is checked per method on the Llama toy,
    tests/test_conformance.py)."""
    model, params, _ = toy
    sources = SOURCES[:4]
    ar = specjax.generate(model, params, sources, max_new_tokens=14).to_lists()
    for name, (drafter, dp) in _drafters(toy).items():
        out = specjax.speculative_generate(model, params, drafter, dp, sources,
                                           max_new_tokens=14)
        assert out.to_lists() == ar, name
    h = Hierarchy(levels=(NGram(NGramDrafter(depth=4, min_ngram=1)), Exit(1), Exit()), T=(2, 3))
    assert hsd_generate(model, params, h, sources, max_new_tokens=14).to_lists() == ar


def test_ngram_drafter_copies_from_the_source(toy):
    model, bp = _bound(toy, [[4, 8, 15, 16, 23, 42, 7]])
    tokens = jnp.asarray([[0, 15, 16, 0, 0, 0]])
    ctx = Context(tokens=tokens, length=jnp.asarray([3]), prompt_len=jnp.asarray([1]),
                  cache=model.init_cache(1, 8), params=bp, source=model.source_tokens(bp))
    draft, _, _ = NGramDrafter(depth=5).propose(None, (), ctx, None, sampling.Greedy())
    assert draft.tokens[0, :3].tolist() == [23, 42, 7]
    assert draft.valid[0].tolist() == [True, True, True, False, False]  # the source ends
    draft, _, _ = NGramDrafter(depth=5, over_source=False).propose(None, (), ctx, None,
                                                                   sampling.Greedy())
    assert not bool(draft.valid.any())


# --- temperature 1 ------------------------------------------------------------------------


V = 8
TINY = T5Config(vocab_size=V, hidden_size=16, intermediate_size=24, num_layers=2,
                num_encoder_layers=1, num_heads=2, head_dim=8, num_buckets=8, max_distance=16)
SRC = [3, 5, 1, 6]


@dataclasses.dataclass(frozen=True)
class AcceptWithP(Rejection):
    """Wrong: accepts with p(x) instead of min(1, p(x)/q(x))."""

    def accept_prob(self, p, q, x):
        return p[x]


def _exact_pair(model, params):
    bp = specjax.core.encdec.encode(model, params, [SRC] * (V + 1))
    toks = jnp.asarray([[0, 0]] + [[0, y] for y in range(V)])
    logits, _, _ = model.forward(bp, toks, jnp.broadcast_to(jnp.arange(2), (V + 1, 2)),
                                 model.init_cache(V + 1, 8))
    p = np.asarray(jax.nn.softmax(logits, -1), np.float64)
    return p[0, 0][:, None] * p[1:, 1]


# the wrong rule's control is opt-in (the suite's time): the chi-square test's power against
# a lossy rule is shown by default on the Llama toy (tests/test_conformance.py), and for T5 by
# the HSD control below
@pytest.mark.parametrize("rule,lossless", [
    (Rejection(), True), pytest.param(AcceptWithP(), False, marks=pytest.mark.extended)])
def test_sampled_t5_speculation_follows_the_target(rule, lossless):
    model = T5(TINY)
    tp = _sharp(init_params(TINY, jax.random.key(2)), 2.0)
    dp = _sharp(init_params(TINY, jax.random.key(3)), 2.0)
    drafter = ModelDrafter(model, depth=3)
    counts, acc = np.zeros((V, V)), []
    for i in range(30):
        out = specjax.speculative_generate(model, tp, drafter, dp, [SRC] * 256,
                                           max_new_tokens=2, sampler=sampling.Sample(1.0),
                                           key=jax.random.key(i), rule=rule)
        y = np.asarray(out.tokens)[:, :2]
        np.add.at(counts, (y[:, 0], y[:, 1]), 1)
        acc.append(np.asarray(out.accepted_at)[:, 0])
    assert 0.05 < np.mean(acc) < 0.95, "acceptance must be partial, or the test is vacuous"
    p = pvalue(counts, _exact_pair(model, tp))
    if lossless:
        assert p > 1e-4, f"(y0, y1) differs from the target's distribution (p={p:.2e})"
    else:
        assert p < 1e-6, f"the wrong rule was not caught (p={p:.2e})"


# --- clear errors ---------------------------------------------------------------------------


def test_bad_input_fails_clearly(toy, tmp_path):
    model, params, _ = toy
    llama_cfg = toys.LLAMA
    other = ModelDrafter(Llama(llama_cfg), depth=2)
    with pytest.raises(ValueError, match="encoder-decoder model with 64 tokens.*decoder-only"):
        specjax.speculative_generate(model, params, other, llama_init(llama_cfg,
                                                                      jax.random.key(0)),
                                     [SOURCES[0]], max_new_tokens=4)
    with pytest.raises(ValueError, match="source of 300 tokens does not fit the encoder's "
                                         "cache of 128"):
        specjax.generate(model, params, [[3] * 300], max_new_tokens=4, source_size=128)
    path = save_random(tmp_path / "t5", dict(vocab_size=64, d_model=16, d_kv=4, d_ff=32,
                                              num_layers=1, num_heads=4))
    cfg = json.loads((path / "config.json").read_text())
    del cfg["decoder_start_token_id"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(loading.WeightLoadError, match="no decoder_start_token_id"):
        loading.load_hf_dir(path)


# --- HSD with per-level draft temperatures ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ReportsTargetQ(Exit):
    """Wrong: draws at its own temperature but reports q at the target's."""

    def reports(self, target_sampler):
        return target_sampler


def _hsd_pair_pvalue(h, tp, sampler, calls=30):
    model, counts, acc = T5(TINY), np.zeros((V, V)), []
    for i in range(calls):
        out = hsd_generate(model, tp, h, [SRC] * 256, max_new_tokens=2, sampler=sampler,
                           key=jax.random.key(100 + i))
        y = np.asarray(out.tokens)[:, :2]
        np.add.at(counts, (y[:, 0], y[:, 1]), 1)
        acc.append(out.acceptance)
    assert np.all(np.mean(acc, 0) > 0.05), "drafts were almost never accepted: vacuous"
    return pvalue(counts, _exact_pair(model, tp))


@pytest.mark.parametrize("levels,lossless", [  # a tempered exit level, under an n-gram one
    ((NGram(NGramDrafter(depth=2, min_ngram=1)), Exit(1, temperature=0.5), Exit()), True),
    ((ReportsTargetQ(1, temperature=0.3), Exit()), False),
])
def test_hsd_with_draft_temperatures_follows_the_target(levels, lossless):
    tp = _sharp(init_params(TINY, jax.random.key(2)), 2.0)
    h = Hierarchy(levels, (2,) * (len(levels) - 1))
    p = _hsd_pair_pvalue(h, tp, sampling.Sample(1.0))
    if lossless:
        assert p > 1e-4, f"(y0, y1) differs from the target's distribution (p={p:.2e})"
    else:
        assert p < 1e-6, f"the wrong q was not caught (p={p:.2e})"


def test_greedy_hsd_with_sampling_draft_levels_equals_ar(toy):
    model, params, _ = toy
    ar = specjax.generate(model, params, SOURCES, max_new_tokens=12).to_lists()
    h = Hierarchy((NGram(NGramDrafter(depth=3, min_ngram=1)), Exit(1, temperature=0.7),
                   Exit(2, temperature=0.0), Exit()), (2, 2, 3))
    out = hsd_generate(model, params, h, SOURCES, max_new_tokens=12, key=jax.random.key(0))
    assert out.to_lists() == ar
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        hsd_generate(model, params, Hierarchy((Exit(1, temperature=-1.0), Exit()), (2,)),
                     SOURCES, max_new_tokens=4)
