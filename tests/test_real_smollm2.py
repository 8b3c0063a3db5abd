"""Every decoding method's greedy output equals ``ar`` on the real SmolLM2-135M weights,
at a ragged batch of 4, against one ``ar`` reference computed once for this file (the
``ar_reference`` fixture in conftest.py). Batch 1 against batch 4 is checked for every
registered method on the toy (tests/test_conformance.py::test_greedy_equals_ar).

This file gathers what used to be five copies of the same check (tests/test_speculative.py
for the n-gram, early-exit and model drafters, tests/test_eagle.py, tests/test_redrafter.py
and tests/test_hsd.py). Random-weight versions of every registered method are tests/test_conformance.py; the
Gemma family's real-weight check is tests/test_gemma.py::test_gemma3_270m_every_method_equals_ar.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import hsd, methods
from specjax.drafters import EarlyExitDrafter, ModelDrafter, NGramDrafter
from specjax.drafters import eagle, exit_heads, redrafter
from specjax.heads import kinds, shipped_head
from toys import SMOLLM_PROMPTS as PROMPTS

MODEL = "smollm2-135m"
BUDGETS = [24, 9, 17, 30]
# The drafters whose proposals come from the target itself (n-gram lookup, an early exit of
# it, a bfloat16 copy of it) and ReDrafter are opt-in here (``extended``, tests/conftest.py),
# to keep the suite's time: by default their greedy equality runs on the Llama toys
# (tests/test_conformance.py, tests/test_speculative.py), and on SmolLM2 the n-gram drafter's
# in notebooks/01_quickstart.ipynb, ReDrafter's in notebooks/04_redrafter.ipynb and early
# exits' in the three-level HSD test below; the shipped EAGLE-2 head's stays in the default
# run.
_OPT_IN = pytest.mark.extended
SPECULATIVE = [pytest.param("ngram", marks=_OPT_IN), pytest.param("early-exit", marks=_OPT_IN),
               pytest.param("model-tree", marks=_OPT_IN), "eagle2",
               pytest.param("redrafter", marks=_OPT_IN)]


def _eagle(lm):
    """The shipped head when there is one (long accepted paths), else a random head."""
    if shipped_head("eagle", MODEL) is not None:
        return methods.load_drafter("eagle2:4,4,12", lm, MODEL)
    head = eagle.init_head(lm.model.config, jax.random.key(0))
    return (eagle.EagleDrafter(lm.model, depth=4, topk=4, total_tokens=12),
            eagle.draft_params(head, lm.model, lm.params, vocab_ids=np.arange(4096)))


def _redrafter(lm):
    """The shipped head when there is one (long accepted paths), else a random head."""
    if shipped_head("redrafter", MODEL) is not None:
        return methods.load_drafter("redrafter:3,4", lm, MODEL)
    head = redrafter.init_head(lm.model.config.hidden_size, 4096, jax.random.key(0))
    return (redrafter.RedrafterDrafter(lm.model, width=3, length=4),
            redrafter.draft_params(head, np.arange(4096)))


def _drafter(lm, name):
    if name == "ngram":
        return NGramDrafter(depth=6), None
    if name == "early-exit":
        return EarlyExitDrafter(lm.model, 10, depth=3), None
    if name == "model-tree":  # the same model in bfloat16, drafting a top-2 tree
        return (ModelDrafter(lm.model, depth=3, width=2),
                jax.tree.map(lambda x: x.astype(jnp.bfloat16), lm.params))
    return {"eagle2": _eagle, "redrafter": _redrafter}[name](lm)


@pytest.fixture(scope="module")
def ids(smollm):
    return [smollm.encode(p, chat=c) for p, c in PROMPTS]


@pytest.fixture(scope="module")
def ar(smollm, ids, ar_reference):
    return ar_reference(MODEL, smollm, ids, BUDGETS)


@pytest.mark.parametrize("name", SPECULATIVE)
def test_speculative_greedy_equals_ar(smollm, ids, ar, name):
    """was: test_speculative.py::test_greedy_equals_ar_on_real_model[ngram, early-exit,
    model-tree], test_eagle.py::test_greedy_eagle_equals_ar_on_real_model,
    test_redrafter.py::test_greedy_redrafter_equals_ar_on_real_model."""
    drafter, dparams = _drafter(smollm, name)
    kw = dict(eos_ids=smollm.eos_ids)
    out = specjax.speculative_generate(smollm.model, smollm.params, drafter, dparams, ids,
                                       max_new_tokens=BUDGETS, **kw)
    assert out.to_lists() == ar, f"{name}: batch of 4 differs from ar"
    if name in ("ngram", "early-exit", "model-tree"):
        assert np.all(np.asarray(out.target_forwards) <= np.asarray(out.lengths))
    if name == "model-tree":
        assert out.tau > 2.0, "a bf16 copy of the target should be accepted almost always"
    if name == "redrafter" and shipped_head("redrafter", MODEL) is not None:
        assert out.tau > 1.1, f"the shipped head's tau is {out.tau:.2f}"  # drafts usefully


def test_three_level_hsd_greedy_equals_ar(smollm, ids, ar):
    """was: test_hsd.py::test_greedy_three_level_hsd_equals_ar_on_real_model. An n-gram
    bottom, the shipped exit head at layer 12, then the target."""
    path = shipped_head("exit-heads", MODEL)
    assert path is not None, f"no exit heads ship for {MODEL}"
    heads, _ = kinds.load_exit_heads(path, smollm.model)
    h = hsd.Hierarchy((hsd.NGram(specjax.NGramDrafter(depth=4)),
                       hsd.Exit(12, exit_heads.exit_head), hsd.Exit()), (4, 2))
    kw = dict(eos_ids=smollm.eos_ids, hparams=(None, heads[12], None))
    out = specjax.hsd_generate(smollm.model, smollm.params, h, ids, max_new_tokens=BUDGETS,
                               **kw)
    assert out.to_lists() == ar, "hsd: batch of 4 differs from ar"
    assert out.accepted[1] > 0 and out.accepted[2] > 0
