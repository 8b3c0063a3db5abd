"""Drafter conformance: every registered method that decodes (``methods.registered()``),
built through the registry from a tiny spec, with random heads where it reads heads
(``Method.random``, as the device check builds them), on the toy Llama target of
tests/toys.py:

(a) greedy output equals ``ar`` (plain greedy decoding) token for token, at batch 1 and at
    a ragged batch of 4 (different prompt lengths and budgets), with drafts accepted;
(b) at temperature 1 the first two sampled tokens follow the target's exact joint law (a
    chi-square test, tests/laws.py), for every method that drafts (HSD with one hierarchy;
    tests/test_hsd.py checks three more); and a chain and a tree drafter with the lossy ``Typical``
    acceptance rule are rejected by that test: the check has the power to see a wrong rule.

This replaces the per-drafter "greedy equals ar on a toy" copies that lived in
tests/test_speculative.py, tests/test_eagle.py, tests/test_redrafter.py, tests/test_hsd.py,
tests/test_methods.py and tests/test_scan.py (its unrolled-layer half). Real weights:
tests/test_real_smollm2.py and tests/test_gemma.py; drafter mechanics (the tree, beams,
head recurrences, window edges) stay in each drafter's file.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest

import specjax
import toys
from laws import exact_pair, pvalue
from toys import BUDGETS, OPTIONS, PROMPTS
from specjax import methods
from specjax.core import sampling
from specjax.core.speculative import Speculative
from specjax.core.verify import Typical

# every registered method's tiny specs (``Method.tiny``), the options and the ragged batch:
# tests/toys.py (tests/test_multiprocess.py decodes the same ones on two processes)
SPECS = toys.conformance_specs()
SAMPLE_PROMPT = [1, 5, 2, 7, 5, 2, 7, 5]  # repeats, so the n-gram drafters draft at once


@pytest.fixture(scope="module")
def lm():
    model, params = toys.llama(seed=1)
    return toys.ToyLM(model, params, eos_ids=())


@pytest.fixture(scope="module")
def target(lm):
    """``target(spec)``: the toy ``spec`` runs on (the Llama toy, or the toy of the one
    family a method drafts for: ``toys.lm_for``), made once per module."""
    return functools.lru_cache(maxsize=None)(lambda spec: toys.lm_for(spec, lm))


@pytest.fixture(scope="module")
def ar(target):
    """``ar(spec, batch)``: greedy ar output of ``spec``'s toy for batch 1 (the first
    prompt) and 4, computed once per toy family."""
    @functools.lru_cache(maxsize=None)
    def run(spec, b):
        t = target(spec)
        return specjax.generate(t.model, t.params, PROMPTS[:b],
                                max_new_tokens=BUDGETS[:b] if b > 1 else BUDGETS[0]).to_lists()
    return lambda spec, b: run(_first_of_family(spec), b)


def _first_of_family(spec: str) -> str:
    """The first tiny spec of ``spec``'s family (the key ``ar`` runs its toy under)."""
    fam = type(methods.parse(spec)).family
    return next(s for s in SPECS if type(methods.parse(s)).family == fam)


@pytest.fixture(scope="module")
def built(target):
    """``built(spec)``: the registry's random-head build of ``spec``, made once per module."""
    return functools.lru_cache(maxsize=None)(
        lambda spec: methods.parse(spec).random(target(spec), OPTIONS, jax.random.key(3)))


def test_every_registered_method_has_a_tiny_spec():
    decoding = [cls for cls in methods.registered() if cls.decodes]
    bare = [cls.__name__ for cls in decoding if not cls.tiny]
    assert not bare, f"registered methods without tiny specs (Method.tiny): {bare}"
    assert [methods.parse(s).kind for s in SPECS] == [c.kind for c in decoding for _ in c.tiny]
    kinds = {cls.kind for cls in decoding}
    assert {methods.parse(s).kind for s in SAMPLED} == kinds - {"ar"}  # every one that drafts


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("spec", SPECS)
def test_greedy_equals_ar(ar, built, spec, batch):
    b = built(spec)
    assert b.name == spec and isinstance(b.decoder, specjax.Decoder)
    out = b(PROMPTS[:batch], max_new_tokens=BUDGETS[:batch] if batch > 1 else BUDGETS[0])
    assert out.to_lists() == ar(spec, batch), f"{spec} at batch {batch} differs from ar"
    if spec != "ar" and batch == 4:
        assert np.all(np.asarray(out.accepted)[1:] > 0), f"{spec}: nothing accepted: vacuous"
        assert int(np.max(out.target_forwards)) < max(BUDGETS), f"{spec}: no speculation"


def _pair_pvalue(model, tparams, decoder, params, calls: int = 4, batch: int = 2048):
    """The chi-square p-value of the first two tokens ``decoder`` samples at temperature 1
    after SAMPLE_PROMPT against the target's exact pair law, and the tokens each draft
    level had accepted, summed over the calls."""
    sampler = sampling.Sample(1.0)
    counts, acc = np.zeros((toys.V, toys.V)), []
    for i in range(calls):
        out = specjax.decode(decoder, params, [SAMPLE_PROMPT] * batch, max_new_tokens=2,
                             sampler=sampler, key=jax.random.key(i))
        y = np.asarray(out.tokens)[:, :2]
        np.add.at(counts, (y[:, 0], y[:, 1]), 1)
        acc.append(np.asarray(out.accepted, np.float64)[1:])
    law = exact_pair(model, tparams, sampler, SAMPLE_PROMPT)
    return pvalue(counts, law), np.sum(acc, 0)


# every method that drafts (ar's own sampling law: tests/test_decoding.py's chi-square), HSD
# with one of its hierarchies here (the (y1, y2) law after a round, for three more:
# tests/test_hsd.py::test_sampled_three_level_hsd_matches_target), mtp with its tree (its
# chain's drafts are argmax too, verified by the same rule: the suite's time)
SAMPLED = [s for s in SPECS if methods.parse(s).kind not in ("ar", "hsd", "mtp")
           or s in ("hsd:ngram:3,1:2,target", "mtp:3,2,5")]


@pytest.mark.parametrize("spec", SAMPLED)
def test_sampled_output_follows_the_target(target, built, spec):
    b, lm = built(spec), target(spec)
    p, accepted = _pair_pvalue(lm.model, lm.params, b.decoder, b.params)
    assert p > 1e-4, f"{spec} at temperature 1: (y0, y1) differs from the target (p={p:.2e})"
    assert np.all(accepted > 0), f"{spec}: no draft was ever accepted: vacuous"


# The control shows the chi-square test has the power to see a wrong acceptance rule. The
# rule is one piece of code (``Speculative.rule``) applied on two shapes of draft, so one
# chain drafter and one tree drafter carry it. HSD has no acceptance rule to swap: its lossy
# control, a level reporting the wrong q, is
# tests/test_t5.py::test_hsd_with_draft_temperatures_follows_the_target.
CONTROLS = ["sd-ngram:4", "eagle2:3,2,5"]


@pytest.mark.parametrize("spec", CONTROLS)
def test_a_lossy_rule_is_caught(lm, built, spec):
    """The negative control: the same drafter and draft, accepted by Medusa's typical rule
    (lossy by design), must fail the test above."""
    dec = built(spec).decoder
    assert isinstance(dec, Speculative)
    lossy = dataclasses.replace(dec, rule=Typical())
    p, _ = _pair_pvalue(lm.model, lm.params, lossy, built(spec).params)
    assert p < 1e-6, f"{spec}: the lossy rule was not caught (p={p:.2e})"
