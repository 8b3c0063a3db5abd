"""The verification-width policy (``specjax.core.widths``): one padded width verifies
exactly as one compiled width per node count does, token for token, at padded widths 1,
2, 8, 10 and 17, with chains (n-gram), ReDrafter trees and an EAGLE-2 tree; the padded
path traces one target verification forward."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import toys
import specjax
from specjax.core import sampling, widths
from specjax.core.verify import Draft
from specjax.drafters import NGramDrafter, eagle, redrafter
from specjax.models.llama import Llama, init_params

V = toys.V
TOY = toys.LLAMA_2
# repeats (the n-gram drafter matches) and fresh tokens (it does not): narrow rounds too
PROMPTS = [[1, 5, 2, 7, 5, 2, 7, 5], [3, 3, 1], [1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [7]]
BUDGETS = [24, 9, 30, 14]


@dataclasses.dataclass(frozen=True)
class NoDraft:
    """A drafter that proposes nothing: every round is one decoding step (width 1)."""

    num_nodes = 0
    depth = 0
    verify_widths = (1,)
    chain = True
    needs_features = False
    feature_layers = ()
    draft_model = None

    def check(self, target):
        pass

    def init(self, dparams, ctx, chunk):
        return ()

    def propose(self, dparams, state, ctx, key, sampler):
        b = ctx.tokens.shape[0]
        empty = jnp.zeros((b, 0), jnp.int32)
        return Draft(tokens=empty, parents=empty, valid=jnp.zeros((b, 0), bool)), state, ctx.cache

    def commit(self, dparams, state, ctx, result):
        return state


@pytest.fixture(scope="module")
def toy():
    model = Llama(TOY)
    tp = jax.tree.map(lambda x: x * 3.0, init_params(TOY, jax.random.key(1)))
    head = redrafter.init_head(TOY.hidden_size, V, jax.random.key(3))
    head["blocks"] = {k: {"w": jax.random.normal(jax.random.key(10 + k), b["w"].shape) * 0.3,
                          "b": b["b"] + 0.01} for k, b in head["blocks"].items()}
    rd = redrafter.draft_params(head)
    ed = eagle.draft_params(eagle.init_head(TOY, jax.random.key(2)), model, tp)
    ar = specjax.generate(model, tp, PROMPTS, max_new_tokens=BUDGETS).to_lists()
    return model, tp, rd, ed, ar


def _case(name, model, rd, ed):
    """``(drafter, dparams)`` whose full node count + 1 is the padded width."""
    return {"none:1": (NoDraft(), None),
            "ngram:2": (NGramDrafter(depth=1, min_ngram=1), None),
            "ngram:8": (NGramDrafter(depth=7, min_ngram=1), None),
            "eagle2:8": (eagle.EagleDrafter(model, depth=3, topk=2, total_tokens=7), ed),
            "ngram:17": (NGramDrafter(depth=16, min_ngram=1), None),
            "redrafter3x3:10": (redrafter.RedrafterDrafter(model, width=3, length=3), rd),
            "redrafter3x2:7": (redrafter.RedrafterDrafter(model, width=3, length=2), rd),
            }[name]


def _run(model, tp, drafter, dp, policy, sampler=sampling.Greedy(), key=None):
    return specjax.speculative_generate(model, tp, drafter, dp, PROMPTS,
                                        max_new_tokens=BUDGETS, widths=policy,
                                        sampler=sampler, key=key)


# ReDrafter's case is opt-in (the suite's time): the padded path it takes is the one the
# n-gram and EAGLE cases take, and ReDrafter's greedy equality runs by default
# (tests/test_conformance.py)
CASES = ["none:1", "ngram:2", "eagle2:8", "ngram:17",
         pytest.param("redrafter3x3:10", marks=pytest.mark.extended)]


@pytest.mark.parametrize("name", CASES)
def test_padded_equals_per_width_greedy(toy, name):
    model, tp, rd, ed, ar = toy
    drafter, dp = _case(name, model, rd, ed)
    n1 = int(name.rsplit(":", 1)[1])
    assert drafter.num_nodes + 1 == n1
    assert widths.resolve(drafter, "padded") == (n1,)
    per = _run(model, tp, drafter, dp, "per-width")
    pad = _run(model, tp, drafter, dp, "padded")
    assert pad.to_lists() == per.to_lists() == ar
    for f in ("target_forwards", "accepted_at", "lengths"):
        np.testing.assert_array_equal(getattr(pad, f), getattr(per, f), err_msg=f)
    rounds = np.asarray(pad.target_forwards) - 1
    np.testing.assert_array_equal(pad.verified_tokens, rounds * n1)
    if len(drafter.verify_widths) > 1:  # some rounds ran narrower: not vacuous
        assert np.sum(per.verified_tokens) < np.sum(rounds) * n1, name


def test_padded_equals_per_width_sampled(toy):
    """Trees whose every width is >= 2 consume keys identically in both paths (the
    rejection walk splits a key per tried child only; the final draw uses the row's key),
    so the same key gives the same tokens. Width 1 (an n-gram round without a match) draws
    with ``sampling.sample`` instead of the walk's last categorical: the same distribution
    from the same key, but not the same bits, so n-gram sampled runs are compared by
    distribution in tests/test_speculative.py, not here."""
    model, tp, rd, ed, _ = toy
    drafter, dp = _case("redrafter3x2:7", model, rd, ed)
    s, key = sampling.Sample(temperature=1.0), jax.random.key(7)
    per = _run(model, tp, drafter, dp, "per-width", s, key)
    pad = _run(model, tp, drafter, dp, "padded", s, key)
    assert pad.to_lists() == per.to_lists()
    np.testing.assert_array_equal(pad.target_forwards, per.target_forwards)
    rounds = np.sum(np.asarray(pad.target_forwards) - 1)
    assert np.sum(per.verified_tokens) < rounds * 7, "no round ran narrower: vacuous"


@dataclasses.dataclass(frozen=True)
class _Counting(Llama):
    """Records the width of every target forward traced (in ``_TRACED``)."""

    def forward(self, params, tokens, *a, **kw):
        _TRACED.append(tokens.shape[1])
        return super().forward(params, tokens, *a, **kw)


_TRACED: list[int] = []


def test_padded_traces_one_verification_forward(toy):
    _, tp, rd, _, _ = toy
    model = _Counting(TOY)
    drafter = redrafter.RedrafterDrafter(model, width=4, length=4)
    x = specjax.prepare(model, PROMPTS, BUDGETS, extra=drafter.num_nodes + 1)
    for policy in ("padded", "per-width", "merged"):
        expect = widths.resolve(drafter, policy)
        spec = specjax.Speculative(model, drafter, policy, chunk=16)
        _TRACED.clear()
        jax.jit(lambda p, x: spec.output(spec.loop(p, spec.init(p, x)))).lower((tp, rd), x)
        assert sorted(_TRACED) == sorted([16, *expect]), policy  # prefill + verification
    assert widths.resolve(drafter, "padded") == (17,)


def test_policies_resolve(toy):
    model, *_ = toy
    ng = NGramDrafter(depth=7)
    rd = redrafter.RedrafterDrafter(model, width=4, length=4)
    assert widths.resolve(ng, None) == widths.resolve(ng, widths.Auto())
    assert widths.Auto(backend="gpu").widths(rd) == (17,)
    assert widths.Auto(backend="tpu").widths(ng) == (8,)
    assert widths.Auto(backend="cpu").policy() == widths.PerWidth(merge=True)
    assert widths.resolve(ng, "per-width") == (1, 8)
    assert widths.resolve(rd, "per-width") == tuple(range(5, 18))
    assert widths.resolve(rd, (17, 5, 5)) == (5, 17)
    assert widths.resolve(rd, "9,17") == (9, 17)
    if jax.default_backend() == "cpu":  # 5-8 multiply at 8 columns, 9-16 at 16, 17 at 24
        assert widths.resolve(rd, "merged") == (8, 16, 17)
        assert widths.resolve(ng, "auto") == (1, 8)
    with pytest.raises(ValueError, match="unknown verification widths 'wide'"):
        widths.as_policy("wide")
    for bad in ("0", "-1,8", (), (0, 8)):
        with pytest.raises(ValueError, match="must be positive integers"):
            widths.as_policy(bad)
    with pytest.raises(ValueError, match="must lie in"):
        specjax.Speculative(model, rd, (5, 9))
